"""One benchmark run: every method on the same prompts, one engine configuration.

Per method one in-process vLLM engine is started with the same settings (dtype, context
length, batch size); each dataset is generated as one batch and the engine's counters
are read before and after, so every number comes from the same run. Greedy outputs of
every method are compared with plain decoding token by token. The batch sweep keeps its
methods' engines alive together and lets them take turns, round after round
(:func:`run_engines_interleaved`): its ratios to plain decoding are what speed goals
are judged by, and this machine's speed drifts more than the differences measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from tqdm import tqdm

from vllm_graft.assets import datasets
from vllm_graft.bench.methods import Method, methods
from vllm_graft.cli.common import render_prompts


DFLASH_METHODS = ("dflash", "tail_dflash")  # rows that need a DFlash block drafter
#: every engine first generates this many tokens for as many ShareGPT prompts as its
#: largest dataset, untimed
ENGINE_WARMUP_TOKENS = 16
#: where those prompts start in the ShareGPT file (about 11,100 records): past the
#: prompts of the matrix warm-up (from 0), calibration (from 100) and the drafters'
#: training (200-2199), so no engine warms up on a prompt anything learned from
ENGINE_WARMUP_OFFSET = 10_000


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
    #: (:func:`run_engines_interleaved`)
    batch_rounds: int = 3
    #: start every sweep engine again for each round (:func:`run_engines_interleaved`)
    batch_fresh_engines: bool = False


def config_default(name: str):
    """The default of one :class:`BenchConfig` field (the CLI's defaults are these)."""
    found = next(f for f in fields(BenchConfig) if f.name == name)
    return found.default_factory() if found.default_factory is not MISSING else found.default


def load_dataset(name: str, tokenizer, cache_dir: Path, limit: int) -> list[datasets.Prompt]:
    if name == "humaneval":
        return datasets.humaneval(cache_dir, limit)
    if name == "mtbench":
        return datasets.mtbench(cache_dir, limit)
    if name == "gsm8k":
        return datasets.gsm8k(cache_dir, limit)
    if name == "code-edit":
        return datasets.code_edit(limit)
    kind, _, size = name.partition("-")
    tokens = int(size.rstrip("k")) * 1024
    if kind == "essays":
        return datasets.essays(cache_dir, tokenizer, tokens, limit=min(limit, 4))
    if kind == "code":
        return datasets.stdlib_code(tokenizer, tokens, limit=min(limit, 4))
    raise ValueError(f"unknown dataset {name!r}")


def guard_steps(delta: dict) -> dict[str, int]:
    """The engine steps budget "auto"'s throughput guard ran in each mode, from a run's
    counter deltas (empty for other methods)."""
    return {key.removeprefix("graft_guard_").removesuffix("_steps"): value
            for key, value in delta.items()
            if key.startswith("graft_guard_") and key.endswith("_steps") and value}


def summarize(method: Method, delta: dict, tokens: int, seconds: float,
              chain_tokens: int) -> dict:
    drafts = delta.get("spec_decode_num_drafts", 0) or 0
    accepted = delta.get("spec_decode_num_accepted_tokens", 0) or 0
    row = {"generated_tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
           "mat": round(1 + accepted / drafts, 3) if drafts else 1.0,
           "verification_steps": drafts,
           "verified_tokens_per_step": round(1 + delta.get("spec_decode_num_draft_tokens", 0)
                                             / drafts, 2) if drafts else 1.0}
    if method.kind == "graft":
        trees = delta.get("graft_trees_built", 0) or 0
        row["draft_forwards_per_step"] = round(delta.get("graft_draft_forwards", 0) / trees, 3) \
            if trees else 0.0
        by_source = {s: delta.get(f"graft_accepted_{s}", 0)
                     for s in ("draft", "retrieved", "both", "context")}
        total = sum(by_source.values())
        for source in ("retrieved", "both", "context"):
            row[f"accepted_share_{source}"] = round(by_source[source] / total, 3) if total \
                else 0.0
        copied = delta.get("graft_context_nodes", 0)
        row["context_acceptance"] = round(by_source["context"] / copied, 3) if copied else None
        lookups = delta.get("graft_retrieval_lookups", 0)
        row["matrix_hit_rate"] = round(delta.get("graft_retrieval_hits", 0) / lookups, 3) \
            if lookups else None
        row["bookkeeping_share"] = round(delta.get("graft_bookkeeping_us", 0) / 1e6 / seconds, 4) \
            if seconds else None
        row["draft_forward_share"] = round(delta.get("graft_draft_forward_us", 0) / 1e6 / seconds, 4) \
            if seconds else None
        row["stages"] = {k.removeprefix("graft_stage_"): v for k, v in delta.items()
                         if k.startswith("graft_stage_") and v}
        # budget "auto": the engine steps the throughput guard ran in each mode
        row["guard_steps"] = guard_steps(delta)
        # its chain scout: plain steps it looked at, chain steps it started, chain nodes
        # its looks taught the acceptance model
        row["chain_scout"] = {name: delta.get(f"graft_chain_{key}", 0) for name, key in (
            ("looks", "scout_looks"), ("steps", "scout_steps"), ("shadow_trials", "shadow_trials"))}
    elif method.name == "eagle3":  # vLLM's chain: one drafter forward per draft token
        row["draft_forwards_per_step"] = float(chain_tokens)
    elif method.name == "dflash":  # one forward drafts the whole block
        row["draft_forwards_per_step"] = 1.0
    else:
        row["draft_forwards_per_step"] = 0.0
    return row


def suffix_available() -> bool:
    """vLLM's ``suffix`` method needs the arctic-inference package."""
    import importlib.util

    return importlib.util.find_spec("arctic_inference") is not None


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
                            rounds: int) -> dict[str, dict]:
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
    noise that they do."""
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

    def stop() -> None:
        for served in engines.values():
            served.close()
        engines.clear()

    started = time.time()
    try:
        runs: dict[tuple[str, str], list[dict]] = {}
        with tqdm(total=rounds * len(prompt_ids) * len(labels), desc="interleaved",
                  unit="run") as bar:
            for r in range(rounds):
                order = labels[r % len(labels):] + labels[:r % len(labels)]
                if not engines:
                    start(order)
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


def method_spec(config: BenchConfig, method: Method, extra_graft: dict | None = None
                ) -> dict | None:
    """The speculative config of ``method`` in this run (None: plain decoding)."""
    spec = method.speculative_config(config.head, config.warmup, config.calibration,
                                     config.drafter, config.tail_calibration,
                                     config.dflash, config.dflash_calibration)
    if spec is not None and extra_graft and method.kind == "graft":
        spec["graft"].update(extra_graft)
        spec["graft"] = {k: v for k, v in spec["graft"].items() if v is not None}
    return spec


def run_methods(config: BenchConfig, prompt_ids: dict[str, list], method_list,
                max_model_len: int, extra_graft: dict | None = None, label: str = "",
                rounds: int | None = None):
    """Rows and greedy outputs of every method. One engine after another, or with
    ``rounds``, all engines at once, interleaved (:func:`run_engines_interleaved`)."""
    rows, outputs = [], {}
    names = {method.name: (method.name + (f"-{label}" if label else "")).replace(" ", "_")
             for method in method_list}
    if rounds is None:  # lazily: each engine runs when its rows are reached
        results = (run_engine(config, method_spec(config, m, extra_graft), prompt_ids,
                              max_model_len, names[m.name])
                   for m in tqdm(method_list, desc=label or "methods", unit="method"))
    else:
        interleaved = run_engines_interleaved(
            config, {names[m.name]: method_spec(config, m, extra_graft) for m in method_list},
            prompt_ids, max_model_len, rounds)
        results = (interleaved[names[m.name]] for m in method_list)
    for method, result in zip(method_list, results):
        for dataset, data in result["datasets"].items():
            tokens = data["tokens"]
            outputs[(method.name, dataset)] = outputs_of_every_round(
                method.name, tokens, data.get("round_same"))
            row = summarize(method, data["delta"], sum(len(t) for t in tokens),
                            data["seconds"], config.chain_tokens)
            if data.get("steps"):
                # tokens per decoding step over all steps, drafted or not (the prefill's
                # token and step excluded): vLLM's MAT above counts steps with drafts only
                decoded = sum(len(t) for t in tokens) - len(tokens)
                steps = max(sum(data["steps"]) - len(tokens), 1)
                row["tokens_per_step"] = round(decoded / steps, 3)
            for key in STEP_SPLIT_KEYS:  # medians over rounds
                if key in data:
                    row[key] = round(data[key], 3)
            if "round_seconds" in data:
                generated = sum(len(t) for t in tokens)
                row["round_tokens_per_s"] = [round(generated / max(x, 1e-9), 2)
                                             for x in data["round_seconds"]]
                row["rounds_identical"] = data["rounds_identical"]
            if data.get("round_prefill_ms") and None not in data["round_prefill_ms"]:
                row["round_prefill_ms"] = [round(x, 1) for x in data["round_prefill_ms"]]
            if any(data.get("round_guard_steps", ())):  # what budget auto ran, each round
                row["round_guard_steps"] = data["round_guard_steps"]
            rows.append({"method": method.name, "dataset": dataset, "prompts": len(tokens),
                         **row})
        rows.append({"method": method.name, "dataset": "_engine",
                     "wall_seconds": round(result["wall_seconds"], 1),
                     "warmup_seconds": round(result["warmup_seconds"], 2),
                     "engine_starts": result.get("engine_starts", 1)})
    return rows, outputs


def run_bench(config: BenchConfig) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.target)
    max_positions = AutoConfig.from_pretrained(config.target).max_position_embeddings
    all_methods = methods(config.budget, config.chain_tokens, config.dflash_block)
    notes = []
    chosen = []
    for name in config.methods:
        if name == "suffix" and not suffix_available():
            notes.append("suffix: skipped, arctic-inference is not installed")
            continue
        if name in DFLASH_METHODS and config.dflash is None:
            notes.append(f"{name}: skipped, no DFlash drafter for this target")
            continue
        chosen.append(all_methods[name])

    prompt_sets, prompt_ids, longest = {}, {}, 0
    most = max([config.prompts, *config.batch_sizes])
    for name in config.datasets:
        prompts = load_dataset(name, tokenizer, config.cache_dir, most)
        ids = render_prompts(tokenizer, prompts)
        fits = [(p, r) for p, r in zip(prompts, ids)
                if len(r["prompt_token_ids"]) + config.max_tokens + config.budget + 8
                <= max_positions]
        if len(fits) < len(prompts):
            notes.append(f"{name}: {len(prompts) - len(fits)} prompts longer than the "
                         f"model's {max_positions} positions were left out")
        if not fits:
            continue
        prompt_sets[name] = [p for p, _ in fits]
        prompt_ids[name] = [r["prompt_token_ids"] for _, r in fits]
        longest = max(longest, max(len(ids) for ids in prompt_ids[name]))
    max_model_len = min(max_positions, longest + config.max_tokens + config.budget + 16)

    warm = render_prompts(tokenizer, engine_warmup_source(config.cache_dir, most))
    config = replace(config, engine_warmup=[r["prompt_token_ids"] for r in warm])
    first = {name: ids[:config.prompts] for name, ids in prompt_ids.items()}
    prompt_sets = {name: prompts[:config.prompts] for name, prompts in prompt_sets.items()}
    rows, outputs = run_methods(config, first, chosen, max_model_len)
    agreement = greedy_agreement(chosen, outputs, prompt_sets)

    batch_rows = []
    for batch in config.batch_sizes:
        swept = [all_methods[name] for name in config.batch_methods]
        subset = {name: ids[:max(batch, config.prompts)] for name, ids in prompt_ids.items()}
        sweep = replace(config, max_num_seqs=batch)
        found, sweep_outputs = run_methods(sweep, subset, swept, max_model_len,
                                           label=f"batch{batch}",
                                           rounds=config.batch_rounds)
        batch_rows += [{"batch": batch, **row} for row in found]
        for method, same in greedy_agreement(swept, sweep_outputs, subset).items():
            agreement[f"{method}@batch{batch}"] = same

    ablations = []
    if config.ablations:
        ablations = run_ablations(config, first, max_model_len)
    return {
        "config": portable_config(config),
        "machine": machine_description(),
        "max_model_len": max_model_len,
        "datasets": {name: len(p) for name, p in prompt_sets.items()},
        "rows": rows,
        "batch_rows": batch_rows,
        "greedy_agreement_with_plain": agreement,
        "ablations": ablations,
        "notes": notes,
    }


def outputs_of_every_round(method: str, tokens: list, round_same: list[bool] | None) -> list:
    """Each request's output as greedy agreement compares it: its first round's tokens
    where every round repeated them, else a marker that equals no other output (a later
    round that diverged fails the comparison with plain decoding, and the exit code)."""
    if round_same is None:
        return tokens
    return [t if same else ("differed between rounds", method, i)
            for i, (t, same) in enumerate(zip(tokens, round_same))]


def greedy_agreement(chosen, outputs, prompt_sets) -> dict[str, dict[str, int]]:
    """Per method: prompts whose greedy output equals plain decoding's (same run)."""
    if "plain" not in [m.name for m in chosen]:
        return {}
    agreement = {}
    for method in chosen:
        same = total = 0
        for name in prompt_sets:
            for a, b in zip(outputs[("plain", name)], outputs[(method.name, name)]):
                same += int(a == b)
                total += 1
        agreement[method.name] = {"identical": same, "total": total}
    return agreement


def run_ablations(config: BenchConfig, prompt_ids, max_model_len) -> list[dict]:
    """Graft with one knob changed at a time, on the ablation datasets."""
    from vllm_graft.cli.warmup import run_warmup

    subset = {k: v for k, v in prompt_ids.items() if k in config.ablation_datasets} \
        or dict(list(prompt_ids.items())[:1])
    graft = methods(config.budget)["graft"]
    cold = Method("graft", "graft", graft=graft.graft, uses_retrieval=False)  # no warm-up file
    variants = [("warmup_rounds", 0, cold, {})]
    if config.warmup:
        variants.append(("warmup_rounds", "warm", graft, {}))
    variants += [("retrieval_depth", d, graft, {"retrieval_depth": d}) for d in (2, 4, 8, 12)]
    for width in (4, 8, 16):
        extra = {"retrieval_width": width}
        if width > 8:  # a wider template needs a matrix that stores more successors
            path = config.out / f"warmup-k{width}.bin"
            if not path.is_file():
                run_warmup(config.target, config.head, path, rounds=5, max_tokens=256,
                           cache_dir=config.cache_dir, budget=config.budget,
                           dtype=config.dtype, extra_graft={"successor_k": width,
                                                            "retrieval_width": width,
                                                            "drafter": config.drafter})
            extra.update(successor_k=width, warmup=str(path))
        variants.append(("retrieval_width", width, graft, extra))
    out = []
    for knob, value, method, extra in variants:
        rows, _ = run_methods(config, subset, [method], max_model_len,
                              extra_graft=extra, label=f"ablation-{knob}-{value}")
        out += [{"knob": knob, "value": value, **row} for row in rows
                if row["dataset"] != "_engine"]
    return out


def portable_config(config: BenchConfig) -> dict:
    """The run's settings with this machine's paths left out: files in the model cache
    are written as ``$VLLM_GRAFT_CACHE/...``, files in the working tree relative to it, so
    committed results name no machine paths."""
    cache, cwd = Path(config.cache_dir).resolve(), Path.cwd().resolve()

    def portable(value):
        if not isinstance(value, (str, Path)) or not str(value).startswith(("/", ".")):
            return str(value) if isinstance(value, Path) else value
        path = Path(value).resolve()
        if path.is_relative_to(cache):
            return "$VLLM_GRAFT_CACHE/" + str(path.relative_to(cache))
        if path.is_relative_to(cwd):
            return str(path.relative_to(cwd))
        return path.name

    settings = asdict(config)
    settings["cache_dir"] = "$VLLM_GRAFT_CACHE"
    settings["engine_warmup"] = {"prompts": len(config.engine_warmup),
                                 "offset": ENGINE_WARMUP_OFFSET,
                                 "tokens": ENGINE_WARMUP_TOKENS,
                                 "prefill_shapes": True}
    return {k: portable(v) for k, v in settings.items()}


def machine_description() -> dict:
    import os

    import torch

    from vllm_graft.machine import cpu_model

    return {"cpu": cpu_model() or platform.processor(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}


def write_results(results: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=2))
    return path
