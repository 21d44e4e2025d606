"""GPU checks and profiles that need no vLLM (run by ``scripts/gpu_check.sh``).

Sections, each recorded in one JSON (and a Markdown table) even when another fails:

* ``tree_kernel_check``: the Triton tree-attention kernel against the torch reference on
  fresh random mixed batches (prefill chunks, decodes, trees of 1 to 64 nodes, contexts
  off block boundaries), fp16 / bf16 / fp32, head dims 64 and 128, GQA, strided views of
  both paged-KV layouts; output poisoned with NaN before each run.
* ``adapter_kernel_path``: the Graft adapter's kernel path against its SDPA path on tree
  attention plans, for the three paged-KV layouts the kernel reads (bf16, fp16), and the
  start-up layout check the adapter runs before using the kernel.
* ``tree_kernel_timing``: Qwen3-8B attention shapes in bf16 (32 query heads, 8 KV heads,
  head dim 128), 60-node trees over contexts of 1K and 8K at batch 1 / 8 / 32: the
  kernel (several tile shapes) against a dense causal FlashAttention call with the same
  query rows (contiguous K/V, SDPA's flash backend) and against the per-request SDPA
  fallback.
* ``bookkeeping``: ``scripts/bench_core.py``'s Graft step bookkeeping on the device,
  vocabulary 151,936, batch 1 / 8 / 32.
* ``build_phases``: a tree build's ops and waits for the host at batch 1 / 8 / 32, and
  its merge eager, with a static depth bound, and under ``torch.compile`` (default mode
  and CUDA graphs): whether compiling the merge pays on the device.
* ``verification_cost``: forward time of a randomly initialised Qwen3-8B-shaped model
  (bf16, transformers) verifying 1 to 128 query tokens per request over a context, at
  batch 1 / 8 / 32: the hardware profile the cost-aware tree size uses.
* ``graph_bookkeeping``: the step's greedy bookkeeping without waits for the host
  (the wait-free tree build, the greedy verification with a bounded walk), each part
  captured as one CUDA graph and replayed, at batch 1 / 8 / 32 with fixed-shape trees:
  what it costs once launches are gone, and its share of a step.

``--smoke`` runs every section on the CPU at toy sizes (Triton under its interpreter),
to check this script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


# ---- timing ---------------------------------------------------------------------------
def median_ms(fn, device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of ``fn`` in ms, with CUDA events on a GPU."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


# ---- sections ---------------------------------------------------------------------------
def tree_kernel_check(device: torch.device, smoke: bool) -> dict:
    from vllm_graft.kernels import paged_tree_attention_reference
    from vllm_graft.kernels.tree_attention_triton import paged_tree_attention
    from vllm_graft.testing.paged_batches import paged_batch, relative_error

    generator = torch.Generator().manual_seed(1)
    cases, failures = [], 0
    dtypes = [torch.bfloat16, torch.float32] if smoke else [torch.bfloat16, torch.float16,
                                                           torch.float32]
    for dtype in dtypes:
        for head_dim in (64, 128):
            for heads, kv_heads in ((4, 4), (8, 2)):
                for layout, block_size in (("kv_first", 16), ("blocks_first", 32)):
                    tree_rows = [1, 7, 64] if smoke else [1, 2, 13, 33, 60, 64]
                    requests = [(int(torch.randint(0, 300, (1,), generator=generator)), n, True)
                                for n in tree_rows]
                    requests += [(0, 37, False), (129, 1, False), (45, 19, False)]
                    order = torch.randperm(len(requests), generator=generator).tolist()
                    batch = paged_batch([requests[i] for i in order], heads, kv_heads,
                                        head_dim, block_size, dtype, device, generator, layout)
                    expected = paged_tree_attention_reference(
                        **batch, compute_dtype=torch.float64)
                    out = torch.full_like(batch["query"], float("nan"))
                    paged_tree_attention(**batch, out=out)
                    finite = bool(torch.isfinite(out).all())
                    error = relative_error(out, expected)
                    ok = finite and error <= TOLERANCE[dtype]
                    failures += not ok
                    cases.append(dict(dtype=str(dtype).removeprefix("torch."),
                                      head_dim=head_dim, heads=heads, kv_heads=kv_heads,
                                      layout=layout, block_size=block_size,
                                      rows=int(batch["query"].shape[0]), rel_error=error,
                                      tolerance=TOLERANCE[dtype], all_written=finite, ok=ok))
    return dict(ok=failures == 0, failures=failures, cases=cases)


def adapter_kernel_path(device: torch.device, smoke: bool) -> dict:
    """The adapter's kernel path against its SDPA path on tree attention plans, for every
    paged-KV layout the kernel reads (what a Graft engine runs on a GPU), in bf16 and
    fp16, with the start-up layout check."""
    from vllm_graft.kernels.tree_mask import unpack_ancestor_bits
    from vllm_graft.testing.paged_batches import random_tree_bits, relative_error
    from vllm_graft.vllm.tree_attention import (TreeAttentionPlan, TreeRequestPlan,
                                                _read_heads_kv_last, _read_kv_first,
                                                _read_kv_second, check_kernel_on_layout,
                                                kernel_cache_views, kernel_tree_rows,
                                                sdpa_tree_rows)

    heads, kv_heads, head, block, blocks = (4, 2, 64, 16, 24) if smoke else (32, 8, 128, 16, 256)
    layouts = {"kv_first": (_read_kv_first, (2, blocks, block, kv_heads, head)),
               "blocks_first": (_read_kv_second, (blocks, 2, block, kv_heads, head)),
               "heads_kv_last": (_read_heads_kv_last, (blocks, kv_heads, block, 2 * head))}
    sizes, prefixes = ([1, 9, 33], [40, 0, 77]) if smoke else ([1, 9, 33, 60, 61],
                                                               [40, 0, 777, 1500, 300])
    generator = torch.Generator().manual_seed(12)
    cases, failures = [], 0
    for dtype in (torch.bfloat16, torch.float16):
        for name, (reader, shape) in layouts.items():
            kv_cache = torch.randn(shape, generator=generator).to(device, dtype)
            order = torch.randperm(blocks, generator=generator)
            requests, start, used = [], 0, 0
            for n, prefix in zip(sizes, prefixes):
                count = (prefix + n + block - 1) // block
                table = order[used:used + count].to(torch.int32).to(device)
                used += count
                mask = unpack_ancestor_bits(random_tree_bits(n, generator), n).to(device)
                requests.append(TreeRequestPlan(query_start=start, num_rows=n,
                                                prefix_len=prefix, block_table=table,
                                                mask=mask))
                start += n
            plan = TreeAttentionPlan(requests=requests)
            keys = torch.empty(start, kv_heads, head, device=device, dtype=dtype)
            values = torch.empty_like(keys)
            for req in requests:
                k, v = reader(kv_cache, req.block_table, req.prefix_len + req.num_rows)
                rows = slice(req.query_start, req.query_start + req.num_rows)
                keys[rows] = k[:, req.prefix_len:].transpose(0, 1)
                values[rows] = v[:, req.prefix_len:].transpose(0, 1)
            query = torch.randn(start, heads, head, generator=generator).to(device, dtype)
            expected = torch.zeros_like(query)
            sdpa_tree_rows(plan, "layer", query, keys, values, kv_cache, reader,
                           head ** -0.5, expected)
            got = torch.full_like(query, float("nan"))
            kernel_tree_rows(plan, query, kernel_cache_views(reader, kv_cache), head ** -0.5,
                             got)
            error = relative_error(got, expected)
            check = check_kernel_on_layout(reader, kv_cache, requests[0].block_table,
                                           prefixes[0] + sizes[0], heads, head ** -0.5)
            ok = bool(torch.isfinite(got).all()) and error < TOLERANCE[dtype] and check
            failures += not ok
            cases.append(dict(dtype=str(dtype).removeprefix("torch."), layout=name,
                              rows=start, rel_error=error, startup_check=check, ok=ok))
    return dict(ok=failures == 0, failures=failures, cases=cases)


def dense_causal_ms(batch_size, context, rows, heads, kv_heads, head_dim, dtype, device):
    """Dense causal attention with the same query rows (contiguous K/V), FlashAttention
    through SDPA on a GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(batch_size, heads, rows, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch_size, heads, context + rows, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = causal_lower_right(rows, context + rows)
    backend = SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH
    try:
        with sdpa_kernel([backend]):
            return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                             device), backend.name
    except RuntimeError:  # flash refused these shapes: SDPA's own choice
        return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                         device), "sdpa default"


def tree_kernel_timing(device: torch.device, smoke: bool) -> dict:
    """The kernel's tile variants in one launch (``num_splits=1``), then split-K with
    several split counts and the automatic one (default tiles and 128-row tiles), against
    dense causal FlashAttention: ``kernel_*`` is the best of all, ``auto_*`` the default
    call's, ``single_launch_*`` the best unsplit variant."""
    from vllm_graft.kernels import paged_tree_attention_reference
    from vllm_graft.kernels.tree_attention_triton import auto_num_splits, paged_tree_attention
    from vllm_graft.testing.paged_batches import paged_batch

    heads, kv_heads, head_dim, block_size, tree_nodes = (32, 8, 128, 16, 60)
    dtype = torch.bfloat16
    batches, contexts = ((1, 8, 32), (1024, 8192))
    variants = [(64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3)]
    split_variants, split_counts = [(64, 64, 4, 2), (128, 64, 8, 2)], (2, 4, 8, 16, 32)
    if smoke:
        heads, kv_heads, head_dim, tree_nodes = 4, 2, 64, 8
        batches, contexts, variants = (1, 2), (40,), variants[:1]
        split_variants, split_counts = split_variants[:1], (2,)
    generator = torch.Generator().manual_seed(2)
    rows = []
    for batch_size in batches:
        for context in contexts:
            batch = paged_batch([(context, tree_nodes, True)] * batch_size, heads, kv_heads,
                                head_dim, block_size, dtype, device, generator)

            def time_it(bm, bn, w, s, k):
                return median_ms(lambda: paged_tree_attention(
                    **batch, block_m=bm, block_n=bn, num_warps=w, num_stages=s,
                    num_splits=k, max_seq_len=context + tree_nodes), device)

            timings = {}
            for block_m, block_n, warps, stages in variants:
                name = f"m{block_m}_n{block_n}_w{warps}_s{stages}"
                timings[name] = time_it(block_m, block_n, warps, stages, 1)
            single = min(timings, key=timings.get)
            auto_splits = {}
            for block_m, block_n, warps, stages in split_variants:
                name = f"m{block_m}_n{block_n}_w{warps}_s{stages}"
                auto_splits[name] = auto_num_splits(
                    batch["query"], batch["key_cache"], batch["block_table"],
                    max_seq_len=context + tree_nodes, block_m=block_m, block_n=block_n)
                for splits in sorted({*split_counts, auto_splits[name]} - {1}):
                    timings[f"{name}_k{splits}"] = time_it(block_m, block_n, warps, stages,
                                                           splits)
            best = min(timings, key=timings.get)
            default = next(iter(auto_splits))  # the default tiles: what a plain call runs
            auto = default + (f"_k{auto_splits[default]}" if auto_splits[default] > 1 else "")
            kv_bytes = (batch_size * (context + tree_nodes) * kv_heads * head_dim * 2
                        * dtype.itemsize)
            dense, dense_backend = dense_causal_ms(batch_size, context, tree_nodes, heads,
                                                   kv_heads, head_dim, dtype, device)
            fallback = None
            if batch_size <= 8:
                fallback = median_ms(lambda: paged_tree_attention_reference(**batch), device,
                                     repeats=5, warmup=1)
            rows.append(dict(batch=batch_size, context=context, tree_nodes=tree_nodes,
                             kernel_ms=timings[best], best_variant=best, variants_ms=timings,
                             kernel_kv_gb_per_s=kv_bytes / timings[best] / 1e6,
                             dense_causal_flash_ms=dense, dense_backend=dense_backend,
                             fallback_sdpa_ms=fallback,
                             kernel_over_dense=timings[best] / dense,
                             auto_splits=auto_splits, auto_variant=auto,
                             auto_ms=timings[auto], auto_over_dense=timings[auto] / dense,
                             single_launch_variant=single,
                             single_launch_over_dense=timings[single] / dense))
            print(f"gpu_check: tree_kernel_timing batch {batch_size} context {context}: "
                  f"best {best} {timings[best] / dense:.2f}x dense, auto {auto} "
                  f"{timings[auto] / dense:.2f}x, single launch {single} "
                  f"{timings[single] / dense:.2f}x", flush=True)
    return dict(ok=True, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size, dtype="bfloat16", rows=rows)


def bookkeeping(device: torch.device, smoke: bool) -> dict:
    import bench_core
    from vllm_graft.core.config import GraftConfig

    vocab, batches = (5000, (1, 2)) if smoke else (151_936, (1, 8, 32))
    cfg = GraftConfig(budget=60)
    rows = [bench_core.bench(b, vocab, "compiled", 3 if smoke else 10, cfg, device)
            for b in batches]
    return dict(ok=True, vocab=vocab, budget=60, rows=rows)


def build_phases(device: torch.device, smoke: bool) -> dict:
    """Where a tree build's time goes on the device, and whether compiling its largest
    part pays: per batch size, the build's ops and waits for the host (counted by
    dispatch), its time, and the merge's time eager (reading the depth), eager with a
    static depth bound, and compiled by ``torch.compile`` with that bound (default
    mode, and CUDA graphs), each compiled output compared with the eager one."""
    import bench_core
    from vllm_graft.core import graft as graft_module
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.core.hybrid import merge_and_flatten
    from vllm_graft.testing.op_counter import OpCounter

    vocab, batches = (5000, (1, 2)) if smoke else (151_936, (1, 8, 32))
    repeats = 3 if smoke else 20
    cfg = GraftConfig(budget=60)
    rows, fields = [], ("tokens", "parents", "depths", "valid", "source")
    for batch in batches:
        builder, drafter, roots = bench_core.build_inputs(batch, vocab, "compiled", cfg, device)
        merges = []
        original = graft_module.merge_and_flatten
        graft_module.merge_and_flatten = lambda *args: merges.append(args) or original(*args)
        try:
            builder.build(roots, drafter)
        finally:
            graft_module.merge_and_flatten = original
        with OpCounter() as counter:
            builder.build(roots, drafter)
        merge_roots, parts, budget = merges[-1][:3]
        depth = max(int(part[2].max()) for part in parts)
        eager = merge_and_flatten(merge_roots, parts, budget)
        row = dict(batch=batch, build_ops=counter.ops, build_host_waits=counter.host_waits,
                   merge_depth=depth,
                   build_ms=median_ms(lambda: builder.build(roots, drafter), device, repeats),
                   merge_ms=median_ms(lambda: merge_and_flatten(merge_roots, parts, budget),
                                      device, repeats),
                   merge_static_ms=median_ms(
                       lambda: merge_and_flatten(merge_roots, parts, budget, depth),
                       device, repeats))
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            compiled = torch.compile(merge_and_flatten, mode=mode, dynamic=False)
            begin = time.perf_counter()
            out = compiled(merge_roots, parts, budget, depth)
            row[f"compile_{mode}_s"] = time.perf_counter() - begin
            row[f"same_{mode}"] = all(torch.equal(getattr(out, name), getattr(eager, name))
                                      for name in fields)
            row[f"merge_{mode}_ms"] = median_ms(
                lambda: compiled(merge_roots, parts, budget, depth), device, repeats)
        rows.append(row)
    torch._dynamo.reset()
    return dict(ok=all(r["same_default"] and r["same_reduce-overhead"] for r in rows),
                vocab=vocab, rows=rows)


def captured(fn, device: torch.device):
    """``fn`` captured as a CUDA graph after two warm-up calls on a side stream: the
    graph and what the captured call returned (its tensors are the graph's outputs,
    rewritten by every replay). None and ``fn()`` off a GPU."""
    if device.type != "cuda":
        return None, fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_bookkeeping(device: torch.device, smoke: bool) -> dict:
    """The step's greedy bookkeeping with no wait for the host, as a serving engine's CUDA
    graph would run it: per batch size, fixed-shape trees (what CUDA-graph verification
    uses) built by the wait-free builder (:class:`GraftTreeBuilder` ``wait_free``; its ops
    and host waits counted, its tree compared with the waiting build's), then the build
    and the greedy verification (the target's top-k at every row, the walk bounded by
    the builder's depth bound, the matrix update) each captured as one CUDA graph and
    replayed, their outputs compared with the eager ones. Off a GPU, eager only."""
    import bench_core
    from vllm_graft.core.acceptance import greedy_walk
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.core.graft import GraftTreeBuilder
    from vllm_graft.testing.op_counter import OpCounter

    vocab, batches = (5000, (1, 2)) if smoke else (151_936, (1, 8, 32))
    repeats = 3 if smoke else 20
    cfg = GraftConfig(budget=60, tree_shape="fixed")
    fields = ("tokens", "parents", "depths", "valid", "source")
    rows = []
    for batch in batches:
        waiting, drafter, roots = bench_core.build_inputs(batch, vocab, "compiled", cfg, device)
        builder = GraftTreeBuilder(cfg, waiting.matrix, device=device, wait_free=True)
        bound = builder.depth_bound()
        expected, _ = waiting.build(roots, drafter)
        with OpCounter() as counter:
            eager, _ = builder.build(roots, drafter)
        row = dict(batch=batch, tree_rows=int(eager.valid.sum()), depth_bound=bound,
                   wait_free_ops=counter.ops, wait_free_host_waits=counter.host_waits,
                   wait_free_same=all(torch.equal(getattr(eager, f), getattr(expected, f))
                                      for f in fields),
                   waiting_build_ms=median_ms(lambda: waiting.build(roots, drafter), device,
                                              repeats),
                   wait_free_build_ms=median_ms(lambda: builder.build(roots, drafter), device,
                                                repeats))
        logits = bench_core.steer_logits(eager, vocab, batch, seed=batch)

        def verify(tree=eager):
            top = builder.target_topk(tree, logits)
            result = greedy_walk(tree, top[..., 0], bound)
            builder.observe(tree, logits, row_topk=top)
            return result

        reference = verify()
        row["eager_verify_greedy_ms"] = median_ms(verify, device, repeats)
        row["eager_step_greedy_ms"] = row["wait_free_build_ms"] + row["eager_verify_greedy_ms"]
        rows.append(row)
        if device.type != "cuda":
            continue
        try:
            # the verifications above taught the matrix: compare with a build on it now
            current, _ = builder.build(roots, drafter)
            graph, (tree, _) = captured(lambda: builder.build(roots, drafter), device)
            graph.replay()
            row["graph_build_same"] = all(torch.equal(getattr(tree, f), getattr(current, f))
                                          for f in fields)
            row["graph_build_ms"] = median_ms(graph.replay, device, repeats)
            verify_graph, result = captured(verify, device)
            verify_graph.replay()
            row["graph_verify_same"] = (
                torch.equal(result.num_accepted, reference.num_accepted)
                and torch.equal(result.accepted_rows, reference.accepted_rows))
            row["graph_verify_greedy_ms"] = median_ms(verify_graph.replay, device, repeats)
            row["graph_step_greedy_ms"] = row["graph_build_ms"] + row["graph_verify_greedy_ms"]
            del graph, verify_graph
        except Exception as error:  # a refused capture is a finding: say what refused it
            row["graph_error"] = f"{type(error).__name__}: {str(error)[:200]}"
            print(f"gpu_check: capture at batch {batch} failed: {error}", file=sys.stderr,
                  flush=True)
            break
    ok = all(r["wait_free_same"] and r["wait_free_host_waits"] == 0
             and "graph_error" not in r
             and r.get("graph_build_same", True) and r.get("graph_verify_same", True)
             for r in rows)
    return dict(ok=ok, vocab=vocab, budget=60, tree_shape="fixed",
                captured=device.type == "cuda", rows=rows)


def add_bookkeeping_shares(sections: dict) -> None:
    """Bookkeeping as a share of a whole step, the step's forward read off this run's
    verification cost curve (1K context: the cheaper one, so the larger share)."""
    import bench_core

    keep, cost = sections.get("bookkeeping", {}), sections.get("verification_cost", {})
    if not cost.get("ok"):
        return
    context = min(r["context"] for r in cost["rows"])
    if keep.get("ok"):
        for row in keep["rows"]:
            bench_core.add_shares(row, bench_core.curve_forward_ms(
                cost["rows"], row["batch"], row["tree_rows"], context))
        keep["forward"] = f"verification_cost rows at context {context}"
    graphs = sections.get("graph_bookkeeping", {})
    for row in graphs.get("rows", []):
        forward = bench_core.curve_forward_ms(cost["rows"], row["batch"], row["tree_rows"],
                                              context)
        row["forward_ms"] = forward
        for kind in ("eager", "graph"):
            spent = row.get(f"{kind}_step_greedy_ms")
            if spent is not None:
                row[f"{kind}_share_greedy"] = spent / (spent + forward)
    if graphs.get("rows"):
        graphs["forward"] = f"verification_cost rows at context {context}"


def qwen3_8b_shaped_config(smoke: bool):
    from transformers import Qwen3Config

    if smoke:
        return Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, max_position_embeddings=4096)
    return Qwen3Config(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40_960, tie_word_embeddings=False,
                       rope_theta=1_000_000)


def rewind(cache, length: int) -> None:
    """Set a static cache's write position back to ``length`` (transformers >= 5 keeps it
    in a device counter per layer, advanced by every forward), so repeated forwards and
    graph replays write the same slots instead of running off the cache's end."""
    for layer in getattr(cache, "layers", ()):
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(length)
        elif counter is not None:
            layer.cumulative_length = length


def forward_ms(model, cache, ids: torch.Tensor, positions: torch.Tensor,
               device: torch.device, repeats: int) -> tuple[float, str]:
    """Median time of one verification forward (logits at every query row), replayed as
    a CUDA graph on a GPU where capture works (what a serving engine does), else eager.
    The cache is static: every call writes the same slots, so calls are alike."""
    batch = ids.shape[0]
    position_ids = positions.expand(batch, -1)
    start = int(positions[0])

    def step():
        rewind(cache, start)
        return model(input_ids=ids, past_key_values=cache, cache_position=positions,
                     position_ids=position_ids, use_cache=True).logits

    if device.type != "cuda":
        return median_ms(step, device, repeats=repeats, warmup=2), "eager"
    try:
        graph, _ = captured(step, device)  # a private pool: freed with the graph
    except Exception as error:  # capture refused: time eagerly, and say why
        print(f"gpu_check: CUDA graph capture failed: {error}", file=sys.stderr, flush=True)
        torch.cuda.synchronize()
        return (median_ms(step, device, repeats=repeats, warmup=1),
                f"eager ({type(error).__name__}: {str(error)[:80]})")
    ms = median_ms(graph.replay, device, repeats=repeats, warmup=2)
    del graph
    return ms, "cuda graph"


def verification_cost(device: torch.device, smoke: bool) -> dict:
    """Forward time for ``q`` new tokens per request over a ``context``-token KV cache."""
    import transformers
    from transformers import Qwen3ForCausalLM, StaticCache

    config = qwen3_8b_shaped_config(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = Qwen3ForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(previous)
    query_tokens = (1, 2, 4) if smoke else (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128)
    batches = (1, 2) if smoke else (1, 8, 32)
    contexts = (16,) if smoke else (1024, 4096)
    rows = []
    with torch.inference_mode():
        for context in contexts:
            for batch_size in batches:
                cache = StaticCache(config=config, max_cache_len=context + max(query_tokens))
                prompt = torch.randint(0, config.vocab_size, (batch_size, context)).to(device)
                model.model(input_ids=prompt, past_key_values=cache, use_cache=True,
                            cache_position=torch.arange(context, device=device))
                for q in query_tokens:
                    # drawn on the host: a refused capture can leave the device RNG unusable
                    ids = torch.randint(0, config.vocab_size, (batch_size, q)).to(device)
                    positions = torch.arange(context, context + q, device=device)
                    ms, mode = forward_ms(model, cache, ids, positions, device,
                                          repeats=3 if smoke else 10)
                    rows.append(dict(context=context, batch=batch_size, query_tokens=q,
                                     total_tokens=batch_size * q, forward_ms=ms, mode=mode))
                del cache, prompt
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    for row in rows:
        base = next(r["forward_ms"] for r in rows if r["context"] == row["context"]
                    and r["batch"] == row["batch"] and r["query_tokens"] == 1)
        row["cost_over_one_token"] = row["forward_ms"] / base
    parameters = sum(p.numel() for p in model.parameters())
    return dict(ok=True, model="Qwen3-8B-shaped, random weights" if not smoke else "tiny Qwen3",
                parameters=parameters, dtype=str(dtype).removeprefix("torch."),
                transformers=transformers.__version__,
                attention="sdpa, static KV cache, logits at every query row", rows=rows)


SECTIONS = {"tree_kernel_check": tree_kernel_check, "adapter_kernel_path": adapter_kernel_path,
            "tree_kernel_timing": tree_kernel_timing,
            "bookkeeping": bookkeeping, "build_phases": build_phases,
            "verification_cost": verification_cost,
            # last: a refused capture may leave the device unusable for what follows
            "graph_bookkeeping": graph_bookkeeping}


# ---- report -----------------------------------------------------------------------------
def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU check: {env.get('device_name', 'no GPU')}", "",
             f"torch {env['torch']}, CUDA {env.get('cuda')}, triton {env.get('triton')}, "
             f"python {env['python']}; {report['finished']}", ""]
    for name, status in report.get("preflight", {}).items():
        lines.append(f"- {name}: {status}")
    lines.append("")
    for name in SECTIONS:
        result = report["sections"].get(name)
        if result is None:
            continue
        lines += [f"## {name}: {'ok' if result.get('ok') else 'FAILED'} "
                  f"({result.get('seconds', 0):.1f} s)", ""]
        if "error" in result:
            lines += ["```", result["error"].strip(), "```", ""]
            continue
        lines += TABLES[name](result) + [""]
    return "\n".join(lines)


def table(columns, rows) -> list[str]:
    from vllm_graft.markdown import records_table

    def cell(value):
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.3f}"
        return "" if value is None else str(value)
    return records_table(rows, columns, cell=cell)


TABLES = {
    "tree_kernel_check": lambda r: table(
        ["dtype", "head_dim", "heads", "kv_heads", "layout", "block_size", "rows",
         "rel_error", "tolerance", "all_written", "ok"], r["cases"]),
    "adapter_kernel_path": lambda r: table(
        ["dtype", "layout", "rows", "rel_error", "startup_check", "ok"], r["cases"]),
    "tree_kernel_timing": lambda r: table(
        ["batch", "context", "tree_nodes", "kernel_ms", "best_variant", "kernel_kv_gb_per_s",
         "dense_causal_flash_ms", "kernel_over_dense", "fallback_sdpa_ms"], r["rows"]),
    "bookkeeping": lambda r: table(
        ["batch", "device", "tree_rows", "build_ms", "topk_ms", "torch_topk_ms", "verify_greedy_ms",
         "verify_sampled_ms", "update_op_ms", "step_greedy_ms", "step_sampled_ms"]
        + (["forward_ms", "share_greedy", "share_sampled"] if "forward_ms" in r["rows"][0]
           else []), r["rows"]),
    "build_phases": lambda r: table(
        ["batch", "build_ops", "build_host_waits", "build_ms", "merge_depth", "merge_ms",
         "merge_static_ms", "merge_default_ms", "merge_reduce-overhead_ms",
         "compile_default_s", "compile_reduce-overhead_s", "same_default",
         "same_reduce-overhead"], r["rows"]),
    "graph_bookkeeping": lambda r: table(
        ["batch", "tree_rows", "depth_bound", "wait_free_ops", "wait_free_host_waits",
         "wait_free_same", "waiting_build_ms", "wait_free_build_ms", "eager_verify_greedy_ms",
         "graph_build_ms", "graph_build_same", "graph_verify_greedy_ms", "graph_verify_same",
         "graph_step_greedy_ms", "forward_ms", "eager_share_greedy", "graph_share_greedy",
         "graph_error"], r["rows"]),
    "verification_cost": lambda r: table(
        ["context", "batch", "query_tokens", "total_tokens", "forward_ms",
         "cost_over_one_token", "mode"], r["rows"]),
}


def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "device": device.type}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    return env


def write_report(report: dict, out: Path) -> str:
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (out / "gpu_check.md").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json / .md")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--preflight", action="append", default=[],
                        help="NAME=STATUS lines from the shell script (build, ops tests)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing measured", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    report = {"environment": environment(device), "smoke": args.smoke,
              "preflight": dict(item.split("=", 1) for item in args.preflight),
              "sections": {}}
    for name in args.sections:
        print(f"gpu_check: {name} ...", flush=True)
        begin = time.perf_counter()
        try:
            result = SECTIONS[name](device, args.smoke)
        except Exception:  # recorded, and the remaining sections still run
            result = {"ok": False, "error": traceback.format_exc()}
            print(result["error"], file=sys.stderr)
        result["seconds"] = time.perf_counter() - begin
        report["sections"][name] = result
        print(f"gpu_check: {name} {'ok' if result['ok'] else 'FAILED'} "
              f"({result['seconds']:.1f} s)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_report(report, out)  # after every section: a later time-out keeps these
    add_bookkeeping_shares(report["sections"])
    print(write_report(report, out))
    return 0 if all(r["ok"] for r in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
