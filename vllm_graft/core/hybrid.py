"""Trie-merge drafted and retrieved subtrees and flatten the result for verification.

All subtrees hang from the same root (the last accepted token). Candidates are laid
out in priority order: root, then each part in the caller's order (in a Graft tree:
context-copied nodes, draft nodes best score first, retrieved nodes in template
order). A candidate is a duplicate of an earlier one when both have the same token
under the same (canonical) parent; duplicates merge into the earliest copy, so
siblings are distinct tokens and a retrieved token that equals a drafted sibling adds
nothing but a "both" source tag. The first ``budget`` distinct candidates are kept.

Every step is a tensor operation over the batch; the only loop runs over tree depth.
Priority order is parents-first and a kept node's canonical parent always precedes it,
so the kept set is prefix-closed and the flattened order is parents-first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

SOURCE_ROOT = 0
SOURCE_DRAFT = 1
SOURCE_RETRIEVED = 2
SOURCE_BOTH = SOURCE_DRAFT | SOURCE_RETRIEVED
#: Padding of a fixed-shape tree (:func:`pad_to_budget`): a valid node no drafter or
#: retrieval proposed; the successor matrix does not learn from it.
SOURCE_PAD = 4
#: Copied from the request's own context (prompt lookup, :mod:`vllm_graft.core.context`);
#: combines with the other bits when sources propose the same node.
SOURCE_CONTEXT = 8
#: the score (:attr:`HybridTree.score`) of a node nothing more is known of than its
#: source and depth
UNKNOWN_SCORE = 0.5


@dataclass
class HybridTree:
    """A flattened tree per request, row 0 = the root, padded to ``budget + 1`` rows.

    tokens:   [B, N+1] int64, -1 in padding rows
    parents:  [B, N+1] int64 row of the parent, -1 for the root and padding
    depths:   [B, N+1] int64, root 0
    valid:    [B, N+1] bool
    source:   [B, N+1] uint8, SOURCE_* bit flags (root 0)
    num_nodes: [B] valid rows, the root included
    score:    [B, N+1] float, optional: what was known of each node when the tree was
              built, in [0, 1] (the acceptance model's score, for example how long a
              context match was; :class:`vllm_graft.core.budget.AcceptanceModel`);
              None: nothing known beyond source and depth
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    source: torch.Tensor
    num_nodes: torch.Tensor
    score: torch.Tensor | None = None

    @property
    def ancestor(self) -> torch.Tensor:
        """``[B, N+1, N+1]`` bool, ``ancestor[b, i, j]``: row ``j`` is row ``i`` or one of
        its ancestors (the tree attention mask among tree rows). Computed when read:
        verification builds each step's mask from the parents of the rows it really
        verifies, so no step pays for this one."""
        depth = int(self.depths.max()) if self.depths.numel() else 0
        return ancestor_mask(self.parents, self.valid, depth)

    def to(self, device: torch.device | str) -> HybridTree:
        """The same tree with every tensor on ``device``."""
        return HybridTree(**{f.name: None if getattr(self, f.name) is None
                             else getattr(self, f.name).to(device) for f in fields(self)})

    def with_score(self, score: torch.Tensor | None) -> HybridTree:
        """The same tree carrying ``score`` (``[B, N+1]``, see the class doc)."""
        if score is not None and score.shape != self.tokens.shape:
            raise ValueError(f"a tree score needs the shape of its tokens "
                             f"{tuple(self.tokens.shape)}, got {tuple(score.shape)}")
        return replace(self, score=score)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.depths.numel() else 0


def merge_and_flatten(root_tokens: torch.Tensor, parts: list[tuple], budget: int,
                      max_depth: int | None = None) -> HybridTree:
    """Merge candidate subtrees into one tree of at most ``budget`` nodes (+ root).

    root_tokens: [B]
    parts: in priority order, each ``(tokens [B, n], parents [B, n], depths [B, n],
           source_flag)`` or with a fifth item, the nodes' scores ``[B, n]`` in [0, 1]
           (:attr:`HybridTree.score`); ``parents`` index into that part (-1 = the
           root); a token -1 marks an invalid candidate, which invalidates its
           descendants too. When any part is scored, the tree is: a node proposed by
           several parts keeps the highest score, a node of an unscored part
           :data:`UNKNOWN_SCORE`.
    max_depth: a bound on the parts' depths that the caller knows. Without it the merge
           reads the deepest from the device (a wait for the host on a GPU); with it
           the merge's ops and shapes are fixed, which ``torch.compile`` can capture
           whole. A bound above the real depth costs one pass per extra level.
    """
    batch = root_tokens.shape[0]
    device = root_tokens.device
    tokens = [root_tokens.long().view(batch, 1)]
    parents = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    depths = [torch.zeros((batch, 1), dtype=torch.long, device=device)]
    # each candidate's source as the index of its part's flag among the parts' distinct
    # flags (the root's own entry is overwritten at the end)
    flags = list(dict.fromkeys(part[3] for part in parts))
    planes = [torch.zeros((batch, 1), dtype=torch.long, device=device)]
    scored = any(len(part) > 4 and part[4] is not None for part in parts)
    scores = [torch.zeros((batch, 1), device=device)]
    offset = 1
    for part_tokens, part_parents, part_depths, flag, *part_score in parts:
        if scored:
            scores.append(part_score[0].float() if part_score and part_score[0] is not None
                          else torch.full(part_tokens.shape, UNKNOWN_SCORE, device=device))
        tokens.append(part_tokens.long())
        parents.append(torch.where(part_parents >= 0, part_parents + offset, 0))
        depths.append(part_depths.long())
        planes.append(torch.full_like(part_tokens, flags.index(flag), dtype=torch.long))
        offset += part_tokens.shape[1]
    tokens, parents = torch.cat(tokens, 1), torch.cat(parents, 1)
    depths, plane = torch.cat(depths, 1), torch.cat(planes, 1)
    parents[:, 0] = 0  # the root is its own parent while canonicalising
    n = tokens.shape[1]
    index = torch.arange(n, device=device)

    # Validity flows down the tree: a candidate needs a valid token and a valid parent.
    valid = tokens >= 0
    if max_depth is None:
        max_depth = int(depths.max()) if depths.numel() else 0
    for _ in range(max_depth):
        valid = valid & valid.gather(1, parents)

    # canon[b, i]: earliest candidate equal to i (same token at the same depth under the
    # same canonical parent). Each pass recomputes every row from its parent's canon of
    # the pass before, so after pass d every row at depth <= d is final; what does not
    # change between passes (token and depth equal, both valid) is compared once.
    # (uint8: argmax takes no bools, and uint8 & bool stays uint8)
    alike = ((tokens[:, :, None] == tokens[:, None, :])
             & (depths[:, :, None] == depths[:, None, :])
             & valid[:, :, None] & valid[:, None, :]).to(torch.uint8)
    canon = index.expand(batch, n)
    for _ in range(max_depth):
        canon_parent = canon.gather(1, parents)
        same = alike & (canon_parent[:, :, None] == canon_parent[:, None, :])
        canon = same.argmax(dim=2)  # argmax returns the first maximum
    canon = torch.where(valid, canon, index)  # an invalid row is its own (none equal it)

    distinct = valid & (canon == index)
    distinct[:, 0] = True
    rank = torch.cumsum(distinct.long(), dim=1) - 1  # root gets rank 0
    kept = distinct & (rank <= budget)

    # source tags: a kept node carries the flags of everything merged into it, one
    # plane per part flag gathered by a single scatter
    present = ((plane[:, :, None] == torch.arange(max(len(flags), 1), device=device))
               & valid[:, :, None]).to(torch.uint8)
    hit = torch.zeros_like(present).scatter_reduce(
        1, canon[:, :, None].expand_as(present), present, "amax")
    merged_flags = hit[..., 0] * flags[0] if flags else torch.zeros_like(hit[..., 0])
    for i, flag in enumerate(flags[1:], 1):
        merged_flags |= hit[..., i] * flag
    merged_score = None
    if scored:
        score = torch.where(valid, torch.cat(scores, 1), 0.0)
        merged_score = torch.zeros_like(score).scatter_reduce(1, canon, score, "amax")

    rows = budget + 1
    row_of = torch.where(kept, rank, rows)  # dropped candidates go to a scratch row
    out_tokens = _scatter_rows(tokens, row_of, rows, -1)
    canon_parent_row = rank.gather(1, canon.gather(1, parents))
    out_parents = _scatter_rows(canon_parent_row, row_of, rows, -1)
    out_parents[:, 0] = -1
    out_depths = _scatter_rows(depths, row_of, rows, 0)
    out_source = _scatter_rows(merged_flags, row_of, rows, 0)
    out_source[:, 0] = SOURCE_ROOT
    out_valid = _scatter_rows(kept.to(torch.uint8), row_of, rows, 0).bool()
    return HybridTree(
        tokens=out_tokens,
        parents=out_parents,
        depths=out_depths,
        valid=out_valid,
        source=out_source,
        num_nodes=out_valid.sum(dim=1),
        score=None if merged_score is None else _scatter_rows(merged_score, row_of, rows, 0),
    )


def pad_to_budget(tree: HybridTree, vocab_size: int) -> HybridTree:
    """Fill every empty row of ``tree`` with a padding node, so each request has exactly
    ``budget`` nodes besides the root (the fixed-shape trees of
    :class:`vllm_graft.core.graft.GraftTreeBuilder`, last resort after retrieval and
    spare drafted candidates).

    Padding nodes are the children of one leaf: the last valid row ``L`` (rows are
    parents-first, so nothing hangs below the last one; ``L`` is the root when the tree
    is otherwise empty). Padding row ``i`` (0-based) carries token
    ``(token[L] + 1 + i) mod vocab_size``.

    Why this is harmless for losslessness: acceptance walks from the root and at each
    node accepts the child that carries the target's own sample (or, in the explicit
    multi-draft rule, tries the distinct children in row order with one-hot proposals).
    Both are exact for *any* set of children, provided siblings carry distinct tokens
    (with two equal siblings the explicit rule would try one token twice and
    over-represent it). Padding nodes are the only children of ``L``, and at most
    ``budget <= vocab_size`` consecutive ids mod ``vocab_size`` are distinct, so every
    sibling set stays distinct; all tokens are real ids in ``[0, vocab_size)``, so every
    row is an ordinary verifiable candidate. Hanging all padding under one leaf keeps
    the tree depth within one level of the unpadded tree (a padding chain could add up
    to ``budget`` levels, and walk steps and positions with them) and puts padding last
    in priority: it can only be reached through the lowest-priority node and is never
    tried before a real candidate. The rows are tagged ``SOURCE_PAD``, so learning can
    skip them (their context, ``L`` followed by an arbitrary id, teaches nothing useful,
    and as the last rows of a tree they would otherwise win the last-writer rule).

    Requires ``budget <= vocab_size``; rows already valid are left exactly as they are.
    """
    batch, rows = tree.tokens.shape
    if rows - 1 > vocab_size:
        raise ValueError(f"cannot pad a tree of {rows - 1} nodes over a vocabulary of "
                         f"{vocab_size} tokens with distinct siblings")
    device = tree.tokens.device
    index = torch.arange(rows, device=device).expand(batch, rows)
    count = tree.valid.sum(1, keepdim=True)  # valid rows are a prefix: rows 0 .. count-1
    pad = index >= count
    leaf = count - 1
    leaf_token = tree.tokens.gather(1, leaf)
    leaf_depth = tree.depths.gather(1, leaf)
    pad_tokens = (leaf_token + 1 + (index - count)) % vocab_size
    tokens = torch.where(pad, pad_tokens, tree.tokens)
    parents = torch.where(pad, leaf, tree.parents)
    depths = torch.where(pad, leaf_depth + 1, tree.depths)
    source = torch.where(pad, torch.full_like(tree.source, SOURCE_PAD), tree.source)
    valid = torch.ones_like(tree.valid)
    score = None if tree.score is None else torch.where(pad, 0.0, tree.score)
    return HybridTree(
        tokens=tokens, parents=parents, depths=depths, valid=valid, source=source,
        num_nodes=torch.full((batch,), rows, dtype=tree.num_nodes.dtype, device=device),
        score=score)


def trim_tree(tree: HybridTree, keep: torch.Tensor) -> HybridTree:
    """The tree restricted to the rows ``keep`` marks (``[B, N]`` bool, closed under
    parents, root kept), compacted parents-first into the same number of rows (the
    shape stays the same; dropped rows become padding at the end)."""
    keep = keep & tree.valid
    keep[:, 0] = True
    batch, rows = tree.tokens.shape
    new_row = torch.cumsum(keep.long(), dim=1) - 1
    row_of = torch.where(keep, new_row, rows)
    parents = torch.where(tree.parents >= 0, new_row.gather(1, tree.parents.clamp(min=0)), -1)
    tokens = _scatter_rows(tree.tokens, row_of, rows, -1)
    out_parents = _scatter_rows(parents, row_of, rows, -1)
    depths = _scatter_rows(tree.depths, row_of, rows, 0)
    source = _scatter_rows(tree.source, row_of, rows, 0)
    valid = _scatter_rows(keep.to(torch.uint8), row_of, rows, 0).bool()
    score = None if tree.score is None else _scatter_rows(tree.score, row_of, rows, 0)
    return HybridTree(
        tokens=tokens, parents=out_parents, depths=depths, valid=valid, source=source,
        num_nodes=valid.sum(dim=1), score=score)


def _scatter_rows(values: torch.Tensor, row_of: torch.Tensor, rows: int,
                  fill: int) -> torch.Tensor:
    """out[b, row_of[b, i]] = values[b, i], with one extra scratch row dropped at the end."""
    out = torch.full((values.shape[0], rows + 1), fill, dtype=values.dtype,
                     device=values.device)
    out.scatter_(1, row_of, values)
    return out[:, :rows].contiguous()


def ancestor_ids(parents: torch.Tensor, nodes: torch.Tensor, depth: int) -> torch.Tensor:
    """``[B, W, depth]``: the ids of the strict ancestors of ``nodes`` (``[B, W]`` ids into
    ``parents`` ``[B, N]``), nearest first, -1 beyond the root. The list form of
    :func:`ancestor_mask`, for a few nodes of a large pool."""
    out = []
    current = nodes
    for _ in range(depth):
        current = torch.where(current >= 0, parents.gather(1, current.clamp(min=0)), -1)
        out.append(current)
    return torch.stack(out, dim=-1) if out else nodes.new_empty(nodes.shape + (0,))


def ancestor_mask(parents: torch.Tensor, valid: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N, N] bool: mask[b, i, j] iff row j is row i or an ancestor of it.

    Doubling over the parent pointers: after t rounds every row knows its ancestors up
    to 2**t levels up, so log2(depth) rounds suffice.
    """
    batch, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(batch, n, n)
    mask = eye.clone()
    has_parent = parents >= 0
    mask |= torch.zeros_like(mask).scatter_(
        2, parents.clamp(min=0).unsqueeze(-1), has_parent.unsqueeze(-1))
    jump = torch.where(has_parent, parents, torch.arange(n, device=parents.device))
    reach = 1
    while reach < max_depth:
        # mask[i] |= mask[jump[i]]; jump[i] = jump[jump[i]]
        mask |= mask.gather(1, jump.unsqueeze(-1).expand(batch, n, n))
        jump = jump.gather(1, jump)
        reach *= 2
    return mask & valid[:, :, None] & valid[:, None, :]
