"""Markdown report and matplotlib figures from a ``results.json``."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from vllm_graft.markdown import markdown_table

MEASURES = """\
MAT is vLLM's: 1 + accepted / drafts over the steps that carried drafts. Prompt lookup
(ngram) proposes nothing when the context has no match, and those steps are not
counted, so its MAT is per *matched* step. Tokens / step counts every decoding step of
every request (the prefill's token excluded), drafted or not: what a verification
forward yields on average."""

GOALS = """\
Goals (same run, same budget). The grafting itself (`graft_no_context`, the paper's
tree): MAT >= 1.05x dense_tree with >= 30 % fewer draft forwards per step; >= 1.3x
vLLM's EAGLE-3 chain; >= 1.06x prune_only; >= 1.5x retrieval_only; Graft bookkeeping
<= 5 % of step time. With context copies (`graft`, the default): MAT >= ngram's on
every dataset and >= 1.2x ngram's on average; no MAT lost against `graft_no_context`
on humaneval, mtbench and gsm8k."""

#: datasets where copying from the context must cost the tree nothing
NO_LOSS_DATASETS = ("humaneval", "mtbench", "gsm8k")


def _rows(results: dict) -> list[dict]:
    return [r for r in results["rows"] if r["dataset"] != "_engine"]


def method_means(results: dict) -> dict[str, dict]:
    """Per method: MAT and draft forwards averaged over datasets, tokens/s overall."""
    by = defaultdict(list)
    for row in _rows(results):
        by[row["method"]].append(row)
    out = {}
    for method, rows in by.items():
        tokens = sum(r["generated_tokens"] for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        out[method] = {
            "mat": sum(r["mat"] for r in rows) / len(rows),
            "tokens_per_step": (sum(r["tokens_per_step"] for r in rows) / len(rows)
                                if all("tokens_per_step" in r for r in rows) else None),
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "draft_forwards_per_step": sum(r.get("draft_forwards_per_step", 0) for r in rows) / len(rows),
            "bookkeeping_share": (sum(r.get("bookkeeping_share") or 0 for r in rows) / len(rows)
                                  if any("bookkeeping_share" in r for r in rows) else None),
        }
    return out


def goal_checks(means: dict, rows: list[dict] | None = None
                ) -> list[tuple[str, str, bool | None]]:
    """(check, value, met) rows; ``rows`` (per dataset) add the per-dataset checks."""
    def ratio(a, b, key="mat"):
        if a not in means or b not in means or not means[b][key]:
            return None
        return means[a][key] / means[b][key]

    checks = []

    def check(text, value, target, higher=True):
        if value is None:
            checks.append((text, "n/a", None))
        else:
            ok = value >= target if higher else value <= target
            checks.append((text, f"{value:.3f} (goal {'>=' if higher else '<='} {target})", ok))

    tree = "graft_no_context" if "graft_no_context" in means else "graft"
    check(f"MAT {tree} / dense_tree", ratio(tree, "dense_tree"), 1.05)
    forwards = ratio(tree, "dense_tree", "draft_forwards_per_step")
    check(f"draft forwards {tree} / dense_tree", forwards, 0.70, higher=False)
    check(f"MAT {tree} / eagle3 chain", ratio(tree, "eagle3"), 1.3)
    check(f"MAT {tree} / prune_only", ratio(tree, "prune_only"), 1.06)
    check(f"MAT {tree} / retrieval_only", ratio(tree, "retrieval_only"), 1.5)
    share = means.get(tree, {}).get("bookkeeping_share")
    check(f"{tree} bookkeeping share of step time", share, 0.05, higher=False)
    for key, label in (("mat", "MAT (vLLM's counters: steps with drafts)"),
                       ("tokens_per_step", "tokens per step (all decoding steps)")):
        if all(means.get(m, {}).get(key) for m in ("graft", "ngram")):
            check(f"{label} graft / ngram, mean", ratio("graft", "ngram", key), 1.2)
        per = {(r["method"], r["dataset"]): r.get(key) for r in rows or []}
        versus = [per[("graft", d)] / per[("ngram", d)] for (m, d) in per
                  if m == "graft" and per[("graft", d)] and per.get(("ngram", d))]
        if versus:
            check(f"{label} graft / ngram, lowest dataset", min(versus), 1.0)
    # Graft-TAIL against vLLM's EAGLE-3 chain at the same number of draft tokens
    check("MAT tail / eagle3 chain", ratio("tail", "eagle3"), 1.0)
    check("tokens/s tail / eagle3 chain", ratio("tail", "eagle3", "tokens_per_s"), 1.0)
    mat = {(r["method"], r["dataset"]): r["mat"] for r in rows or []}
    for dataset in NO_LOSS_DATASETS:
        if ("graft", dataset) in mat and mat.get(("graft_no_context", dataset)):
            check(f"MAT graft / graft_no_context on {dataset}",
                  mat[("graft", dataset)] / mat[("graft_no_context", dataset)], 1.0)
    return checks


def gain_by_prompt_length(results: dict, family: str = "code-") -> list[tuple[str, float]]:
    """graft / dense_tree MAT on the long-prompt datasets of one family (``code-1k``,
    ``code-2k``, ...), shortest first."""
    mat = {(r["method"], r["dataset"]): r["mat"] for r in _rows(results)}
    names = sorted({d for _, d in mat if d.startswith(family) and d[len(family):-1].isdigit()},
                   key=lambda d: int(d[len(family):-1]))
    tree = "graft_no_context" if any(m == "graft_no_context" for m, _ in mat) else "graft"
    return [(d, mat[(tree, d)] / mat[("dense_tree", d)]) for d in names
            if (tree, d) in mat and mat.get(("dense_tree", d))]


def markdown(results: dict) -> str:
    rows = _rows(results)
    cfg = results["config"]
    lines = ["# vllm-graft benchmark", "",
             f"Target `{Path(cfg['target']).name}`, head `{Path(cfg['head']).name}`, budget "
             f"{cfg['budget']}, greedy, {cfg['max_tokens']} new tokens per prompt, dtype "
             f"{cfg['dtype']}, max {cfg['max_num_seqs']} concurrent requests.", "",
             f"Machine: {results['machine']['cpu']} ({results['machine']['cores']} cores), "
             f"torch {results['machine']['torch']}.", "",
             f"Command: `{cfg.get('command') or 'vllm-graft bench'}`", ""]
    warm = cfg.get("engine_warmup")
    if isinstance(warm, dict) and warm.get("prompts"):
        shapes = (" and prefilled, for each dataset, a batch of them repeated or cut to its "
                  "prompts' lengths (its prefill shapes, one token each, the prefix cache "
                  "reset before each)"
                  if warm.get("prefill_shapes") else "")
        lines += [f"Every engine first generated {warm['tokens']} tokens for up to "
                  f"{warm['prompts']} ShareGPT prompts (from #{warm['offset']}, in no "
                  f"dataset){shapes}, untimed.", ""]
    means = method_means(results)
    agreement = results.get("greedy_agreement_with_plain", {})
    summary = []
    for method, m in means.items():
        a = agreement.get(method)
        summary.append([method, f"{m['mat']:.3f}", _cell(m["tokens_per_step"]),
                        f"{m['tokens_per_s']:.2f}", f"{m['draft_forwards_per_step']:.2f}",
                        f"{a['identical']}/{a['total']}" if a else "-"])
    lines += ["## Summary (mean over datasets)", "", *markdown_table(
        ["method", "MAT", "tokens / step", "tokens/s", "draft forwards / step",
         "greedy identical to plain"], summary)]
    lines += ["", MEASURES]
    checks = [[text, value, "yes" if ok else ("no" if ok is False else "-")]
              for text, value, ok in goal_checks(means, rows)]
    gains = gain_by_prompt_length(results)
    if len(gains) > 1:
        grows = all(b >= a for (_, a), (_, b) in zip(gains, gains[1:]))
        checks.append(["tree / dense_tree MAT grows with code prompt length",
                       ", ".join(f"{d}: {g:.3f}" for d, g in gains), "yes" if grows else "no"])
    lines += ["", "## Goals", "", GOALS, "", *markdown_table(["check", "value", "met"], checks)]
    lines += ["", "## Per dataset", "", *markdown_table(
        ["dataset", "method", "MAT", "tokens / step", "tokens/s", "verified / step",
         "draft fwd / step", "retrieved share", "context share", "matrix hits",
         "bookkeeping"],
        ([row["dataset"], row["method"], f"{row['mat']:.3f}",
          _cell(row.get("tokens_per_step")), f"{row['tokens_per_s']:.2f}",
          str(row["verified_tokens_per_step"]), _cell(row.get("draft_forwards_per_step")),
          _cell(row.get("accepted_share_retrieved")), _cell(row.get("accepted_share_context")),
          _cell(row.get("matrix_hit_rate")), _cell(row.get("bookkeeping_share"))]
         for row in sorted(rows, key=lambda r: (r["dataset"], r["method"]))),
        cell=_cell)]
    lines += batch_section(results)
    if results.get("ablations"):
        lines += ["", "## Ablations (graft)", "", *markdown_table(
            ["knob", "value", "dataset", "MAT", "tokens/s"],
            ([row["knob"], row["value"], row["dataset"], f"{row['mat']:.3f}",
              f"{row['tokens_per_s']:.2f}"] for row in results["ablations"]))]
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    """A table cell of the report: ``-`` for no value, floats to 3 decimals."""
    return "-" if value is None else (f"{value:.3f}" if isinstance(value, float)
                                      else str(value))


def batch_speed(results: dict) -> dict[tuple[str, int], float]:
    """(method, batch) -> tokens/s over all datasets of the batch sweep."""
    tokens, seconds = defaultdict(float), defaultdict(float)
    for row in results.get("batch_rows") or []:
        if row["dataset"] != "_engine":
            tokens[(row["method"], row["batch"])] += row["generated_tokens"]
            seconds[(row["method"], row["batch"])] += row["seconds"]
    return {key: tokens[key] / seconds[key] for key in tokens if seconds[key]}


def batch_section(results: dict) -> list[str]:
    """tokens/s per method and batch size, beside plain decoding in the same sweep;
    the cost-aware tree's goals: never slower than plain (any batch, any dataset),
    >= 1.15x plain at batch 1."""
    speed = batch_speed(results)
    if not speed:
        return []
    batches = sorted({b for _, b in speed})
    names = list(dict.fromkeys(m for m, _ in speed))
    def speed_cell(name: str, b: int) -> str:
        value, plain = speed.get((name, b)), speed.get(("plain", b))
        return "-" if value is None else f"{value:.1f}" + (
            f" ({value / plain:.2f}x)" if plain and name != "plain" else "")

    lines = ["", "## Batch sizes (tokens/s, and x plain at the same batch)", "",
             *markdown_table(["method", *(f"batch {b}" for b in batches)],
                             ([name, *(speed_cell(name, b) for b in batches)]
                              for name in names))]
    by = {(r["method"], r["batch"], r["dataset"]): r for r in results["batch_rows"]
          if r["dataset"] != "_engine"}
    datasets = list(dict.fromkeys(d for _, _, d in by))

    def ratio(name: str, batch: int, dataset: str, baseline: str = "plain") -> float | None:
        row, base = by.get((name, batch, dataset)), by.get((baseline, batch, dataset))
        if row is None or base is None or not base["tokens_per_s"]:
            return None
        return row["tokens_per_s"] / base["tokens_per_s"]

    lines += ["", "Per dataset (x plain at the same batch):", "", *markdown_table(
        ["method", "batch", *datasets],
        ([name, b, *("-" if ratio(name, b, d) is None else f"{ratio(name, b, d):.2f}"
                     for d in datasets)]
         for name in names if name != "plain" for b in batches))]
    for name in ("graft_auto", "graft_chain", "graft"):
        ratios = [(b, d, ratio(m, b, d)) for (m, b, d) in by
                  if m == name and ratio(m, b, d) is not None]
        if ratios:
            b, d, worst = min(ratios, key=lambda item: item[2])
            lines.append("")
            lines.append(f"{name}: slowest against plain at batch {b} on {d} ({worst:.2f}x; "
                         f"goal >= 1.0 everywhere); batch 1 over all datasets: "
                         + (f"{speed[(name, 1)] / speed[('plain', 1)]:.2f}x (goal >= 1.15)"
                            if (name, 1) in speed and ("plain", 1) in speed else "n/a"))
    lines += noise_floor_lines({key: ratio(*key) for key in by if key[0] != "plain"})
    fresh = fresh_engines(results)
    lines += rounds_lines(by, fresh, renewed_engines(results))
    lines += step_split_lines(by)
    lines += guard_round_lines(by)
    lines += warmup_lines(results, fresh)
    for baseline in ("ngram", "eagle3"):
        pairs = [(d, ratio("graft_auto", 1, d, baseline))
                 for d in ("humaneval", "mtbench", "gsm8k")
                 if ratio("graft_auto", 1, d, baseline) is not None]
        if pairs:
            lines.append("")
            lines.append(f"graft_auto / {baseline} at batch 1 (goal >= 1.0): "
                         + ", ".join(f"{d} {ratio:.2f}x" for d, ratio in pairs))
    return lines


def noise_floor_lines(ratios: dict[tuple[str, int, str], float | None]) -> list[str]:
    """Where the sweep ran a second plain engine (``plain_again``, the A/A control): the
    band its per-dataset ratios to plain span at each batch size, and which other
    (method, batch, dataset) fell below that band: a ratio inside it is not told apart
    from plain decoding by this sweep."""
    control = "plain_again"
    lines = []
    for batch in sorted({b for m, b, _ in ratios if m == control}):
        band = [r for (m, b, _), r in ratios.items() if m == control and b == batch
                and r is not None]
        if not band:
            continue
        low, high = min(band), max(band)
        below = [f"{m} on {d} ({r:.2f}x)" for (m, b, d), r in sorted(ratios.items())
                 if m != control and b == batch and r is not None and r < low]
        lines += ["", f"A/A control at batch {batch}: a second plain engine measured "
                      f"{low:.2f}-{high:.2f}x plain over the datasets; below that band: "
                      + (", ".join(below) if below else "none")]
    return lines


def renewed_engines(results: dict) -> list[str]:
    """The sweep's methods whose engines started again for every round."""
    return sorted({r["method"] for r in results.get("batch_rows") or []
                   if r["dataset"] == "_engine" and r.get("engine_starts", 1) > 1})


def fresh_engines(results: dict) -> bool:
    """Whether the sweep started every engine again for every round."""
    engines = {r["method"] for r in results.get("batch_rows") or [] if r["dataset"] == "_engine"}
    return bool(engines) and set(renewed_engines(results)) == engines


def rounds_lines(by: dict, fresh: bool = False, renewed: list[str] = ()) -> list[str]:
    """The interleaved sweep's rounds: how many, whether later rounds repeated the first
    one's greedy output, and the spread of each method's round-by-round ratio to plain
    (round r of a method against round r of plain on the same dataset). ``renewed``:
    the methods started again for every round where the others were not."""
    rounds = {len(r["round_tokens_per_s"]) for r in by.values() if "round_tokens_per_s" in r}
    if not rounds:
        return []
    same = sum(r.get("rounds_identical", 0) for r in by.values())
    total = sum(r["prompts"] for r in by.values() if "rounds_identical" in r)
    lives = ("was started afresh for each round, beside the others (in the round's "
             "order), and ran each dataset once a round" if fresh else
             "stayed alive beside the others and ran each dataset")
    lines = ["", f"Every sweep engine {lives}, {max(rounds)} rounds, taking turns in a "
                 f"rotated order; tokens/s above are medians over the rounds. Greedy output "
                 f"repeated the first round's in every later round for {same} / {total} "
                 f"requests."]
    if renewed and not fresh:
        lines[-1] += (f" The engines of {', '.join(renewed)} were started afresh for each "
                      "round: they propose what earlier requests generated, and a later "
                      "round of the same prompts would find its answers there.")
    spreads = {}
    for (name, batch, dataset), row in by.items():
        base = by.get(("plain", batch, dataset))
        if name == "plain" or base is None or "round_tokens_per_s" not in row:
            continue
        spreads.setdefault((name, batch), []).extend(
            a / b for a, b in zip(row["round_tokens_per_s"], base["round_tokens_per_s"]) if b)
    if spreads:
        lines += ["", "Round-by-round x plain (each round against plain's round on the same "
                  "dataset), lowest to highest over rounds and datasets, the median, and "
                  "the geometric mean with its 95 % bootstrap interval (the round pairs "
                  "resampled): "
                  + "; ".join(f"{name} batch {batch} {min(v):.2f}-{max(v):.2f} "
                              f"(median {statistics.median(v):.2f}, mean "
                              "{:.2f} in {:.2f}-{:.2f})".format(*paired_interval(v))
                              for (name, batch), v in sorted(spreads.items()))]
    return lines


def step_split_lines(by: dict) -> list[str]:
    """Each engine's median decoding step split into the target's forward and logits
    and everything else (scheduling, sampling, drafting, Graft's bookkeeping), averaged
    over the datasets, and what the rest adds to plain decoding's: the target's compute
    runs at the speed of the process and the machine, which differ from one engine to
    the next by more than a method's own cost; the rest is that cost."""
    split: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for (name, batch, _), row in by.items():
        if "other_ms" in row:
            split.setdefault((name, batch), []).append(
                (row["step_ms"], row["target_ms"], row["other_ms"]))
    if not split:
        return []
    lines = ["", "Median decoding step (ms, mean over datasets): the whole step = the "
                 "target's forward and logits + the rest (scheduling, sampling, drafting, "
                 "Graft's bookkeeping); the rest against plain decoding's at that batch:"]
    for batch in sorted({b for _, b in split}):
        means = {name: [statistics.fmean(v) for v in zip(*values)]
                 for (name, b), values in split.items() if b == batch}
        plain = means.get("plain")
        cells = []
        for name, (step, target, other) in means.items():
            cell = f"{name} {step:.1f} = {target:.1f} + {other:.2f}"
            if plain is not None and name != "plain":
                extra = other - plain[2]
                cell += f" ({extra:+.2f} ms, {100 * extra / plain[0]:+.1f} % of plain's step)"
            cells.append(cell)
        lines.append(f"- batch {batch}: " + "; ".join(cells))
    return lines + prefill_lines(by)


def guard_round_lines(by: dict) -> list[str]:
    """What budget auto's guard ran on each dataset in each round: its speculative
    steps (copy chains, trees) out of its decoding steps. A round's speed against plain
    decoding says little without it: the same engine may run chains in most steps of
    one round and in none of the next."""
    lines = []
    for (name, batch, dataset), row in by.items():
        rounds = row.get("round_guard_steps")
        if not rounds:
            continue
        if not lines:
            lines = ["", "Budget auto's steps by round (copy chains + trees / all decoding "
                         "steps of the run), each dataset:"]
        cells = [f"{r.get('chain', 0) + r.get('tree', 0)}/{sum(r.values())}" for r in rounds]
        lines.append(f"- {name} batch {batch}, {dataset}: " + " ".join(cells))
    return lines


def prefill_lines(by: dict) -> list[str]:
    """Each engine's prefill phase (until every request has its first token), summed
    over the datasets, against plain decoding's: at batch 32 it is about half of a run,
    and a cost an engine adds there is invisible in its decoding steps."""
    phase: dict[int, dict[str, float]] = {}
    for (name, batch, _), row in by.items():
        if "prefill_ms" in row:
            sums = phase.setdefault(batch, {})
            sums[name] = sums.get(name, 0.0) + row["prefill_ms"] / 1e3
    if not phase:
        return []
    lines = ["", "Prefill phase (s, median over rounds, summed over the datasets): from the "
                 "first step until every request has its first token:"]
    for batch, sums in sorted(phase.items()):
        plain = sums.get("plain")
        cells = [f"{name} {seconds:.2f}" + (f" ({seconds / plain:.2f}x plain's)"
                                            if plain and name != "plain" else "")
                 for name, seconds in sums.items()]
        lines.append(f"- batch {batch}: " + "; ".join(cells))
    return lines


def paired_interval(ratios: list[float], resamples: int = 4000, seed: int = 0
                    ) -> tuple[float, float, float]:
    """The geometric mean of paired speed ratios and its 95 % percentile-bootstrap
    interval. Rounds on this machine spread by 10-20 % whatever the method (a second
    plain engine's rounds do too), so a mean ratio says little without the range it
    is known to; fixed seed: the report is reproducible from its results file."""
    import numpy as np

    logs = np.log(np.asarray(ratios, dtype=np.float64))
    picks = np.random.default_rng(seed).integers(0, len(logs), (resamples, len(logs)))
    low, high = np.percentile(logs[picks].mean(axis=1), [2.5, 97.5])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


def warmup_lines(results: dict, fresh: bool = False) -> list[str]:
    """What each sweep engine's untimed warm-up took: the one-off costs a fresh engine
    pays at its batch size (for budget "auto", its first measurement of every mode)."""
    warm = {(r["method"], r["batch"]): r["warmup_seconds"] for r in results["batch_rows"]
            if r["dataset"] == "_engine" and "warmup_seconds" in r}
    settings = results.get("config", {}).get("engine_warmup") or {}
    if not warm or not settings.get("prompts"):
        return []
    when = "each start (median seconds over its starts)" if fresh \
        else "its first round (seconds)"
    shapes = (", and prefilled each dataset's prompt lengths" if settings.get("prefill_shapes")
              else "")
    return ["", f"Before {when} each engine generated {settings['tokens']} "
                f"tokens for each of as many ShareGPT prompts as its batch{shapes}, untimed: "
                + "; ".join(f"{name} batch {batch} {seconds:.1f}"
                                         for (name, batch), seconds in sorted(warm.items()))]


def plots(results: dict, out: Path) -> list[Path]:
    """The run's figures: MAT against speed and MAT per dataset where the run compares
    two methods or more, and the ablations' MAT by knob value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    means = method_means(results)
    if len(means) >= 2:  # a figure of one point says nothing
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for method, m in means.items():
            ax.scatter(m["tokens_per_s"], m["mat"], s=60)
            ax.annotate(method, (m["tokens_per_s"], m["mat"]), textcoords="offset points",
                        xytext=(5, 4))
        ax.set_xlabel("tokens / s (this machine)")
        ax.set_ylabel("mean accepted tokens per step (MAT)")
        ax.set_title("MAT vs speed")
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "mat_vs_speed.png"))

        rows = _rows(results)
        dataset_names = sorted({r["dataset"] for r in rows})
        method_names = list(means)
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(dataset_names) + 2), 4.5))
        width = 0.8 / max(len(method_names), 1)
        for i, method in enumerate(method_names):
            values = [next((r["mat"] for r in rows if r["method"] == method and r["dataset"] == d), 0)
                      for d in dataset_names]
            ax.bar([x + i * width for x in range(len(dataset_names))], values, width, label=method)
        ax.set_xticks([x + width * (len(method_names) - 1) / 2 for x in range(len(dataset_names))])
        ax.set_xticklabels(dataset_names, rotation=20)
        ax.set_ylabel("MAT")
        ax.legend(fontsize=7, ncol=2)
        ax.set_title("MAT per dataset")
        written.append(_save(fig, out / "mat_per_dataset.png"))

    ablations = results.get("ablations") or []
    knobs = sorted({r["knob"] for r in ablations})
    if knobs:
        fig, axes = plt.subplots(1, len(knobs), figsize=(4 * len(knobs), 3.5))
        axes = axes if len(knobs) > 1 else [axes]
        for ax, knob in zip(axes, knobs):
            values = defaultdict(list)
            for r in ablations:
                if r["knob"] == knob:
                    values[str(r["value"])].append(r["mat"])
            labels = list(values)
            ax.plot(labels, [sum(v) / len(v) for v in values.values()], marker="o")
            ax.set_title(knob)
            ax.set_ylabel("MAT")
            ax.grid(alpha=0.3)
        written.append(_save(fig, out / "ablations.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
