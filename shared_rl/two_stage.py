"""Two-stage rollouts, the shared part: explore many candidates cheaply, keep a contrastive subset, regenerate it.

Sol-RL ("FP4 Explore, BF16 Train", arXiv 2604.06916): stage 1 samples N candidates per group key with a cheap
explorer (a low-precision copy of the policy, deterministic sampling from recorded seeds) and scores them; a
selector keeps ``k`` of them per key; stage 2 regenerates exactly those seeds with the full-precision policy and
only they are trained on. The domain owns the explorer and the regeneration (visgen: ``visgen.two_stage``); this
module holds what every domain shares: the selectors and the agreement statistics, pure tensor functions.
"""
from __future__ import annotations

import torch

from .errors import ConfigError

__all__ = ["SELECTORS", "select_candidates", "spearman", "kept_agreement"]


def _top_bottom(r: torch.Tensor, k: int) -> torch.Tensor:
    """The ``ceil(k/2)`` highest and ``floor(k/2)`` lowest rewards (Sol-RL's contrastive choice)."""
    order = torch.argsort(r, descending=True, stable=True)
    top, bottom = (k + 1) // 2, k // 2
    return torch.cat([order[:top], order[len(order) - bottom:]]) if bottom else order[:top]


def _max_variance(r: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-subset of largest reward variance. Such a subset is always ``j`` highest plus ``k − j`` lowest
    values (moving an inner value outward never lowers the variance), so trying every ``j`` is exact."""
    order = torch.argsort(r, descending=True, stable=True)
    best, best_var = None, -1.0
    for j in range(k + 1):
        idx = torch.cat([order[:j], order[len(order) - (k - j):]]) if k - j else order[:j]
        var = float(r[idx].double().var(unbiased=False)) if idx.numel() > 1 else 0.0
        if var > best_var + 1e-12:
            best, best_var = idx, var
    return best


SELECTORS = {"top_bottom": _top_bottom, "max_variance": _max_variance}


def select_candidates(rewards: torch.Tensor, k: int, mode: str = "top_bottom") -> torch.Tensor:
    """``[G, N]`` candidate rewards per key -> ``[G, k]`` indices of the kept candidates (each row's order: as the
    selector returns them). NaN rewards (failed scoring) are treated as the lowest."""
    if mode not in SELECTORS:
        raise ConfigError(f"two-stage selector {mode!r} is unknown; choose one of {sorted(SELECTORS)}")
    G, N = rewards.shape
    if not 1 <= k <= N:
        raise ConfigError(f"two-stage keeps k={k} of {N} candidates per key; need 1 <= k <= N")
    r = torch.nan_to_num(rewards.double(), nan=-float("inf"))
    r = torch.where(torch.isinf(r), torch.full_like(r, -1e30), r)
    return torch.stack([SELECTORS[mode](r[g], k) for g in range(G)])


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean rank), 0-based."""
    x = x.double().flatten()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(x.numel(), dtype=torch.float64)
    for v in torch.unique(x):
        tie = x == v
        if int(tie.sum()) > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two score vectors (NaN pairs dropped; NaN when fewer than 2 or constant)."""
    a, b = a.double().flatten(), b.double().flatten()
    ok = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[ok], b[ok]
    if a.numel() < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def kept_agreement(explore: torch.Tensor, regenerated: torch.Tensor) -> float:
    """``[G, k]`` rewards of the kept candidates from both stages -> the fraction whose side of the split (upper
    vs lower half by the explorer) the full-precision rewards confirm: how much of the contrast survives."""
    G, k = explore.shape
    if k < 2:
        return float("nan")
    half = k // 2

    def upper(r: torch.Tensor) -> torch.Tensor:
        flags = torch.zeros_like(r, dtype=torch.bool)
        flags.scatter_(1, torch.argsort(r.double(), dim=1, descending=True, stable=True)[:, :half], True)
        return flags

    return float((upper(explore) == upper(regenerated)).double().mean())
