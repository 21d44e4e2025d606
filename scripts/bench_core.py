"""Cost of one Graft step's bookkeeping, without the models, and its share of a step.

:func:`graft_step` runs one whole bookkeeping step as the engine runs it on the fused
path (:mod:`vllm_graft.core.fused`): the draft steps (with a drafter whose answers are
precomputed), the tree finalize, the target's top-k over the tree rows, acceptance
with the successor matrix's update, and the one copy of the packed result to the
host. ``--count`` prints its dispatched ops and host reads (the drafter's own lookups
excluded: they stand in for its forward), the proxy of its GPU cost.

The ``compiled`` and ``reference`` rows time the pure-torch path instead (with the
compiled successor ops, or their torch references): the draft tree build (with a drafter whose answers are precomputed, so only the
tree bookkeeping is timed; retrieval, trie merge and flattening included) and the
verification bookkeeping: one top-k pass over the target logits of every verified row
(``topk_ms``, the compiled ``logits_topk``; ``torch_topk_ms`` is ``torch.topk`` over
every row, the update's former pass), greedy acceptance from its first column and
the matrix update from the whole of it (``verify_greedy_ms``), or the sampled walk plus
the same update (``verify_sampled_ms``). ``update_op_ms`` is the scatter op alone.
Compiled ops and the pure-torch reference are timed in the same run.

The share of a step is the bookkeeping over (bookkeeping + the target's verification
forward for the same query tokens). The forward is that of a Qwen2.5-0.5B-shaped model
(the smallest model with the 151,936-token Qwen vocabulary; random weights cost what
trained ones do) through transformers, over the trees' rows with no KV context, so it
is a lower bound on a real step and the share an upper bound; ``--forward-profile``
reads the forward time from a measured cost curve instead (the GPU check's
``verification_cost`` rows), ``--forward none`` skips it.

    .venv/bin/python scripts/bench_core.py                 # batch 1 / 8 / 32, Qwen vocab
    .venv/bin/python scripts/bench_core.py --batch 1 8 --json out.json
    python scripts/bench_core.py --device cuda --forward-profile \
        bench/results/gpu/2026-11-30-h200/verification_cost_cuda_graphs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from vllm_graft.core import fused
from vllm_graft.core.acceptance import SamplingBatch, accept_tree
from vllm_graft.core.config import GraftConfig
from vllm_graft.core.draft_tree import DraftStep
from vllm_graft.core.graft import GraftTreeBuilder
from vllm_graft.core.successor import SuccessorMatrix
from vllm_graft.markdown import markdown_table
from vllm_graft.testing.op_counter import OpCounter


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
    several levels as it does with a good drafter; drawn on the tree's device (a host
    draw of batch 32's 61 rows of a 151,936 vocabulary and its copy take seconds)."""
    device = tree.tokens.device
    g = torch.Generator(device).manual_seed(seed)
    rows = tree.tokens.shape[1]
    logits = torch.randn(batch, rows, vocab, generator=g, device=device)
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


def build_inputs(batch: int, vocab: int, backend: str, cfg: GraftConfig,
                 device: torch.device, fused_ops: bool = False
                 ) -> tuple[GraftTreeBuilder, BankDrafter, torch.Tensor]:
    """A tree builder over a random full successor matrix, its drafter and ``batch``
    roots, seeded by the batch size. ``fused_ops``: the builder runs the fused ops
    (:func:`graft_step`), else the pure-torch path."""
    torch.manual_seed(batch)
    # unchecked, as the engine runs it (SuccessorMatrix: the checks sync a GPU)
    matrix = SuccessorMatrix.empty(vocab, cfg.successor_k, device=device, backend=backend,
                                   check=False)
    matrix.update_(torch.arange(vocab, device=device),
                   torch.randint(0, vocab, (vocab, cfg.successor_k), device=device))
    builder = GraftTreeBuilder(cfg, matrix, device=device, fused=fused_ops)
    drafter = BankDrafter(vocab, cfg.top_k, device=device)
    return builder, drafter, torch.randint(0, vocab, (batch,), device=device)


def graft_step(builder: GraftTreeBuilder, drafter, roots: torch.Tensor,
               logits: torch.Tensor, sampling: fused.SamplingTensors | None = None
               ) -> torch.Tensor:
    """One whole bookkeeping step on the fused path, as the engine runs it: the trees of
    ``roots`` ([B]), their verification against ``logits`` ([B, budget + 1, V], row
    ``r`` of request ``b`` the target's logits after tree row ``r``), greedy acceptance
    (``sampling`` None) or the sampled one, the successor matrix's update, and the packed
    result copied to the host (:data:`vllm_graft.core.fused.PACKED_COLUMNS`), which it
    returns. No read of the device before that copy."""
    buffers = builder.fused.build(roots, drafter, successors=builder.matrix.table)
    flat = logits.view(-1, logits.shape[-1])
    table, vocab = builder.matrix.table, builder.matrix.vocab_size
    if sampling is None:
        fused.accept_greedy(buffers, flat, table, vocab)
    else:
        fused.accept_sampled(buffers, flat, sampling, table, vocab)
    return buffers.to_host()


class Uncounted:
    """The drafter, with its lookups hidden from an :class:`OpCounter`: they stand in for
    the drafter's forward, which is not Graft's bookkeeping."""

    def __init__(self, drafter: BankDrafter, counter: OpCounter):
        self.drafter, self.counter = drafter, counter

    def __call__(self, step: DraftStep):
        ops, waits, names = self.counter.ops, self.counter.host_waits, dict(self.counter.names)
        try:
            return self.drafter(step)
        finally:
            self.counter.ops, self.counter.host_waits = ops, waits
            self.counter.names = names


def count_step(batch: int, vocab: int, cfg: GraftConfig, sampled: bool,
               device: torch.device | str = "cpu") -> dict:
    """The ops and host reads one :func:`graft_step` dispatches (after a warm-up step),
    the drafter's excluded, and the ops by name."""
    device = torch.device(device)
    builder, drafter, roots = build_inputs(batch, vocab, "compiled", cfg, device,
                                           fused_ops=True)
    logits = step_logits(builder, drafter, roots, vocab)
    sampling = sampling_tensors(batch, device) if sampled else None
    graft_step(builder, drafter, roots, logits, sampling)
    with OpCounter() as counter:
        graft_step(builder, Uncounted(drafter, counter), roots, logits, sampling)
    return {"batch": batch, "sampled": sampled, "ops": counter.ops,
            "host_reads": counter.host_waits, "by_name": counter.names}


def step_logits(builder: GraftTreeBuilder, drafter, roots: torch.Tensor,
                vocab: int) -> torch.Tensor:
    """Target logits for the trees the fused builder makes of ``roots`` (steered to
    each row's first child, :func:`steer_logits`)."""
    tree = builder.fused.build(roots, drafter, successors=builder.matrix.table).tree()
    return steer_logits(tree, vocab, roots.shape[0], seed=roots.shape[0])


def sampling_tensors(batch: int, device: torch.device) -> fused.SamplingTensors:
    """Temperature 1 and top-p 0.9 for every request, as the fused acceptance takes it."""
    return fused.SamplingTensors.of(SamplingBatch(
        temperature=torch.ones(batch, device=device),
        top_p=torch.full((batch,), 0.9, device=device)))


def bench_fused(batch: int, vocab: int, repeats: int, cfg: GraftConfig,
                device: torch.device | str = "cpu") -> dict:
    """:func:`graft_step` timed whole (greedy and sampled), with its op counts."""
    device = torch.device(device)
    builder, drafter, roots = build_inputs(batch, vocab, "compiled", cfg, device,
                                           fused_ops=True)
    logits = step_logits(builder, drafter, roots, vocab)
    sampling = sampling_tensors(batch, device)
    buffers = builder.fused.build(roots, drafter, successors=builder.matrix.table)
    row = {
        "batch": batch, "backend": "fused", "device": device.type,
        "tree_rows": int(buffers.tree_valid.sum()),
        "build_ms": time_it(lambda: builder.fused.build(
            roots, drafter, successors=builder.matrix.table), repeats, device),
        "step_greedy_ms": time_it(lambda: graft_step(builder, drafter, roots, logits),
                                  repeats, device),
        "step_sampled_ms": time_it(lambda: graft_step(builder, drafter, roots, logits,
                                                      sampling), repeats, device),
    }
    row["verify_greedy_ms"] = row["step_greedy_ms"] - row["build_ms"]
    row["verify_sampled_ms"] = row["step_sampled_ms"] - row["build_ms"]
    packed = graft_step(builder, drafter, roots, logits)
    synchronize(device)  # the packed result's copy to the host is non-blocking
    accepted = packed[:, buffers.columns["num_accepted"]].float()
    row["mean_accepted"] = float(accepted.mean())
    stage = packed[:, buffers.columns["stage"]]
    row["pruned_share"] = float((stage < builder.full_stage).float().mean())
    for sampled in (False, True):
        counts = count_step(batch, vocab, cfg, sampled, device)
        kind = "sampled" if sampled else "greedy"
        row[f"ops_{kind}"], row[f"host_reads_{kind}"] = counts["ops"], counts["host_reads"]
    return row


def bench(batch: int, vocab: int, backend: str, repeats: int, cfg: GraftConfig,
          device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    builder, drafter, roots = build_inputs(batch, vocab, backend, cfg, device)
    matrix = builder.matrix
    tree, stats = builder.build(roots, drafter)
    logits = steer_logits(tree, vocab, batch, seed=batch)
    greedy = SamplingBatch.greedy(batch, device=device)
    sampled = SamplingBatch(temperature=torch.ones(batch, device=device),
                            top_p=torch.full((batch,), 0.9, device=device))
    row_topk = builder.target_topk(tree, logits)
    tokens = torch.where(tree.valid, tree.tokens, -1).reshape(-1)

    def verify_greedy():
        top = builder.target_topk(tree, logits)
        result = accept_tree(tree, logits, greedy, row_tokens=top[..., 0])
        builder.observe(tree, logits, row_topk=top)
        return result

    def verify_sampled():
        top = builder.target_topk(tree, logits)
        result = accept_tree(tree, logits, sampled)
        builder.observe(tree, logits, row_topk=top)
        return result

    row = {
        "batch": batch, "backend": backend, "device": device.type,
        "tree_rows": int(tree.valid.sum()),
        "build_ms": time_it(lambda: builder.build(roots, drafter), repeats, device),
        "topk_ms": time_it(lambda: builder.target_topk(tree, logits), repeats, device),
        # what the update used before logits_topk: torch.topk over every row
        "torch_topk_ms": time_it(lambda: logits.reshape(-1, vocab).topk(cfg.successor_k, dim=-1),
                                 repeats, device),
        "verify_greedy_ms": time_it(verify_greedy, repeats, device),
        "verify_sampled_ms": time_it(verify_sampled, repeats, device),
        "update_op_ms": time_it(lambda: matrix.update_(tokens, row_topk.reshape(tokens.numel(), -1)),
                                repeats, device),
        "mean_accepted": float(verify_greedy().num_accepted.float().mean()),
        "pruned_share": float((stats.stage < builder.full_stage).float().mean()),
    }
    row["step_greedy_ms"] = row["build_ms"] + row["verify_greedy_ms"]
    row["step_sampled_ms"] = row["build_ms"] + row["verify_sampled_ms"]
    return row


def qwen_05b_shaped_model(vocab: int):
    """A Qwen2.5-0.5B-shaped causal LM (random weights, fp32), the smallest real model
    with the Qwen vocabulary: the cheapest verification forward a Qwen-vocab step has."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def measured_forward_ms(model, batch: int, query_tokens: int, device: torch.device) -> float:
    """One verification forward of ``batch`` requests with ``query_tokens`` rows each
    (logits at every row), no KV context; the median of two after a warm-up."""
    ids = torch.randint(0, model.config.vocab_size, (batch, query_tokens), device=device)
    with torch.inference_mode():
        return time_it(lambda: model(input_ids=ids), 2, device)


def curve_forward_ms(curve: list[dict], batch: int, total_tokens: int,
                     context: int | None = None) -> float:
    """Forward time at ``total_tokens`` query tokens from a measured cost curve (rows of
    ``batch``, ``total_tokens``, ``forward_ms``, optionally ``context``: the GPU check's
    ``verification_cost``), linear between points, at the curve's batch nearest
    ``batch`` and its smallest context unless one is given."""
    contexts = sorted({r.get("context", 0) for r in curve})
    context = contexts[0] if context is None else context
    rows = [r for r in curve if r.get("context", 0) == context]
    nearest = min({r["batch"] for r in rows}, key=lambda b: abs(b - batch))
    points = sorted((r["total_tokens"], r["forward_ms"]) for r in rows if r["batch"] == nearest)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if total_tokens <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if total_tokens <= x1:
            return y0 + (total_tokens - x0) * (y1 - y0) / (x1 - x0)
    return ys[-1] + (total_tokens - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])


def add_shares(row: dict, forward_ms: float) -> None:
    row["forward_ms"] = forward_ms
    for kind in ("greedy", "sampled"):
        spent = row[f"step_{kind}_ms"]
        row[f"share_{kind}"] = spent / (spent + forward_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--budget", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--forward", choices=["qwen2.5-0.5b", "none"], default="qwen2.5-0.5b",
                        help="the verification forward the share is taken of (measured here)")
    parser.add_argument("--forward-profile",
                        help="JSON cost curve (a list of rows, or a GPU-check report with "
                             "verification_cost rows) to read the forward time from instead")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--count", action="store_true",
                        help="only count the fused step's dispatched ops and host reads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = GraftConfig(budget=args.budget)
    if args.count:
        counts = [count_step(b, args.vocab, cfg, sampled, device)
                  for b in args.batch for sampled in (False, True)]
        for row in counts:
            print(f"batch {row['batch']:>3} {'sampled' if row['sampled'] else 'greedy ':>7}: "
                  f"{row['ops']} ops, {row['host_reads']} host reads  {row['by_name']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(counts, f, indent=2)
        return
    rows = [bench_fused(b, args.vocab, args.repeats, cfg, device) if backend == "fused"
            else bench(b, args.vocab, backend, args.repeats, cfg, device)
            for b in args.batch for backend in ("fused", "compiled", "reference")]

    forward_source = None
    if args.forward_profile:
        with open(args.forward_profile) as f:
            curve = json.load(f)
        if isinstance(curve, dict):  # a GPU-check report
            curve = curve.get("sections", curve).get("verification_cost", curve)["rows"]
        forward_source = f"cost curve {args.forward_profile}"
        for row in rows:
            add_shares(row, curve_forward_ms(curve, row["batch"], row["tree_rows"]))
    elif args.forward != "none":
        model = qwen_05b_shaped_model(args.vocab).to(device)
        forward_source = "Qwen2.5-0.5B-shaped model, fp32, transformers, no KV context"
        measured = {}
        for row in rows:
            per_request = -(-row["tree_rows"] // row["batch"])
            key = (row["batch"], per_request)
            if key not in measured:
                measured[key] = measured_forward_ms(model, row["batch"], per_request, device)
            add_shares(row, measured[key])

    print(f"Graft step bookkeeping, budget {args.budget}, vocab {args.vocab:,}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; median of {args.repeats} (ms)")
    if forward_source:
        print(f"share = bookkeeping / (bookkeeping + verification forward of the same rows: "
              f"{forward_source})")
    print()
    cols = ["batch", "backend", "tree_rows", "build_ms", "topk_ms", "torch_topk_ms",
            "verify_greedy_ms",
            "verify_sampled_ms", "update_op_ms", "step_greedy_ms", "step_sampled_ms",
            "ops_greedy", "host_reads_greedy", "ops_sampled", "host_reads_sampled"]
    if forward_source:
        cols += ["forward_ms", "share_greedy", "share_sampled"]
    cols += ["mean_accepted", "pruned_share"]
    print("\n".join(markdown_table(cols, (
        [(f"{100 * r[c]:.1f} %" if c.startswith("share") else f"{r[c]:.2f}")
         if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        for r in rows))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "forward": forward_source, "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
