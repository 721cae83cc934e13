"""Flow-matching action head with exact per-step log-probs (the denoising chain as a Gaussian MDP).

Convention (as visgen, DESIGN.md §3): x_σ = (1−σ)·x0 + σ·ε, σ from 1 (noise) to 0 (action chunk); the network
predicts v ≈ ε − x0; a step σ → σ' < σ has dt = σ' − σ < 0; all step math in float32.

Sampling modes (one *step* = one denoising step of one action chunk):

- ``ode``: x' = x + v·dt. Deterministic; used for evaluation (pi0 / SmolVLA style inference).
- ``flow_sde`` (Flow-GRPO, Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL"; used for
  VLAs in "πRL: Online RL Fine-tuning for Flow-based VLA Models"): std_t = a·sqrt(σ/(1−σ)) (at σ=1 the next
  sigma takes the denominator's place), μ = x·(1 + std_t²·dt/(2σ)) + v·(1 + std_t²·(1−σ)/(2σ))·dt,
  x' = μ + std_t·sqrt(−dt)·ε. Every step but the last is stochastic and trained (the last step's density
  explodes as σ' → 0, so it stays ODE).
- ``flow_noise`` (ReinFlow, Zhang et al. 2025, "ReinFlow: Fine-tuning Flow Matching Policy with Online RL"): a
  learned noise head gives a per-dimension std σ_θ(h, x, σ) ∈ [std_min, std_max]; x' = x + v·dt + σ_θ·ε. Every
  step is stochastic and trained (the std is bounded below, so the last step is safe too).
- ``sde_one_step`` (the ODE–SDE mix of πRL's Flow-SDE / MixGRPO-style windows): one denoising step per chunk, chosen at
  random in [0, S−2], uses the flow_sde kernel; the others are ODE. The chain and the chosen index are stored so
  the log-prob of that one step is recomputed exactly.

The step math is the project's one copy in ``shared_rl.flow_kernels`` (``flow_step`` with the ``sde`` kernel, the
Gaussian log-prob and entropy), the same code visgen samples images with; sampling and recomputation both go
through :meth:`FlowActionHead.transition`. Log-prob of x' under N(μ, var): −(x'−μ)²/(2·var) − ½·log(2π·var),
reduced over the action dims by ``sum`` (a proper density of the chunk; the default here) or ``mean`` (the
Flow-GRPO/DDPO image convention).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shared_rl.flow_kernels import (
    DEFAULT_NOISE_LEVEL,
    StepOutput,
    flow_step,
    gaussian_entropy,
    gaussian_log_prob,
    ode_step,
)

MODES = ("ode", "flow_sde", "flow_noise", "sde_one_step")


@dataclass
class FlowSample:
    """What sampling one chunk per row records. S = denoising steps, D = chunk * action_dim."""

    actions: torch.Tensor  # [B, D] final chain element x_S
    chain: torch.Tensor  # [B, S+1, D] x_0 (noise) .. x_S
    logp: torch.Tensor  # [B, S] behaviour log-prob of each step (0 where deterministic)
    stochastic: torch.Tensor  # [B, S] bool, steps that were sampled (and are trained)


def sigma_schedule(num_steps: int) -> torch.Tensor:
    return torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)


def timestep_embedding(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half)
    args = sigma.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class FlowActionHead(nn.Module):
    """Velocity MLP v(h, x_σ, σ) plus ReinFlow's bounded std head, over a flattened action chunk of size D."""

    def __init__(self, feature_dim: int, action_dim: int, hidden: int = 256, num_steps: int = 5, time_dim: int = 32,
                 std_min: float = 0.02, std_max: float = 0.3, std_init: float = 0.1):
        super().__init__()
        self.action_dim, self.num_steps, self.time_dim = action_dim, num_steps, time_dim
        self.velocity = nn.Sequential(
            nn.Linear(feature_dim + action_dim + time_dim, hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(),
            nn.Linear(hidden, action_dim),
        )
        self.std_min, self.std_max = std_min, std_max
        self.noise_std = nn.Sequential(nn.Linear(feature_dim + action_dim + time_dim, 128), nn.GELU(), nn.Linear(128, action_dim))
        # start the learned std at std_init: zero weights, bias = logit of its position in [std_min, std_max]
        nn.init.zeros_(self.noise_std[-1].weight)
        frac = (std_init - std_min) / (std_max - std_min)
        nn.init.constant_(self.noise_std[-1].bias, math.log(frac / (1 - frac)))
        self.register_buffer("sigmas", sigma_schedule(num_steps), persistent=False)

    def _inputs(self, h: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, x, timestep_embedding(sigma, self.time_dim)], dim=-1)

    def velocity_at(self, h: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.velocity(self._inputs(h, x, sigma)).float()

    def learned_std(self, h: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        z = self.noise_std(self._inputs(h, x, sigma)).float()
        return self.std_min + (self.std_max - self.std_min) * torch.sigmoid(z)

    # ------------------------------------------------------------------------------------------------------
    def transition(self, h: torch.Tensor, x: torch.Tensor, step: torch.Tensor, mode: str, noise_level: float,
                   stochastic: torch.Tensor | bool = True, noise: torch.Tensor | None = None,
                   next_sample: torch.Tensor | None = None, reduce: str = "sum") -> StepOutput:
        """Denoising step ``step`` (per row) of ``mode``: the one code path of sampling and of recomputation.

        Rows where ``stochastic`` is False take the ODE step (std 0, log-prob 0). Give ``noise`` to sample the
        stochastic rows or ``next_sample`` to score stored transitions (with grad). ``flow_sde``/``sde_one_step`` use the shared
        Flow-GRPO kernel; ``flow_noise`` is the ODE mean with ReinFlow's learned per-dimension std; ``ode`` is Euler.
        """
        sig = self.sigmas.to(x.device)
        sigma, sigma_next = sig[step], sig[step + 1]
        v = self.velocity_at(h, x, sigma)
        if mode != "flow_noise":
            kernel = "sde" if mode in ("flow_sde", "sde_one_step") else "ode"
            return flow_step(kernel, x, v, sigma, sigma_next, noise_level, noise=noise, next_sample=next_sample,
                             stochastic=stochastic, reduction=reduce)
        ode = ode_step(x, v, sigma, sigma_next)
        rows = torch.as_tensor(stochastic, device=x.device).expand(x.shape[0]).bool()[:, None]
        std = torch.where(rows, self.learned_std(h, x, sigma), torch.zeros_like(x))
        if next_sample is None:
            next_sample = ode.mean if noise is None else ode.mean + std * noise.float()
        return StepOutput(next_sample, ode.mean, std, gaussian_log_prob(next_sample, ode.mean, std, reduce))

    def stochastic_steps(self, batch: int, mode: str, generator: torch.Generator | None, device) -> torch.Tensor:
        """[B, S] bool: which steps are sampled in ``mode`` (sde_one_step draws one index per row from ``generator``)."""
        s = self.num_steps
        out = torch.zeros(batch, s, dtype=torch.bool, device=device)
        if mode == "flow_noise":
            out[:] = True
        elif mode == "flow_sde":
            out[:, : max(s - 1, 1)] = True
        elif mode == "sde_one_step":
            idx = torch.randint(0, max(s - 1, 1), (batch,), generator=generator).to(device)
            out[torch.arange(batch, device=device), idx] = True
        return out

    @torch.no_grad()
    def sample(self, h: torch.Tensor, mode: str, generator: torch.Generator | None, noise_level: float = DEFAULT_NOISE_LEVEL,
               reduce: str = "sum", init_noise: float = 1.0, start_noise: torch.Tensor | None = None,
               step_noise: torch.Tensor | None = None, one_step: torch.Tensor | None = None) -> FlowSample:
        """One chunk per row. ``init_noise`` scales the starting point x(σ=1) ~ N(0, init_noise²·I): 0 starts every
        chain at the origin, so the ODE is deterministic and all sampling randomness comes from the SDE steps
        (the only randomness a log-prob is computed for). ``start_noise`` [B, D]: the standard-normal draw of that
        start given per row (an evaluation's per-episode noise) instead of drawn from ``generator``.
        ``step_noise`` [B, S, D] and ``one_step`` [B] (``sde_one_step``'s stochastic step per row): every other draw
        given per row too, so a row's chunk is a function of its features and its own noise alone (the two-stage
        rollout's noise streams: an imagined candidate re-executed in the simulator draws the same noise)."""
        if mode not in MODES:
            raise ValueError(f"unknown flow sampling mode {mode!r}; choose one of {MODES}")
        b, d, s = h.shape[0], self.action_dim, self.num_steps
        dev = h.device
        z = torch.randn(b, d, generator=generator) if start_noise is None else start_noise
        x = (z * init_noise).to(dev)
        if one_step is not None and mode == "sde_one_step":
            stochastic = torch.zeros(b, s, dtype=torch.bool, device=dev)
            stochastic[torch.arange(b, device=dev), one_step.to(dev)] = True
        else:
            stochastic = self.stochastic_steps(b, mode, generator, dev)
        chain = [x]
        logp = torch.zeros(b, s, device=dev)
        for t in range(s):
            rows = stochastic[:, t]
            # noise is drawn only at steps where some row is stochastic (keeps the generator's stream per mode)
            if step_noise is not None:
                eps = step_noise[:, t].to(dev)
            else:
                eps = torch.randn(b, d, generator=generator).to(dev) if rows.any() else None
            out = self.transition(h, x, torch.full((b,), t, device=dev), mode, noise_level, rows, noise=eps,
                                  reduce=reduce)
            x = out.next_sample
            logp[:, t] = out.log_prob
            chain.append(x)
        return FlowSample(actions=x, chain=torch.stack(chain, 1), logp=logp, stochastic=stochastic)

    def step_log_prob(self, h: torch.Tensor, x: torch.Tensor, x_next: torch.Tensor, step: torch.Tensor, mode: str,
                      noise_level: float = DEFAULT_NOISE_LEVEL, reduce: str = "sum") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-prob (with grad) of stored transitions x → x_next at denoising ``step`` (one per row, all trained).

        Returns (logp [B], entropy [B], mean [B, D], std [B, 1 or D]); ``sde_one_step`` rows use the flow_sde kernel.
        """
        out = self.transition(h, x, step, mode, noise_level, True, next_sample=x_next, reduce=reduce)
        return out.log_prob, gaussian_entropy(out.std, self.action_dim, reduce), out.mean, out.std

    def bc_loss(self, h: torch.Tensor, x0: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Rectified-flow loss ‖v(x_σ, σ) − (ε − x0)‖² with σ ~ logit-normal (SD3's choice), per row mean."""
        b = x0.shape[0]
        eps = torch.randn(x0.shape, generator=generator).to(x0.device)
        sigma = torch.sigmoid(torch.randn(b, generator=generator)).to(x0.device)
        xs = (1 - sigma[:, None]) * x0 + sigma[:, None] * eps
        v = self.velocity_at(h, xs, sigma)
        return ((v - (eps - x0)) ** 2).mean()
