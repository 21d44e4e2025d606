"""The settings of one benchmark run (:class:`BenchConfig`); ``vllm-graft bench``'s
defaults are its fields' defaults."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

DFLASH_METHODS = ("dflash", "tail_dflash")  # rows that need a DFlash block drafter


@dataclass
class BenchConfig:
    target: str
    head: str
    out: Path
    cache_dir: Path
    methods: list[str]
    datasets: list[str]
    prompts: int = 10
    max_tokens: int = 128
    budget: int = 60
    chain_tokens: int = 5
    warmup: str | None = None
    calibration: str | None = None
    tail_calibration: str | None = None  # Graft-TAIL's, for chains of chain_tokens
    dtype: str = "float32"
    max_num_seqs: int = 16
    ablations: bool = False
    ablation_datasets: list[str] = field(default_factory=lambda: ["humaneval", "mtbench"])
    drafter: str = "eagle3"  # or "draft_model": ``head`` is then a draft model
    dflash: str | None = None  # the DFlash block drafter of the dflash / tail_dflash rows
    dflash_block: int = 8
    dflash_calibration: str | None = None  # Graft-TAIL's, for its blocks
    command: str = ""
    #: prompt token ids every engine generates from, untimed, before the datasets
    engine_warmup: list[list[int]] = field(default_factory=list)
    #: the batch sweep: each method of ``batch_methods`` on every dataset at each batch
    #: size (``max_num_seqs``), with max(batch, prompts) prompts per dataset
    batch_sizes: list[int] = field(default_factory=list)
    batch_methods: list[str] = field(default_factory=lambda: ["plain", "ngram", "eagle3",
                                                              "graft", "graft_auto"])
    #: the sweep's engines run interleaved, each dataset this many times per engine
    #: (:func:`~vllm_graft.bench.engines.run_engines_interleaved`)
    batch_rounds: int = 3
    #: start every sweep engine again for each round
    #: (:func:`~vllm_graft.bench.engines.run_engines_interleaved`)
    batch_fresh_engines: bool = False


def config_default(name: str):
    """The default of one :class:`BenchConfig` field (the CLI's defaults are these)."""
    found = next(f for f in fields(BenchConfig) if f.name == name)
    return found.default_factory() if found.default_factory is not MISSING else found.default
