"""The interleaved sweep's rounds (:func:`vllm_graft.bench.engines.run_engines_interleaved`)
with a stand-in for the benchmark's own engine processes: which engines start when."""

from __future__ import annotations

from pathlib import Path

from vllm_graft.bench import engines
from vllm_graft.bench.config import BenchConfig
from vllm_graft.bench.methods import methods


class CountingEngine:
    """Stands in for one method's served engine process; counts the starts."""

    starts: list[str] = []

    def __init__(self, job: dict, jobs: Path, label: str):
        self.label = label
        CountingEngine.starts.append(label)

    def receive(self) -> dict:
        return {"warmup_seconds": 0.1}

    def run(self, dataset: str) -> dict:
        return {"seconds": 1.0, "tokens": [[1, 2]], "delta": {}}

    def close(self) -> None:
        pass


def test_engines_that_remember_requests_start_afresh_every_round(tmp_path, monkeypatch):
    """Suffix decoding proposes what earlier requests generated: in a later round of the
    same prompts it would find the answers. Its engine (and Graft's with one matrix and
    the outputs shared by every request) starts again for each round; the others stay
    alive through the rounds."""
    monkeypatch.setattr(engines, "_ServedEngine", CountingEngine)
    CountingEngine.starts = []
    remembering = {name for name, method in methods(60).items() if method.remembers_requests}
    assert remembering == {"suffix", "graft_auto_shared", "graft_chain_shared"}
    config = BenchConfig(target="t", head="h", out=tmp_path, cache_dir=tmp_path,
                         methods=[], datasets=["a", "b"])
    specs = {"plain": None, "ngram": {"method": "ngram"}, "suffix": {"method": "suffix"}}
    out = engines.run_engines_interleaved(config, specs, {"a": [[1]], "b": [[2]]}, 64,
                                          rounds=3, fresh_each_round={"suffix"})
    assert CountingEngine.starts.count("suffix") == 3
    assert CountingEngine.starts.count("plain") == CountingEngine.starts.count("ngram") == 1
    assert out["suffix"]["engine_starts"] == 3 and out["plain"]["engine_starts"] == 1
    assert all(len(out[label]["datasets"]["a"]["round_seconds"]) == 3 for label in specs)
