"""Flow-matching step kernels with Gaussian log-probs (float32, diffusers-scheduler style), shared by every domain.

visgen's image/video denoisers and robotics' flow-matching action head both sample and recompute their steps through
:func:`flow_step`, so there is one Flow-GRPO SDE (and one CPS, one DanceGRPO step) in the project. The Gaussian
log-prob, the analytic step entropy (E-GRPO) and the equal-std Gaussian mean KL (Flow-GRPO's KL) live here too,
with the kernels' default noise levels (``DEFAULT_NOISE_LEVEL``, ``KERNEL_NOISE_LEVELS``).

Convention (diffusers ``FlowMatchEulerDiscreteScheduler``): ``x_sigma = (1 - sigma) * x0 + sigma * eps``; sigma runs
from 1 (noise) to 0 (data); the model predicts the velocity ``v ~ eps - x0``; one step goes ``sigma -> sigma_next``
with ``dt = sigma_next - sigma < 0``.

Every kernel is a pure function of tensors and returns :class:`StepOutput` ``(next_sample, mean, std, log_prob)``:
the transition is ``next_sample ~ N(mean, std^2 I)`` where ``std`` is the *actual* per-element standard deviation
of the transition (for the Flow-GRPO SDE that is ``std_t * sqrt(-dt)``). Kernels:

- ``ode``: Euler step ``x + dt * v``; bit-identical to ``FlowMatchEulerDiscreteScheduler.step`` in float32.
- ``sde``: Flow-GRPO (Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025) ODE-to-SDE
  conversion with ``std_t = a * sqrt(sigma / (1 - sigma))``.
- ``cps``: coefficients-preserving sampling (Wang & Yu, "Coefficients-Preserving Sampling for Reinforcement
  Learning with Flow Matching", 2025).
- ``dance``: DanceGRPO (Xue et al., "DanceGRPO: Unleashing GRPO on Visual Generation", 2025) score-based SDE.

``noise_level`` is ``a`` for ``sde``/``cps`` and ``eta`` for ``dance``. ``noise_level = 0`` gives exactly the ODE
step for ``sde`` and ``dance`` by construction; :func:`flow_step` additionally routes every deterministic element
(per-sample ``stochastic=False`` or zero std) to the ODE formula, so a mixed SDE/ODE batch is bit-exact on its ODE
rows for every kernel (``cps`` at ``a = 0`` equals Euler only up to rounding because of its algebraic form).

Log-probs follow the Flow-GRPO / DDPO convention: the Gaussian log-density of ``next_sample`` is reduced over the
non-batch dims by **mean** (this is why clip ranges are ~1e-4); ``reduction="sum"`` gives the true joint density.
Deterministic transitions get log-prob 0 (they carry no density and are never trained).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

# the settings a config names live torch-free (grove config show); re-exported here, where the kernels use them
from .kernel_settings import DEFAULT_NOISE_LEVEL, KERNEL_NOISE_LEVELS, REDUCTIONS  # noqa: F401

__all__ = [
    "StepOutput",
    "KERNELS",
    "ode_step",
    "sde_step",
    "cps_step",
    "dance_step",
    "flow_step",
    "get_kernel",
    "gaussian_log_prob",
    "cps_unnormalized_log_prob",
    "gaussian_entropy",
    "sde_mean_kl",
    "REDUCTIONS",
    "dpm2_step",
]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)




class StepOutput(NamedTuple):
    """One transition ``x -> next_sample ~ N(mean, std^2)``.

    next_sample, mean: like ``x`` (float32). std: ``[B, 1, ..., 1]`` (broadcastable to ``x``; 0 where the step is
    deterministic). log_prob: ``[B]`` log-density of ``next_sample`` reduced over non-batch dims (0 where std is 0).
    """

    next_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor


# --------------------------------------------------------------------------------------------- helpers


def _per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A scalar or ``[B]`` value as a float32 ``[B, 1, ..., 1]`` tensor broadcastable against ``like``."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.dim() == 0:
        t = t.expand(like.shape[0])
    if t.shape[0] != like.shape[0]:
        raise ValueError(f"per-sample value has {t.shape[0]} rows, the batch has {like.shape[0]}")
    return t.reshape(t.shape[0], *([1] * (like.dim() - 1)))


def _std_like(std: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``[B]`` (or already broadcastable) std as float32 broadcastable against ``like``."""
    std = torch.as_tensor(std, dtype=torch.float32, device=like.device)
    if std.dim() == 1 and like.dim() > 1:
        std = std.reshape(-1, *([1] * (like.dim() - 1)))
    return std


def _reduce(elementwise: torch.Tensor, reduction: str) -> torch.Tensor:
    dims = tuple(range(1, elementwise.dim()))
    if reduction == "mean":
        return elementwise.mean(dim=dims) if dims else elementwise
    if reduction == "sum":
        return elementwise.sum(dim=dims) if dims else elementwise
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def gaussian_log_prob(
    sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """``log N(sample; mean, std^2)`` per element, reduced over non-batch dims -> ``[B]``; 0 where ``std == 0``.

    ``std``: ``[B]`` or broadcastable against ``mean``. Elementwise: ``-(sample - mean)^2 / (2 std^2) - log(std) - log(2 pi) / 2``. ``std`` broadcasts against ``mean``.
    Zero-std rows use a dummy std of 1 inside the formula so no inf/NaN reaches autograd through ``torch.where``.
    """
    sample = sample.float()
    mean = mean.float()
    std = _std_like(std, mean)
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    elementwise = -((sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _HALF_LOG_2PI
    elementwise = torch.where(positive, elementwise, torch.zeros_like(elementwise))
    return _reduce(elementwise, reduction)


def cps_unnormalized_log_prob(sample: torch.Tensor, mean: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The simplified CPS "log-prob" of the Flow-GRPO code base: ``-(sample - mean)^2`` reduced, no variance factor
    and no constants. It is *not* a log-density; offered only to reproduce that variant (name kept explicit)."""
    return _reduce(-((sample.float() - mean.float()) ** 2), reduction)


def gaussian_entropy(std: torch.Tensor, numel: int, reduction: str = "mean") -> torch.Tensor:
    """Analytic entropy of the step Gaussian ``N(mean, diag(std^2))`` over ``d = numel`` elements (E-GRPO, Zhang et
    al. 2025).

    Per element ``0.5 * log(2 pi e std^2)``; ``reduction="mean"`` returns the mean over elements (matching
    mean-reduced log-probs), ``"sum"`` the sum. ``std``: ``[B]`` or ``[B, 1, ...]`` (one std per row, the kernels'
    case: ``sum`` is then ``d`` times the per-element value) or ``[B, d]`` per element (ReinFlow's learned std);
    zero std gives entropy 0 (deterministic).
    """
    rows = std.float().reshape(std.shape[0], -1)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    positive = rows > 0
    safe_std = torch.where(positive, rows, torch.ones_like(rows))
    per_element = 0.5 * torch.log(2 * math.pi * math.e * safe_std**2)
    per_element = torch.where(positive, per_element, torch.zeros_like(per_element))
    if rows.shape[1] == 1:
        per_row = per_element[:, 0]
        return per_row if reduction == "mean" else per_row * numel
    return per_element.mean(1) if reduction == "mean" else per_element.sum(1)


def sde_mean_kl(
    mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """KL between two step Gaussians with the same std: ``||mean - mean_ref||^2 / (2 std^2)``, reduced -> ``[B]``.

    This is the Flow-GRPO KL regulariser on SDE means; 0 where ``std == 0``. ``std``: ``[B]`` or broadcastable.
    """
    std = _std_like(std, mean)
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    elementwise = (mean.float() - mean_ref.float()) ** 2 / (2 * safe_std**2)
    elementwise = torch.where(positive, elementwise, torch.zeros_like(elementwise))
    return _reduce(elementwise, reduction)


def _finish(
    mean: torch.Tensor,
    std: torch.Tensor,
    noise: torch.Tensor | None,
    next_sample: torch.Tensor | None,
    reduction: str,
) -> StepOutput:
    """Draw (or take) the next sample and score it."""
    if next_sample is None:
        if noise is None:
            if bool((std > 0).any()):
                raise ValueError("a stochastic step needs `noise` (to sample) or `next_sample` (to score)")
            next_sample = mean
        else:
            next_sample = mean + std * noise.float()
    return StepOutput(next_sample, mean, std, gaussian_log_prob(next_sample, mean, std, reduction))


# --------------------------------------------------------------------------------------------- kernels


def ode_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: torch.Tensor | float = 0.0,
    noise: torch.Tensor | None = None,
    next_sample: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """Euler step ``x' = x + dt * v`` (``dt = sigma_next - sigma``); std 0, log-prob 0.

    Same operations, in the same order, as ``FlowMatchEulerDiscreteScheduler.step`` in float32, so a chain of these
    reproduces the stock pipeline bit for bit. ``noise_level``/``noise`` are accepted and ignored (uniform signature).
    ``next_sample`` is ignored too: an ODE step has no density to evaluate.
    """
    x = x.float()
    dt = _per_sample(sigma_next, x) - _per_sample(sigma, x)
    mean = x + dt * v.float()
    std = torch.zeros_like(dt)
    return StepOutput(mean, mean, std, torch.zeros(x.shape[0], dtype=torch.float32, device=x.device))


def sde_std_t(
    sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: torch.Tensor
) -> torch.Tensor:
    """Flow-GRPO diffusion coefficient ``std_t = a * sqrt(sigma / (1 - sigma))``.

    At ``sigma = 1`` the denominator would be 0; as in Flow-GRPO we put the next sigma in its place (``1 -
    sigma_next``), which is the schedule's second sigma because sigma = 1 only occurs at the first step.
    """
    denominator_sigma = torch.where(sigma >= 1, sigma_next, sigma)
    return noise_level * torch.sqrt(sigma / (1 - denominator_sigma))


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: torch.Tensor | float = DEFAULT_NOISE_LEVEL,
    noise: torch.Tensor | None = None,
    next_sample: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """Flow-GRPO SDE step (Liu et al. 2025, Eq. 9 / their ``sde_step_with_logprob``).

    ``std_t = a sqrt(sigma/(1-sigma))``;
    ``mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt``;
    ``x' = mean + std_t sqrt(-dt) eps``. With ``a = 0`` the coefficients are exactly 1 and the step is the ODE step.
    """
    x = x.float()
    v = v.float()
    sigma_b = _per_sample(sigma, x)
    sigma_next_b = _per_sample(sigma_next, x)
    a = _per_sample(noise_level, x)
    dt = sigma_next_b - sigma_b
    std_t = sde_std_t(sigma_b, sigma_next_b, a)
    mean = x * (1 + std_t**2 / (2 * sigma_b) * dt) + v * (1 + std_t**2 * (1 - sigma_b) / (2 * sigma_b)) * dt
    std = std_t * torch.sqrt(-dt)
    return _finish(mean, std, noise, next_sample, reduction)


def cps_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: torch.Tensor | float = DEFAULT_NOISE_LEVEL,
    noise: torch.Tensor | None = None,
    next_sample: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """Coefficients-preserving step (Wang & Yu 2025): the noisy sample keeps the marginal coefficients exactly.

    ``std = sigma_next sin(a pi / 2)``; ``x0_hat = x - sigma v``; ``x1_hat = x + (1 - sigma) v``;
    ``mean = x0_hat (1 - sigma_next) + x1_hat sqrt(sigma_next^2 - std^2)``; ``x' = mean + std eps``.
    The last step (``sigma_next = 0``) is deterministic (std 0).
    """
    x = x.float()
    v = v.float()
    sigma_b = _per_sample(sigma, x)
    sigma_next_b = _per_sample(sigma_next, x)
    a = _per_sample(noise_level, x)
    std = sigma_next_b * torch.sin(a * math.pi / 2)
    x0_hat = x - sigma_b * v
    x1_hat = x + (1 - sigma_b) * v
    # clamp: rounding can make sigma_next^2 - std^2 a tiny negative number when a = 1
    mean = x0_hat * (1 - sigma_next_b) + x1_hat * torch.sqrt((sigma_next_b**2 - std**2).clamp(min=0))
    return _finish(mean, std, noise, next_sample, reduction)


def dance_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: torch.Tensor | float = 0.3,
    noise: torch.Tensor | None = None,
    next_sample: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """DanceGRPO step (Xue et al. 2025, their ``flux_step``), ``noise_level`` = eta (0.3 for FLUX).

    ``std = eta sqrt(sigma - sigma_next)``; ``x0_hat = x - sigma v``; score ``s = -(x - (1 - sigma) x0_hat) / sigma^2``;
    ``mean = x + dt v - eta^2 s dt / 2``; ``x' = mean + std eps``. ``eta = 0`` is exactly the ODE step.
    """
    x = x.float()
    v = v.float()
    sigma_b = _per_sample(sigma, x)
    sigma_next_b = _per_sample(sigma_next, x)
    eta = _per_sample(noise_level, x)
    dt = sigma_next_b - sigma_b
    x0_hat = x - sigma_b * v
    score = -(x - (1 - sigma_b) * x0_hat) / sigma_b**2
    mean = x + dt * v - 0.5 * eta**2 * score * dt
    std = eta * torch.sqrt(-dt)
    return _finish(mean, std, noise, next_sample, reduction)


Kernel = Callable[..., StepOutput]
KERNELS: dict[str, Kernel] = {"ode": ode_step, "sde": sde_step, "cps": cps_step, "dance": dance_step}


def get_kernel(name: str) -> Kernel:
    """The kernel registered under ``name`` (``ode``, ``sde``, ``cps``, ``dance``)."""
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; choose one of {sorted(KERNELS)}") from None


def flow_step(
    kernel: str,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: torch.Tensor | float,
    noise: torch.Tensor | None = None,
    next_sample: torch.Tensor | None = None,
    stochastic: torch.Tensor | bool = True,
    reduction: str = "mean",
) -> StepOutput:
    """One step of ``kernel`` where ``stochastic[b]`` is True and of the ODE elsewhere (a step plan's SDE/ODE mix).

    Deterministic rows (``stochastic`` False, or zero std) use the exact Euler formula, std 0 and log-prob 0, so
    they match the stock pipeline bit for bit whatever the kernel. With ``next_sample`` given (recomputation), the
    stochastic rows score it instead of drawing; the deterministic rows return their ODE result.
    This is the single code path used both while sampling and while recomputing log-probs with grad, which is
    what makes the recomputed log-prob equal the stored one exactly for the same batch layout.
    """
    ode = ode_step(x, v, sigma, sigma_next)
    if kernel == "ode":
        return ode
    stochastic_b = _per_sample(torch.as_tensor(stochastic, device=x.device).float(), x) > 0
    level = _per_sample(noise_level, x) * stochastic_b
    out = get_kernel(kernel)(x, v, sigma, sigma_next, level, noise=noise, next_sample=next_sample,
                             reduction=reduction)
    deterministic = ~(stochastic_b & (out.std > 0))
    std = torch.where(deterministic, torch.zeros_like(out.std), out.std)
    mean = torch.where(deterministic, ode.mean, out.mean)
    sample = torch.where(deterministic, ode.next_sample, out.next_sample)
    log_prob = torch.where(deterministic.flatten(), torch.zeros_like(out.log_prob), out.log_prob)
    return StepOutput(sample, mean, std, log_prob)


# --------------------------------------------------------------------------------------------- multistep ODE solver


def dpm2_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sigma_prev: torch.Tensor | float | None = None,
    x0_prev: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One deterministic step of the multistep DPM-Solver++(2M) in the flow parametrisation (alpha = 1 - sigma), the
    ``dpm2`` rollout sampler of DiffusionOPSD (worldbench/DiffusionOPSD ``src/diffusers_patch/solver.py``
    ``dpm_step(order=2)``). Returns ``(next_sample, x0)``; ``x0 = x - sigma v`` is the step's clean prediction, the
    ``x0_prev`` of the next step.

    - first step (``x0_prev`` None) and the final step (``sigma_next`` = 0): the first-order (DDIM, eta 0) update
      ``x' = (1 - sigma') x0 + sigma' (x - (1 - sigma) x0) / sigma`` (at sigma' = 0: x' = x0);
    - otherwise, with ``lambda = log(alpha) - log(sigma)``, ``h = lambda' - lambda``, ``h0 = lambda - lambda_prev``,
      ``D1 = (h / h0) (x0 - x0_prev)`` (0 when ``sigma_prev`` >= 1: lambda_prev = -inf, h0 = inf):
      ``x' = (sigma'/sigma) x - alpha' (e^{-h} - 1) (x0 + D1 / 2)``.

    Coefficients in float64, the update in float32 (as the reference). ``sigma*``: scalars or ``[B]`` per row; a row
    with ``sigma_prev`` NaN counts as a first step.
    """
    x = x.float()
    x0 = x - _per_sample(sigma, x) * v.float()

    def rows(value) -> torch.Tensor:
        t = torch.as_tensor(value, dtype=torch.float64, device=x.device)
        return t.expand(x.shape[0]) if t.dim() == 0 else t

    s, s_next = rows(sigma), rows(sigma_next)
    first = torch.ones_like(s, dtype=torch.bool) if x0_prev is None else torch.isnan(rows(sigma_prev))
    first = first | (s_next <= 0)
    # first order (DDIM eta 0)
    eps_hat = (x - _per_sample((1 - s).float(), x) * x0) / _per_sample(s.float(), x)
    ddim = _per_sample((1 - s_next).float(), x) * x0 + _per_sample(s_next.float(), x) * eps_hat
    if x0_prev is None or bool(first.all()):
        return ddim, x0
    # second order, multistep (safe values on the rows that take the first-order update)
    s_prev = torch.where(first, torch.full_like(s, 0.5), rows(sigma_prev))
    s_n = torch.where(first, torch.full_like(s, 0.25), s_next)
    s_c = torch.where(first, torch.full_like(s, 0.375), s)
    lam = torch.log(1 - s_c) - torch.log(s_c)
    lam_next = torch.log(1 - s_n) - torch.log(s_n)
    h = lam_next - lam
    d1_scale = torch.where(s_prev >= 1, torch.zeros_like(s),
                           h / (lam - (torch.log((1 - s_prev).clamp(min=1e-300)) - torch.log(s_prev))))
    coef = (1 - s_n) * (torch.exp(-h) - 1)
    second = (_per_sample((s_n / s_c).float(), x) * x
              - _per_sample(coef.float(), x) * (x0 + 0.5 * _per_sample(d1_scale.float(), x) * (x0 - x0_prev.float())))
    return torch.where(_per_sample(first.float(), x) > 0, ddim, second), x0
