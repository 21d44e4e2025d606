"""Budget auto against its own plain decoding, paired inside one engine process.

A benchmark sweep compares engines in separate processes, and on a shared CPU one
process runs 10-20 % faster or slower than the next for its whole life (two plain
engines of one sweep: 0.69-1.60x of each other round by round). That noise is wider
than what the throughput guard's choices gain or lose at batch 8. Here one budget-auto
engine runs every dataset twice a round: once as it is (the guard choosing copy chains,
trees or plain decoding), and once with the guard held to plain decoding (its state and
its chain scout set aside for that run and given back after it, so the auto runs see
one continuous engine; the cost model behind budget auto's sizing does learn from the
plain runs' steps, as it learns from any plain step); the two runs take turns in
opposite orders in alternate rounds. Every run starts from the successor matrix the
warm-up left: the rounds repeat the same prompts, and a matrix taught one round's text
by its speculative steps would predict the next round's (copy chains continued by the
matrix then ran in 47 of 51 steps of a chat dataset where they otherwise ran in 2-4).
Their ratio measures what the guard's speculation gains or loses against the same
process decoding plainly: a process's speed cancels out. What Graft's runner costs a
plain step against plain decoding itself is measured elsewhere (the sweep's
``graft_plain`` method, interleaved with plain decoding).

Usage, with a job file a sweep wrote (``OUT/jobs/graft_auto-batch8.job.json``)::

    python scripts/guard_ab.py JOB.json --rounds 6 --out DIR [--guard text_steps=1e9]
        [--datasets humaneval]

``--guard NAME=VALUE`` sets a throughput-guard field for the auto runs (a number; 0 or
1 for a switch such as ``scout_new_batches``; a name for a choice such as
``credit=sum``; modes joined by '+', such as ``modes=chain`` for copy chains at
every step), to compare guard settings run against run; ``--datasets`` keeps only the
named datasets of the job (more rounds of one dataset in the same time). Writes
``DIR/guard_ab.json`` and prints a summary: per dataset the auto runs' speed over the
plain runs', round by round, with the geometric mean and its 95 % bootstrap interval,
and the steps the guard ran in each mode. Greedy output must be the same in both runs
of every pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def hold_to_plain(worker) -> None:
    """Set the budget-auto guard and its chain scout aside; a guard of plain decoding
    only runs until :func:`give_back`."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    drafter = worker.model_runner.drafter
    drafter.held = (drafter.guard, drafter.scout)
    drafter.guard, drafter.scout = ThroughputGuard(modes=(StepMode.PLAIN,)), None


def give_back(worker) -> None:
    drafter = worker.model_runner.drafter
    drafter.guard, drafter.scout = drafter.held
    del drafter.held


def keep_matrix(worker) -> None:
    """Keep a copy of the successor matrix as the warm-up left it."""
    drafter = worker.model_runner.drafter
    drafter.kept_table = drafter.matrix.table.clone()


def restore_matrix(worker) -> None:
    """The successor matrix as the warm-up left it: the rounds repeat the same prompts,
    and a matrix that learned a dataset's continuations in one round's speculative
    steps would predict them in the next (a memorised text no new request brings)."""
    drafter = worker.model_runner.drafter
    drafter.matrix.table.copy_(drafter.kept_table)


def set_guard(worker, settings: dict) -> None:
    """The auto runs' guard with ``settings`` (checked again as the guard checks its
    own fields at construction)."""
    guard = worker.model_runner.drafter.guard
    if guard is None:
        raise SystemExit("the job's engine has no throughput guard (budget \"auto\")")
    for name, value in settings.items():
        setattr(guard, name, value)
    guard.__post_init__()


def switch(value: float) -> bool:
    """A switch's value given as a number: 0 or 1."""
    if value not in (0.0, 1.0):
        raise ValueError(value)
    return bool(value)


def step_modes(value: str) -> tuple:
    """Guard modes given as names joined by '+': ``chain+plain``."""
    from vllm_graft.core.config import StepMode

    return tuple(StepMode(name) for name in value.split("+"))


def parse_guard(items: list[str]) -> dict:
    """``NAME=VALUE`` pairs of throughput-guard settings (numbers, switches, choices),
    refused before any engine starts when a name is no such field or a value is out of
    its range."""
    import dataclasses

    from vllm_graft.core.budget import ThroughputGuard

    kinds = {"int": int, "float": float, "float | None": float, "bool": switch, "str": str,
             "tuple[StepMode, ...]": step_modes}
    state = {"steps", "measuring"}  # what the guard keeps as it runs, no setting
    settable = {field.name: kinds[field.type] for field in dataclasses.fields(ThroughputGuard)
               if field.type in kinds and field.name not in state}
    settings = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--guard takes NAME=VALUE, got {item!r}")
        if name not in settable:
            raise SystemExit(f"--guard: {name!r} is not a throughput-guard setting "
                             f"(one of {', '.join(sorted(settable))})")
        try:
            settings[name] = value if settable[name] is str else settable[name](
                value if settable[name] is step_modes else float(value))
        except ValueError:
            wanted = {switch: "0 or 1", step_modes: "modes joined by '+' (chain+plain)"
                      }.get(settable[name], "a number")
            raise SystemExit(f"--guard: {name} takes {wanted}, got {value!r}") from None
    try:
        ThroughputGuard(**settings)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"--guard: {error}") from None
    return settings


def steal_ticks() -> int | None:
    """Ticks the hypervisor gave this machine's CPUs to other guests (Linux), if known."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return None


def timed_run(llm, job: dict, dataset: str) -> dict:
    """One run of ``dataset``: its wall seconds, and this process's CPU seconds (every
    thread's, so work another process or guest took the cores from does not count)."""
    from vllm_graft.bench.engines import guard_steps
    from vllm_graft.bench.worker import run_dataset

    cpu, steal = time.process_time(), steal_ticks()
    run = run_dataset(llm, job, dataset)
    stolen = None if steal is None else steal_ticks() - steal
    return {"seconds": run["seconds"], "prefill_ms": run["prefill_ms"],
            "cpu_seconds": time.process_time() - cpu,
            "steal_ticks": stolen, "tokens": run["tokens"],
            "guard_steps": guard_steps(run["delta"]),
            "scout": {"looks": run["delta"].get("graft_chain_scout_looks", 0),
                      "chain_steps": run["delta"].get("graft_chain_scout_steps", 0)},
            "graft_ms": graft_ms(run["delta"])}


def graft_ms(delta: dict) -> dict[str, float]:
    """Milliseconds of Graft's own work in a run, one entry per time counter the engine
    has (bookkeeping outside the forwards, draft-head forwards, tree attention, tree
    preparation, heap trims), from its counter deltas: where the auto run's extra time
    went beside its steps."""
    from vllm_graft.vllm.metrics import GRAFT_COUNTERS

    return {name.removesuffix("_us"): round(delta.get(f"graft_{name}", 0) / 1e3, 2)
            for name in GRAFT_COUNTERS if name.endswith("_us")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", type=Path, help="a budget-auto engine's job file from a sweep")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--guard", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--datasets", nargs="+", metavar="NAME",
                        help="only these of the job's datasets (default: all, in its order)")
    args = parser.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        parser.error("--rounds must be even (the pair's order alternates round by round)")
    job = json.loads(args.job.read_text())
    graft = (job.get("spec") or {}).get("graft", {})
    if graft.get("budget") != "auto" and not graft.get("auto_size"):
        parser.error(f"{args.job}: not a budget-auto Graft engine's job")
    settings = parse_guard(args.guard)
    if args.datasets:
        unknown = [name for name in args.datasets if name not in job["datasets"]]
        if unknown:
            parser.error(f"--datasets: {', '.join(unknown)} not in {args.job} (it has "
                         f"{', '.join(job['datasets'])})")
        job["datasets"] = {name: job["datasets"][name] for name in args.datasets}

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_graft.bench.report import paired_interval
    from vllm_graft.bench.worker import warm_up
    from vllm_graft.offline.engine import cpu_runtime_defaults, engine

    cpu_runtime_defaults()
    runs: dict[str, list[dict]] = {name: [] for name in job["datasets"]}
    started = time.time()
    with engine(job["target"], job["spec"], **job["engine"]) as llm:
        llm.collective_rpc(set_guard, args=(settings,))
        warmup_seconds = warm_up(llm, job)
        llm.collective_rpc(keep_matrix)
        for r in range(args.rounds):
            for dataset in job["datasets"]:
                pair = {}
                for held in ((False, True) if r % 2 == 0 else (True, False)):
                    llm.collective_rpc(restore_matrix)
                    if held:
                        llm.collective_rpc(hold_to_plain)
                    try:
                        pair["plain" if held else "auto"] = timed_run(llm, job, dataset)
                    finally:
                        if held:
                            llm.collective_rpc(give_back)
                if pair["auto"]["tokens"] != pair["plain"]["tokens"]:
                    raise SystemExit(f"round {r}, {dataset}: greedy output differs between "
                                     f"the auto and the plain run")
                runs[dataset].append({key: {k: v for k, v in run.items() if k != "tokens"}
                                      for key, run in pair.items()})
                print(f"round {r} {dataset}: auto {pair['auto']['seconds']:.3f} s "
                      f"{pair['auto']['guard_steps']} (scout {pair['auto']['scout']}), "
                      f"plain {pair['plain']['seconds']:.3f} s; Graft ms auto "
                      f"{pair['auto']['graft_ms']}, plain {pair['plain']['graft_ms']}",
                      flush=True)
    summary = {"job": args.job.name, "guard": settings, "rounds": args.rounds,
               "warmup_seconds": round(warmup_seconds, 2),
               "wall_seconds": round(time.time() - started, 1), "datasets": {}}
    all_ratios = []
    lines = [f"auto / plain-held speed in one process ({args.rounds} rounds"
             + (f", guard {settings}" if settings else "") + "):"]
    all_cpu = []
    for dataset, pairs in runs.items():
        ratios = [p["plain"]["seconds"] / p["auto"]["seconds"] for p in pairs]
        cpu = [p["plain"]["cpu_seconds"] / p["auto"]["cpu_seconds"] for p in pairs]
        all_ratios += ratios
        all_cpu += cpu
        mean, low, high = paired_interval(ratios)
        cpu_mean, cpu_low, cpu_high = paired_interval(cpu)
        speculative = [p["auto"]["guard_steps"].get("chain", 0)
                       + p["auto"]["guard_steps"].get("tree", 0) for p in pairs]
        steps = [sum(p["auto"]["guard_steps"].values()) for p in pairs]
        summary["datasets"][dataset] = {
            "ratios": [round(x, 4) for x in ratios], "mean": round(mean, 4),
            "interval": [round(low, 4), round(high, 4)],
            "cpu_ratios": [round(x, 4) for x in cpu], "cpu_mean": round(cpu_mean, 4),
            "cpu_interval": [round(cpu_low, 4), round(cpu_high, 4)], "runs": pairs}
        lines.append(f"- {dataset}: wall {mean:.3f}x ({low:.3f}-{high:.3f}), rounds "
                     + " ".join(f"{x:.2f}" for x in ratios)
                     + f"; CPU time {cpu_mean:.3f}x ({cpu_low:.3f}-{cpu_high:.3f}), rounds "
                     + " ".join(f"{x:.2f}" for x in cpu) + "; speculative steps "
                     + " ".join(f"{s}/{n}" for s, n in zip(speculative, steps))
                     + "; prefill phase auto / plain (ms, median) "
                     + f"{statistics.median(p['auto']['prefill_ms'] for p in pairs):.0f} / "
                     + f"{statistics.median(p['plain']['prefill_ms'] for p in pairs):.0f}")
    mean, low, high = paired_interval(all_ratios)
    cpu_mean, cpu_low, cpu_high = paired_interval(all_cpu)
    summary.update(mean=round(mean, 4), interval=[round(low, 4), round(high, 4)],
                   cpu_mean=round(cpu_mean, 4), cpu_interval=[round(cpu_low, 4),
                                                              round(cpu_high, 4)])
    lines.append(f"- all: wall {mean:.3f}x ({low:.3f}-{high:.3f}), median "
                 f"{statistics.median(all_ratios):.3f}; CPU time {cpu_mean:.3f}x "
                 f"({cpu_low:.3f}-{cpu_high:.3f})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "guard_ab.json").write_text(json.dumps(summary, indent=2))
    (args.out / "guard_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
