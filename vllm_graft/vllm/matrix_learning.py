"""What every verified row teaches the successor matrix: the target's top-k at the
row, learned by the row's token in its request's matrix partition."""

from __future__ import annotations

import torch

from vllm_graft.core.config import StepMode
from vllm_graft.core.hybrid import SOURCE_PAD, HybridTree
from vllm_graft.vllm.proposal import last_proposal
from vllm_graft.vllm.tree_verification import VerifiedTree


def learn_every_row(runner, logits: torch.Tensor, spec_decode_metadata,
                     row_topk: torch.Tensor, padding_rows: list[int]) -> None:
    """:func:`learn` when every logits row is a verified row (each request's drafts
    are its chain, or it has none): the row's input token learns the target's top-k
    there, but for the ``padding_rows`` of fixed-shape chains."""
    drafter = runner.drafter
    tokens = runner.input_ids.gpu[spec_decode_metadata.logits_indices].long()
    if padding_rows:
        tokens[torch.tensor(padding_rows, device=tokens.device)] = -1
    num_draft_tokens = spec_decode_metadata.num_draft_tokens
    partitions = row_partitions(runner, [drafts + 1 for drafts in num_draft_tokens])
    drafter.matrix.update_from_logits_(tokens, logits, None, partitions, next_tokens=row_topk)


def row_partitions(runner, counts: list[int]) -> torch.Tensor | None:
    """The matrix partition each learned row teaches: request ``b``'s, repeated for its
    ``counts[b]`` rows (None: every request shares partition 0)."""
    partitions = runner.drafter.partitions(runner, runner.input_batch.req_ids[:len(counts)])
    if partitions is None:
        return None
    # each request teaches its own matrix (graft.isolation)
    return partitions.repeat_interleave(torch.tensor(counts, device=partitions.device))


def learned_rows(runner, host_tree: HybridTree, spec_decode_metadata, starts: torch.Tensor,
                  trees: list[VerifiedTree]) -> torch.Tensor:
    """``[B, rows]`` the matrix row each verified row teaches (-1: none), as
    :func:`learn` teaches them: every row of each tree but padding, and the sampled row
    of every other request; nothing in the guard's plain mode."""
    batch, rows = host_tree.tokens.shape
    device = starts.device
    if last_proposal(runner).mode is StepMode.PLAIN:  # the guard's plain mode learns nothing
        return torch.full((batch, rows), -1, dtype=torch.long, device=device)
    tokens = torch.where(host_tree.valid & (host_tree.source != SOURCE_PAD),
                         host_tree.tokens, -1).to(device)
    with_tree = {t.batch_row for t in trees}
    plain = [b for b in range(batch) if b not in with_tree]
    if plain:
        index = torch.tensor(plain, dtype=torch.long, device=device)
        logits_rows = spec_decode_metadata.logits_indices[starts[index]]
        tokens[index, 0] = runner.input_ids.gpu[logits_rows].long()
    partitions = runner.drafter.partitions(runner, runner.input_batch.req_ids[:batch])
    if partitions is None:
        return tokens
    return runner.drafter.matrix.partition_rows(tokens, partitions.unsqueeze(1))


def learn(runner, logits, spec_decode_metadata, starts, trees, row_topk=None) -> None:
    """Every verified row teaches the successor matrix: all rows of each tree, and the
    sampled row of every other request (its decode or last prefill row). One update in
    persistent-batch order, so the last-writer rule is the same on every rank.
    ``row_topk`` [B, rows, k]: the target's top-k at every tree row when acceptance has
    read it already (row 0 of a request without a tree is its sampled row)."""
    device = starts.device
    batch = starts.numel()
    tree_of_row = {t.batch_row: t for t in trees}
    # the learned rows, in batch order, indexed on the host: a few tensor ops per step
    # rather than a few per request
    counts = [tree_of_row[b].tree.tokens.numel() if b in tree_of_row else 1
              for b in range(batch)]
    first_logits_row = 0  # ``starts[b]``
    width = 0 if row_topk is None else row_topk.shape[1]
    ordered = [tree_of_row[b] for b in range(batch) if b in tree_of_row]
    plain = [b for b in range(batch) if b not in tree_of_row]
    rows, topk_rows, plain_at, tree_at = [], [], [], []
    for b, count in enumerate(counts):
        (tree_at if b in tree_of_row else plain_at).extend(range(len(rows), len(rows) + count))
        rows.extend(range(first_logits_row, first_logits_row + count))
        topk_rows.extend(range(b * width, b * width + count))
        first_logits_row += spec_decode_metadata.num_draft_tokens[b] + 1
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    if plain:
        logits_rows = spec_decode_metadata.logits_indices[starts[plain]]
        tokens[plain_at] = runner.input_ids.gpu[logits_rows].long()
    if ordered:
        tree_tokens = torch.cat([t.tree.tokens for t in ordered])
        # padding nodes of fixed-shape trees teach nothing (-1 skips the row)
        tree_tokens[torch.cat([t.tree.source for t in ordered]) == SOURCE_PAD] = -1
        tokens[tree_at] = tree_tokens.to(device)
    known = None
    if row_topk is not None:
        known = row_topk.flatten(0, 1)[torch.tensor(topk_rows, device=row_topk.device)]
    drafter = runner.drafter
    partitions = row_partitions(runner, counts)
    drafter.matrix.update_from_logits_(tokens, logits, torch.tensor(rows, device=device),
                                       partitions, next_tokens=known)

