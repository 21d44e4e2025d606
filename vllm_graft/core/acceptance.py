"""Lossless acceptance of a verified token tree, batched over requests.

Every Graft candidate is a deterministic proposal (a top-k draft or a matrix lookup),
so each child has a one-hot proposal distribution. Walking from the root:

* greedy (temperature 0): follow the child whose token is the target's argmax; when
  none matches, emit the argmax as the bonus token and stop.
* sampling: with ``r`` the target distribution at the current node after temperature,
  top-k and top-p, try the distinct children in row order; accept child ``x`` with
  probability ``r(x) / sum(r)``, otherwise set ``r(x) = 0`` and try the next; when all
  are rejected, emit a sample of the renormalised residual ``r`` and stop.

This is SpecInfer's multi-draft rule with one-hot proposals: the emitted token at each
node is distributed exactly as ``r`` (child ``j`` is accepted with probability
``r(x_j)`` overall, and the residual carries the remaining mass), so the output has the
distribution of plain sampling. Children and their order are fixed before the target
pass, as the rule requires.

Because the emitted token at every node is a sample of ``r``, the same walk can also be
driven by an engine's own sampler (:func:`walk_tree` with a ``LevelSampler``): sample
from ``r`` at the current node, accept the child that carries the sample. The vLLM
adapter does that, so every sampling feature and the seeded random streams behave
exactly as in plain decoding.

Greedy requests need only the target's argmax at every tree row: :func:`greedy_walk`
walks the whole batch from those tokens with a fixed number of tensor operations per
level (no host reads), and the argmax comes from the same one-pass top-k that teaches
the successor matrix (:func:`vllm_graft.ops.logits_topk`, whose column 0 is exactly
``argmax``), so a greedy verification reads the vocabulary once per row.

Random numbers come from per-request generators when a request has one (seeded
requests), otherwise from the default generator; a fixed count is drawn per level so
a seeded request's stream does not depend on the other requests in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from vllm_graft.core.hybrid import HybridTree


@dataclass
class SamplingBatch:
    """Per-request sampling settings. temperature 0 = greedy; top_k <= 0 or >= vocab
    and top_p >= 1 switch those filters off. ``generators`` maps a batch index to its
    own generator (seeded requests)."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor | None = None  # [B] int64
    top_p: torch.Tensor | None = None  # [B] float32
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    @classmethod
    def greedy(cls, batch: int, device: torch.device | str = "cpu") -> SamplingBatch:
        return cls(temperature=torch.zeros(batch, device=device))

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature <= 0


@dataclass
class AcceptanceResult:
    """accepted_rows: [B, D] tree rows of the accepted drafts in path order, -1 padded
    output_tokens: [B, D+1] accepted draft tokens followed by the bonus token, -1 padded
    num_accepted:  [B] accepted drafts (the bonus token not counted)"""

    accepted_rows: torch.Tensor
    output_tokens: torch.Tensor
    num_accepted: torch.Tensor


#: ``probs_fn(logits [A, V], rows [A]) -> probs [A, V]``: the target distribution used
#: for sampling, for the requests at batch indices ``rows``. Must be the distribution
#: plain decoding samples from (the vLLM adapter passes vLLM's own processing).
ProbsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor,
                   top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then softmax: vLLM's sampler semantics
    (top-k keeps ties with the k-th value; top-p keeps the smallest high-probability set
    whose mass reaches p, at least one token)."""
    logits = logits.float() / temperature.float().clamp(min=1e-6).unsqueeze(1)
    vocab = logits.shape[1]
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k <= 0) | (k > vocab), vocab, k)
        if bool((k < vocab).any()):
            kth = logits.topk(int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=1, descending=False)
        cumulative = sorted_logits.softmax(dim=1).cumsum(dim=1)
        drop = cumulative <= (1 - top_p.float()).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(dim=1)


def _uniforms(rows: torch.Tensor, count: int, params: SamplingBatch,
              device: torch.device) -> torch.Tensor:
    """[len(rows), count] uniforms; rows with their own generator draw from it."""
    out = torch.rand((rows.numel(), count), device=device)
    if params.generators:
        for i, row in enumerate(rows.tolist()):
            gen = params.generators.get(row)
            if gen is not None:
                out[i] = torch.rand(count, generator=gen, device=gen.device).to(device)
    return out


#: ``sample_level(step, rows, current) -> tokens``: the token emitted at tree row
#: ``current[i]`` of request ``rows[i]`` (rows = the requests still walking). It must be
#: a sample of the target distribution at that node (its argmax for greedy requests).
LevelSampler = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def walk_tree(tree: HybridTree, sample_level: LevelSampler) -> AcceptanceResult:
    """The tree walk shared by every acceptance rule.

    At each level every walking request emits one token (``sample_level``); if a child
    of its current node carries that token (siblings are distinct, so at most one), the
    child is accepted and the walk goes on from it, otherwise the emitted token is the
    bonus token and the request stops. With one-hot proposals this *is* the multi-draft
    rule: a child is accepted exactly when the target's own sample equals it.
    """
    batch, rows = tree.tokens.shape
    device = tree.tokens.device
    max_steps = tree.max_depth + 1
    accepted_rows = torch.full((batch, max_steps), -1, dtype=torch.long, device=device)
    output = torch.full((batch, max_steps), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    current = torch.zeros(batch, dtype=torch.long, device=device)
    batch_index = torch.arange(batch, device=device)
    live = torch.ones(batch, dtype=torch.bool, device=device)

    for step in range(max_steps):
        idx = batch_index[live]
        if idx.numel() == 0:
            break
        cur = current[idx]
        emitted = sample_level(step, idx, cur).to(device).long()
        match = (tree.parents[idx] == cur[:, None]) & tree.valid[idx] \
            & (tree.tokens[idx] == emitted[:, None])  # [A, N+1]
        hit = match.any(1)
        chosen = match.to(torch.uint8).argmax(1)
        output[idx, step] = emitted
        accepted_rows[idx[hit], step] = chosen[hit]
        num_accepted[idx[hit]] += 1
        current[idx[hit]] = chosen[hit]
        live[idx[~hit]] = False
    return AcceptanceResult(accepted_rows[:, :max_steps - 1].contiguous(), output, num_accepted)


def _check_row_tokens(tree: HybridTree, row_tokens: torch.Tensor) -> None:
    """``row_tokens`` must have the tree's ``[B, N+1]`` shape."""
    if row_tokens.shape != tree.tokens.shape:
        raise ValueError(f"row_tokens has shape {tuple(row_tokens.shape)}, tree "
                         f"{tuple(tree.tokens.shape)}")


def greedy_walk(tree: HybridTree, row_tokens: torch.Tensor,
                max_depth: int | None = None) -> AcceptanceResult:
    """:func:`walk_tree` for a batch of greedy requests, given the target's choice at
    every row: ``row_tokens`` [B, N+1] (the argmax at each row; anything at rows the
    walk cannot reach). Every level is the same few batched operations whatever the
    batch, with no host read on a GPU (the CPU stops once every request has stopped).
    ``max_depth``: a bound on the tree's depth that the caller knows (the walk then
    takes ``max_depth + 1`` levels and never reads the tree's depth: a wait for the host
    on a GPU); the result has that many columns."""
    _check_row_tokens(tree, row_tokens)
    batch = tree.tokens.shape[0]
    device = tree.tokens.device
    if max_depth is not None and device.type == "cpu" and tree.max_depth > max_depth:
        raise ValueError(f"greedy_walk: the tree is {tree.max_depth} deep, past its bound "
                         f"{max_depth}")  # checked where reading the depth costs no wait
    max_steps = (tree.max_depth if max_depth is None else max_depth) + 1
    row_tokens = row_tokens.to(device).long()
    accepted_rows = torch.full((batch, max_steps), -1, dtype=torch.long, device=device)
    output = torch.full((batch, max_steps), -1, dtype=torch.long, device=device)
    current = torch.zeros(batch, dtype=torch.long, device=device)
    live = torch.ones(batch, dtype=torch.bool, device=device)
    candidates = tree.valid & (tree.parents >= 0)
    for step in range(max_steps):
        emitted = row_tokens.gather(1, current.unsqueeze(1)).squeeze(1)
        match = candidates & (tree.parents == current.unsqueeze(1)) \
            & (tree.tokens == emitted.unsqueeze(1))
        hit = match.any(1) & live
        chosen = match.to(torch.uint8).argmax(1)
        output[:, step] = torch.where(live, emitted, -1)
        accepted_rows[:, step] = torch.where(hit, chosen, -1)
        current = torch.where(hit, chosen, current)
        live = hit
        if device.type == "cpu" and not bool(live.any()):
            break
    num_accepted = (accepted_rows >= 0).sum(1)
    return AcceptanceResult(accepted_rows[:, :max_steps - 1].contiguous(), output, num_accepted)


def greedy_chain_walk(tree: HybridTree, row_tokens: torch.Tensor) -> AcceptanceResult:
    """:func:`greedy_walk` for chains (row ``j``'s parent is row ``j - 1``, the valid rows
    a prefix; a bare root is a chain): a chain is accepted up to its first node that is
    not the target's choice at the row before it, a running product over the rows
    instead of one pass per level."""
    _check_row_tokens(tree, row_tokens)
    device = tree.tokens.device
    steps = tree.max_depth + 1
    row_tokens = row_tokens.to(device).long()[:, :steps]
    match = (tree.tokens[:, 1:steps] == row_tokens[:, :steps - 1]) & tree.valid[:, 1:steps]
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    positions = torch.arange(steps, device=device)
    accepted = num_accepted.unsqueeze(1)
    output = torch.where(positions <= accepted, row_tokens, -1)
    accepted_rows = torch.where(positions[:-1] < accepted, positions[1:], -1)
    return AcceptanceResult(accepted_rows, output, num_accepted)


def greedy_chain_walk_lists(drafts: list[list[int]], row_tokens: list[int]) -> list[int]:
    """:func:`greedy_chain_walk` on host lists, for a batch laid out as vLLM lays out a
    speculative step's logits: request ``b`` has rows for its root and each of its
    ``drafts[b]`` (an empty list: the root alone), one after another, and ``row_tokens``
    holds the target's choice at every row. Returns how many drafts of each request
    were accepted: up to its first draft that is not the choice at the row before it."""
    accepted, first = [], 0
    for proposed in drafts:
        count = 0
        while count < len(proposed) and proposed[count] == row_tokens[first + count]:
            count += 1
        accepted.append(count)
        first += len(proposed) + 1
    return accepted


def accept_tree(tree: HybridTree, target_logits: torch.Tensor, params: SamplingBatch,
                probs_fn: ProbsFn | None = None,
                argmax_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                row_tokens: torch.Tensor | None = None,
                uniforms: torch.Tensor | None = None) -> AcceptanceResult:
    """Walk every request's tree with the explicit rule of the module docstring.

    target_logits: [B, N+1, V], row i = target logits after the path to tree row i.
    probs_fn / argmax_fn: how plain decoding turns logits into a distribution / a greedy
    token (defaults: :func:`sampling_probs`, ``argmax``).
    row_tokens: [B, N+1] the target's argmax at every valid row, when the caller has it
    (column 0 of :func:`vllm_graft.ops.logits_topk`); an all-greedy batch without an
    ``argmax_fn`` then walks with :func:`greedy_walk` and reads no logits here.
    uniforms: [B, levels, N+2] the random numbers of every request's walk, drawn before
    it (level ``l`` of request ``b`` uses ``uniforms[b, l]``: one per row, then the
    residual's), as the fused acceptance takes them; default: drawn level by level.
    """
    batch, rows, _ = target_logits.shape
    if tree.tokens.shape != (batch, rows):
        raise ValueError(f"tree has shape {tuple(tree.tokens.shape)}, logits {batch}x{rows}")
    if argmax_fn is None and bool(params.is_greedy.all()):
        if row_tokens is None:
            row_tokens = tree_row_topk(tree, target_logits, 1)[..., 0]
        return greedy_walk(tree, row_tokens)
    if probs_fn is None:
        def probs_fn(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            return sampling_probs(
                logits, params.temperature[idx],
                None if params.top_k is None else params.top_k[idx],
                None if params.top_p is None else params.top_p[idx])
    greedy = params.is_greedy.to(target_logits.device)

    def explicit_rule(step: int, idx: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        logits = target_logits[idx, cur]  # [A, V]
        emitted = torch.empty_like(cur)
        g = greedy[idx]
        if bool(g.any()):
            emitted[g] = argmax_fn(logits[g]) if argmax_fn is not None \
                else logits[g].argmax(dim=1)
        s = ~g
        if bool(s.any()):
            children = (tree.parents[idx[s]] == cur[s, None]) & tree.valid[idx[s]]
            child_tokens = tree.tokens[idx[s]].clamp(min=0)
            drawn = () if uniforms is None else (uniforms[idx[s], step, :rows + 1],)
            chosen, residual = _sample_level(probs_fn(logits[s], idx[s]), children,
                                             child_tokens, idx[s], params, *drawn)
            emitted[s] = torch.where(
                chosen >= 0, child_tokens.gather(1, chosen.clamp(min=0).unsqueeze(1)).squeeze(1),
                residual)
        return emitted

    return walk_tree(tree, explicit_rule)


def tree_row_topk(tree: HybridTree, target_logits: torch.Tensor, k: int,
                  backend: str = "compiled") -> torch.Tensor:
    """[B, N+1, k] the target's top-k token ids at every valid tree row, best first
    (column 0 is the row's argmax), -1 at invalid rows; one pass over each valid row's
    logits (:func:`vllm_graft.ops.logits_topk`, or its torch reference)."""
    batch, rows, vocab = target_logits.shape
    flat = target_logits.reshape(batch * rows, vocab)
    index = torch.arange(batch * rows, device=flat.device).view(batch, rows)
    index = torch.where(tree.valid.to(flat.device), index, -1).reshape(-1)
    if backend == "compiled":
        from vllm_graft.ops import logits_topk

        top = logits_topk(flat, k, index, check=False)
    else:
        from vllm_graft.ops_reference import reference_logits_topk

        top = reference_logits_topk(flat, k, index)
    return top.view(batch, rows, k)


def _sample_level(probs: torch.Tensor, children: torch.Tensor, child_tokens: torch.Tensor,
                  rows: torch.Tensor, params: SamplingBatch,
                  uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One level of the multi-draft rule for A sampled requests.

    probs [A, V]; children [A, N+1] bool (which rows are children of the current node;
    their tokens are distinct); returns (accepted child row or -1, residual sample).

    The mass left before child j is computed from the remaining side (residual mass plus
    the children from j on) in float64, so when the children cover all of ``r`` the last
    one is accepted with probability exactly 1 and the residual is never empty.
    """
    width = children.shape[1]
    probs = probs.double()
    is_child_token = torch.zeros(probs.shape, dtype=torch.uint8, device=probs.device)
    is_child_token.scatter_reduce_(1, child_tokens, children.to(torch.uint8), "amax")
    residual = probs.masked_fill(is_child_token.bool(), 0.0)
    residual_mass = residual.sum(1, keepdim=True)
    r_child = probs.gather(1, child_tokens) * children  # r(x_j); 0 for non-children
    mass_from_j = residual_mass + r_child.flip(1).cumsum(1).flip(1)
    accept_prob = torch.where(children, r_child / mass_from_j.clamp(min=1e-300), 0.0)

    u = (_uniforms(rows, width + 1, params, probs.device) if uniforms is None
         else uniforms.to(probs.device)).double()
    accepted = (u[:, :width] < accept_prob) & children
    chosen = torch.where(accepted.any(1), accepted.to(torch.uint8).argmax(1), -1)

    cdf = residual.cumsum(1)
    sample = torch.searchsorted(cdf, u[:, width:] * residual_mass, right=True).squeeze(1)
    return chosen, sample.clamp(max=probs.shape[1] - 1)
