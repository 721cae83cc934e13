"""Policy losses: the clipped surrogate (PPO / GRPO / DAPO / GSPO), aggregation modes and KL estimators.

All losses take per-step tensors ``[n, T]`` with a step mask, so the same code trains denoising steps (visgen,
robot action heads) and tokens (LLM). Aggregations are normalised by **global** counts of the whole optimizer
step (``Normalizer``), so splitting a minibatch into micro-batches and accumulating gradients gives the same
gradient as one big batch (``tests/core/test_losses.py`` checks it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class Normalizer:
    """Global denominators for one optimizer step: trained steps in total, sequences with ≥ 1 trained step, and
    the constant length for ``seq-mean-token-sum-norm``."""

    num_steps: float
    num_seqs: float
    max_steps: float

    @classmethod
    def from_mask(cls, mask: torch.Tensor, max_steps: int | None = None) -> "Normalizer":
        mask = mask.bool()
        return cls(
            num_steps=max(float(mask.sum()), 1.0),
            num_seqs=max(float(mask.any(dim=1).sum()), 1.0),
            max_steps=float(max_steps or mask.shape[1]),
        )


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, norm: Normalizer) -> torch.Tensor:
    """Reduce per-step ``values[n, T]`` to a scalar (names as verl ``agg_loss``).

    - ``token-mean`` (DAPO): Σ_{i,t} m·x / N_steps(global).
    - ``seq-mean-token-mean`` (GRPO): Σ_i [Σ_t m·x / Σ_t m] / N_seqs(global).
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): Σ_i [Σ_t m·x / L] / N_seqs(global), L a constant max length.
    """
    m = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * m).sum() / norm.num_steps
    if mode == "seq-mean-token-mean":
        per_seq = (values * m).sum(1) / m.sum(1).clamp(min=1)
        return per_seq.sum() / norm.num_seqs
    if mode == "seq-mean-token-sum-norm":
        return (values * m).sum() / norm.max_steps / norm.num_seqs
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, level: str = "step") -> torch.Tensor:
    """Per-step log importance ratio.

    ``step``: log ρ_t = logp_t − logp_old_t (PPO/GRPO).  ``sequence`` (GSPO, Zheng et al. 2025): every step of
    sequence i carries log s_i = mean_t m·(logp_t − logp_old_t) (length-normalised sequence ratio).
    """
    lr = (logp - logp_old) * mask
    if level == "step":
        return lr
    if level == "sequence":
        seq = lr.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        return seq.expand_as(logp)
    raise ValueError(f"unknown ratio level {level!r}; choose 'step' or 'sequence'")


def clipped_surrogate(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "step",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-step clipped surrogate loss (PPO, Schulman et al. 2017; GRPO; DAPO clip-higher, Yu et al. 2025).

    ρ = exp(log_ratio);  L = −min(ρ·A, clip(ρ, 1−ε_lo, 1+ε_hi)·A).
    Dual clip (Ye et al. 2020) for A < 0: L = min(L, −c·A).
    ``advantages`` is ``[n]`` (one per sequence) or ``[n, T]``. Returns (loss ``[n, T]``, per-step stats).
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    hi = clip_low if clip_high is None else clip_high
    lr = log_ratio(logp, logp_old, mask, ratio_level)
    ratio = torch.exp(lr)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + hi)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    is_clipped = (clipped > unclipped).to(logp.dtype)
    stats = {"ratio": ratio.detach(), "clipped": is_clipped.detach(), "log_ratio": lr.detach()}
    return loss * mask, stats


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 estimator of KL(π‖π_ref) (Schulman 2020): log π − log π_ref."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator (Schulman 2020; GRPO): exp(log π_ref − log π) − (log π_ref − log π) − 1 ≥ 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between Gaussians of equal std (Flow-GRPO, on SDE step means): ‖μ_θ − μ_ref‖² / (2σ²), mean over
    non-batch dims. ``std`` broadcasts against ``mean``."""
    kl = (mean - ref_mean) ** 2 / (2.0 * std**2)
    return kl.flatten(1).mean(1)


KL_ESTIMATORS = {"k1": kl_k1, "k3": kl_k3}
