"""GPU checks and profiles that need no vLLM (run by ``scripts/gpu_check.sh``).

Sections, in the order they run (what matters most first), each recorded in one JSON (and
a Markdown table) even when another fails; ``gpu_check.sh`` runs each in a process of its
own, with its own time limit (:data:`SECTION_LIMITS_S`):

* ``tree_kernel_check``: the Triton tree-attention kernel against the torch reference on
  fresh random mixed batches (prefill chunks, decodes, trees of 1 to 64 nodes, contexts
  off block boundaries), fp16 / bf16 / fp32, head dims 64 and 128, GQA, strided views of
  both paged-KV layouts; output poisoned with NaN before each run.
* ``adapter_kernel_path``: the Graft adapter's kernel path against its SDPA path on tree
  attention plans, for the three paged-KV layouts the kernel reads (bf16, fp16), and the
  start-up layout check the adapter runs before using the kernel.
* ``whole_step``: one decoding step of a Qwen3-8B-shaped target (bf16, random weights,
  plain torch with the Triton tree kernel over a paged KV cache) and EAGLE-3 head at
  batch 1 / 8 / 32 and context 1K / 8K: Graft's draft loop (the head between the fused
  draft steps), tree finalize, the 61-row verification forward and the fused acceptance,
  captured as CUDA graphs, each phase and the whole step timed; beside it a plain decode
  step and EAGLE-3 chain steps of 3 and 5 tokens (FlashAttention through SDPA, CUDA
  graphs); Graft's bookkeeping as a share of the step, and the tokens/s each would make
  with the mean accepted tokens of the committed CPU results (``--mat-*`` overrides).
* ``tree_kernel_timing``: Qwen3-8B attention shapes in bf16 (32 query heads, 8 KV heads,
  head dim 128), 60-node trees over contexts of 1K and 8K at batch 1 / 8 / 32: the
  kernel (several tile shapes in one launch, and split-K over the context with several
  split counts and the automatic choice) against a dense causal FlashAttention call with
  the same query rows (contiguous K/V, SDPA's flash backend) and against the per-request
  SDPA fallback.
* ``graph_bookkeeping``: the step's greedy bookkeeping without waits for the host
  (the wait-free tree build, the greedy verification with a bounded walk), each part
  captured as one CUDA graph and replayed, and the fused step captured whole as one
  graph, at batch 1 / 8 / 32 with fixed-shape trees: what it costs once launches are
  gone, and its share of a step.
* ``bookkeeping``: ``scripts/bench_core.py``'s Graft step bookkeeping on the device,
  vocabulary 151,936, batch 1 / 8 / 32: the fused step (its ops and host reads counted)
  beside the pure-torch path with the compiled successor ops.
* ``verification_cost``: forward time of a randomly initialised Qwen3-8B-shaped model
  (bf16, transformers) verifying 1 to 128 query tokens per request over a context, at
  batch 1 / 8 / 32: the hardware profile the cost-aware tree size uses.
* ``build_phases``: a tree build's ops and waits for the host at batch 1 / 8 / 32, and
  its merge eager, with a static depth bound, and under ``torch.compile`` (default mode
  and CUDA graphs): whether compiling the merge pays on the device.

``--smoke`` runs every section on the CPU at toy sizes (Triton under its interpreter),
to check this script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
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
                    num_splits=k, max_seq_len=context + tree_nodes), device,
                    *((3, 1) if smoke else (20, 3)))  # the interpreter is slow

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
    """Per batch size, the fused step (``bench_core.bench_fused``: the whole step as the
    engine runs it, its ops and host reads counted) beside the pure-torch path with the
    compiled successor ops (``bench_core.bench``, backend ``compiled``)."""
    import bench_core
    from vllm_graft.core.config import GraftConfig

    vocab, batches = (5000, (1, 2)) if smoke else (151_936, (1, 8, 32))
    repeats = 3 if smoke else 10
    cfg = GraftConfig(budget=60)
    rows, fused_error = [], None
    for batch in batches:
        if fused_error is None:
            try:
                rows.append(bench_core.bench_fused(batch, vocab, repeats, cfg, device))
            except Exception as error:  # recorded; the torch path still runs
                fused_error = _error(error)
                print(f"gpu_check: fused bookkeeping failed:\n{traceback.format_exc()}",
                      file=sys.stderr, flush=True)
        rows.append(bench_core.bench(batch, vocab, "compiled", repeats, cfg, device))
    return dict(ok=fused_error is None, vocab=vocab, budget=60, rows=rows,
                fused_error=fused_error)


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
    replayed, their outputs compared with the eager ones; and the fused step whole
    (:func:`fused_graph_step`). Off a GPU, eager only."""
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
            fused_graph_step(row, batch, vocab, cfg, device, repeats)  # eager
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
        if not fused_graph_step(row, batch, vocab, cfg, device, repeats):
            break  # a refused capture: what follows might not run
    ok = all(r["wait_free_same"] and r["wait_free_host_waits"] == 0
             and "graph_error" not in r
             and r.get("graph_build_same", True) and r.get("graph_verify_same", True)
             and "fused_error" not in r and "fused_graph_error" not in r
             and r.get("fused_replay_same", False)
             for r in rows)
    return dict(ok=ok, vocab=vocab, budget=60, tree_shape="fixed",
                captured=device.type == "cuda", rows=rows)


def fused_graph_step(row: dict, batch: int, vocab: int, cfg, device: torch.device,
                     repeats: int) -> bool:
    """The fused step (``bench_core.graft_step``: draft steps, finalize, top-k, greedy
    acceptance with the update, the copy to the host) of ``batch`` requests, eager and
    captured whole as one CUDA graph (off a GPU eager only), into ``row``: its ops and
    host reads, its times, and whether a replay (an eager call off a GPU) from the same
    matrix gives the eager result. False where capture was refused."""
    import bench_core

    try:
        builder, drafter, roots = bench_core.build_inputs(batch, vocab, "compiled", cfg,
                                                          device, fused_ops=True)
        logits = bench_core.step_logits(builder, drafter, roots, vocab)
        packed, table = builder.fused.buffers.view(batch).packed, builder.matrix.table

        def step():
            return bench_core.graft_step(builder, drafter, roots, logits)

        counts = bench_core.count_step(batch, vocab, cfg, sampled=False, device=device)
        row.update(fused_tree_rows=int(builder.fused.buffers.view(batch).tree_valid.sum()),
                   fused_ops=counts["ops"], fused_host_reads=counts["host_reads"],
                   fused_eager_step_greedy_ms=median_ms(step, device, repeats))
    except Exception as error:  # the fused ops failed here: recorded, the rest runs
        row["fused_error"] = _error(error)
        print(f"gpu_check: fused step at batch {batch} failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        return True
    graph = None
    if _gpu(device):
        try:
            graph, _ = captured(step, device)
        except Exception as error:  # a refused capture is a finding: say what refused it
            row["fused_graph_error"] = _error(error)
            print(f"gpu_check: capture of the fused step at batch {batch} failed: {error}",
                  file=sys.stderr, flush=True)
            return False
    saved = table.clone()
    step()
    _synchronize(device)
    expected = packed.clone()
    table.copy_(saved)
    (graph.replay if graph is not None else step)()
    _synchronize(device)
    row["fused_replay_same"] = bool(torch.equal(packed, expected))
    if graph is not None:
        row["fused_graph_step_greedy_ms"] = median_ms(graph.replay, device, repeats)
    return True


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
        for kind in ("eager", "graph", "fused_eager", "fused_graph"):
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


# ---- whole_step: one decoding step of a Qwen3-8B-shaped target and its EAGLE-3 head ------
@dataclass(frozen=True)
class ModelShape:
    """A Qwen3-style target and its EAGLE-3 head: one decoder layer at the target's hidden
    size, fed by three target hidden states through an fc, its own lm_head over
    ``draft_vocab`` ids mapped to target ids by an offset table (``d2t``)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6

    @property
    def aux_layers(self) -> tuple[int, int, int]:
        """The target layers whose outputs feed the head (vLLM's EAGLE-3 default)."""
        last = self.layers - 1
        return min(2, last), min(self.layers // 2, last), max(self.layers - 3, 0)


QWEN3_8B = ModelShape(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                      intermediate=12_288, vocab=151_936, draft_vocab=32_000)
TOY_SHAPE = ModelShape(layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16,
                       intermediate=64, vocab=1000, draft_vocab=500)
#: the committed CPU results the projection's mean accepted tokens per step (MAT) come
#: from: name -> (folder under bench/results, method, draft tokens of a chain)
MAT_RESULTS = {"graft": ("smollm2-135m", "graft", None),
               "chain3": ("smollm2-135m-tail3", "eagle3", 3),
               "chain5": ("smollm2-135m", "eagle3", 5)}
#: wall-clock budget of the whole_step section on a GPU: shapes past it are skipped
WHOLE_STEP_BUDGET_S = 160.0
ROOT = Path(__file__).resolve().parents[1]


def committed_mat(name: str) -> tuple[float | None, str]:
    """The mean accepted tokens per step of ``name`` (:data:`MAT_RESULTS`) in the committed
    CPU benchmark results (the mean of its rows' ``mat`` over datasets) and where it came
    from: the named folder first, else the first ``results.json`` with such rows."""
    folder, method, chain = MAT_RESULTS[name]
    results = ROOT / "bench" / "results"
    for path in [results / folder / "results.json", *sorted(results.glob("*/results.json"))]:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if chain is not None and data.get("config", {}).get("chain_tokens") != chain:
            continue
        rows = [r for r in data.get("rows", []) if r.get("method") == method
                and isinstance(r.get("mat"), (int, float))]
        if rows:
            what = f"{method} (chain of {chain})" if chain else method
            return (statistics.fmean(r["mat"] for r in rows),
                    f"{path.relative_to(ROOT)}: {what}, mean MAT over {len(rows)} datasets")
    return None, f"no committed result for {method}"


def _random(device, dtype, *shape) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype).mul_(0.02)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class PagedKV:
    """The K/V of ``batch`` requests over ``layers`` layers, ``capacity`` positions each, in
    one tensor ``[layers, 2, B, S, Hkv, D]``: a paged view (blocks of 16, request ``b``
    owning blocks ``b * S / 16`` on) for the tree kernel and per-request contiguous views
    for SDPA share its memory. Filled with a host-drawn pattern (no device RNG)."""

    BLOCK = 16

    def __init__(self, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.batch, self.capacity, self.kv_heads, self.head_dim = (batch, capacity, kv_heads,
                                                                   head_dim)
        self.data = torch.empty((layers, 2, batch, capacity, kv_heads, head_dim), dtype=dtype,
                                device=device)
        chunk = self.BLOCK * kv_heads * head_dim
        pattern = torch.randn(chunk, generator=torch.Generator().manual_seed(capacity))
        self.data.view(-1, chunk).copy_(pattern.to(device, dtype).expand(
            self.data.numel() // chunk, chunk))
        self.block_table = torch.arange(batch * capacity // self.BLOCK, dtype=torch.int32,
                                        device=device).view(batch, -1)

    @classmethod
    def nbytes(cls, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> int:
        return layers * 2 * batch * capacity * kv_heads * head_dim * dtype.itemsize

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """``[B * n]`` flat slots of ``positions`` (``[n]``, or ``[B, n]``) of every request."""
        base = torch.arange(self.batch, device=positions.device)[:, None] * self.capacity
        return (base + positions).reshape(-1)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        flat = self.data[layer].view(2, -1, self.kv_heads, self.head_dim)
        flat[0].index_copy_(0, slots, key)
        flat[1].index_copy_(0, slots, value)

    def paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[blocks, 16, Hkv, D]`` views of the layer's K and V."""
        key, value = self.data[layer].view(2, -1, self.BLOCK, self.kv_heads,
                                           self.head_dim).unbind(0)
        return key, value

    def dense(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, Hkv, length, D]`` views of positions ``[0, length)`` of the layer's K and V."""
        return (self.data[layer, 0, :, :length].transpose(1, 2),
                self.data[layer, 1, :, :length].transpose(1, 2))


class TreeRows:
    """Attention of ``rows`` query rows per request, the last of ``seq_len`` positions,
    through the Triton tree kernel (``paged_tree_attention``) over a :class:`PagedKV`; the
    tree starts at ``tree_start`` and ``bits`` (``[B * rows]``, set before a call) holds
    each row's 64-bit ancestor mask."""

    def __init__(self, cache: PagedKV, rows: int, seq_len: int, tree_start: int,
                 scale: float):
        device = cache.data.device
        self.cache, self.seq_len, self.scale = cache, seq_len, scale
        batch = cache.batch
        self.query_start = torch.arange(batch + 1, dtype=torch.int32, device=device) * rows
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        self.tree_start = torch.full((batch,), tree_start, dtype=torch.int32, device=device)
        self.bits = torch.ones(batch * rows, dtype=torch.long, device=device)

    def __call__(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        from vllm_graft.kernels.tree_attention_triton import paged_tree_attention

        key, value = self.cache.paged(layer)
        return paged_tree_attention(query, key, value, self.cache.block_table,
                                    self.query_start, self.seq_lens, self.tree_start,
                                    self.bits, self.scale, max_seq_len=self.seq_len)


class DenseRows:
    """Causal attention (bottom-right) of ``rows`` query rows per request over positions
    ``[0, seq_len)`` of a :class:`PagedKV`'s contiguous views, through SDPA with GQA:
    FlashAttention where it takes the call (the first, eager call finds out), else SDPA's
    own choice with the mask spelled out; ``backend`` says which."""

    def __init__(self, cache: PagedKV, rows: int, seq_len: int, scale: float):
        self.cache, self.rows, self.seq_len, self.scale = cache, rows, seq_len, scale
        self.backend = None
        self.mask = None

    def _attend(self, query, key, value, flash: bool):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        if flash:
            mask = causal_lower_right(self.rows, self.seq_len) if self.rows > 1 else None
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                      scale=self.scale, enable_gqa=True)
        if self.mask is None and self.rows > 1:  # made at the first (eager) call
            self.mask = torch.ones(self.rows, self.seq_len, dtype=torch.bool,
                                   device=query.device).tril(self.seq_len - self.rows)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=self.mask,
                                              scale=self.scale, enable_gqa=True)

    def agreement(self, query: torch.Tensor) -> float:
        """The largest difference between the flash call and the spelled-out mask on
        ``query`` (``[B * rows, Hq, D]``) over layer 0, relative to the output's scale."""
        key, value = self.cache.dense(0, self.seq_len)
        query = query.view(self.cache.batch, self.rows, *query.shape[1:]).transpose(1, 2)
        flash = self._attend(query, key, value, flash=True).float()
        spelled = self._attend(query, key, value, flash=False).float()
        return float((flash - spelled).abs().max() / spelled.abs().max().clamp(min=1e-6))

    def __call__(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        tokens, heads, head_dim = query.shape
        batch = self.cache.batch
        key, value = self.cache.dense(layer, self.seq_len)
        query = query.view(batch, self.rows, heads, head_dim).transpose(1, 2)
        if self.backend is None:
            try:
                out = self._attend(query, key, value, flash=True)
                self.backend = "flash"
            except Exception:  # flash refused the call: SDPA's own choice
                self.backend = "sdpa default"
                out = self._attend(query, key, value, flash=False)
        else:
            out = self._attend(query, key, value, flash=self.backend == "flash")
        return out.transpose(1, 2).reshape(tokens, heads, head_dim)


def _attention_block(x: torch.Tensor, weights: dict, positions: torch.Tensor, rope, shape,
                     cache: PagedKV, layer: int, slots: torch.Tensor, attend) -> torch.Tensor:
    """QKV projection (with Qwen3's per-head q/k norms where the weights have them),
    RoPE at ``positions``, the K/V written to ``slots``, ``attend``, O projection."""
    n = x.shape[0]
    q_size, kv_size = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    q, k, v = F.linear(x, weights["qkv"]).split([q_size, kv_size, kv_size], -1)
    q = q.view(n, shape.heads, shape.head_dim)
    k = k.view(n, shape.kv_heads, shape.head_dim)
    v = v.view(n, shape.kv_heads, shape.head_dim)
    if "q_norm" in weights:
        q, k = _rms(q, weights["q_norm"], shape.eps), _rms(k, weights["k_norm"], shape.eps)
    cos, sin = rope[0][positions][:, None], rope[1][positions][:, None]
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    cache.write(layer, slots, k, v)
    return F.linear(attend(layer, q).reshape(n, q_size), weights["o"])


def _mlp(x: torch.Tensor, weights: dict) -> torch.Tensor:
    gate, up = F.linear(x, weights["gate_up"]).chunk(2, -1)
    return F.linear(F.silu(gate) * up, weights["down"])


class Target:
    """A Qwen3-shaped decoder with random weights in plain torch: RMSNorm, QKV with
    per-head q/k norms, RoPE, one attention call per layer (given by the caller), O
    projection, SwiGLU MLP; logits of every row it runs, and the outputs of the head's
    three layers (``[N, 3 * hidden]``)."""

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype,
                 max_positions: int):
        s = shape
        self.shape, self.dtype = s, dtype
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim

        def ones(n):
            return torch.ones(n, device=device, dtype=dtype)

        self.embed = _random(device, dtype, s.vocab, s.hidden)
        self.lm_head = _random(device, dtype, s.vocab, s.hidden)
        self.norm = ones(s.hidden)
        self.layers = [dict(ln1=ones(s.hidden), qkv=_random(device, dtype, q_size + 2 * kv_size,
                                                             s.hidden),
                            q_norm=ones(s.head_dim), k_norm=ones(s.head_dim),
                            o=_random(device, dtype, s.hidden, q_size), ln2=ones(s.hidden),
                            gate_up=_random(device, dtype, 2 * s.intermediate, s.hidden),
                            down=_random(device, dtype, s.hidden, s.intermediate))
                       for _ in range(s.layers)]
        inverse = 1.0 / s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64)
                                         / s.head_dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inverse[None]
        self.rope = (angles.cos().to(device, dtype), angles.sin().to(device, dtype))
        self.scale = s.head_dim ** -0.5

    def parameters(self) -> int:
        tensors = [self.embed, self.lm_head, self.norm] + [w for layer in self.layers
                                                           for w in layer.values()]
        return sum(t.numel() for t in tensors)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: PagedKV,
                slots: torch.Tensor, attend, features: bool = True):
        s = self.shape
        x = F.embedding(tokens, self.embed)
        kept = {}
        for index, weights in enumerate(self.layers):
            x = x + _attention_block(_rms(x, weights["ln1"], s.eps), weights, positions,
                                     self.rope, s, cache, index, slots, attend)
            x = x + _mlp(_rms(x, weights["ln2"], s.eps), weights)
            if features and index in s.aux_layers:
                kept[index] = x
        logits = F.linear(_rms(x, self.norm, s.eps), self.lm_head)
        return logits, torch.cat([kept[i] for i in s.aux_layers], -1) if features else None


class Eagle3Head:
    """An EAGLE-3 head of the target's shape, random weights: ``fc`` maps the target's
    three hidden states to one; the decoder layer takes the token's embedding (the
    target's table) and the hidden state, both normed and concatenated (QKV from
    ``2 * hidden``), its residual the hidden state; its lm_head covers ``draft_vocab`` ids,
    target id = id + ``d2t[id]``."""

    def __init__(self, target: Target, device: torch.device):
        s, dtype = target.shape, target.dtype
        self.target, self.shape = target, s
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        ones = functools.partial(torch.ones, device=device, dtype=dtype)
        self.fc = _random(device, dtype, s.hidden, 3 * s.hidden)
        self.norm_embed, self.norm_hidden, self.norm = ones(s.hidden), ones(s.hidden), ones(
            s.hidden)
        self.layer = dict(qkv=_random(device, dtype, q_size + 2 * kv_size, 2 * s.hidden),
                          o=_random(device, dtype, s.hidden, q_size), ln2=ones(s.hidden),
                          gate_up=_random(device, dtype, 2 * s.intermediate, s.hidden),
                          down=_random(device, dtype, s.hidden, s.intermediate))
        self.lm_head = _random(device, dtype, s.draft_vocab, s.hidden)
        kept = torch.randperm(s.vocab, generator=torch.Generator().manual_seed(3))[
            :s.draft_vocab].sort().values
        self.d2t = (kept - torch.arange(s.draft_vocab)).to(device)

    def parameters(self) -> int:
        tensors = [self.fc, self.norm_embed, self.norm_hidden, self.norm, self.lm_head,
                   *self.layer.values()]
        return sum(t.numel() for t in tensors)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: PagedKV, slots: torch.Tensor, attend):
        """The layer's output hidden state ``[N, hidden]`` (the next step's input) and the
        draft logits ``[N, draft_vocab]`` in float32."""
        s = self.shape
        embedded = F.embedding(tokens.clamp(min=0), self.target.embed)
        x = torch.cat((_rms(embedded, self.norm_embed, s.eps),
                       _rms(hidden, self.norm_hidden, s.eps)), -1)
        h = hidden + _attention_block(x, self.layer, positions, self.target.rope, s, cache, 0,
                                      slots, attend)
        h = h + _mlp(_rms(h, self.layer["ln2"], s.eps), self.layer)
        return h, F.linear(_rms(h, self.norm, s.eps), self.lm_head).float()

    def target_ids(self, index: torch.Tensor) -> torch.Tensor:
        return index + self.d2t[index]


class TreeDrafter:
    """The head as the fused build's drafter (:class:`vllm_graft.core.fused.FusedTreeBuild`,
    every request at every depth): step 0 runs the root (its hidden state ``fc`` of the
    target's three), step ``s >= 1`` the ``top_k`` frontier nodes of every request, each
    fed its parent's output hidden state and attending over the context plus its
    ancestors (the root, and at each depth ``t`` the node the draft step's ``lineage``
    names). Draft K/V of the context, then the root, then ``top_k`` slots per depth.
    :meth:`tree_inputs` (each row's ancestor bits and parent, from ``lineage``) is Graft's
    bookkeeping; :meth:`forward_step` the head's forward and top-k."""

    def __init__(self, head: Eagle3Head, cache: PagedKV, buffers, roots: torch.Tensor,
                 features: torch.Tensor, context: int, top_k: int, depth: int):
        device = roots.device
        batch = roots.shape[0]
        self.head, self.cache, self.buffers = head, cache, buffers
        self.roots, self.features, self.top_k, self.depth = roots, features, top_k, depth
        self.plans = []
        for step in range(depth):
            width = 1 if step == 0 else top_k
            first = context if step == 0 else context + 1 + top_k * (step - 1)
            positions = torch.full((batch * width,), context + step, dtype=torch.long,
                                   device=device)
            slots = cache.slots(torch.arange(first, first + width, device=device))
            rows = TreeRows(cache, width, first + width, context, head.target.scale)
            self.plans.append((width, positions, slots, rows))
        self.level_offsets = 1 + top_k * torch.arange(depth, device=device)  # depth t >= 1
        self.one = torch.ones(1, dtype=torch.long, device=device)
        self.parents = [torch.zeros(batch, 1 if step == 0 else top_k, dtype=torch.long,
                                    device=device) for step in range(depth)]
        # head-only timing: fixed tokens (the forward's cost does not depend on them)
        generator = torch.Generator().manual_seed(batch)
        self.fixed_tokens = [torch.randint(0, head.shape.vocab, (batch, plan[0]),
                                           generator=generator).to(device)
                             for plan in self.plans]
        self.hidden = None

    def tree_inputs(self, step: int) -> None:
        """Ancestor bits (the root, the node at each depth ``1..step``) and the parent of
        every frontier row at ``step >= 1``, from the draft step's ``lineage``."""
        lineage = self.buffers.lineage.clamp(0, self.top_k - 1)  # [B, k, D]
        bits = (self.one << (lineage[:, :, 1:step + 1] + self.level_offsets[:step])).sum(-1)
        self.plans[step][3].bits.copy_((bits | 1).view(-1))
        if step >= 2:
            self.parents[step].copy_(lineage[:, :, step - 1])

    def forward_step(self, step: int, tokens: torch.Tensor):
        width, positions, slots, rows = self.plans[step]
        batch, hidden_size = tokens.shape[0], self.head.shape.hidden
        if step == 0:
            hidden = F.linear(self.features, self.head.fc)
        else:
            index = self.parents[step][..., None].expand(-1, -1, hidden_size)
            hidden = self.hidden.gather(1, index).reshape(-1, hidden_size)
        out, logits = self.head.forward(tokens.reshape(-1), hidden, positions, self.cache,
                                        slots, rows)
        self.hidden = out.view(batch, width, hidden_size)
        logprobs, index = logits.log_softmax(-1).topk(self.top_k, dim=-1)
        return (logprobs.view(batch, width, self.top_k),
                self.head.target_ids(index).view(batch, width, self.top_k))

    def __call__(self, step):
        if step.step >= 1:
            self.tree_inputs(step.step)
        return self.forward_step(step.step, step.tokens)

    def head_only(self) -> None:
        """The head's forwards and top-k of one build, inputs fixed (no Graft op)."""
        for step in range(self.depth):
            self.forward_step(step, self.fixed_tokens[step])


class HostCopy:
    """The step's last op: its result copied to the host (non-blocking into pinned memory
    on a GPU, one buffer per shape made at the first call, before any capture)."""

    def __init__(self, device: torch.device):
        self.device, self.buffers = device, {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not _gpu(self.device):
            return tensor.cpu()
        key = (tuple(tensor.shape), tensor.dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return self.buffers[key].copy_(tensor, non_blocking=True)


def tree_finalize(build, roots: torch.Tensor, buffers, successors: torch.Tensor) -> None:
    """The finalize launch of ``FusedTreeBuild.build`` (no context, no partitions), for
    timing it alone; the smoke run checks it builds the same trees."""
    from vllm_graft import ops

    recipe = build.recipe
    ops.graft_tree_finalize(
        roots, buffers.pool_tokens, buffers.pool_parents, buffers.pool_scores, buffers.stage,
        recipe.keep_by_stage, recipe.retrieval_keep, successors, build.empty,
        recipe.template_parents, recipe.template_ranks, recipe.template_scores,
        build.empty_context, build.empty_context, build.empty_context,
        draft_top_k=recipe.top_k, draft_capacity=recipe.draft_capacity,
        replace_below=recipe.replace_below, replace_keep=recipe.replace_keep,
        spare=recipe.spare, fixed_shape=recipe.fixed_shape, vocab_size=recipe.vocab_size,
        out={name: getattr(buffers, name) for name in ops.TREE_OUTPUTS})


def try_capture(fn, device: torch.device):
    """``(graph, output, error)``: ``fn`` captured as one CUDA graph (:func:`captured`) and
    its output; off a GPU, or where capture fails (``error`` says why), no graph and an
    eager call's output."""
    if not _gpu(device):
        return None, fn(), None
    try:
        graph, out = captured(fn, device)
        return graph, out, None
    except Exception as error:  # a refused capture is a finding: say what refused it
        message = f"{type(error).__name__}: {str(error)[:200]}"
        print(f"gpu_check: whole_step capture failed: {message}", file=sys.stderr, flush=True)
        _synchronize(device)
        return None, fn(), message


def timed_graph(fn, device: torch.device, repeats: int, warmup: int):
    """``(ms, graph, output, error)``: the median time of ``fn``'s CUDA graph replays
    (:func:`try_capture`), or of eager calls where capture fails; off a GPU the time of
    one eager call."""
    if not _gpu(device):
        begin = time.perf_counter()
        out = fn()
        return (time.perf_counter() - begin) * 1e3, None, out, None
    graph, out, error = try_capture(fn, device)
    return median_ms(graph.replay if graph else fn, device, repeats, warmup), graph, out, error


def timed_step(fn, host: HostCopy, device: torch.device, repeats: int, warmup: int):
    """``(ms, replay, mode, errors)`` of a step ``fn(to_host=True)`` whose last op copies
    its result to the host (``fn(False)`` returns the tensor instead): one CUDA graph;
    where capture refuses the copy, a graph with the copy after it; else eager (``errors``
    says why). ``replay`` runs the step as timed. Off a GPU, one eager call."""
    ms, graph, _, error = timed_graph(fn, device, repeats, warmup)
    if not _gpu(device):
        return ms, fn, "eager (no GPU)", {}
    if graph is not None:
        return ms, graph.replay, "one graph", {}
    errors = {"capture": error}
    graph, out, error = try_capture(lambda: fn(False), device)
    if graph is None:
        errors["capture_without_host_copy"] = error
        return ms, fn, "eager", errors

    def replay():
        graph.replay()
        return host(out)

    return (median_ms(replay, device, repeats, warmup), replay, "one graph, host copy after it",
            errors)


def _gpu(device: torch.device) -> bool:
    """Whether ``device`` runs CUDA graphs (every GPU-only branch of the whole step and
    the fused graph step asks here)."""
    return device.type == "cuda"


def _synchronize(device: torch.device) -> None:
    if _gpu(device):
        torch.cuda.synchronize(device)


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:300]}"


#: the phases of a Graft step, in order (``head`` is the head's forwards alone)
STEP_PHASES = ("draft", "finalize", "forward", "accept")


def _whole_step_shape(target: Target, head: Eagle3Head, batch: int, context: int,
                      device: torch.device, smoke: bool, check_attention: bool = False
                      ) -> dict:
    """One (batch, context) row of :func:`whole_step` (its docstring says what);
    ``check_attention``: also compare the chains' flash call with its mask spelled out."""
    from vllm_graft.core import fused
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.core.graft import GraftTreeBuilder
    from vllm_graft.core.successor import SuccessorMatrix

    s, dtype = target.shape, target.dtype
    repeats, warmup = (1, 0) if smoke else (5, 1)
    cfg = GraftConfig(budget=60, tree_shape="fixed")
    top_k, depth, rows = cfg.top_k, cfg.max_depth, cfg.budget + 1
    row = dict(batch=batch, context=context, tree_rows=rows)
    generator = torch.Generator().manual_seed(1000 * batch + context)
    matrix = SuccessorMatrix.empty(s.vocab, cfg.successor_k, device=device,
                                   backend="compiled", check=False)
    matrix.update_(torch.arange(s.vocab, device=device), torch.randint(
        0, s.vocab, (s.vocab, cfg.successor_k), generator=generator).to(device))
    table = matrix.table
    build = GraftTreeBuilder(cfg, matrix, device=device, fused=True).fused
    buffers = build.reserve(batch).view(batch)
    levels = build.recipe.levels
    roots = torch.randint(0, s.vocab, (batch,), generator=generator).to(device)
    features = torch.randn(batch, 3 * s.hidden, generator=generator).to(device, dtype)
    capacity = -(-(context + 64) // PagedKV.BLOCK) * PagedKV.BLOCK
    cache = PagedKV(s.layers, batch, capacity, s.kv_heads, s.head_dim, dtype, device)
    draft_cache = PagedKV(1, batch, capacity, s.kv_heads, s.head_dim, dtype, device)
    drafter = TreeDrafter(head, draft_cache, buffers, roots, features, context, top_k, depth)
    everyone = torch.arange(batch, device=device)
    host = HostCopy(device)

    # ---- Graft: draft loop, finalize, verification forward, acceptance
    tree_rows = TreeRows(cache, rows, context + rows, context, target.scale)
    tree_slots = cache.slots(torch.arange(context, context + rows, device=device))

    def verify():
        tree_rows.bits = buffers.ancestor_bits[..., 0].reshape(-1)
        tokens = buffers.tree_tokens.clamp(min=0).reshape(-1)
        positions = (buffers.tree_depths + context).reshape(-1)
        return target.forward(tokens, positions, cache, tree_slots, tree_rows)

    def hand_over(tree_features):
        """The next step's root (the bonus token) and its target features (those of the
        last accepted row)."""
        accepted = buffers.num_accepted.clamp(0, levels)
        last = buffers.accepted_rows.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
        last = last.clamp(min=0) * (accepted > 0)
        roots.copy_(buffers.output_tokens.gather(1, accepted[:, None])[:, 0].clamp(min=0))
        features.copy_(tree_features.view(batch, rows, -1)[everyone, last])

    def accept(logits, tree_features, to_host=True):
        fused.accept_greedy(buffers, logits, table, s.vocab)
        hand_over(tree_features)
        return host(buffers.packed) if to_host else buffers.packed

    def graft_step(to_host=True):
        build.build(roots, drafter, successors=table)
        return accept(*verify(), to_host=to_host)

    def draft_phase():
        build._draft(roots, drafter, buffers, False)

    def finalize_phase():
        tree_finalize(build, roots, buffers, table)

    errors, replays, phase_out = {}, {}, None
    try:
        # the phases build the trees build() does (the first calls compile the kernels)
        build.build(roots, drafter, successors=table)
        expected = (buffers.tree_tokens.clone(), buffers.ancestor_bits.clone())
        draft_phase()
        finalize_phase()
        row["phases_same"] = bool(torch.equal(expected[0], buffers.tree_tokens)
                                  and torch.equal(expected[1], buffers.ancestor_bits))
        for name, fn in (("draft", draft_phase), ("head", drafter.head_only),
                         ("finalize", finalize_phase), ("forward", verify)):
            row[f"{name}_ms"], graph, out, error = timed_graph(fn, device, repeats, warmup)
            replays[name] = graph.replay if graph is not None else None
            if name == "forward":
                phase_out = out
            if error:
                errors[f"{name}_capture"] = error
        graph = out = None
        row["accept_ms"], replays["accept"], mode, failures = timed_step(
            lambda to_host=True: accept(*phase_out, to_host=to_host), host, device, repeats,
            warmup)
        if mode == "eager":
            replays["accept"] = None
        errors.update({f"accept_{key}": value for key, value in failures.items()})
        if _gpu(device):
            row["step_eager_ms"] = median_ms(graft_step, device, repeats=3, warmup=0)
        # the whole step: one graph (else with the host copy after it), else one per phase
        row["step_ms"], step_fn, mode, failures = timed_step(graft_step, host, device, repeats,
                                                             warmup)
        errors.update({f"step_{key}": value for key, value in failures.items()})
        if mode == "eager" and all(replays[name] is not None for name in STEP_PHASES):
            def step_fn():
                for name in STEP_PHASES:
                    replays[name]()
            mode = "one graph per phase"
            row["step_ms"] = median_ms(step_fn, device, repeats, warmup)
        row["step_mode"] = mode
        row.setdefault("step_eager_ms", row["step_ms"])
        # from the same state, the timed step (a replay on a GPU) gives the eager result
        saved = [t.clone() for t in (roots, features, table)]
        graft_step()
        _synchronize(device)
        expected_packed = buffers.packed.clone()
        for tensor, value in zip((roots, features, table), saved):
            tensor.copy_(value)
        step_fn()
        _synchronize(device)
        row["replay_same"] = bool(torch.equal(buffers.packed, expected_packed))
        row["mean_accepted"] = float(
            expected_packed[:, buffers.columns["num_accepted"]].float().mean())
        row["bookkeeping_ms"] = row["step_ms"] - row["head_ms"] - row["forward_ms"]
        row["bookkeeping_share"] = row["bookkeeping_ms"] / row["step_ms"]
        row["draft_bookkeeping_ms"] = row["draft_ms"] - row["head_ms"]
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:  # Graft's part failed: plain and chain steps still run
        errors["graft"] = _error(error)
        print(f"gpu_check: whole_step batch {batch} context {context}: Graft step failed:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
    replays = phase_out = step_fn = None  # the graphs' memory pools go
    _synchronize(device)

    # ---- plain decoding and EAGLE-3 chains (FlashAttention through SDPA)
    plain_rows = DenseRows(cache, 1, context + 1, target.scale)
    plain_positions = torch.full((batch,), context, dtype=torch.long, device=device)
    plain_slots = cache.slots(torch.tensor([context], device=device))

    def plain_step(to_host=True):
        logits, _ = target.forward(roots, plain_positions, cache, plain_slots, plain_rows,
                                   features=False)
        roots.copy_(logits.argmax(-1))
        return host(roots) if to_host else roots

    def chain_plan(k):
        drafts = [(torch.full((batch,), context + i, dtype=torch.long, device=device),
                   draft_cache.slots(torch.tensor([context + i], device=device)),
                   DenseRows(draft_cache, 1, context + i + 1, target.scale))
                  for i in range(k)]
        positions = (context + torch.arange(k + 1, device=device)).repeat(batch)
        slots = cache.slots(torch.arange(context, context + k + 1, device=device))
        return drafts, positions, slots, DenseRows(cache, k + 1, context + k + 1, target.scale)

    def chain_step(plan, k, to_host=True):
        drafts, positions, slots, verify_rows = plan
        hidden, token, chain = F.linear(features, head.fc), roots, [roots]
        for draft_positions, draft_slots, draft_rows in drafts:
            hidden, logits = head.forward(token, hidden, draft_positions, draft_cache,
                                          draft_slots, draft_rows)
            token = head.target_ids(logits.argmax(-1))
            chain.append(token)
        chain = torch.stack(chain, 1)  # [B, k + 1]
        logits, chain_features = target.forward(chain.reshape(-1), positions, cache, slots,
                                                verify_rows)
        best = logits.argmax(-1).view(batch, k + 1)
        accepted = (chain[:, 1:] == best[:, :-1]).cumprod(1).sum(1)
        bonus = best.gather(1, accepted[:, None])
        result = torch.cat((accepted[:, None], chain[:, 1:], bonus), 1)
        roots.copy_(bonus[:, 0])
        features.copy_(chain_features.view(batch, k + 1, -1)[everyone, accepted])
        return host(result) if to_host else result

    attention = {}
    for name, k in (("plain", 0), ("chain3", 3), ("chain5", 5)):
        try:
            if k:
                plan = chain_plan(k)
                fn = functools.partial(chain_step, plan, k)
            else:
                fn = plain_step
            fn()  # eager first: finds the attention backend
            attention[name] = (f"verify {plan[3].backend}, draft {plan[0][0][2].backend}"
                               if k else plain_rows.backend)
            row[f"{name}_ms"], _, row[f"{name}_mode"], failures = timed_step(
                fn, host, device, repeats, warmup)
            errors.update({f"{name}_{key}": value for key, value in failures.items()})
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as error:
            errors[name] = _error(error)
            print(f"gpu_check: whole_step batch {batch} context {context}: {name} failed:\n"
                  f"{traceback.format_exc()}", file=sys.stderr, flush=True)
    row["dense_attention"] = attention
    if check_attention:  # the flash call's mask against the spelled-out one, once
        try:
            plan = chain_plan(5)
            query = torch.randn(batch * 6, s.heads, s.head_dim, generator=generator)
            row["dense_flash_vs_mask"] = plan[3].agreement(query.to(device, dtype))
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as error:  # flash refused these shapes: the steps used the mask
            row["dense_flash_vs_mask"] = _error(error)[:120]
    if errors:
        row["errors"] = errors
    return row


def project_throughput(rows: list[dict], mats: dict) -> list[dict]:
    """Tokens/s = batch x MAT / step time for Graft, the chains and plain decoding (MAT
    1), per row; Graft over the better chain and over plain; and the two goals: Graft over
    the EAGLE-3 chain at the smallest batch (>= 1.2x) and over plain at the largest
    (>= 1.0x), per context."""
    for row in rows:
        for name, key in (("graft", "step_ms"), ("chain3", "chain3_ms"),
                          ("chain5", "chain5_ms"), ("plain", "plain_ms")):
            mat = 1.0 if name == "plain" else mats[name][0]
            if mat is not None and row.get(key):
                row[f"{name}_tok_s"] = row["batch"] * mat / row[key] * 1e3
        chains = [row[k] for k in ("chain3_tok_s", "chain5_tok_s") if k in row]
        if "graft_tok_s" in row and chains:
            row["graft_over_chain"] = row["graft_tok_s"] / max(chains)
        if "graft_tok_s" in row and "plain_tok_s" in row:
            row["graft_over_plain"] = row["graft_tok_s"] / row["plain_tok_s"]
    measured = [r for r in rows if "batch" in r and "skipped" not in r]
    goals = []
    if measured:
        smallest, largest = min(r["batch"] for r in measured), max(r["batch"] for r in measured)
        for row in sorted(measured, key=lambda r: (r["batch"], r["context"])):
            for batch, key, what, bar in ((smallest, "graft_over_chain",
                                           "Graft / better EAGLE-3 chain", 1.2),
                                          (largest, "graft_over_plain", "Graft / plain", 1.0)):
                if row["batch"] == batch:
                    value = row.get(key)
                    goals.append(dict(goal=what, batch=batch, context=row["context"],
                                      value=value, bar=bar,
                                      met=None if value is None else value >= bar))
    return goals


def whole_step(device: torch.device, smoke: bool, mats: dict | None = None,
               budget_s: float | None = None) -> dict:
    """One decoding step of a Qwen3-8B-shaped target (bf16, random weights) with a
    Qwen3-8B-shaped EAGLE-3 head, at batch 1 / 8 / 32 and context 1K / 8K:

    * Graft: the head's forward at each draft depth (the root, then the 10 frontier rows
      of every request, tree attention over the context plus each row's ancestors, from
      the draft step's ``lineage``) between ``graft_draft_step`` calls;
      ``graft_tree_finalize``; the target's forward over the 61-row trees (the Triton
      tree kernel over a paged KV cache of the context, positions prefix + depth,
      logits at the tree rows); ``logits_topk`` + ``graft_accept_greedy`` (the matrix
      update included) and the next root's hand-over; the packed result to the host.
      Timed as one CUDA graph (else one with the host copy after it, else one per phase;
      ``step_mode`` says which), each phase as a graph of its own, and eagerly.
      ``head_ms`` is the head's forwards alone; bookkeeping = step - head - forward.
    * beside it: a plain decode step (one row per request) and EAGLE-3 chain steps of 3
      and 5 draft tokens (the head drafting a chain, the target verifying ``k + 1``
      causal rows), FlashAttention through SDPA over the same cache, each a CUDA graph.
    * the projected tokens/s (batch x MAT / step time) of each, with ``mats`` (name ->
      (MAT, source); default: the committed CPU results, :func:`committed_mat`).

    A shape whose cache does not fit, or past the section's time budget
    (:data:`WHOLE_STEP_BUDGET_S`, or ``budget_s`` where less), is skipped with the
    reason; a failed capture is recorded and the part timed eagerly."""
    import gc

    if mats is None:
        mats = {name: committed_mat(name) for name in MAT_RESULTS}
    for name, (value, source) in mats.items():
        print(f"gpu_check: whole_step MAT {name} = "
              f"{'unknown' if value is None else f'{value:.3f}'} ({source})", flush=True)
    shape = TOY_SHAPE if smoke else QWEN3_8B
    dtype = torch.float32 if smoke else torch.bfloat16
    batches, contexts = ((1, 2), (24,)) if smoke else ((1, 32, 8), (1024, 8192))
    torch.manual_seed(0)
    target = Target(shape, device, dtype, max(contexts) + 128)
    head = Eagle3Head(target, device)
    budget_s = WHOLE_STEP_BUDGET_S if budget_s is None else min(budget_s, WHOLE_STEP_BUDGET_S)
    deadline = time.perf_counter() + budget_s
    rows = []
    with torch.no_grad():
        for batch in batches:
            for context in contexts:
                reason = None
                capacity = context + 64
                logits_bytes = 4 * batch * 61 * shape.vocab * dtype.itemsize
                need = (PagedKV.nbytes(shape.layers + 1, batch, capacity, shape.kv_heads,
                                       shape.head_dim, dtype) + logits_bytes + (3 << 30))
                if time.perf_counter() > deadline:
                    reason = f"the section's time budget ({budget_s:.0f} s) is spent"
                elif _gpu(device):
                    free = torch.cuda.mem_get_info(device)[0]
                    if need > free:
                        reason = (f"needs about {need / 2**30:.1f} GiB (KV cache, logits, "
                                  f"work), {free / 2**30:.1f} GiB free")
                if reason is None:
                    try:
                        row = _whole_step_shape(target, head, batch, context, device, smoke,
                                                check_attention=not rows)
                    except torch.cuda.OutOfMemoryError as error:
                        reason = f"out of memory: {str(error)[:160]}"
                    except Exception as error:
                        row = dict(batch=batch, context=context, errors={"setup": _error(error)})
                        print(traceback.format_exc(), file=sys.stderr, flush=True)
                if reason is not None:
                    row = dict(batch=batch, context=context, skipped=reason)
                rows.append(row)
                gc.collect()
                if _gpu(device):
                    torch.cuda.empty_cache()
                print(f"gpu_check: whole_step batch {batch} context {context}: " + (
                    f"skipped ({row['skipped']})" if "skipped" in row else
                    ", ".join(f"{k} {row[k]:.2f} ms" for k in (
                        "draft_ms", "finalize_ms", "forward_ms", "accept_ms", "step_ms",
                        "bookkeeping_ms", "plain_ms", "chain3_ms", "chain5_ms") if k in row)
                    + (f"; errors: {row['errors']}" if "errors" in row else "")), flush=True)
    rows.sort(key=lambda r: (r["batch"], r["context"]))
    goals = project_throughput(rows, mats)
    for goal in goals:
        value = "n/a" if goal["value"] is None else f"{goal['value']:.2f}x"
        print(f"gpu_check: whole_step {goal['goal']} at batch {goal['batch']}, context "
              f"{goal['context']}: {value} (goal >= {goal['bar']}x)", flush=True)
    ok = all("errors" not in r for r in rows) and any("step_ms" in r for r in rows)
    return dict(ok=ok, model="Qwen3-8B-shaped" if not smoke else "toy Qwen3",
                dtype=str(dtype).removeprefix("torch."),
                target_parameters=target.parameters(), head_parameters=head.parameters(),
                aux_layers=list(shape.aux_layers), draft_vocab=shape.draft_vocab,
                mat={name: dict(value=value, source=source)
                     for name, (value, source) in mats.items()},
                rows=rows, goals=goals)


#: the sections in the order they run, what matters most first (``gpu_check.sh`` runs
#: each in a process of its own, so that a hang, a crash or a lost CUDA context costs
#: only its own section, and skips those its time budget cannot reach)
SECTIONS = {"tree_kernel_check": tree_kernel_check, "adapter_kernel_path": adapter_kernel_path,
            "whole_step": whole_step, "tree_kernel_timing": tree_kernel_timing,
            "graph_bookkeeping": graph_bookkeeping, "bookkeeping": bookkeeping,
            # measured twice before (2026-11-30, 2026-12-04; within 2 %)
            "verification_cost": verification_cost,
            # cold torch.compile: the least predictable time
            "build_phases": build_phases}
#: the most seconds ``gpu_check.sh`` gives each section's process on a GPU (whole_step
#: keeps its own budget within it)
SECTION_LIMITS_S = {"tree_kernel_check": 60, "adapter_kernel_path": 45, "whole_step": 200,
                    "tree_kernel_timing": 90, "graph_bookkeeping": 90, "bookkeeping": 90,
                    "verification_cost": 150, "build_phases": 150}
#: the same on the CPU (``--smoke``: toy sizes, Triton's interpreter)
SMOKE_LIMIT_S = 300
#: a section's record while it runs: what stays if its process never returns
UNFINISHED = ("did not finish: its process was killed (the time limit gpu_check.sh gave "
              "it) or crashed; see gpu_check.log")


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
        status = "ok" if result.get("ok") else "SKIPPED" if "skipped" in result else "FAILED"
        lines += [f"## {name}: {status} ({result.get('seconds', 0):.1f} s)", ""]
        if "skipped" in result:
            lines += [f"Not run: {result['skipped']}", ""]
            continue
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
         "dense_causal_flash_ms", "kernel_over_dense", "auto_variant", "auto_over_dense",
         "single_launch_over_dense", "fallback_sdpa_ms"], r["rows"]),
    "bookkeeping": lambda r: table(
        ["batch", "backend", "device", "tree_rows", "build_ms", "topk_ms", "torch_topk_ms",
         "verify_greedy_ms", "verify_sampled_ms", "update_op_ms", "step_greedy_ms",
         "step_sampled_ms", "ops_greedy", "host_reads_greedy"]
        + (["forward_ms", "share_greedy", "share_sampled"] if "forward_ms" in r["rows"][0]
           else []), r["rows"]) + ([f"fused step failed: {r['fused_error']}"]
                                   if r.get("fused_error") else []),
    "whole_step": lambda r: whole_step_table(r),
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
         "graph_error"], r["rows"]) + ["", "The fused step (`bench_core.graft_step`) whole:",
                                       ""] + table(
        ["batch", "fused_tree_rows", "fused_ops", "fused_host_reads",
         "fused_eager_step_greedy_ms", "fused_graph_step_greedy_ms", "fused_replay_same",
         "forward_ms", "fused_eager_share_greedy", "fused_graph_share_greedy",
         "fused_graph_error", "fused_error"], r["rows"]),
    "verification_cost": lambda r: table(
        ["context", "batch", "query_tokens", "total_tokens", "forward_ms",
         "cost_over_one_token", "mode"], r["rows"]),
}


def whole_step_table(r: dict) -> list[str]:
    lines = [f"{r['model']}, {r['dtype']}, random weights: target "
             f"{r['target_parameters']:,} parameters (the head fed by its layers "
             f"{r['aux_layers']}), EAGLE-3 head {r['head_parameters']:,} (draft vocabulary "
             f"{r['draft_vocab']:,}). Times in ms per step; bookkeeping = step - head - "
             "forward (Graft's ops and their glue, the acceptance, the copy to the host).", ""]
    for name, mat in r["mat"].items():
        value = "unknown" if mat["value"] is None else f"{mat['value']:.3f}"
        lines.append(f"- MAT {name}: {value} ({mat['source']})")
    lines += [""] + table(
        ["batch", "context", "step_mode", "draft_ms", "head_ms", "finalize_ms", "forward_ms",
         "accept_ms", "step_ms", "step_eager_ms", "bookkeeping_ms", "bookkeeping_share",
         "plain_ms", "chain3_ms", "chain5_ms", "replay_same", "skipped"], r["rows"])
    lines += ["", "Projected tokens/s (batch x MAT / step time):", ""] + table(
        ["batch", "context", "graft_tok_s", "chain3_tok_s", "chain5_tok_s", "plain_tok_s",
         "graft_over_chain", "graft_over_plain"], r["rows"])
    if r.get("goals"):
        lines += [""] + table(["goal", "batch", "context", "value", "bar", "met"], r["goals"])
    measured = [row for row in r["rows"] if row.get("dense_attention")]
    if measured:
        agreement = next((row["dense_flash_vs_mask"] for row in measured
                          if "dense_flash_vs_mask" in row), None)
        lines += ["", f"Plain and chain attention: {measured[0]['dense_attention']} (batch "
                      f"{measured[0]['batch']}); flash against the spelled-out mask: "
                      f"{agreement}."]
    problems = [f"- batch {row['batch']}, context {row['context']}: {row['errors']}"
                for row in r["rows"] if row.get("errors")]
    return lines + ([""] + problems if problems else [])


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
    add_bookkeeping_shares(report["sections"])
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (out / "gpu_check.md").write_text(text)
    return text


def pairs(items: list[str], option: str) -> dict[str, str]:
    """``NAME=VALUE`` command-line items as a dict (``option`` names them in errors)."""
    if bad := [item for item in items if "=" not in item]:
        raise SystemExit(f"gpu_check: {option} takes NAME=VALUE, got {bad}")
    return dict(item.split("=", 1) for item in items)


def run_sections(names: list[str], report: dict, out: Path, device: torch.device,
                 smoke: bool, mats: dict, limit_s: float | None) -> None:
    """Each section of ``names`` into ``report``, written after each; a section's error is
    recorded and the next runs, unless the device is lost (then they are not run)."""
    for position, name in enumerate(names):
        print(f"gpu_check: {name} ...", flush=True)
        report["sections"][name] = {"ok": False, "error": UNFINISHED}
        write_report(report, out)
        begin = time.perf_counter()
        try:
            options = {}
            if name == "whole_step":
                options = {"mats": mats, "budget_s": None if limit_s is None
                           else max(limit_s - 40.0, 10.0)}  # set-up and report in the rest
            result = SECTIONS[name](device, smoke, **options)
        except Exception:  # recorded, and the remaining sections still run
            result = {"ok": False, "error": traceback.format_exc()}
            print(result["error"], file=sys.stderr)
        result["seconds"] = time.perf_counter() - begin
        report["sections"][name] = result
        print(f"gpu_check: {name} {'ok' if result['ok'] else 'FAILED'} "
              f"({result['seconds']:.1f} s)", flush=True)
        lost = None
        if device.type == "cuda":
            try:  # after an illegal address or a device assert, this raises too
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
            except Exception as error:
                lost = f"the CUDA context was lost after {name}: {_error(error)}"
        if lost is not None:
            result["ok"] = False
            result.setdefault("error", lost)
            for later in names[position + 1:]:
                report["sections"][later] = {"ok": False, "skipped": lost}
        write_report(report, out)  # after every section: a later time-out keeps these
        if lost is not None:
            print(f"gpu_check: {lost}; sections not run: {names[position + 1:]}",
                  file=sys.stderr, flush=True)
            return


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json / .md")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes")
    parser.add_argument("--sections", nargs="*", choices=list(SECTIONS), default=None,
                        help="the sections to run (default: all; none with --finish)")
    parser.add_argument("--plan", action="store_true",
                        help="print the chosen sections, each with its time limit in "
                             "seconds (SECTION_LIMITS_S), and exit")
    parser.add_argument("--merge", action="store_true",
                        help="add to the report already in --out instead of a new one")
    parser.add_argument("--limit-s", type=float, default=None,
                        help="the time this process was given (whole_step keeps within it)")
    parser.add_argument("--finish", action="store_true",
                        help="run no section: complete the report in --out (--killed, "
                             "--not-run, --preflight), print it, and exit 0 only if every "
                             "section passed")
    parser.add_argument("--killed", action="append", default=[], metavar="NAME=SECONDS",
                        help="with --finish: the section's process was killed at its limit")
    parser.add_argument("--not-run", action="append", default=[], metavar="NAME=REASON",
                        help="with --finish: the section was not started, and why")
    parser.add_argument("--preflight", action="append", default=[],
                        help="NAME=STATUS lines from the shell script (build, ops tests)")
    for name, (folder, method, chain) in MAT_RESULTS.items():
        parser.add_argument(f"--mat-{name}", type=float, default=None,
                            help=f"whole_step's mean accepted tokens per step of {name} "
                                 f"(default: the committed CPU result, bench/results/{folder})")
    args = parser.parse_args()
    names = ([] if args.finish else list(SECTIONS)) if args.sections is None else args.sections
    if args.plan:
        for name in names:
            print(name, SMOKE_LIMIT_S if args.smoke else SECTION_LIMITS_S[name])
        return 0
    mats = {name: (getattr(args, f"mat_{name}"), f"--mat-{name}")
            if getattr(args, f"mat_{name}") is not None else committed_mat(name)
            for name in MAT_RESULTS}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing measured", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    existing = out / "gpu_check.json"
    report = json.loads(existing.read_text()) if (args.merge or args.finish) \
        and existing.exists() else {"sections": {}}
    report.update(environment=environment(device), smoke=args.smoke)
    report.setdefault("preflight", {}).update(pairs(args.preflight, "--preflight"))
    for name, seconds in pairs(args.killed, "--killed").items():
        report["sections"][name] = {"ok": False, "seconds": float(seconds), "error": (
            f"killed at its time limit of {seconds} s (gpu_check.sh): a hang, or more work "
            f"than the limit; what it printed is in gpu_check.log")}
    for name, reason in pairs(args.not_run, "--not-run").items():
        report["sections"][name] = {"ok": False, "skipped": reason}
    run_sections(names, report, out, device, args.smoke, mats, args.limit_s)
    text = write_report(report, out)
    if args.finish or args.sections is None:
        print(text)
    sections = report["sections"].values()
    return 0 if sections and all(r["ok"] for r in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
