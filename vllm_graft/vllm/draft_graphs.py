"""The drafter's draft loop as one CUDA graph per batch size.

A tree round's draft loop is ``max_depth - 1`` drafter forwards, each followed by the
fused draft-step op (:meth:`vllm_graft.core.fused.FusedTreeBuild.draft`): on a GPU
hundreds of small launches. In cache mode (:class:`TreeExpansion`: the drafter's tree
rows in its paged cache, the Triton kernel for its attention, no read of the device) the
whole loop has fixed shapes for a batch size, so it is captured once per batch size and
replayed with the round's inputs copied into the graph's own tensors
(:class:`StaticDraftInputs`): the roots, the catch-up's top-k and hidden rows, the
root positions, the block tables.

The first round of a batch size runs eagerly on those tensors (its result is the
round's), and is also the check that every drafter layer ran the kernel: a layer on the
SDPA path reads lengths the host knows at capture time, which a replay would keep, so
such a loop is never captured. The first :data:`CHECKED_REPLAYS` replays of each size
run eagerly too, and the two draft states must be equal. Any difference, or any error
while capturing or checking, turns the capture off for good with one log line; the
round keeps the eager result. No GPU in the project's test machines has vLLM, so this is
how the graphs protect themselves where they run.

The drafter's forward timer cannot time captured work span by span: a replay is timed
as one span (it holds the fused draft-step ops too).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_graft.vllm.drafter_forwards import TreeExpansion

logger = logging.getLogger(__name__)

#: replays per batch size checked against an eager run of the same round
CHECKED_REPLAYS = 2
#: the draft state a loop leaves in the step buffers (what the checks compare)
DRAFT_STATE = ("pool_tokens", "pool_parents", "pool_scores", "frontier_ids",
               "frontier_tokens", "frontier_scores", "lineage", "going", "stage", "steps",
               "confidence")


def capture_cuda_graph(fn: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    """``fn`` captured as a CUDA graph in ``pool`` (side stream, as torch wants)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


@dataclass
class StaticDraftInputs:
    """A round's draft inputs in tensors of fixed address (copied in before a replay)."""

    roots: torch.Tensor
    expansion: TreeExpansion

    @classmethod
    def like(cls, roots: torch.Tensor, drafter: TreeExpansion) -> StaticDraftInputs:
        values, ids = drafter.root_logprobs
        hidden = None if drafter.root_hidden is None else drafter.root_hidden.clone()
        expansion = TreeExpansion(  # its positions from the host's copy: no device read
            drafter.proposer, root_logprobs=(values.clone(), ids.clone()),
            root_hidden=hidden, root_positions=torch.tensor(drafter.root_positions_host),
            block_tables=drafter.block_tables.clone(),
            slot_tables=drafter.slot_tables.clone(), kv_layout=drafter.kv_layout)
        return cls(roots=roots.clone(), expansion=expansion)

    def load(self, roots: torch.Tensor, drafter: TreeExpansion) -> None:
        static = self.expansion
        self.roots.copy_(roots)
        for target, source in ((static.root_logprobs[0], drafter.root_logprobs[0]),
                               (static.root_logprobs[1], drafter.root_logprobs[1]),
                               (static.root_positions, drafter.root_positions),
                               (static.prefix_lens, drafter.prefix_lens),
                               (static.block_tables, drafter.block_tables),
                               (static.slot_tables, drafter.slot_tables)):
            target.copy_(source)
        if static.root_hidden is not None:
            static.root_hidden.copy_(drafter.root_hidden)
        # read only where a layer would take the SDPA path, which a captured loop never
        # holds; kept equal for the eager runs on these tensors
        static.root_positions_host = list(drafter.root_positions_host)

    def fits(self, roots: torch.Tensor, drafter: TreeExpansion) -> bool:
        """Whether the round's tensors have the shapes these were made with."""
        static = self.expansion
        pairs = [(self.roots, roots), (static.root_logprobs[0], drafter.root_logprobs[0]),
                 (static.block_tables, drafter.block_tables),
                 (static.slot_tables, drafter.slot_tables)]
        if (static.root_hidden is None) != (drafter.root_hidden is None):
            return False
        if static.root_hidden is not None:
            pairs.append((static.root_hidden, drafter.root_hidden))
        return all(a.shape == b.shape and a.dtype == b.dtype for a, b in pairs)


@dataclass
class CapturedLoop:
    inputs: StaticDraftInputs
    graph: object  # torch.cuda.CUDAGraph (or what ``capture`` returned)
    buffers: int  # the address of the step buffers it writes
    checks_left: int = CHECKED_REPLAYS


class DraftLoopGraphs:
    """The draft-loop hook of :class:`~vllm_graft.core.fused.FusedTreeBuild`
    (``draft_loop``): returns True when it ran the round's loop (captured or replayed),
    False to let the build run it eagerly.

    ``capture``: makes a graph of a callable (default :func:`capture_cuda_graph`; tests
    pass a stand-in that replays by calling it again, to check the inputs' plumbing and
    the checks on a CPU, with ``require_kernel`` off since a CPU has no tree kernel)."""

    def __init__(self, fused, proposer, capture: Callable | None = None, pool=None,
                 require_kernel: bool = True):
        self.fused = fused
        self.proposer = proposer
        self.capture = capture or capture_cuda_graph
        self.pool = pool
        self.require_kernel = require_kernel
        self.loops: dict[int, CapturedLoop] = {}
        self.off_reason: str | None = None
        self.replays = 0
        self.captures = 0

    def __call__(self, roots: torch.Tensor, drafter, buffers) -> bool:
        if self.off_reason is not None or not isinstance(drafter, TreeExpansion) \
                or drafter.store is not None:
            return False
        batch = roots.shape[0]
        loop = self.loops.get(batch)
        if loop is not None and loop.buffers != buffers.pool_tokens.data_ptr():
            self.loops.clear()  # the step buffers grew: every graph writes the old ones
            loop = None
        if loop is not None and not loop.inputs.fits(roots, drafter):
            return False  # shapes of another configuration: eager, never a stale graph
        try:
            if loop is None:
                self._first_round(roots, drafter, buffers)
                return True
            loop.inputs.load(roots, drafter)
            with self.proposer.forward_timer.span():
                loop.graph.replay()
            self.replays += 1
            if loop.checks_left:
                loop.checks_left -= 1
                self._check(roots, drafter, buffers)
            return True
        except Exception as error:  # never let the graphs take the engine down
            self.turn_off(f"{type(error).__name__}: {error}")
            self.fused.draft(roots, drafter, buffers)
            return True

    def _first_round(self, roots, drafter: TreeExpansion, buffers) -> None:
        """The round eagerly on new static tensors (its result stands), then, if every
        drafter layer ran the kernel, the loop captured on them."""
        inputs = StaticDraftInputs.like(roots, drafter)
        self.fused.draft(inputs.roots, inputs.expansion, buffers)
        sdpa_layers = inputs.expansion.sdpa_layers
        if sdpa_layers and self.require_kernel:
            self.turn_off(f"{sdpa_layers} drafter attention layers ran the SDPA path (the "
                          "tree kernel is off or refused this cache layout): a captured "
                          "loop would keep the lengths of its capture")
            return
        expansion = inputs.expansion

        def run() -> None:  # a replay is timed as a whole, not span by span
            with _untimed(expansion.proposer):
                expansion.reset()
                self.fused.draft(inputs.roots, expansion, buffers)

        graph = self.capture(run, self.pool)
        self.captures += 1
        self.loops[roots.shape[0]] = CapturedLoop(inputs, graph,
                                                  buffers.pool_tokens.data_ptr())
        logger.debug("Graft: the drafter's draft loop captured for %d requests",
                     roots.shape[0])

    def _check(self, roots, drafter: TreeExpansion, buffers) -> None:
        """The replayed draft state against an eager run of the same round."""
        replayed = {name: getattr(buffers, name).clone() for name in DRAFT_STATE}
        self.fused.draft(roots, drafter, buffers)
        for name in DRAFT_STATE:
            eager = getattr(buffers, name)
            same = torch.allclose(replayed[name], eager, rtol=1e-4, atol=1e-5,
                                  equal_nan=True) if eager.is_floating_point() \
                else torch.equal(replayed[name], eager)
            if not same:
                self.turn_off(f"a replayed draft loop left {name} unlike an eager run of "
                              f"the same round (batch {roots.shape[0]})")
                return

    def turn_off(self, reason: str) -> None:
        if self.off_reason is None:
            logger.error("Graft: the drafter's CUDA graphs are off, its draft loop runs "
                         "eagerly from now on: %s", reason)
        self.off_reason = reason
        self.loops.clear()


@contextlib.contextmanager
def _untimed(proposer):
    """The proposer's forward timer replaced by one that records nothing (CUDA events
    cannot time spans inside a capture)."""
    saved = proposer.forward_timer
    proposer.forward_timer = _NoTimer()
    try:
        yield
    finally:
        proposer.forward_timer = saved


class _NoTimer:
    @contextlib.contextmanager
    def span(self):
        yield


def install(drafting, vllm_config, device) -> DraftLoopGraphs | None:
    """Capture the draft loop of ``drafting`` (a
    :class:`~vllm_graft.vllm.tree_drafting.GraftTreeDrafting`) where it can run in CUDA
    graphs: a GPU engine that is not eager (``graft.cuda_graphs``) and builds with the
    fused ops."""
    from vllm_graft.vllm.config import cuda_graphs_enabled

    fused = drafting.tree_builder.fused
    if fused is None or not fused.recipe.max_depth or torch.device(device).type != "cuda" \
            or not cuda_graphs_enabled(vllm_config):
        return None
    fused.draft_loop = DraftLoopGraphs(fused, drafting, pool=torch.cuda.graph_pool_handle())
    return fused.draft_loop
