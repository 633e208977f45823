"""Pearson's chi-square goodness-of-fit test, for tests that check sampled distributions."""

from __future__ import annotations

import torch


def chi_square_p_value(counts: list[int], probs: list[float]) -> float:
    """The p-value of `counts` having been drawn from `probs`; cells that expect fewer than 5
    draws are pooled into one, as the test's approximation needs."""
    n = sum(counts)
    cells: list[tuple[float, float]] = []
    pooled_obs = pooled_exp = 0.0
    for c, p in zip(counts, probs, strict=True):
        if n * p >= 5:
            cells.append((c, n * p))
        else:
            pooled_obs += c
            pooled_exp += n * p
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    # The chi-square survival function: the regularized upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
