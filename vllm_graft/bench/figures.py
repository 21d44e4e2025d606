"""Summary figures across benchmark runs (``results.json`` files): speed against plain
decoding by batch size, and what a verification step yields by the source of its tokens.

Speed is always a ratio to plain decoding in the same run, tokens/s over all datasets
pooled (:func:`vllm_graft.bench.report.batch_speed`, the number the report prints); the
band is a second plain engine against the first (``plain_again``, the A/A control),
from its lowest to its highest dataset. A figure with fewer than two points is not drawn.
"""

from __future__ import annotations

from pathlib import Path

from vllm_graft.bench.report import _save, batch_speed

#: sources of a step's tokens, bottom to top: the draft head's, the successor matrix's,
#: both at once, copies of the request's own context, and the target's bonus token
SOURCES = ("drafted", "retrieved", "both", "context", "bonus")
SOURCE_COLORS = ("#4c72b0", "#dd8452", "#8172b3", "#55a868", "#c8c8c8")
SOURCE_NAMES = ("drafted (head)", "retrieved (successor matrix)", "drafted and retrieved",
                "context copies", "bonus (the target's own)")
#: method -> label of the figures (a chain's length is appended from the run's config)
LABELS = {"graft_auto": "Graft, budget auto", "graft": "Graft tree with context copies", "ngram": "vLLM ngram",
          "eagle3": "vLLM EAGLE-3 chain", "graft_no_context": "Graft tree, no context copies",
          "graft_chain": "Graft copy chains"}


def label(method: str, results: dict) -> str:
    name = LABELS.get(method, method)
    if method == "eagle3":
        tokens = results.get("config", {}).get("chain_tokens", 5)
        name += f" ({tokens} token{'s' if tokens != 1 else ''})"
    return name


def speedups(runs: list[dict]) -> dict[str, dict[int, float]]:
    """Label -> batch size -> tokens/s over plain decoding of the same run, for every
    method but plain decoding and its A/A control; a later run's point replaces an
    earlier one's."""
    out: dict[str, dict[int, float]] = {}
    for results in runs:
        speed = batch_speed(results)
        for (method, batch), value in speed.items():
            plain = speed.get(("plain", batch))
            if method not in ("plain", "plain_again") and plain:
                out.setdefault(label(method, results), {})[batch] = value / plain
    return out


def plain_band(runs: list[dict]) -> dict[int, tuple[float, float]]:
    """Batch size -> (lowest, highest) ratio of the second plain engine to the first over
    the datasets of the runs that have one; 1.0 always inside."""
    ratios: dict[int, list[float]] = {}
    for results in runs:
        rows = {(r["method"], r["batch"], r["dataset"]): r["tokens_per_s"]
                for r in results.get("batch_rows") or [] if r["dataset"] != "_engine"}
        for (method, batch, dataset), value in rows.items():
            plain = rows.get(("plain", batch, dataset))
            if method == "plain_again" and plain:
                ratios.setdefault(batch, [1.0]).append(value / plain)
    return {batch: (min(values), max(values)) for batch, values in sorted(ratios.items())}


def tokens_by_source(results: dict, methods: tuple[str, ...]) -> list[tuple[str, str, dict]]:
    """(dataset, label, tokens per verification step by :data:`SOURCES`) for each dataset
    and method of ``results``' rows: the accepted tokens (MAT - 1) split by the shares
    the run counted, plus the one bonus token every step yields."""
    out = []
    rows = [r for r in results["rows"] if r["dataset"] != "_engine" and r["method"] in methods]
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        for method in methods:
            row = next((r for r in rows if r["method"] == method and r["dataset"] == dataset),
                       None)
            if row is None:
                continue
            accepted = row["mat"] - 1.0
            shares = {s: row.get(f"accepted_share_{s}") or 0.0
                      for s in ("retrieved", "both", "context")}
            tokens = {"drafted": accepted * max(0.0, 1.0 - sum(shares.values())),
                      **{s: accepted * share for s, share in shares.items()}, "bonus": 1.0}
            out.append((dataset, label(method, results), tokens))
    return out


def _hatch(labels: list[str], name: str) -> str | None:
    """The first of several methods' bars is hatched, the others solid."""
    return "//" if len(labels) > 1 and labels.index(name) == 0 else None


def plot_speedup(runs: list[dict], path: Path) -> Path | None:
    """Speed over plain decoding against batch size, one line per method, the A/A band
    shaded; None (nothing written) where the runs hold fewer than two points."""
    series, band = speedups(runs), plain_band(runs)
    if sum(len(points) for points in series.values()) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({b for points in series.values() for b in points} | set(band))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    if band:
        xs = sorted(band)
        ax.fill_between(xs, [band[b][0] for b in xs], [band[b][1] for b in xs],
                        color="0.85", label="plain vs plain (A/A control)")
    ax.axhline(1.0, color="0.4", lw=0.8)
    for name, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[b] for b in xs], marker="o", lw=2 if "Graft" in name else 1,
                label=name)
        for b in xs:
            ax.annotate(f"{points[b]:.2f}x", (b, points[b]), textcoords="offset points",
                        xytext=(6, -3), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("tokens/s over plain decoding")
    ax.set_title("Tokens/s over plain decoding in the same run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    return _save(fig, path)


def plot_sources(results: dict, methods: tuple[str, ...], path: Path) -> Path | None:
    """Tokens per verification step by source, one stacked bar per dataset and method;
    None (nothing written) where the results hold fewer than two bars."""
    bars = tokens_by_source(results, methods)
    if len(bars) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(name for _, name, _ in bars))
    datasets = list(dict.fromkeys(dataset for dataset, _, _ in bars))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(datasets) + 1.5), 3.8))
    for dataset, name, tokens in bars:
        x = datasets.index(dataset) + (labels.index(name) - (len(labels) - 1) / 2) * width
        bottom = 0.0
        for source, color in zip(SOURCES, SOURCE_COLORS):
            ax.bar(x, tokens[source], width * 0.92, bottom=bottom, color=color,
                   hatch=_hatch(labels, name), edgecolor="white", lw=0.5)
            bottom += tokens[source]
    ax.set_xticks(range(len(datasets)), datasets)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in SOURCE_COLORS]
    names = list(SOURCE_NAMES)
    if len(labels) > 1:
        handles += [plt.Rectangle((0, 0), 1, 1, fc="white", ec="0.3", hatch=_hatch(labels, name))
                    for name in labels]
        names += labels
    ax.legend(handles, names, fontsize=7, ncol=2, loc="upper left")
    ax.set_ylabel("tokens per verification step")
    ax.set_title("What a verification step yields, by source")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)
