"""What every verified row teaches the successor matrix: the target's top-k at the
row, learned by the row's token in its request's matrix partition."""

from __future__ import annotations

import torch

from vllm_graft.core.config import StepMode
from vllm_graft.core.hybrid import SOURCE_PAD, HybridTree
from vllm_graft.vllm.proposal import last_proposal
from vllm_graft.vllm.tree_verification import VerifiedTree


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


def learn(runner, logits: torch.Tensor, spec_decode_metadata, trees: list[VerifiedTree],
          row_topk: torch.Tensor | None = None) -> None:
    """Every verified row teaches the successor matrix: each row of a verified tree but
    the padding of fixed-shape trees, and the sampled row of every other request (its
    decode or last prefill row). The row's input token learns the target's top-k there,
    in its request's partition; one update in persistent-batch order, so the last-writer
    rule is the same on every rank. ``row_topk``: the target's top-k where the walk read
    it already, [B, rows, k] at each request's tree rows (row 0 of a request without a
    tree is its sampled row) or [logits rows, k] at every logits row."""
    num_draft_tokens = spec_decode_metadata.num_draft_tokens
    tree_of_row = {t.batch_row: t for t in trees}
    # the learned rows, in batch order, indexed on the host: a few tensor ops per step
    # rather than a few per request
    counts = [tree_of_row[b].tree.tokens.numel() if b in tree_of_row else 1
              for b in range(len(num_draft_tokens))]
    width = 0 if row_topk is None or row_topk.dim() == 2 else row_topk.shape[1]
    rows, topk_rows, padding = [], [], []
    first_logits_row = 0
    for b, count in enumerate(counts):
        if b in tree_of_row:  # padding nodes of fixed-shape trees teach nothing
            padding += [len(rows) + j for j, tag in
                        enumerate(tree_of_row[b].tree.source.tolist()) if tag == SOURCE_PAD]
        rows.extend(range(first_logits_row, first_logits_row + count))
        topk_rows.extend(range(b * width, b * width + count))
        first_logits_row += num_draft_tokens[b] + 1
    every_row = len(rows) == first_logits_row  # each request's logits rows, all learned
    logits_indices = spec_decode_metadata.logits_indices
    device = logits_indices.device
    index = None if every_row else torch.tensor(rows, device=device)
    tokens = runner.input_ids.gpu[
        logits_indices if every_row else logits_indices[index]].long()
    if padding:
        tokens[torch.tensor(padding, device=tokens.device)] = -1
    known = None
    if row_topk is not None and row_topk.dim() == 2:
        known = row_topk if every_row else row_topk[index.to(row_topk.device)]
    elif row_topk is not None:
        known = row_topk.flatten(0, 1)[torch.tensor(topk_rows, device=row_topk.device)]
    runner.drafter.matrix.update_from_logits_(tokens, logits, index, row_partitions(
        runner, counts), next_tokens=known)
