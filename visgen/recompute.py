"""Recompute the log-probs (and the KL to the reference) of stored denoising steps, with grad — for every method.

What is image-specific in the policy loss is how a step's log-prob is recomputed::

    v = transformer(x_t, t, prompt)                    # guided velocity (CFG through both branches when on)
    mean, std = kernel(x_t, v, sigma_t, sigma_next)    # the same ``flow_step`` code the sampler ran
    logp = log N(x_{t+1}; mean, std^2)                  # reduced by mean over latent elements (Flow-GRPO convention)

**Exact ratio 1.** Rows are grouped by the rollout forward that computed each step (``fwd_id``, see
``visgen.engine``); within a group the distinct inputs (``fwd_slot``: siblings share their parent's slot at step 0)
are forwarded once, in rollout order, and scattered back. When a call holds every row of those rollout forwards
and the same steps are trained for all of them (Flow-GRPO, Flow-GRPO-Fast, MixGRPO, the tree methods), every
forward sees exactly its rollout batch and the log-probs equal ``logp_old`` bit for bit. Per-sample random step
subsets (DanceGRPO) forward only the rows trained at a step, which matches to float rounding.

**KL** (Flow-GRPO, Liu et al. 2025): between the policy's and the reference's step Gaussians, which share the
std, ``KL = ||mean_theta - mean_ref||^2 / (2 std^2)`` (mean over latent elements; ``kl_type="mean"``), or the
velocity distance ``||v_theta - v_ref||^2`` used by UniGRPO / DiffusionNFT-style regularisers (``"velocity"``).
The reference is the base model reached by switching the LoRA adapter off (``FlowPolicy.reference``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from shared_rl.flow_kernels import flow_step, gaussian_entropy, sde_mean_kl

__all__ = ["KL_TYPES", "RecomputedEdges", "recompute_edges", "recompute_trajectory"]

KL_TYPES = ("mean", "velocity")


@dataclass
class RecomputedEdges:
    logp: torch.Tensor  # [n, L] with grad (0 where not recomputed)
    kl: torch.Tensor | None
    entropy: torch.Tensor  # [n, L]
    nfe: int
    std: torch.Tensor | None = None  # [n, L] each recomputed step's transition std (0 elsewhere)
    # [n, L] ||mu - mu_old||^2 / (2 std^2) to the old copy's means, with grad (Flow-DPPO's mask; the teacher's for
    # on-policy distillation)
    old_kl: torch.Tensor | None = None


def recompute_edges(
    adapter,
    payload: dict[str, Any],
    steps: torch.Tensor,
    cond,
    kernel: str,
    reduction: str = "mean",
    reference: Callable[[], ContextManager] | None = None,
    kl_type: str = "mean",
    old: Callable[[], ContextManager] | None = None,
    pad: Callable[[int], int] | None = None,
) -> RecomputedEdges:
    """Log-probs (with grad) of the stored executed steps ``steps[i, j]`` of edges ``i`` (rows of a forest payload).

    Rows are grouped by the rollout forward that computed each step (``fwd_id``); within a group the distinct
    inputs (``fwd_slot``: siblings share their parent's slot at step 0) are forwarded once, in rollout order, and
    scattered back. When a call holds every row of those rollout forwards, each forward sees exactly its rollout
    batch and the log-probs equal ``logp_old`` bit for bit. ``reference`` (a context-manager factory switching to
    the reference model) adds the Flow-GRPO KL: ``kl_type="mean"`` ``||mu - mu_ref||^2 / (2 std^2)`` or
    ``"velocity"`` ``||v - v_ref||^2`` (mean over latent elements). ``old`` (a context-manager factory swapping
    the old policy's weights in) adds ``old_kl``, the same Gaussian-mean KL to the old copy's step means (with grad
    through the policy's means: Flow-DPPO's mask detaches it, on-policy distillation's teacher KL trains on it), from
    one more forward per step under one weight swap.

    ``pad`` (FSDP2, ``visgen.fsdp.ForwardPadding``): maps this call's number of velocity calls per pass to the
    largest over the processes; each pass (reference, old, trained) then adds that many minus its own of weight-0
    velocity calls, so every process issues the same transformer forwards (each one a collective) in the same order.
    Padding calls add exactly zero to the log-probs and gradients and are not counted in ``nfe``.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    steps = steps.bool().cpu()
    n, L = steps.shape
    lat = payload["latents"]
    device = lat.device
    numel = int(lat[0, 0].numel())
    fid, fslot = payload["fwd_id"].cpu(), payload["fwd_slot"].cpu()
    per_forward = adapter.forwards_per_step(cond)
    work = []
    for j in range(L):
        rows = torch.nonzero(steps[:, j]).flatten()
        if rows.numel() == 0:
            continue
        if bool((fid[rows, j] < 0).any()):
            raise ValueError("asked to recompute a padding step (no rollout forward)")
        for key in torch.unique(fid[rows, j]).tolist():
            members = rows[fid[rows, j] == key]
            slots = fslot[members, j]
            uniq, inverse = torch.unique(slots, sorted=True, return_inverse=True)
            first = torch.full((uniq.numel(),), -1, dtype=torch.long)
            first.scatter_reduce_(0, inverse, torch.arange(members.numel()), "amin", include_self=False)
            work.append((j, members, members[first], inverse))
    extra = pad(len(work)) - len(work) if pad is not None else 0

    def run(j, members, reps, inverse):
        d_m, d_r = members.to(device), reps.to(device)
        v_u = adapter.velocity(lat[d_r, j], payload["timestep"][reps, j].to(device), cond[d_r])
        v = v_u[inverse.to(device)]
        out = flow_step(kernel, lat[d_m, j], v, payload["sigma"][members, j].to(device),
                        payload["sigma_next"][members, j].to(device), payload["noise_level"][members, j].to(device),
                        next_sample=lat[d_m, j + 1], stochastic=payload["sde"][members, j].to(device),
                        reduction=reduction)
        return v, out

    def padding() -> torch.Tensor:
        """One velocity call of weight 0 on a single input of this call (any latent, timestep and prompt row: only
        the forward's collectives matter), returned as a scalar 0 that keeps the forward in the autograd graph."""
        j, reps = (work[0][0], work[0][2][:1]) if work else (0, torch.zeros(1, dtype=torch.long))
        d_r = reps.to(device)
        v = adapter.velocity(lat[d_r, j], payload["timestep"][reps, j].to(device), cond[d_r])
        return v.float().nan_to_num(0.0, 0.0, 0.0).sum() * 0.0

    nfe = 0
    refs = []
    if reference is not None:
        with torch.no_grad(), reference():
            for item in work:
                v_ref, out_ref = run(*item)
                refs.append((v_ref, out_ref.mean))
                nfe += per_forward * item[2].numel()
            for _ in range(extra):
                padding()
    olds = []
    if old is not None:  # one weight swap for all of them: swapping between forwards that keep a graph would break it
        with torch.no_grad(), old():
            for item in work:
                olds.append(run(*item)[1].mean)
                nfe += per_forward * item[2].numel()
            for _ in range(extra):
                padding()
    logp = torch.zeros(n, L, device=device)
    kl = torch.zeros(n, L, device=device) if reference is not None else None
    old_kl = torch.zeros(n, L, device=device) if old is not None else None
    entropy = torch.zeros(n, L, device=device)
    std = torch.zeros(n, L, device=device)
    for w, item in enumerate(work):
        j, members = item[0], item[1]
        v, out = run(*item)
        nfe += per_forward * item[2].numel()
        d_m = members.to(device)
        col = torch.full_like(d_m, j)
        logp = logp.index_put((d_m, col), out.log_prob)
        entropy[d_m, j] = gaussian_entropy(out.std.detach().reshape(-1), numel, reduction)
        std[d_m, j] = out.std.detach().reshape(-1).float()
        if kl is not None:
            v_ref, mean_ref = refs[w]
            if kl_type == "mean":
                value = sde_mean_kl(out.mean, mean_ref, out.std, reduction="mean")
            else:
                value = ((v - v_ref.float()) ** 2).flatten(1).mean(1)
            kl = kl.index_put((d_m, col), value)
        if old_kl is not None:  # with grad: on-policy distillation trains on it (Flow-DPPO's mask detaches it)
            old_kl = old_kl.index_put((d_m, col), sde_mean_kl(out.mean, olds[w], out.std, reduction="mean").float())
    for _ in range(extra):  # after the real forwards, as every process's trained pass ends the same way
        logp = logp + padding()
    return RecomputedEdges(logp, kl, entropy, nfe, std, old_kl)


def recompute_trajectory(pipe, traj, steps, reference: Callable[[], ContextManager] | None = None,
                         kl_type: str = "mean") -> RecomputedEdges:
    """:func:`recompute_edges` for a ``visgen.sample`` :class:`~visgen.trajectory.Trajectory` (or a sub-batch
    ``traj[idx]``): the log-probs (with grad) of its stored steps ``steps`` — an int, a ``[k]`` list of step
    indices for every sample, a ``[B, k]`` tensor of per-sample indices, or a ``[B, T]`` bool mask. Returns ``[B, T]``
    arrays, 0 where not recomputed. Same layout as the rollout (whole rollout micro-batches) gives ratio exactly 1."""
    from .pipelines import as_adapter

    B, T = traj.log_probs.shape
    steps = torch.as_tensor(steps)
    if steps.dtype != torch.bool:
        idx = steps.long().reshape(1, -1).expand(B, -1) if steps.dim() < 2 else steps.long()
        if idx.shape[0] != B or bool((idx < 0).any()) or bool((idx >= T).any()):
            raise ValueError(f"step indices must be in 0..{T - 1}, one row per sample ({B})")
        steps = torch.zeros(B, T, dtype=torch.bool).scatter_(1, idx.cpu(), True)
    return recompute_edges(as_adapter(pipe), traj.payload, steps, traj.cond, traj.kernel, traj.reduction,
                           reference=reference, kl_type=kl_type)
