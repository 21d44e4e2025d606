"""The drafting rounds Graft's proposers share (:class:`GraftTreeDrafting`): the
drafter's state (successor matrix, sizer, guard, per-request tables), one round's
trees, and the context index each request copies from. Chains, admission and the
drafter's forwards are its parts in :mod:`~vllm_graft.vllm.chain_drafting`,
:mod:`~vllm_graft.vllm.drafting_admission` and :mod:`~vllm_graft.vllm.drafter_forwards`."""

from __future__ import annotations

import logging

import torch

from vllm_graft.core.budget import ChainScout, ThroughputGuard, TreeSizer, context_scores
from vllm_graft.core.config import StepMode, TreeShape
from vllm_graft.core.context import ContextIndex, match_score, proposals_to_tensors
from vllm_graft.core.graft import GraftTreeBuilder
from vllm_graft.core.isolation import IsolationMode, MatrixPartitions, default_max_matrices
from vllm_graft.core.shared_outputs import PeerOutputs, RecentOutputsIndex
from vllm_graft.core.successor import SuccessorMatrix
from vllm_graft.core.transfer import dataclasses_to_host
from vllm_graft.step_clock import SpanTimer
from vllm_graft.vllm import draft_graphs
from vllm_graft.vllm.chain_drafting import ChainDrafting
from vllm_graft.vllm.config import GraftSettings, TokenizerRef
from vllm_graft.vllm.draft_records import HostRows, PendingTree, SettledRows, ShadowChain
from vllm_graft.vllm.drafter_forwards import DeferredRows, DrafterForwards, TreeExpansion
from vllm_graft.vllm.drafting_admission import DraftingAdmission
from vllm_graft.vllm.heap import HeapTrimmer
from vllm_graft.vllm.proposal import StepProposal
from vllm_graft.vllm.successor_state import (SuccessorStateKeeper, is_state_writer,
                                             load_successor_state, matrix_metadata)
from vllm_graft.vllm.tp_agreement import agree

logger = logging.getLogger(__name__)


def check_compiled_ops(backend: str, device) -> None:
    """On a GPU the compiled ops need their CUDA kernels: a library built where torch or
    the CUDA toolkit lacked CUDA has CPU kernels only (its build said so), and its first
    use on the GPU would fail in the middle of a step."""
    from vllm_graft.ops import cuda_ops_available

    if backend == "compiled" and torch.device(device).type == "cuda" \
            and not cuda_ops_available():
        raise RuntimeError(
            "vllm_graft's compiled ops were built without their CUDA kernels, and this "
            "engine runs on a GPU: rebuild them where torch has CUDA and nvcc is found "
            "(VLLM_GRAFT_BUILD_CUDA=1 pip install --no-build-isolation .), or set "
            "graft.ops_backend to \"reference\" (slower)")


class GraftTreeDrafting(ChainDrafting, DraftingAdmission, DrafterForwards):
    """The drafting rounds, shared by both drafters; subclasses say how their model is
    fed (``_catch_up_inputs``, ``_forward``, ``_top_k``) and where its tree rows sit:
    a node at depth ``d`` under a root at position ``R`` is fed at position
    ``R + d + EXPANSION_OFFSET`` and sees the cached positions ``[0, R + PREFIX_EXTRA)``.
    """

    EXPANSION_OFFSET: int
    PREFIX_EXTRA: int
    USES_HIDDEN: bool

    def _init_graft(self, vllm_config, device) -> None:
        settings = GraftSettings.from_vllm_config(vllm_config)
        if settings is None:
            raise ValueError("GraftProposer needs additional_config['graft']")
        self.settings = settings
        config = settings.config
        check_compiled_ops(config.ops_backend, device)
        vocab_size = vllm_config.model_config.get_vocab_size()
        # the saved state holds what the warm-up taught and what serving taught since;
        # the ops skip their per-call id checks (device syncs on a GPU): every id the
        # engine passes is in range by construction (SuccessorMatrix's doc)
        load = dict(vocab_size=vocab_size, k=config.successor_k,
                    tokenizer_fingerprint=TokenizerRef.fingerprint_of(vllm_config.model_config),
                    device=device, backend=config.ops_backend, check=False)
        writer = config.successor_state is not None and is_state_writer(vllm_config)
        matrix = source = None
        if config.successor_state is not None:  # a file it cannot use: on_corrupt decides
            matrix = load_successor_state(config.successor_state, writer=writer, fallback=(
                f"the warm-up file {config.warmup}" if config.warmup else "an empty matrix"),
                **load)
            source = config.successor_state.path
        if matrix is None and config.warmup is not None:
            matrix, source = SuccessorMatrix.load(config.warmup, **load), config.warmup
        if matrix is not None:
            logger.info("Graft: successor matrix from %s (%d rows)", source,
                        int(matrix.touched_rows().numel()))
        else:
            matrix = SuccessorMatrix.empty(vocab_size, config.successor_k, device=device,
                                           backend=config.ops_backend, check=False)
        self.state_keeper: SuccessorStateKeeper | None = None
        if config.successor_state is not None:
            self.state_keeper = SuccessorStateKeeper(
                config.successor_state, lambda: self.matrix, matrix_metadata(vllm_config),
                writer=writer)
        # the worker's heap, handed back now and then (graft.heap_trim_s)
        self.heap_trimmer = HeapTrimmer(config.heap_trim_s)
        # budget "auto": the sizer exists once the runner measured the cost profile
        self.auto_size = config.auto_size and settings.tree_shape is TreeShape.DYNAMIC
        # trees carry their nodes' scores: the sizer's acceptance model tells nodes apart
        # by them, and a calibration's tree records tally them (for fixed budgets too)
        self.tree_builder = GraftTreeBuilder(config, matrix, settings.thresholds, device,
                                             tree_shape=settings.tree_shape,
                                             score_nodes=True)
        # a request's drafter rows in one tree (every step after the root's expands
        # top_k nodes); written to its cache slots after the context where they fit
        # (TreeExpansion's cache mode), which the tree's lookahead (budget slots)
        # guarantees when they are no more than the budget
        self.draft_rows_per_request = config.top_k * (config.max_depth - 1)
        if config.variant.drafts and not config.variant.chains \
                and self.draft_rows_per_request + self.PREFIX_EXTRA > config.budget:
            logger.info("Graft: the drafter's %d tree rows a request exceed the budget "
                        "(%d): where vLLM allocated fewer slots they are kept aside and "
                        "attended with SDPA, not the tree kernel",
                        self.draft_rows_per_request + self.PREFIX_EXTRA, config.budget)
        # which matrix partition each request reads and teaches (graft.isolation)
        matrix_bytes = matrix.partition(0).nbytes
        self.isolation = MatrixPartitions(
            IsolationMode(config.isolation.mode), matrix, config.isolation.max_matrices
            or default_max_matrices(vllm_config.scheduler_config.max_num_seqs, matrix_bytes))
        if self.isolation.max_matrices > 1:
            logger.info("Graft: %d successor matrices (graft.isolation.max_matrices) take "
                        "%.0f MiB on this device", self.isolation.max_matrices,
                        self.isolation.max_matrices * matrix_bytes / 2**20)
        self.tenant_field = config.isolation.tenant_field
        self.pending: dict[str, PendingTree] = {}
        if config.auto_size and not self.auto_size:
            logger.warning("Graft: budget \"auto\" is off: fixed-shape trees always "
                           "hold budget nodes")
        self.sizer: TreeSizer | None = None
        # budget "auto": each step runs the mode measured fastest (set with the sizer);
        # a round's choice travels in its StepProposal
        self.guard: ThroughputGuard | None = None
        # per request, decided once at its first sight (:meth:`admit`): whether the
        # drafter reads its positions at all
        self.drafter_follows: dict[str, bool] = {}
        self.chain_tokens, self.chain_walk = config.chain_tokens, config.chain_walk
        # budget "auto": looks at the batch's copy chains while the guard decodes plainly
        # (set with the guard)
        self.scout: ChainScout | None = None
        # per request, the whole chain of the last chain build (a scout's look or a chain
        # step) until decoding has emitted the positions it proposed
        self.shadows: dict[str, ShadowChain] = {}
        # requests whose last tree was cut to nothing: steps since, while they skip drafting
        self.plain_steps: dict[str, int] = {}
        self.max_model_len = vllm_config.model_config.max_model_len
        self.forward_timer = SpanTimer(device)  # head forwards (for the overhead metrics)
        # on a GPU, the draft loop in CUDA graphs (one per batch size, self-checked)
        self.draft_graphs = draft_graphs.install(self, vllm_config, device)
        # the drafter's catch-up (its forwards included); outside tree steps it serves
        # only trees to come, and budget "auto" charges it to them
        # (StepProposal.tree_preparation)
        self.catch_up_timer = SpanTimer(device)
        # drafter inputs deferred while the throughput guard decodes plainly; the tree
        # step that feeds them carries their cost in the guard's measurement (the
        # switch from a cheaper mode to trees costs that much)
        self.deferred: dict[str, DeferredRows] = {}
        # context retrieval: one index per request over its prompt and output, and,
        # when configured, matches in other requests' outputs (PeerOutputs): those of
        # the running requests that share the request's matrix, and in global mode an
        # index of recent finished outputs
        self.context_config = config.context_settings  # resolved once: read per request, step
        self.uses_context = config.uses_context and self.context_config.max_nodes > 0
        self.context_indexes: dict[str, ContextIndex] = {}
        self.prompt_lengths: dict[str, int] = {}
        self.shared_context = None
        if self.uses_context and self.context_config.cross_request \
                and self.isolation.mode is IsolationMode.GLOBAL:
            context = self.context_config
            self.shared_context = RecentOutputsIndex(
                max_tokens=context.cross_request_tokens, min_ngram=context.min_ngram,
                max_ngram=context.max_ngram)

    @property
    def matrix(self) -> SuccessorMatrix:
        return self.tree_builder.matrix

    def shared_outputs(self, req_ids: list[str]) -> list[PeerOutputs | None]:
        """Per request of ``req_ids`` (partitions assigned), the other requests' outputs
        it may copy from (``graft.context.cross_request``): those of the running
        requests that read its successor matrix, and in global mode the recent finished
        ones; None where there are none."""
        if not (self.uses_context and self.context_config.cross_request):
            return [None] * len(req_ids)
        by_partition: dict[int, list[str]] = {}
        for req_id, partition in self.isolation.partition_of.items():
            if req_id in self.context_indexes:
                by_partition.setdefault(partition, []).append(req_id)
        shared = []
        for req_id in req_ids:
            partition = self.isolation.partition_of.get(req_id)
            peers = [(self.context_indexes[peer], self.prompt_lengths.get(peer, 0))
                     for peer in by_partition.get(partition, ()) if peer != req_id]
            outputs = PeerOutputs(peers, self.shared_context)
            shared.append(outputs if outputs else None)
        return shared

    # ---- vLLM hooks -----------------------------------------------------------------
    def dummy_run(self, num_tokens: int, *args, **kwargs) -> None:
        """One forward is enough to warm the drafter up (vLLM's loops once per draft
        token, 60 times for a 60-node budget)."""
        saved = self.num_speculative_tokens
        self.num_speculative_tokens = 1
        try:
            super().dummy_run(num_tokens, *args, **kwargs)
        finally:
            self.num_speculative_tokens = saved

    def partitions(self, runner, req_ids: list[str]) -> torch.Tensor | None:
        """[B] the successor-matrix partition of each request (assigned at first sight
        from its tenant: the front end wrote it into the tenant field from the source the
        operator chose, ``graft.isolation.tenant_source``); ``None`` while every request
        reads the one matrix."""
        unnamed = self.settings.config.isolation.unnamed
        for req_id in req_ids:
            if req_id not in self.isolation.partition_of:
                extra = runner.requests[req_id].sampling_params.extra_args or {}
                tenant = extra.get(self.tenant_field)
                self.isolation.assign(req_id, None if tenant is None else str(tenant),
                                      unnamed)
        if all(self.isolation.partition_of.get(r) == 0 for r in req_ids):
            return None  # partition 0 is the table's first rows: the plain lookup
        return self.isolation.partitions(req_ids, self.device)

    def request_state_counts(self) -> dict[str, int]:
        """How many requests each per-request table holds (all zero once the batch has
        emptied: a finished, aborted or preempted request leaves nothing behind)."""
        return {"pending_trees": len(self.pending), "plain_steps": len(self.plain_steps),
                "deferred_rows": len(self.deferred),
                "context_indexes": len(self.context_indexes),
                "prompt_lengths": len(self.prompt_lengths),
                "matrix_partitions": len(self.isolation.partition_of),
                "drafter_follows": len(self.drafter_follows),
                "shadow_chains": len(self.shadows),
                "matrix_refusals": self.isolation.refusals}

    def forget(self, req_ids, finished=()) -> None:
        """Drop the state of requests that left the batch; the outputs of ``finished``
        ones feed the cross-request context index when it is on."""
        for req_id in req_ids:
            self.isolation.release(req_id)
            self.pending.pop(req_id, None)
            self.plain_steps.pop(req_id, None)
            self.deferred.pop(req_id, None)
            self.drafter_follows.pop(req_id, None)
            self.shadows.pop(req_id, None)
            index = self.context_indexes.pop(req_id, None)
            prompt_len = self.prompt_lengths.pop(req_id, 0)
            if index is not None and self.shared_context is not None and req_id in finished:
                self.shared_context.add(list(index.tokens[prompt_len:]))

    # ---- one drafting round -----------------------------------------------------------
    @torch.inference_mode()
    def propose_trees(self, runner, scheduler_output, settled: list[SettledRows],
                      aux_hidden_states: list[torch.Tensor], proposal: StepProposal) -> None:
        """Run catch-up and drafting in ``proposal.mode``; the drafts (in persistent-batch
        order), what ran and what was built go into ``proposal``."""
        req_ids = runner.input_batch.req_ids
        drafts: list[list[int]] = [[] for _ in req_ids]
        proposal.drafts = drafts
        if not settled:
            return
        uses_drafter = self.settings.config.variant.drafts  # retrieval_only does not
        drafting = [i for i, s in enumerate(settled) if s.drafts]
        catchup = None
        if uses_drafter:  # only a request about to draft a tree needs its rows fed now
            feeds = proposal.mode is StepMode.TREE
            with self.catch_up_timer.span():
                catchup = self._catch_up(runner, settled, aux_hidden_states,
                                         [feeds and s.drafts for s in settled])
        proposal.ran = proposal.mode if drafting else StepMode.PLAIN
        if not drafting:
            return
        if proposal.mode is StepMode.CHAIN:
            self._propose_chains(runner, settled, drafting, proposal)
            return
        roots = torch.tensor([settled[i].next_tokens[-1] for i in drafting], dtype=torch.long)
        expander = None
        if uses_drafter:
            fed, last_rows, last_hidden, next_hidden = catchup
            index = torch.tensor([fed[i] for i in drafting], dtype=torch.long)
            root_positions = torch.tensor(
                [settled[i].first_position + len(settled[i].rows) for i in drafting])
            batch_rows = torch.tensor([settled[i].batch_row for i in drafting],
                                      dtype=torch.long)
            layout = self._kv_layout(runner)
            manager_tables = self._block_table(runner)[batch_rows.to(self.device)]
            expander = TreeExpansion(
                self, root_logprobs=self._top_k(last_hidden[last_rows[index]]),
                root_hidden=None if next_hidden is None else next_hidden[last_rows[index]],
                root_positions=root_positions,
                block_tables=layout.kernel_block_table(manager_tables),
                slot_tables=manager_tables, kv_layout=layout,
                allocated_slots=layout.allocated_slots(runner, batch_rows.numpy()).tolist())
        context = None
        drafting_ids = [req_ids[settled[i].batch_row] for i in drafting]
        partitions = self.partitions(runner, drafting_ids)
        if self.uses_context:
            config = self.context_config
            indexes = [self._context_index(runner, settled[i]) for i in drafting]
            proposals = [index.propose(
                max_nodes=config.max_nodes, max_depth=config.max_depth,
                max_matches=config.max_matches, shared=shared,
                lead_nodes=config.lead_nodes)
                for index, shared in zip(indexes, self.shared_outputs(drafting_ids))]
            tokens, parents, depths, _ = proposals_to_tensors(
                proposals, config.max_nodes, self.device)
            context = (tokens, parents, depths)
        tree, stats = self.tree_builder.build(roots.to(self.device), expander, context,
                                              partitions)
        if context is not None and self.sizer is not None:  # the acceptance model's input
            tree = self._scored_by_match(tree, [p.match_length for p in proposals])
        if self.sizer is not None:
            tree, proposal.choice = self.sizer.trim(tree)
        # the tree and its build's facts on the host in one copy (the round's one wait
        # for the device; the next build reuses the device buffers); the ranks of a
        # tensor-parallel engine verify one tree
        tree, stats = dataclasses_to_host(tree, stats)
        tree = agree(tree)
        proposal.build = stats
        stages, confidence = stats.stage.tolist(), stats.confidence
        rows = HostRows.of(tree)
        for t, i in enumerate(drafting):
            req_id = req_ids[settled[i].batch_row]
            n = self._schedule(tree, rows, t, req_id, settled[i].batch_row, drafts,
                               stages[t], confidence[t])
            if proposal.choice is not None:
                if n == 1:  # nothing worth verifying: decode plainly for a while
                    self.plain_steps[req_id] = 1
                else:
                    self.plain_steps.pop(req_id, None)

    @staticmethod
    def pass_plainly(req_ids: list[str], proposal: StepProposal) -> None:
        """:meth:`propose_trees` for a plain step when the drafter follows none of the
        step's requests: no drafts, and no drafter input to feed or defer, so the
        step's settled rows are never read."""
        proposal.drafts = [[] for _ in req_ids]

    def _schedule(self, tree, rows: HostRows, t: int, req_id: str, batch_row: int,
                  drafts: list[list[int]], stage: int = -1,
                  confidence: torch.Tensor | None = None, chain: bool = False) -> int:
        """Keep row ``t`` of the (host) ``tree`` for verification and hand its nodes to
        the scheduler as the request's draft tokens; returns its rows (root included).
        ``rows``: the tree's sizes and tokens read once for the whole batch."""
        n = rows.num_nodes[t]
        drafts[batch_row] = rows.tokens[t][1:n]
        self.pending[req_id] = PendingTree(
            tree.tokens[t, :n], tree.parents[t, :n], tree.depths[t, :n], tree.source[t, :n],
            stage, confidence, None if tree.score is None else tree.score[t, :n],
            list(drafts[batch_row]), chain)  # its own list: the scheduler gets the other
        return n

    def _scored_by_match(self, tree, match_lengths: list[int]):
        """``tree`` with its copied nodes scored by their request's context match
        (:func:`vllm_graft.core.context.match_score`), its other nodes keeping the score
        the build gave them, for the sizer's acceptance model."""
        min_ngram = self.context_config.min_ngram
        return tree.with_score(context_scores(tree.source, torch.tensor(
            [match_score(length, min_ngram) for length in match_lengths]), tree.score))

    #: context positions a request's index takes in per step at most: a long prompt is
    #: indexed over several steps (a 128K-token one over 64, each a few ms on a 2-core
    #: CPU, where indexing it at once stalled every stream's step for about 1 s)
    CONTEXT_INDEX_STEP = 2048

    def _context_index(self, runner, settled: SettledRows) -> ContextIndex:
        """The request's context index, holding its context up to the last settled token
        (the source of its copied continuations). The context grows by the positions
        settled since the last call: everything up to this step's first position is
        final in the runner's token table, the rest is ``next_tokens``. The index takes
        in at most :data:`CONTEXT_INDEX_STEP` of the positions not yet indexed per
        step, newest first (:meth:`ContextIndex.catch_up`); until it has caught up it
        proposes from the part indexed (copies are only proposals: verification keeps
        the output plain decoding's). A rewound history is cut back where it still
        agrees with the runner's table, not rebuilt."""
        req_id = runner.input_batch.req_ids[settled.batch_row]
        index = self.context_indexes.get(req_id)
        first, next_tokens = settled.first_position, settled.next_tokens
        if index is not None and len(index) > first + 1:  # asked again, or rewound
            if index.tokens[first] != settled.first_token:
                index = None  # not this history: start again
            elif index.tokens[first + 1:] == next_tokens:
                return index  # this step's positions are in already
            else:
                index.truncate(first + 1)
        if index is None:
            config = self.context_config
            index = ContextIndex(min_ngram=config.min_ngram, max_ngram=config.max_ngram)
            self.context_indexes[req_id] = index
            self.prompt_lengths[req_id] = runner.requests[req_id].num_prompt_tokens
        if len(index) <= first:
            index.append(runner.input_batch.token_ids_cpu[settled.batch_row,
                                                          len(index):first + 1])
        index.append(next_tokens)
        index.catch_up(self.CONTEXT_INDEX_STEP)
        return index
