"""The README's figures from the canonical results in bench/results/:

    .venv/bin/python scripts/plot_results.py [--out docs/images]

``speedup_by_batch.png``: budget auto's tokens/s over plain decoding at batch 1, 8 and 32
(the batch sweeps ``smollm2-135m-sweep/b{1,8,32}``, with vLLM's ngram and
EAGLE-3 chain at batch 1 and its one-token chain at batch 8) and the plain-vs-plain band
of the same runs. ``tokens_per_step_by_source.png``: Graft's tree with and without
context copies per dataset (``smollm2-135m-context``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_graft.bench.figures import plot_sources, plot_speedup  # noqa: E402

RESULTS = REPO / "bench" / "results"
SPEED_RUNS = ("smollm2-135m-b8-eagle3-one-token", "smollm2-135m-sweep/b1",
              "smollm2-135m-sweep/b8", "smollm2-135m-sweep/b32")
SOURCE_RUN = "smollm2-135m-context"


def load(name: str) -> dict:
    path = RESULTS / name / "results.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        sys.exit(f"plot_results: no results file {path.relative_to(REPO)}")


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images",
                        help="folder the PNGs are written to")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = [plot_speedup([load(name) for name in SPEED_RUNS],
                            args.out / "speedup_by_batch.png"),
               plot_sources(load(SOURCE_RUN), ("graft_no_context", "graft"),
                            args.out / "tokens_per_step_by_source.png")]
    for path in written:
        if path is not None:
            print(path)
    return [path for path in written if path is not None]


if __name__ == "__main__":
    main()
