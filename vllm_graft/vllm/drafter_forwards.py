"""The drafter's forwards: the causal catch-up over the positions the target settled
(with the rows deferred while a request did not draft, :class:`DeferredRows`), and the
tree steps' forwards with tree attention (:class:`TreeExpansion`, the callback of
:class:`vllm_graft.core.graft.GraftTreeBuilder`)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_graft.core.draft_tree import DraftStep
from vllm_graft.core.hybrid import ancestor_ids
from vllm_graft.vllm.draft_records import SettledRows
from vllm_graft.vllm.tree_attention import (KernelBatch, TreeAttentionPlan, TreeKVStore,
                                            TreeRequestPlan, active_plan)


@dataclass
class DeferredRows:
    """Drafter inputs of positions a request settled without drafting (decoded plainly
    or by a copy chain), kept until its next tree feeds them to the drafter in one
    forward.
    Positions are contiguous and increasing (the catch-up attends causally).

    The hidden inputs (the target's hidden rows, not yet projected by the drafter) are
    kept as one chunk per step and joined only when fed: a plain step costs a list
    append, not a copy of everything kept."""

    tokens: list[int]
    positions: list[int]
    chunks: list[torch.Tensor] = field(default_factory=list)  # [n_i, H] per append

    @property
    def hidden(self) -> torch.Tensor | None:
        """``[len(positions), H]``: the kept positions' hidden inputs (None: none)."""
        return torch.cat(self.chunks) if self.chunks else None

    def append(self, tokens: list[int], positions: list[int], hidden: torch.Tensor | None,
               limit: int) -> None:
        """Add one step's rows; a position fed again replaces the earlier copy, a gap
        drops what came before it, and only the last ``limit`` positions stay."""
        start = positions[0]
        keep = bisect.bisect_left(self.positions, start)  # the rows before this step's
        if keep and self.positions[keep - 1] != start - 1:
            keep = 0  # not contiguous: start again from here
        kept = len(self.positions)
        self.tokens = self.tokens[:keep] + tokens
        self.positions = self.positions[:keep] + positions
        if hidden is not None:
            if keep < kept:  # rows replaced or dropped: cut the chunks to the first keep
                self.chunks = _drop_rows(self.chunks, kept - keep, from_end=True)
            self.chunks.append(hidden)
        overflow = len(self.positions) - limit
        if overflow > 0:
            self.tokens, self.positions = self.tokens[overflow:], self.positions[overflow:]
            self.chunks = _drop_rows(self.chunks, overflow, from_end=False)


def _drop_rows(chunks: list[torch.Tensor], rows: int, from_end: bool) -> list[torch.Tensor]:
    """``chunks`` without ``rows`` rows of their concatenation, taken from its end or
    its start; only the chunks that lose rows are touched."""
    chunks, edge = list(chunks), -1 if from_end else 0
    while rows > 0 and chunks:
        size = chunks[edge].shape[0]
        if size <= rows:
            chunks.pop(edge)
        else:
            chunks[edge] = chunks[edge][:size - rows] if from_end else chunks[edge][rows:]
        rows -= size
    return chunks


class DrafterForwards:
    """The catch-up forward of :class:`~vllm_graft.vllm.tree_drafting.GraftTreeDrafting`;
    its subclasses say how their model is fed (``_catch_up_inputs``, ``_forward``,
    ``_top_k``)."""

    @staticmethod
    def _kv_layout(runner):
        return runner._graft_kv_layout

    def _block_table(self, runner) -> torch.Tensor:
        """Manager block ids of the persistent batch (the target's and drafter's group)."""
        return self._kv_layout(runner).block_table(runner)

    #: positions per request whose drafter inputs wait while it does not draft;
    #: older ones are dropped (the drafter's cache keeps stale entries there, which can
    #: only cost acceptance, never correctness)
    MAX_DEFERRED = 64

    def _target_rows(self, settled: list[SettledRows], indices: list[int],
                     aux_hidden_states: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The target's hidden rows of the ``settled`` requests at ``indices``, copied
        into one tensor and split per request."""
        if not indices:
            return {}
        rows = torch.tensor([r for i in indices for r in settled[i].rows],
                            dtype=torch.long, device=self.device)
        target_hidden = torch.cat([h[rows] for h in aux_hidden_states], dim=-1) \
            if self.eagle3_use_aux_hidden_state else aux_hidden_states[-1][rows]
        return dict(zip(indices, target_hidden.split([len(settled[i].rows)
                                                      for i in indices])))

    def _catch_up(self, runner, settled: list[SettledRows],
                  aux_hidden_states: list[torch.Tensor], feeds: list[bool]):
        """Causal drafter forward over the settled positions of the requests that
        ``feeds`` names (each with the rows kept for it since its last feed) and over
        prefill chunks; the decode rows of every other request are kept for later
        (:class:`DeferredRows`): a request decoded plainly, or by a copy chain, costs no
        drafter forward. Returns None when nothing was fed, else (the catch-up batch
        index of each fed request by its index in ``settled``, last row of each fed
        request in the catch-up batch, hidden for logits, hidden for the next step)."""
        req_ids = runner.input_batch.req_ids
        followed = [i for i, s in enumerate(settled)
                    if self.follows(runner.requests[req_ids[s.batch_row]])]
        per_request = {i: self._catch_up_inputs(settled[i]) for i in followed}
        hidden_rows: dict[int, torch.Tensor | None] = dict.fromkeys(followed)
        if self.USES_HIDDEN and followed:
            # the target's rows as they are (a copy: vLLM reuses its buffers); the
            # drafter's projection of them runs when they are fed (:meth:`_feed`), so a
            # row deferred by a plain or chain step costs no matrix product. Rows to be
            # kept get a copy of their own: kept as views of the step's copy, a
            # request's one row would hold every prompt chunk fed beside it in memory
            # for as long as the request keeps its rows (up to MAX_DEFERRED steps)
            kept = [i for i in followed if not feeds[i] and settled[i].decoding]
            fed = [i for i in followed if feeds[i] or not settled[i].decoding]
            for group in (kept, fed):
                hidden_rows.update(self._target_rows(settled, group, aux_hidden_states))
        now: list[tuple[int, tuple]] = []  # (index in settled, rows fed now)
        for i in followed:
            s, (tokens, positions), hidden = settled[i], per_request[i], hidden_rows[i]
            req_id = req_ids[s.batch_row]
            if feeds[i]:
                entry = self.deferred.pop(req_id, None)
                if entry is not None:
                    entry.append(tokens, positions, hidden, self.MAX_DEFERRED + len(positions))
                    tokens, positions, hidden = entry.tokens, entry.positions, entry.hidden
                now.append((i, (tokens, positions, hidden)))
            elif s.decoding:  # a decode step, its chain's accepted rows too: wait for the
                # request's next tree
                self.deferred.setdefault(req_id, DeferredRows([], [])).append(
                    tokens, positions, hidden, self.MAX_DEFERRED)
            else:  # a prefill chunk is fed at once: the prompt's drafter KV stays whole
                now.append((i, (tokens, positions, hidden)))
        if not now:
            return None
        fed = {i: k for k, (i, _) in enumerate(now)}
        return (fed, *self._feed(runner, [settled[i] for i, _ in now], [x for _, x in now]))

    def _feed(self, runner, settled: list[SettledRows], inputs: list[tuple]):
        """One drafter forward over each request's (tokens, positions, hidden) rows."""
        per_request = [(tokens, positions) for tokens, positions, _ in inputs]
        counts = np.array([len(tokens) for tokens, _ in per_request], dtype=np.int32)
        input_ids = torch.tensor([t for tokens, _ in per_request for t in tokens],
                                 dtype=torch.int32, device=self.device)
        positions = torch.tensor([p for _, pos in per_request for p in pos],
                                 dtype=torch.long, device=self.device)
        hidden = None
        if self.USES_HIDDEN:
            hidden = self.model.combine_hidden_states(torch.cat([h for _, _, h in inputs]))

        batch_rows = torch.tensor([s.batch_row for s in settled], dtype=torch.long)
        block_table = self._block_table(runner)[batch_rows.to(self.device)]
        req_of_row = torch.from_numpy(np.repeat(np.arange(len(settled)), counts)).to(self.device)
        slot_mapping = self._kv_layout(runner).slots(
            block_table[req_of_row], positions.unsqueeze(-1)).squeeze(-1)
        query_start = np.zeros(len(settled) + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start[1:])
        seq_lens = np.array([pos[-1] + 1 for _, pos in per_request], dtype=np.int32)
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(query_start).to(self.device),
            query_start_loc_cpu=torch.from_numpy(query_start),
            seq_lens=torch.from_numpy(seq_lens).to(self.device),
            num_reqs=len(settled),
            num_actual_tokens=int(counts.sum()),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
            causal=True,
            positions=positions,
            seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens),
        )
        metadata = {}
        for group in self.draft_attn_groups:
            built = group.build_metadata_for_drafting(common, draft_index=0)
            for name in group.layer_names:
                metadata[name] = built
        with self.forward_timer.span(), set_forward_context(
                metadata, self.vllm_config, num_tokens=int(counts.sum()),
                slot_mapping={name: slot_mapping for name in self._draft_attn_layer_names}):
            last_hidden, next_hidden = self._forward(input_ids, positions, hidden)
        last_rows = torch.from_numpy(query_start[1:].astype(np.int64) - 1).to(self.device)
        return last_rows, last_hidden, next_hidden

    def _top_k_of_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits.float().log_softmax(dim=-1).topk(self.settings.config.draft_top_k,
                                                        dim=-1)


class TreeExpansion:
    """The drafter callback of :class:`GraftTreeBuilder` for one round (see module doc).

    Keeps, for every expanded node (a pool slot), its row among the request's tree rows
    and (EAGLE) its pre-norm output, which its children take as their hidden input.

    Where each request's draft rows fit in the KV slots vLLM allocated to it beyond its
    context (the tree's lookahead; :meth:`fits_in_cache`), a step's
    rows are written to the drafter's paged cache right after the request's prefix, step
    after step (*cache mode*): later steps read them there like the prefix, every tensor
    of a step has a fixed shape, and on a GPU the Triton tree kernel serves the drafter's
    forwards. The target's cache is untouched (the drafter's layers have their own), and
    the positions written are the ones the target's next tree verification writes in its
    layers; what is left there is rewritten by the catch-up before any later forward
    reads it as context. Otherwise the rows are kept aside in a :class:`TreeKVStore`
    (*store mode*, the SDPA path).
    """

    #: cache mode where the rows fit (tests switch it off to compare the two modes)
    ROWS_IN_CACHE = True

    def __init__(self, proposer: DrafterForwards, *, root_logprobs, root_hidden,
                 root_positions: torch.Tensor, block_tables: torch.Tensor,
                 slot_tables: torch.Tensor | None = None, kv_layout=None,
                 allocated_slots: list[int] | None = None):
        self.proposer = proposer
        self.root_logprobs = root_logprobs  # ([D, top_k], [D, top_k])
        self.root_hidden = root_hidden  # [D, H], None for drafters without hidden input
        self.root_positions = root_positions.to(proposer.device)  # [D]
        self.root_positions_host = root_positions.tolist()  # read per request, no sync
        self.prefix_lens = self.root_positions + proposer.PREFIX_EXTRA  # [D]
        self.prefix_lens_host = [p + proposer.PREFIX_EXTRA for p in self.root_positions_host]
        self.block_tables = block_tables  # [D, max_blocks] kernel-block ids
        # manager-block ids ([D, max_blocks]) when the rows go to the cache, else None,
        # and the :class:`~vllm_graft.vllm.kv_blocks.PagedKVLayout` that makes slots of
        # them; ``allocated_slots`` (per request, None: known to fit) decides
        in_cache = slot_tables is not None and self.ROWS_IN_CACHE and (
            allocated_slots is None or self.fits_in_cache(
                self.prefix_lens_host, proposer.draft_rows_per_request, allocated_slots))
        self.slot_tables = slot_tables if in_cache else None
        self.kv_layout = kv_layout
        self.reset()

    def reset(self) -> None:
        """Forget the round's draft steps (a captured loop starts each replay afresh)."""
        self.store = TreeKVStore() if self.slot_tables is None else None
        self.hidden_rows: list[torch.Tensor] = []  # pre-norm outputs, in row order
        self.rows_so_far = 0  # rows of every forward so far (the hidden rows' numbering)
        self.sdpa_layers = 0  # drafter layers whose tree rows took the SDPA path
        self.row_of_slot: torch.Tensor | None = None  # [D, pool] row or -1
        self.expanded: list[torch.Tensor] = []  # per step: [D, W] expanded slots

    @staticmethod
    def fits_in_cache(prefix_lens: list[int], rows: int, allocated: list[int]) -> bool:
        """Whether ``rows`` draft rows after each request's prefix stay inside the slots
        allocated to it (``allocated``: its block table's blocks times the block size)."""
        return all(prefix + rows <= slots for prefix, slots in zip(prefix_lens, allocated))

    def __call__(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        if step.step == 0:
            values, ids = self.root_logprobs
            return values[step.active].unsqueeze(1), ids[step.active].unsqueeze(1)
        return self._expand(step)

    def _visible_earlier(self, step: DraftStep, active: torch.Tensor,
                         earlier: torch.Tensor) -> torch.Tensor:
        """``[A, W, C]``: which of the request's ``C`` earlier tree rows (``earlier``
        ``[A, C]``: the slots the earlier steps expanded, step after step) each node of
        this step sees: its ancestors. Nodes expanded at step ``s`` sit at depth ``s``,
        so the ancestor walk needs no read of the device."""
        slots = step.node_ids
        ancestors = ancestor_ids(step.pool.parents[active], slots, step.step)  # [A, W, s]
        same = ancestors.unsqueeze(-1) == earlier[:, None, None, :]  # [A, W, s, C]
        return same.any(dim=2) & (earlier >= 0).unsqueeze(1)

    def _expand(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        proposer = self.proposer
        device = proposer.device
        active, slots = step.active, step.node_ids  # [A], [A, W]
        num_active, width = slots.shape
        pool = step.pool
        if self.row_of_slot is None:
            self.row_of_slot = torch.full(pool.tokens.shape, -1, dtype=torch.long, device=device)
        parents = pool.parents[active].gather(1, slots)  # [A, W]
        depths = pool.depths[active].gather(1, slots)
        tokens = step.tokens.clamp(min=0)
        positions = (self.root_positions[active].unsqueeze(1) + depths
                     + proposer.EXPANSION_OFFSET).reshape(-1)

        hidden = None
        if self.root_hidden is not None:
            # hidden input: the pre-norm output of the row that proposed each node
            hidden = self.root_hidden[active].unsqueeze(1).expand(-1, width, -1)
            if self.hidden_rows:
                parent_rows = torch.where(
                    parents >= 0, self.row_of_slot[active].gather(1, parents.clamp(min=0)), -1)
                all_hidden = torch.cat(self.hidden_rows)
                from_parent = all_hidden[parent_rows.clamp(min=0)]  # [A, W, H]
                hidden = torch.where((parent_rows >= 0).unsqueeze(-1), from_parent, hidden)
            hidden = hidden.reshape(num_active * width, -1)

        earlier = width * (step.step - 1)  # each request's rows of the earlier steps
        earlier_slots = torch.cat(self.expanded, dim=1)[active] if self.expanded \
            else torch.empty((num_active, 0), dtype=torch.long, device=device)  # [A, C]
        visible = self._visible_earlier(step, active, earlier_slots) if self.expanded \
            else earlier_slots.new_zeros((num_active, width, 0), dtype=torch.bool)
        eye = torch.eye(width, dtype=torch.bool, device=device).expand(num_active, -1, -1)
        mask = torch.cat([visible, eye], dim=2)  # [A, W, C + W]
        # the full batch needs no read of the device (the fused build's wait-free path)
        requests = range(num_active) if num_active == len(self.root_positions_host) \
            else active.tolist()
        first_row = self.rows_so_far
        if self.store is None:  # cache mode: the earlier rows in the cache after the prefix
            where = [{"cached_tree_rows": earlier}] * num_active
        else:  # store mode: the earlier rows by their rows in the store
            context_rows = self.row_of_slot[active].gather(1, earlier_slots.clamp(min=0))
            where = [{"context_rows": rows} for rows in context_rows]
        plan = TreeAttentionPlan(
            requests=[TreeRequestPlan(query_start=a * width, num_rows=width,
                                      prefix_len=self.prefix_lens_host[b],
                                      block_table=self.block_tables[b], mask=mask[a],
                                      **where[a]) for a, b in enumerate(requests)],
            replace_all=True)
        if self.store is None:
            cache_positions = (self.prefix_lens[active].unsqueeze(1) + earlier
                               + torch.arange(width, device=device))
            plan.write_slots = self.kv_layout.slots(self.slot_tables[active],
                                                    cache_positions).reshape(-1)
            if device.type == "cuda":
                plan.kernel_batch = KernelBatch.uniform(self.block_tables[active],
                                                        self.prefix_lens[active], mask)
        else:
            plan.store = self.store
            plan.store_rows = torch.arange(num_active * width, device=device)
        with proposer.forward_timer.span(), active_plan(plan), set_forward_context(
                {name: None for name in proposer._draft_attn_layer_names},
                proposer.vllm_config, num_tokens=num_active * width, slot_mapping={}):
            last_hidden, next_hidden = proposer._forward(
                tokens.reshape(-1).to(torch.int32), positions, hidden)
        self.rows_so_far += num_active * width
        self.sdpa_layers += plan.sdpa_layers
        if self.store is not None:
            self.store.num_rows = self.rows_so_far
        if next_hidden is not None:
            self.hidden_rows.append(next_hidden)
        new_rows = torch.arange(first_row, first_row + num_active * width,
                                device=device).view(num_active, width)
        self.row_of_slot[active.unsqueeze(1), slots] = new_rows
        expanded = torch.full((self.row_of_slot.shape[0], width), -1, dtype=torch.long,
                              device=device)
        expanded[active] = slots
        self.expanded.append(expanded)
        values, ids = proposer._top_k(last_hidden)
        k = values.shape[-1]
        return values.view(num_active, width, k), ids.view(num_active, width, k)
