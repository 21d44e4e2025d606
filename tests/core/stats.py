"""Goodness-of-fit helpers for the losslessness tests."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square test of observed ``counts`` against ``probs``; bins with a small
    expected count are pooled. An observation in a zero-probability bin gives p = 0."""
    counts = counts.double()
    probs = probs.double() / probs.sum()
    total = counts.sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    expected = probs * total
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))
