"""Small deterministic stand-ins for a drafter and pure-Python references for the core."""

from __future__ import annotations

import torch

from vllm_graft.core.draft_tree import DraftStep


class TableDrafter:
    """A drafter whose log-probs depend only on the token being expanded, from a fixed
    random table, so tests can recompute every score by hand. Records its calls."""

    def __init__(self, vocab: int, top_k: int, *, sharpness: float = 3.0, seed: int = 0,
                 confidence: dict[int, float] | None = None):
        g = torch.Generator().manual_seed(seed)
        self.logprobs = (torch.randn(vocab, vocab, generator=g) * sharpness).log_softmax(-1)
        self.top_k = top_k
        self.calls: list[DraftStep] = []
        if confidence:  # force the top-1 probability after the given tokens
            for token, p in confidence.items():
                row = torch.full((vocab,), (1 - p) / (vocab - 1)).log()
                row[(token + 1) % vocab] = torch.tensor(p).log()
                self.logprobs[token] = row

    def __call__(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(step)
        rows = self.logprobs[step.tokens.clamp(min=0)]  # [A, W, V]
        values, ids = rows.topk(self.top_k, dim=-1)
        return values, ids


def reference_trie_merge(root: int, parts: list[tuple[list[int], list[int], int]],
                         budget: int) -> list[tuple[int, int, int]]:
    """Sequential trie merge: returns kept nodes as (token, parent_row, source_flags),
    row 0 being the root. parts: (tokens, parents-within-part, flag) in priority order."""
    rows: list[list[int]] = [[root, -1, 0]]
    child_of: dict[tuple[int, int], int] = {}
    for tokens, parents, flag in parts:
        placed: list[int | None] = []
        for token, parent in zip(tokens, parents):
            parent_row = 0 if parent < 0 else placed[parent]
            if token < 0 or parent_row is None:
                placed.append(None)
                continue
            key = (parent_row, token)
            if key in child_of:
                rows[child_of[key]][2] |= flag
                placed.append(child_of[key])
            elif len(rows) <= budget:
                child_of[key] = len(rows)
                rows.append([token, parent_row, flag])
                placed.append(len(rows) - 1)
            else:
                placed.append(None)
    return [tuple(r) for r in rows]


def copied_to_tensor(copied: list[list[int]], length: int) -> torch.Tensor:
    """``[B, length]`` int64, what :func:`vllm_graft.core.chain.build_chains` takes: each
    copied continuation cut to ``length``, padded with -1."""
    rows = [tokens[:length] + [-1] * (length - min(len(tokens), length)) for tokens in copied]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(copied), length)
