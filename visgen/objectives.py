"""Flow-GRPO objective wiring: recompute the log-probs (and the KL to the reference) of stored denoising steps.

The clipped surrogate itself is the shared one (``shared_rl.losses.clipped_surrogate``, per step, ratio
``exp(logp - logp_old)``); what is image-specific is how a step's log-prob is recomputed with grad:

    v = transformer(x_t, t, prompt)            # guided velocity (CFG through both branches when on)
    mean, std = kernel(x_t, v, sigma_t, sigma_next)   # the same ``flow_step`` code the sampler ran
    logp = log N(x_{t+1}; mean, std^2)          # reduced by mean over latent elements (Flow-GRPO convention)

**Exact ratio 1.** The rollout ran one transformer forward per step over each rollout micro-batch. Here the rows
of a call are grouped the same way (``layout`` = which rollout forward a row was in, ``slot`` = its position
there) and each group is forwarded in rollout order, then scattered back into the caller's order. When a call
holds complete rollout micro-batches and the trained steps are the same for all their rows (Flow-GRPO,
Flow-GRPO-Fast, MixGRPO), every forward sees exactly the batch it saw during sampling, so the recomputed
log-probs equal the stored ones bit for bit before the first update. Per-sample random step subsets
(DanceGRPO) forward only the rows trained at a step, which matches to float rounding.

**KL** (Flow-GRPO, Liu et al. 2025): between the policy's and the reference's step Gaussians, which share the
std, ``KL = ||mean_theta - mean_ref||^2 / (2 std^2)`` (mean over latent elements; ``kl_type="mean"``), or the
velocity distance ``||v_theta - v_ref||^2`` used by UniGRPO / DiffusionNFT-style regularisers (``"velocity"``).
The reference is the base model reached by switching the LoRA adapter off (``FlowPolicy.reference``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from .pipelines import Conditioning, FlowPipelineAdapter
from shared_rl.flow_kernels import flow_step, gaussian_entropy, sde_mean_kl

KL_TYPES = ("mean", "velocity")


@dataclass
class StepBatch:
    """What recomputing the steps of n stored chains needs (rows of a rollout payload).

    latents: ``[n, T+1, *latent]``; sde_mask: ``[n, T]``; sigmas: ``[n, T+1]``; timesteps: ``[n, T]``;
    cond: per-row prompt embeddings; layout, slot: ``[n]`` the rollout forward each row was in and its position.
    """

    latents: torch.Tensor
    sde_mask: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    cond: Conditioning
    layout: torch.Tensor
    slot: torch.Tensor


@dataclass
class Recomputed:
    logp: torch.Tensor  # [n, T] with grad (0 where not recomputed)
    kl: torch.Tensor | None  # [n, T] with grad, or None
    entropy: torch.Tensor  # [n, T] analytic step entropy (no grad)
    nfe: int  # model forwards, one per sample per call (CFG counts 2; reference forwards included)


def forward_groups(rows: torch.Tensor, layout: torch.Tensor, slot: torch.Tensor) -> list[torch.Tensor]:
    """Split ``rows`` into the rollout forwards they came from, each ordered as it was sampled."""
    groups = []
    keys = layout[rows]
    for key in torch.unique(keys).tolist():
        members = rows[keys == key]
        groups.append(members[torch.argsort(slot[members])])
    return groups


def recompute_steps(
    adapter: FlowPipelineAdapter,
    batch: StepBatch,
    steps: torch.Tensor,
    sampler: str,
    noise_level: float,
    reduction: str = "mean",
    reference: Callable[[], ContextManager] | None = None,
    kl_type: str = "mean",
) -> Recomputed:
    """Log-probs of the transitions ``latents[i, t] -> latents[i, t+1]`` where ``steps[i, t]`` is True.

    ``reference``: a context manager factory under which ``adapter`` computes the reference velocity; given, the
    per-step KL is returned too. Reference forwards run first (no grad), then the policy forwards (with grad).
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    n, T = steps.shape
    device = batch.latents.device
    steps = steps.to(device).bool()
    numel = int(batch.latents[0, 0].numel())
    per_forward = adapter.forwards_per_step(batch.cond)
    layout, slot = batch.layout.to(device), batch.slot.to(device)
    work: list[tuple[int, torch.Tensor]] = []
    for t in range(T):
        rows = torch.nonzero(steps[:, t]).flatten()
        if rows.numel():
            work += [(t, g) for g in forward_groups(rows, layout, slot)]

    def step(t: int, rows: torch.Tensor):
        x = batch.latents[rows, t]
        v = adapter.velocity(x, batch.timesteps[rows, t], batch.cond[rows])
        out = flow_step(sampler, x, v, batch.sigmas[rows, t], batch.sigmas[rows, t + 1], noise_level,
                        next_sample=batch.latents[rows, t + 1], stochastic=batch.sde_mask[rows, t], reduction=reduction)
        return v, out

    nfe = 0
    ref: list[tuple[torch.Tensor, torch.Tensor]] = []
    if reference is not None:
        with torch.no_grad(), reference():
            for t, rows in work:
                v_ref, out_ref = step(t, rows)
                ref.append((v_ref, out_ref.mean))
                nfe += per_forward * rows.numel()

    logp = torch.zeros(n, T, dtype=torch.float32, device=device)
    kl = torch.zeros(n, T, dtype=torch.float32, device=device) if reference is not None else None
    entropy = torch.zeros(n, T, dtype=torch.float32, device=device)
    for k, (t, rows) in enumerate(work):
        v, out = step(t, rows)
        nfe += per_forward * rows.numel()
        cols = torch.full_like(rows, t)
        logp = logp.index_put((rows, cols), out.log_prob)
        entropy[rows, t] = gaussian_entropy(out.std.detach().reshape(-1), numel, reduction)
        if kl is not None:
            v_ref, mean_ref = ref[k]
            if kl_type == "mean":
                value = sde_mean_kl(out.mean, mean_ref, out.std, reduction="mean")
            else:
                value = ((v - v_ref.float()) ** 2).flatten(1).mean(1)
            kl = kl.index_put((rows, cols), value)
    return Recomputed(logp, kl, entropy, nfe)

