"""Flow Policy Optimization (``robotics.head_mode: fpo``): PPO on a flow policy without its likelihood.

McAllister, Ge, Yi, Kanazawa et al., "Flow Matching Policy Gradients" (2025; code: akanazawa/fpo,
``playground/src/flow_policy/fpo.py``). The rollouts are the policy's own distribution — the ODE from a random start
x(σ=1) ~ N(0, init_noise²), exactly how it is evaluated, no SDE noise — and the likelihood ratio PPO needs is
replaced by one built from conditional flow-matching losses of the executed action chunk a:

    ℓ_θ(a | o) = mean_n  w(τ_n) · mean_d ( v_θ(x_τn, τ_n | o) − (ε_n − a) )²,   x_τ = (1 − τ)·a + τ·ε
    log p̂_θ = −ℓ_θ,      ρ = exp(log p̂_θ − log p̂_old) = exp(ℓ_old − ℓ_θ)

with N pairs (ε_n, τ_n) drawn once per chunk at rollout time and reused by every later forward (old and new see the
same pairs, so ρ = 1 before the first update: ``logp_old`` is deferred to the trainer's first forward). The losses
are averaged over the N pairs before the exponential (the reference's ``average_losses_before_exp: True``), and the
clipped surrogate is the trainer's ``clipped`` loss on ρ (the reference clips at 0.05: ``loss.clip_low/high``).

The reference's defaults, kept here: N = 8 (``n_samples_per_action``), τ drawn from the sampler's own grid σ_0..σ_{S−1}
(``discretize_t_for_training: True``), and the error measured on the ε the network implies
(``output_mode: u_but_supervise_as_eps``): ε̂ = x_τ + (1 − τ)·v, so (ε − ε̂)² = (1 − τ)²·(v − (ε − a))², i.e.
w(τ) = (1 − τ)²; ``target: velocity`` is its plain-velocity ``output_mode: u`` (w = 1).

Why it suits the VLA here: the SDE-step log-prob credits one noisy denoising step per chunk, so its gradient is
dominated by that step's noise; FPO's is advantage-weighted flow matching on the whole executed chunk, the same
regression the policy was cloned with (docs/methods/fpo.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from shared_rl.errors import ConfigError

if TYPE_CHECKING:  # the config class is read by `grove config show`, which does not import torch
    import torch


@dataclass
class FPOConfig:
    """``robotics.fpo``: the flow-matching likelihood surrogate of ``head_mode: fpo`` (the reference's defaults)."""

    samples: int = field(default=8, metadata={
        "help": "(ε, τ) pairs per executed chunk whose flow-matching losses are averaged into log p̂ (the reference's "
                "n_samples_per_action: 8)"})
    timesteps: Literal["schedule", "uniform"] = field(default="schedule", metadata={
        "help": "where τ is drawn: schedule = uniformly among the sampler's own steps σ_0..σ_{S-1} (the reference's "
                "discretize_t_for_training: true); uniform = U(0, 1)"})
    target: Literal["epsilon", "velocity"] = field(default="epsilon", metadata={
        "help": "the error of each pair: epsilon = on the noise the velocity implies, (1-τ)²·‖v − (ε − a)‖² (the "
                "reference's output_mode u_but_supervise_as_eps); velocity = ‖v − (ε − a)‖² (output_mode u)"})
    reduce: Literal["mean", "sum"] = field(default="mean", metadata={
        "help": "how ℓ reduces over the chunk's action dims: mean (the reference's) or sum (the chunk's ELBO is a "
                "sum over dims: D times as sensitive a ratio, so the PPO clip binds at D times smaller a move; the "
                "gradient's direction is the same)"})

    def check(self, where: str = "robotics.fpo") -> None:
        if self.samples < 1:
            raise ConfigError(f"{where}.samples must be >= 1 (the reference's 8), got {self.samples}")


def draw_pairs(cfg: FPOConfig, shape: tuple[int, ...], dim: int, sigmas: torch.Tensor,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (ε, τ) pairs of ``shape`` chunks: ε [*shape, N, dim] standard normal, τ [*shape, N] (``cfg.timesteps``;
    ``sigmas`` the sampler's grid σ_0 = 1 .. σ_S = 0, whose first S entries are the schedule's τ)."""
    import torch

    n = cfg.samples
    eps = torch.randn(*shape, n, dim, generator=generator)
    if cfg.timesteps == "schedule":
        steps = sigmas.numel() - 1
        tau = sigmas.cpu()[torch.randint(0, steps, (*shape, n), generator=generator)]
    else:
        tau = torch.rand(*shape, n, generator=generator)
    return eps, tau.float()


def log_likelihood(velocity_at, h: torch.Tensor, actions: torch.Tensor, eps: torch.Tensor, tau: torch.Tensor,
                   target: str = "epsilon", reduce: str = "mean") -> torch.Tensor:
    """log p̂ = −ℓ of each row: ``velocity_at(h, x, τ)`` the head's velocity, ``h`` [B, F] features, ``actions`` [B, D]
    the executed chunks, ``eps`` [B, N, D], ``tau`` [B, N]; ``reduce`` over the D dims. Returns [B] (with grad)."""
    b, n, d = eps.shape
    a = actions.float()[:, None, :]
    t = tau.to(a)[..., None]
    x = (1 - t) * a + t * eps.to(a)
    v = velocity_at(h.repeat_interleave(n, 0), x.reshape(b * n, d), t.reshape(b * n)).view(b, n, d)
    sq = (v - (eps.to(a) - a)) ** 2
    err = sq.sum(-1) if reduce == "sum" else sq.mean(-1)  # [B, N]
    if target == "epsilon":
        err = err * (1 - tau.to(err)) ** 2
    return -err.mean(-1)


def attach_pairs(rollout, cfg: FPOConfig, sigmas: "torch.Tensor", generator: "torch.Generator | None") -> None:
    """Give a flat rollout of ``head_mode: fpo`` its (ε, τ) pairs (payload ``fpo_eps`` [N, C, n, D], ``fpo_tau``
    [N, C, n]) and defer its ``logp_old`` to the trainer's first forward: the old surrogate is the current weights'
    on the same pairs, so the first optimizer step on the batch has ρ = 1 exactly."""
    import torch

    n, c, _, d = rollout.payload["chain"].shape
    rollout.payload["fpo_eps"], rollout.payload["fpo_tau"] = draw_pairs(cfg, (n, c), d, sigmas, generator)
    rollout.logp_deferred = rollout.mask.clone()
    rollout.logp_old = torch.where(rollout.mask, torch.full_like(rollout.logp_old, float("nan")),
                                   torch.zeros_like(rollout.logp_old))
