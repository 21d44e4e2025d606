"""Cost of one Graft step's bookkeeping, without the models.

Times, per decoding step and batch size, everything Graft adds around the two model
passes: the draft tree build (with a drafter whose answers are precomputed, so only the
tree bookkeeping is timed), retrieval from the successor matrix, the trie merge and
flattening, acceptance (greedy and sampled), and the matrix update from the target
logits of every verified row (``update_ms``: the top-k over the vocabulary included;
``update_op_ms``: the scatter op alone). Compiled ops and the pure-torch reference are
timed in the same run. ``step_greedy_ms`` = build + greedy acceptance + update.

    .venv/bin/python scripts/bench_core.py                 # batch 1 / 8 / 32, Qwen vocab
    .venv/bin/python scripts/bench_core.py --batch 1 8 --json out.json
    python scripts/bench_core.py --device cuda      # on a GPU (the device is synchronised
                                                    # around every timed call)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from vllm_graft.core.acceptance import SamplingBatch, accept_tree
from vllm_graft.core.config import GraftConfig
from vllm_graft.core.draft_tree import DraftStep
from vllm_graft.core.graft import GraftTreeBuilder
from vllm_graft.core.successor import SuccessorMatrix


class BankDrafter:
    """Answers from a precomputed bank of top-k draft distributions, chosen by the
    expanded token, so the drafter itself costs one gather. Confidence varies across
    tokens, so requests prune at different checkpoints as in real decoding."""

    def __init__(self, vocab: int, top_k: int, bank: int = 4096, seed: int = 0,
                 device: torch.device | str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        # half the contexts are easy (peaked drafts), half hard, so requests stop at
        # different checkpoints as in real decoding
        sharpness = torch.where(torch.rand(bank, 1, generator=g) < 0.5, 25.0,
                                torch.rand(bank, 1, generator=g) * 4)
        logits = torch.randn(bank, 4 * top_k, generator=g) * sharpness
        values, index = logits.log_softmax(-1).topk(top_k, dim=-1)
        self.logprobs = values.to(device)
        tokens = torch.randint(0, vocab, (bank, 4 * top_k), generator=g).gather(1, index)
        self.tokens = tokens.to(device)
        self.bank = bank

    def __call__(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        key = (step.tokens.clamp(min=0) * 2654435761 + step.step) % self.bank
        return self.logprobs[key], self.tokens[key]


def steer_logits(tree, vocab: int, batch: int, seed: int) -> torch.Tensor:
    """Random target logits that prefer each row's first child, so acceptance walks
    several levels as it does with a good drafter."""
    g = torch.Generator().manual_seed(seed)
    device = tree.tokens.device
    rows = tree.tokens.shape[1]
    logits = torch.randn(batch, rows, vocab, generator=g).to(device)
    child = torch.arange(rows, device=device).expand(batch, rows)
    first = torch.where(tree.valid & (child > 0), child, rows)
    first_child = torch.full((batch, rows + 1), rows, device=device).scatter_reduce(
        1, tree.parents.clamp(min=0) + (tree.parents < 0) * rows, first, "amin")[:, :rows]
    has = first_child < rows
    b, r = torch.nonzero(has, as_tuple=True)
    logits[b, r, tree.tokens[b, first_child[b, r]]] += 8.0
    return logits


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn, repeats: int, device: torch.device = torch.device("cpu")) -> float:
    fn()  # warm-up
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def bench(batch: int, vocab: int, backend: str, repeats: int, cfg: GraftConfig,
          device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    torch.manual_seed(batch)
    matrix = SuccessorMatrix.empty(vocab, cfg.successor_k, device=device, backend=backend)
    matrix.update_(torch.arange(vocab, device=device),
                   torch.randint(0, vocab, (vocab, cfg.successor_k), device=device))
    builder = GraftTreeBuilder(cfg, matrix, device=device)
    drafter = BankDrafter(vocab, cfg.top_k, device=device)
    roots = torch.randint(0, vocab, (batch,), device=device)
    tree, stats = builder.build(roots, drafter)
    logits = steer_logits(tree, vocab, batch, seed=batch)
    greedy = SamplingBatch.greedy(batch, device=device)
    tokens = torch.where(tree.valid, tree.tokens, -1).reshape(-1)
    next_tokens = logits.reshape(tokens.numel(), -1).topk(cfg.successor_k, dim=-1).indices
    sampled = SamplingBatch(temperature=torch.ones(batch, device=device),
                            top_p=torch.full((batch,), 0.9, device=device))

    row = {
        "batch": batch, "backend": backend, "device": device.type,
        "build_ms": time_it(lambda: builder.build(roots, drafter), repeats, device),
        "accept_greedy_ms": time_it(lambda: accept_tree(tree, logits, greedy), repeats, device),
        "accept_sampled_ms": time_it(lambda: accept_tree(tree, logits, sampled), repeats,
                                     device),
        "update_ms": time_it(lambda: builder.observe(tree, logits), repeats, device),
        "update_op_ms": time_it(lambda: matrix.update_(tokens, next_tokens), repeats, device),
        "mean_accepted": float(accept_tree(tree, logits, greedy).num_accepted.float().mean()),
        "pruned_share": float((stats.stage < builder.full_stage).float().mean()),
    }
    row["step_greedy_ms"] = row["build_ms"] + row["accept_greedy_ms"] + row["update_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--budget", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GraftConfig(budget=args.budget)
    rows = [bench(b, args.vocab, backend, args.repeats, cfg, args.device)
            for b in args.batch for backend in ("compiled", "reference")]

    print(f"Graft step bookkeeping, budget {args.budget}, vocab {args.vocab:,}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; median of {args.repeats} (ms)\n")
    cols = ["batch", "backend", "build_ms", "accept_greedy_ms", "accept_sampled_ms",
            "update_ms", "update_op_ms", "step_greedy_ms", "mean_accepted", "pruned_share"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
