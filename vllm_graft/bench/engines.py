"""The benchmark's engines, each in a process of its own (:mod:`vllm_graft.bench.worker`):
what an engine is given (its job: speculative config, engine settings, warm-up prompts,
datasets), one engine run to the end (:func:`run_engine`, resumable), or all engines of a
sweep alive at once taking turns (:func:`run_engines_interleaved`)."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from vllm_graft.assets import datasets
from vllm_graft.bench.config import BenchConfig

#: every engine first generates this many tokens for as many ShareGPT prompts as its
#: largest dataset, untimed
ENGINE_WARMUP_TOKENS = 16
#: where those prompts start in the ShareGPT file (about 11,100 records): past the
#: prompts of the matrix warm-up (from 0), calibration (from 100) and the drafters'
#: training (200-2199), so no engine warms up on a prompt anything learned from
ENGINE_WARMUP_OFFSET = 10_000


def guard_steps(delta: dict) -> dict[str, int]:
    """The engine steps budget "auto"'s throughput guard ran in each mode, from a run's
    counter deltas (empty for other methods)."""
    return {key.removeprefix("graft_guard_").removesuffix("_steps"): value
            for key, value in delta.items()
            if key.startswith("graft_guard_") and key.endswith("_steps") and value}


def engine_warmup_source(cache_dir: Path, count: int) -> list[datasets.Prompt]:
    """``count`` ShareGPT prompts from :data:`ENGINE_WARMUP_OFFSET` on. Fewer is an error:
    an engine warmed up on fewer requests than a dataset's batch would meet its batch
    size for the first time inside the timed runs."""
    prompts = datasets.sharegpt(cache_dir, limit=count, offset=ENGINE_WARMUP_OFFSET)
    if len(prompts) < count:
        raise ValueError(f"the ShareGPT file in {cache_dir} holds {len(prompts)} prompts "
                         f"from record {ENGINE_WARMUP_OFFSET} on; the engines' warm-up "
                         f"needs {count} (ENGINE_WARMUP_OFFSET)")
    return prompts


def engine_warmup_prompts(candidates: list[list[int]], prompt_ids: dict[str, list],
                          max_model_len: int, max_tokens: int) -> list[list[int]]:
    """As many warm-up prompts as the largest dataset has, each cut to fit the engine's
    ``max_model_len`` with ``max_tokens`` generated: a ShareGPT prompt longer than the
    datasets' is cut, not dropped (dropping them left engines sized for short-prompt
    datasets with no warm-up at all)."""
    fits = max_model_len - max_tokens - 1
    if fits < 1:
        return []
    return [ids[:fits] for ids in candidates][:max(len(p) for p in prompt_ids.values())]


def prefill_warmups(candidates: list[list[int]], prompt_ids: dict[str, list]
                    ) -> list[list[list[int]]]:
    """Per dataset, a batch of warm-up prompts of its prompts' own lengths (each
    warm-up prompt repeated as often as it must be to reach the length): prefilled
    untimed, they give every engine the dataset's prefill shapes before its timed runs.
    On a CPU the first forward of a number of query rows a process has not met sets up
    its kernels (oneDNN primitives), which took from 0.7 to 3.8 s where the same prefill
    later took 0.8-1.0 s at batch 8, in engines of every method alike: noise in a
    fresh engine's timed runs that a long-running server pays once."""
    if not candidates:
        return []

    def cut(ids: list[int], length: int) -> list[int]:
        return (ids * -(-length // len(ids)))[:length]

    return [[cut(candidates[i % len(candidates)], len(prompt))
             for i, prompt in enumerate(prompts)] for prompts in prompt_ids.values()]


def engine_job(config: BenchConfig, spec: dict | None, prompt_ids: dict[str, list],
               max_model_len: int) -> dict:
    """What one benchmark engine is given (see :mod:`vllm_graft.bench.worker`)."""
    return {
        "target": config.target, "spec": spec, "max_tokens": config.max_tokens,
        "engine": {"dtype": config.dtype, "max_model_len": max_model_len,
                   "max_num_seqs": config.max_num_seqs},
        "warmup": engine_warmup_prompts(config.engine_warmup, prompt_ids, max_model_len,
                                        config.max_tokens),
        "warmup_tokens": min(ENGINE_WARMUP_TOKENS, config.max_tokens),
        "warmup_prefills": prefill_warmups([ids for ids in config.engine_warmup if ids],
                                           prompt_ids),
        "datasets": prompt_ids}


def _worker_env() -> dict:
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def resume_stamp(spec: dict | None) -> str:
    """What a finished engine's result depends on besides its job's text: Graft's code
    and the contents of the files its spec names (a job names files by path: a
    retrained warm-up or an edited module at the same path would otherwise be served
    the old result)."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    graft = (spec or {}).get("graft", {})
    for key in ("warmup", "calibration"):
        if isinstance(graft.get(key), str) and Path(graft[key]).is_file():
            digest.update(Path(graft[key]).read_bytes())
    return digest.hexdigest()


def run_engine(config: BenchConfig, spec: dict | None, prompt_ids: dict[str, list],
               max_model_len: int, label: str) -> dict:
    """One method's engine in its own process (see :mod:`vllm_graft.bench.worker`)."""
    jobs = config.out / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    job, result, log = (jobs / f"{label}.{ext}" for ext in ("job.json", "result.json", "log"))
    description = json.dumps(engine_job(config, spec, prompt_ids, max_model_len))
    stamp_file, stamp = jobs / f"{label}.stamp", resume_stamp(spec)
    # an interrupted run resumes: a finished engine with the very same job, code and
    # input files is reused
    if result.is_file() and job.is_file() and job.read_text() == description \
            and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return json.loads(result.read_text())
    result.unlink(missing_ok=True)
    job.write_text(description)
    stamp_file.write_text(stamp)
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "vllm_graft.bench.worker", str(job),
                               str(result)], stdout=f, stderr=subprocess.STDOUT,
                              env=_worker_env())
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"benchmark engine {label!r} failed (log {log}):\n{tail}")
    return json.loads(result.read_text())


class _ServedEngine:
    """One method's engine kept alive in its own process (the worker's ``--serve``
    mode): commands go to its standard input, replies come back on a pipe of their
    own (the engine's logs go to its log file)."""

    def __init__(self, job: dict, jobs: Path, label: str):
        self.label, self.log = label, jobs / f"{label}.log"
        path = jobs / f"{label}.job.json"
        path.write_text(json.dumps(job))
        read_end, write_end = os.pipe()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_graft.bench.worker", "--serve", str(path),
                 str(write_end)], stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT, env=_worker_env(), pass_fds=(write_end,),
                text=True)
        os.close(write_end)  # the worker holds the only writer: its exit ends the pipe
        self.replies = os.fdopen(read_end)

    def receive(self) -> dict:
        line = self.replies.readline()
        if not line:
            self.proc.wait()
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"benchmark engine {self.label!r} exited with "
                               f"{self.proc.returncode} (log {self.log}):\n{tail}")
        return json.loads(line)

    def run(self, dataset: str) -> dict:
        self.proc.stdin.write(json.dumps({"dataset": dataset}) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"stop": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.replies.close()


#: a dataset run's median decoding step, split (:func:`vllm_graft.bench.worker.step_split`),
#: and its prefill phase (:func:`vllm_graft.bench.worker.generate_counting_steps`)
STEP_SPLIT_KEYS = ("step_ms", "target_ms", "other_ms", "prefill_ms")


def run_engines_interleaved(config: BenchConfig, specs: dict[str, dict | None],
                            prompt_ids: dict[str, list], max_model_len: int,
                            rounds: int, fresh_each_round: set[str] = frozenset()
                            ) -> dict[str, dict]:
    """Every engine of ``specs`` (label -> speculative config) alive at once, each
    dataset generated by one engine after another, ``rounds`` times, the order rotated
    each round; only one engine works at a time. Each engine's time for a dataset is
    the median of its rounds, so the machine's drift (this CPU's speed moves by 10-20 %
    over minutes) falls on every method alike instead of on whichever ran then. Greedy
    output must be the same every round: ``rounds_identical`` counts the requests
    whose later rounds repeated the first.

    With ``config.batch_fresh_engines`` every engine is stopped after each round and
    started again, in the next round's order, for the next: a process keeps a speed of
    its own for its whole life (two identical plain engines of one sweep measured 0.94x
    of each other over all their rounds, and 0.99x in another sweep), which the rounds
    of one process cannot average out; fresh processes turn it into round-to-round
    noise that they do.

    The engines named in ``fresh_each_round`` are started again for every round in any
    case: they propose what earlier requests generated (suffix decoding's tree of
    responses), and the same prompts' second round would find its answers there (suffix
    decoding's rounds after the first ran copy prompts 1.2-2.7x faster than its first)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    jobs = config.out / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    labels = list(specs)
    engines: dict[str, _ServedEngine] = {}
    warmups: dict[str, list[float]] = {label: [] for label in labels}

    def start(order: list[str]) -> None:
        for label in order:  # one at a time: start-ups do not compete for the cores
            engines[label] = _ServedEngine(
                engine_job(config, specs[label], prompt_ids, max_model_len), jobs, label)
            warmups[label].append(engines[label].receive()["warmup_seconds"])  # ready

    def stop(labels_to_stop=None) -> None:
        for label in list(engines) if labels_to_stop is None else labels_to_stop:
            engines.pop(label).close()

    started = time.time()
    try:
        runs: dict[tuple[str, str], list[dict]] = {}
        with tqdm(total=rounds * len(prompt_ids) * len(labels), desc="interleaved",
                  unit="run") as bar:
            for r in range(rounds):
                order = labels[r % len(labels):] + labels[:r % len(labels)]
                if not engines:
                    start(order)
                elif fresh_each_round:
                    renewed = [label for label in order if label in fresh_each_round]
                    stop(renewed)
                    start(renewed)
                for dataset in prompt_ids:
                    for label in order:
                        runs.setdefault((label, dataset), []).append(
                            engines[label].run(dataset))
                        bar.update()
                if config.batch_fresh_engines:
                    stop()
    finally:
        stop()
    wall = time.time() - started
    out = {}
    for label in labels:
        datasets_out = {}
        for dataset in prompt_ids:
            first, *later = runs[(label, dataset)]
            seconds = [run["seconds"] for run in runs[(label, dataset)]]
            split = {key: statistics.median(run[key] for run in runs[(label, dataset)])
                     for key in STEP_SPLIT_KEYS if key in first}
            datasets_out[dataset] = {
                **first, **split, "seconds": statistics.median(seconds),
                "round_seconds": seconds,
                "round_prefill_ms": [run.get("prefill_ms") for run in runs[(label, dataset)]],
                "round_guard_steps": [guard_steps(run["delta"])
                                      for run in runs[(label, dataset)]],
                "round_same": [all(run["tokens"][i] == tokens for run in later)
                               for i, tokens in enumerate(first["tokens"])]}
            datasets_out[dataset]["rounds_identical"] = sum(
                datasets_out[dataset]["round_same"])
        out[label] = {"datasets": datasets_out, "wall_seconds": wall,
                      "warmup_seconds": statistics.median(warmups[label]),
                      "engine_starts": len(warmups[label])}
        (jobs / f"{label}.result.json").write_text(json.dumps(out[label]))
    return out
