"""Graft against vLLM's EAGLE-3 chain, prompt lookup, suffix decoding and its own
ablations, on the same prompts in one run.

    vllm-graft bench --target smollm2-135m --head assets/heads/smollm2-135m-eagle3 \\
        --out bench/results/smollm2 --ablations
    vllm-graft bench --quick --out /tmp/quick      # a few minutes: every method runs

Writes ``results.json``, ``report.md`` and PNG figures into ``--out``. Targets named like
a prepared model (``smollm2-135m``, ``qwen-coder-0.5b``, ``qwen-coder-1.5b``) are
prepared on first use (``vllm-graft prepare-models``).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from vllm_graft.assets.datasets import COPY_KINDS
from vllm_graft.assets.models import MODELS, prepare_model
from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.bench.config import DFLASH_METHODS, config_default
from vllm_graft.cli.common import add_num_prompts, command_parser
from vllm_graft.offline.engine import cpu_runtime_defaults, drafter_graft_keys

ALL_METHODS = ["plain", "eagle3", "ngram", "ngram_long", "suffix", "dense_tree",
               "prune_only", "retrieval_only", "graft_no_context", "graft", "graft_chain",
               "graft_auto", "graft_auto_shared", "graft_chain_shared", "graft_tree", "tail",
               "tail_auto", "dflash", "tail_dflash", "graft_plain", "plain_again",
               "graft_reference_ops"]
# run when named only
DIAGNOSTIC_METHODS = ["ngram_long", "graft_plain", "graft_tree", "plain_again",
                      "graft_auto_shared", "graft_chain_shared", "graft_reference_ops"]
ALL_DATASETS = ["humaneval", "mtbench", "gsm8k", "code-edit", "essays-4k", "code-4k", "code-8k",
                "code-16k"]
COMMITTED_HEADS = Path(__file__).resolve().parents[2] / "assets" / "heads"


def default_head(target: str) -> Path | None:
    head = COMMITTED_HEADS / f"{target}-eagle3"
    return head if (head / "config.json").is_file() else None


def default_dflash(target: str) -> Path | None:
    drafter = COMMITTED_HEADS / f"{target}-dflash"
    return drafter if (drafter / "config.json").is_file() else None


def write_report(results: dict, out: Path) -> None:
    """``report.md`` and the figures of ``results`` into ``out``; the report is printed."""
    from vllm_graft.bench.report import markdown, plots

    (out / "report.md").write_text(markdown(results))
    plots(results, out)
    print((out / "report.md").read_text())


def rewrite_report(parser, out: Path) -> int:
    import json

    path = out / "results.json"
    if not path.is_file():
        parser.error(f"--report-only: no results file {path}")
    write_report(json.loads(path.read_text()), out)
    return 0


def build_parser():
    p = command_parser("bench", __doc__)
    p.add_argument("--target", default="smollm2-135m",
                   help="model directory or a prepared model name")
    p.add_argument("--head", help="EAGLE-3 head (default: the committed one for the target)")
    p.add_argument("--draft-model", help="use this draft model instead of an EAGLE-3 head "
                   "(a prepared model name or a directory with the target's tokenizer)")
    p.add_argument("--out", type=Path, required=True,
                   help="directory of results.json, report.md and the figures")
    p.add_argument("--methods", nargs="+", choices=ALL_METHODS, metavar="METHOD",
                   default=[m for m in ALL_METHODS if m not in DIAGNOSTIC_METHODS],
                   help=f"methods to compare, of: {' '.join(ALL_METHODS)}")
    p.add_argument("--datasets", nargs="+", default=ALL_DATASETS,
                   help="datasets to run; the copy benchmark, run when named, is one "
                   f"dataset a kind: {' '.join(COPY_KINDS)}")
    add_num_prompts(p, config_default("prompts"), "prompts per dataset")
    p.add_argument("--max-tokens", type=int, default=config_default("max_tokens"),
                   help="tokens generated per prompt")
    p.add_argument("--budget", type=int, default=config_default("budget"),
                   help="tree nodes of the Graft methods")
    p.add_argument("--chain-tokens", type=int, default=config_default("chain_tokens"),
                   help="draft tokens of the chain methods: vLLM's EAGLE-3 and ngram, "
                   "Graft-TAIL (tail)")
    p.add_argument("--warmup", help="successor matrix file (default: 5 warm-up rounds)")
    p.add_argument("--warmup-rounds", type=int, default=5,
                   help="warm-up conversations when no --warmup is given")
    p.add_argument("--calibration", help="calibration file (default: fitted in this run)")
    p.add_argument("--tail-calibration", help="Graft-TAIL calibration file for chains of "
                   "--chain-tokens (default: fitted in this run when tail is benchmarked)")
    p.add_argument("--dflash", help="DFlash block drafter of the dflash / tail_dflash rows "
                   "(default: the committed one for the target; without one they are skipped)")
    p.add_argument("--dflash-block", type=int, default=config_default("dflash_block"),
                   help="block size of the DFlash rows (vLLM's num_speculative_tokens, "
                   "Graft-TAIL's budget)")
    p.add_argument("--dflash-calibration", help="Graft-TAIL calibration file for the DFlash "
                   "blocks (default: fitted in this run when tail_dflash is benchmarked)")
    p.add_argument("--no-calibration", action="store_true",
                   help="use default thresholds instead of calibrating")
    p.add_argument("--draft-cost", type=float, default=0.1,
                   help="calibration: one draft step's cost relative to a verification")
    p.add_argument("--ablations", action="store_true",
                   help="also run Graft with one knob changed at a time")
    p.add_argument("--max-num-seqs", type=int, default=config_default("max_num_seqs"),
                   help="requests each engine runs at once")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                   help="also run --batch-methods at each of these batch sizes "
                   "(max_num_seqs), with max(batch, --num-prompts) prompts per dataset")
    p.add_argument("--batch-methods", nargs="+", choices=ALL_METHODS, metavar="METHOD",
                   default=config_default("batch_methods"),
                   help="methods of the batch sweep")
    p.add_argument("--batch-rounds", type=int, default=config_default("batch_rounds"),
                   help="the sweep's engines stay alive together and take turns, each "
                   "dataset this many times per engine; times are medians over rounds")
    p.add_argument("--batch-fresh-engines", action="store_true",
                   help="start every sweep engine again for each round, so that a "
                   "process's own speed varies between rounds instead of favouring one "
                   "method for the whole sweep (a start-up and warm-up per engine and round)")
    p.add_argument("--dtype", default=config_default("dtype"),
                   help="every engine's dtype (float32: outputs comparable across methods "
                   "on a CPU)")
    p.add_argument("--quick", action="store_true",
                   help="2 prompts of 3 short datasets, 24 tokens, no calibration")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="datasets and models (default: $VLLM_GRAFT_CACHE or "
                   "~/.cache/vllm-graft)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write report.md and the figures again from "
                   "--out's results.json (with this version's report)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.report_only:
        return rewrite_report(p, args.out)
    if args.batch_rounds < 1:
        p.error(f"--batch-rounds must be >= 1, got {args.batch_rounds}")
    cpu_runtime_defaults()

    from vllm_graft.bench.config import BenchConfig
    from vllm_graft.bench.runner import run_bench, write_results
    from vllm_graft.offline.calibration import run_calibration
    from vllm_graft.offline.warmup import run_warmup

    cache = args.cache_dir or default_cache_dir()
    target = args.target
    if target in MODELS:
        target = str(prepare_model(target, cache))
    drafter = "eagle3"
    if args.draft_model:
        drafter = "draft_model"
        head = args.draft_model
        if head in MODELS:
            head = str(prepare_model(head, cache))
    else:
        head = args.head or default_head(args.target)
        if head is None:
            p.error(f"no committed head for {args.target!r}; pass --head or --draft-model")
    extra = {"drafter": drafter} if drafter != "eagle3" else {}
    dflash = args.dflash or default_dflash(args.target)
    if dflash is None:  # the DFlash rows run where a drafter is given or committed
        named = set()  # methods asked for by name, not by default
        for chosen in ("methods", "batch_methods"):
            if getattr(args, chosen) != p.get_default(chosen):
                named.update(getattr(args, chosen))
        wanted = set(DFLASH_METHODS) & named
        if wanted:
            p.error(f"{', '.join(sorted(wanted))}: no DFlash drafter for {args.target!r}; "
                    "pass --dflash")
        args.methods = [m for m in args.methods if m not in DFLASH_METHODS]
    if args.quick:
        args.datasets = [d for d in args.datasets if d in ("humaneval", "mtbench", "gsm8k")]
        args.num_prompts, args.max_tokens, args.warmup_rounds = 2, 24, 1
        args.no_calibration = True
    args.out.mkdir(parents=True, exist_ok=True)
    warmup = args.warmup
    if warmup is None and args.warmup_rounds > 0:
        warmup = str(args.out / "warmup.bin")
        if Path(warmup).is_file():
            print(f"bench: reusing {warmup} (delete it to build it again)")
        else:
            run_warmup(target, str(head), Path(warmup), rounds=args.warmup_rounds,
                       max_tokens=64 if args.quick else 256, cache_dir=cache,
                       budget=args.budget, extra_graft=extra,
                       engine_options={"dtype": args.dtype})
    calibration = args.calibration
    if calibration is None and not args.no_calibration:
        calibration = str(args.out / "calibration.json")
        if Path(calibration).is_file():
            print(f"bench: reusing {calibration} (delete it to fit it again)")
        else:
            run_calibration(target, str(head), Path(calibration), warmup=warmup, rounds=5,
                            max_tokens=256, cache_dir=cache, draft_cost=args.draft_cost,
                            budget=args.budget, extra_graft=extra,
                            engine_options={"dtype": args.dtype})
    tail_calibration = args.tail_calibration
    tails = {"tail", "tail_auto"} & set(args.methods + args.batch_methods)
    if tail_calibration is None and not args.no_calibration and tails:
        tail_calibration = str(args.out / f"calibration-tail{args.chain_tokens}.json")
        if not Path(tail_calibration).is_file():
            run_calibration(target, str(head), Path(tail_calibration), warmup=warmup,
                            rounds=5, max_tokens=256, cache_dir=cache,
                            draft_cost=args.draft_cost, budget=args.chain_tokens,
                            extra_graft=extra, variant="tail",
                            engine_options={"dtype": args.dtype})
    dflash_calibration = args.dflash_calibration
    if dflash is not None and dflash_calibration is None and not args.no_calibration \
            and "tail_dflash" in args.methods + args.batch_methods:
        dflash_calibration = str(args.out / f"calibration-dflash{args.dflash_block}.json")
        if not Path(dflash_calibration).is_file():
            run_calibration(target, str(dflash), Path(dflash_calibration), warmup=warmup,
                            rounds=5, max_tokens=256, cache_dir=cache,
                            draft_cost=args.draft_cost, budget=args.dflash_block,
                            extra_graft=drafter_graft_keys("dflash"), variant="tail",
                            engine_options={"dtype": args.dtype})
    config = BenchConfig(
        target=target, head=str(head), out=args.out, cache_dir=cache, methods=args.methods,
        datasets=args.datasets, prompts=args.num_prompts, max_tokens=args.max_tokens,
        budget=args.budget, chain_tokens=args.chain_tokens, warmup=warmup,
        calibration=calibration, tail_calibration=tail_calibration, dtype=args.dtype,
        max_num_seqs=args.max_num_seqs, ablations=args.ablations, drafter=drafter,
        dflash=str(dflash) if dflash is not None else None, dflash_block=args.dflash_block,
        dflash_calibration=dflash_calibration,
        batch_sizes=args.batch_sizes, batch_methods=args.batch_methods,
        batch_rounds=args.batch_rounds, batch_fresh_engines=args.batch_fresh_engines,
        command="vllm-graft bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    results = run_bench(config)
    write_results(results, args.out)
    write_report(results, args.out)
    agreement = results["greedy_agreement_with_plain"]
    return 0 if all(a["identical"] == a["total"] for a in agreement.values()) else 1
