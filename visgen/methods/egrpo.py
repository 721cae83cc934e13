"""E-GRPO (Zhang, Zhang, Dai & Duan, "E-GRPO: High Entropy Steps Drive Effective Reinforcement Learning for Flow
Models", 2026): entropy-aware step merging, one ODE anchor path per prompt, groups that share a consolidated step.

**Step entropy.** An SDE step is the Gaussian ``N(mean, std^2 I_d)``; its entropy per latent element is
``H = 1/2 log(2 pi e std^2)`` (``shared_rl.flow_kernels.gaussian_entropy``), with ``std`` the kernel's transition std (for
the Flow-GRPO SDE ``std = a sqrt(sigma / (1 - sigma)) sqrt(sigma - sigma_next)``). Early (high-noise) steps have
high entropy; late steps have so little that siblings come out nearly identical and the group has no signal.

**Merging** (:func:`merge_schedule`). Within the eligible grid steps ``[start, stop)`` (``stop`` =
``ceil(train_fraction * T)``, capped so the final step is never inside a merged step), walk left to right; at
step ``i`` take the smallest ``k >= 1`` with ``H(sigma_i -> sigma_{i+k}) >= tau`` (capped by ``max_merge`` and by
``i + k <= T - 1``), emit the consolidated SDE step ``(i, k)`` and continue at ``i + k``. ``tau`` is ``threshold``
when given, else the entropy of the first eligible single step (the merged steps are made about as exploratory as
the noisiest step). ``schedule: [[i, k], ...]`` overrides the automatic result.

**Rollout** (:func:`egrpo_forest`). Per prompt one initial noise and one deterministic ODE *anchor* path over the
grid. For every consolidated step ``(i, k)`` a group of ``rollout.group_size`` members branches from the anchor latent
``x_i``: one SDE step ``sigma_i -> sigma_{i+k}`` (its velocity is the anchor's own forward at ``x_i``, computed
once), then ODE on grid steps ``i+k .. T-1`` to the image. As a ``Rollout`` every (prompt, consolidated step) pair
is one tree: the root is the anchor latent (no edge), the members are its leaves, and only their SDE step trains.

**Advantages** (multi-step group-normalised): ``A = (r - mean_g) / (std_g + eps)`` within the group ``g`` that shares
the consolidated step — ``shared_rl``'s ``depth_zscore`` (or ``grpo``) on these one-level trees. Each member trains
exactly one step, so the token-mean surrogate is ``1/(J G) * sum_j sum_{m in g_j} ...``: the per-step group terms
summed over the consolidated steps (a constant factor).
"""
from __future__ import annotations

import math

import torch

from shared_rl.config import ConfigError
from shared_rl.flow_kernels import flow_step, gaussian_entropy, get_kernel

from ..engine import Forwarder, Level, StepSegment, grow_forest
# the settings and the config-time checks are torch-free (visgen.method_settings); their names stay here
from ..method_settings import EGRPOSettings, EGRPOSpec
from .base import Grown, RolloutMethod, register_method

__all__ = ["EGRPOSettings", "EGRPO", "step_entropy", "grid_entropies", "merge_schedule", "egrpo_forest",
           "coarse_tail", "granular_tails"]


def step_entropy(sigma: torch.Tensor | float, sigma_next: torch.Tensor | float, kernel: str, noise_level: float,
                 reduction: str = "mean", numel: int = 1) -> torch.Tensor:
    """Entropy of the Gaussian transition ``sigma -> sigma_next`` of ``kernel`` (per element for ``mean``).

    The std does not depend on the latent or the velocity for any kernel, so it is read off a dummy step.
    """
    sig = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1)
    nxt = torch.as_tensor(sigma_next, dtype=torch.float32).reshape(-1).expand_as(sig)
    zeros = torch.zeros(sig.numel(), 1)
    out = get_kernel(kernel)(zeros, zeros, sig, nxt, noise_level, next_sample=zeros)
    return gaussian_entropy(out.std.reshape(-1), numel, reduction)


def grid_entropies(sigmas: torch.Tensor, kernel: str, noise_level: float) -> torch.Tensor:
    """``[T]`` per-element entropy of each single grid step ``sigmas[i] -> sigmas[i+1]``."""
    s = sigmas.detach().float().cpu()
    return step_entropy(s[:-1], s[1:], kernel, noise_level)


def merge_schedule(sigmas: torch.Tensor, kernel: str, noise_level: float, s: EGRPOSettings) -> tuple[list[tuple[int, int]], float]:
    """The consolidated SDE steps ``[(i, k), ...]`` and the threshold used (see the module docstring)."""
    sig = sigmas.detach().float().cpu()
    T = sig.numel() - 1
    if s.schedule:
        sched = [(int(i), int(k)) for i, k in s.schedule]
        return (sched[: s.max_groups] if s.max_groups else sched), float("nan")
    stop = min(math.ceil(s.train_fraction * T), T - 1)
    tau = float(step_entropy(sig[s.start], sig[s.start + 1], kernel, noise_level)) if s.threshold is None else float(s.threshold)
    sched: list[tuple[int, int]] = []
    i = s.start
    while i < stop:
        k = 1
        while (float(step_entropy(sig[i], sig[i + k], kernel, noise_level)) < tau and k < s.max_merge
               and i + k + 1 <= T - 1):
            k += 1
        sched.append((i, k))
        i += k
    if s.max_groups:
        sched = sched[: s.max_groups]
    return sched, tau


@torch.no_grad()
def egrpo_forest(adapter, cond, keys: list[int], sigmas: torch.Tensor, timesteps: torch.Tensor, s: EGRPOSettings,
                 group_size: int, generator: torch.Generator | None, kernel: str, noise_level: float,
                 reduction: str = "mean", micro_batch: int = 0, first_forward_id: int = 0):
    """Anchor paths + one group per (prompt, consolidated step); returns ``(forest, root_cond, root_keys, info)``.

    Root order is prompt-major: root ``p * J + j`` is prompt ``p`` at consolidated step ``j``.
    """
    T = int(timesteps.numel())
    sched, tau = merge_schedule(sigmas, kernel, noise_level, s)
    if not sched:
        raise ConfigError("visgen.tree.egrpo: the merge schedule is empty; lower start or raise train_fraction")
    J, P = len(sched), len(keys)
    x = adapter.prepare_latents(P, cond, generator)
    device = x.device
    fwd = Forwarder(adapter, micro_batch, first_forward_id)
    starts = {i for i, _ in sched}
    last = max(starts)
    anchor: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    sig = sigmas.to(device)
    for i in range(last + 1):  # the anchor ODE path; its forward at a consolidated step is the members' step 0
        v, ids, slots = fwd(x, timesteps[i].expand(P).to(device), cond)
        if i in starts:
            anchor[i] = (x.clone(), v, ids, slots)
        if i < last:
            x = flow_step("ode", x, v, sig[i], sig[i + 1], 0.0).next_sample
    segments = []
    for i, k in sched:
        tail = list(range(i + k, T))
        segments.append(StepSegment.from_grid(sigmas, timesteps, [(i, k)] + [(t, 1) for t in tail],
                                              [True] + [False] * len(tail), [True] + [False] * len(tail),
                                              [noise_level] + [0.0] * len(tail)))
    order = [(p, j) for p in range(P) for j in range(J)]
    root_latents = torch.stack([anchor[sched[j][0]][0][p] for p, j in order])
    first_v = torch.stack([anchor[sched[j][0]][1][p] for p, j in order])
    first_ids = torch.stack([anchor[sched[j][0]][2][p] for p, j in order])
    first_slots = torch.stack([anchor[sched[j][0]][3][p] for p, j in order])
    root_index = torch.tensor([p for p, _ in order], dtype=torch.long)
    root_cond = cond[root_index.to(device)]
    level = Level.stack([group_size] * len(order), [segments[j] for _, j in order])
    forest = grow_forest(adapter, root_cond, root_latents, [level], generator, kernel, reduction, micro_batch,
                         fwd.next_id, first_velocity=(first_v, first_ids, first_slots))
    forest.nfe += fwd.nfe
    forest.forwards += fwd.calls
    info = {"egrpo/groups_per_prompt": float(J), "egrpo/threshold": tau,
            "egrpo/mean_merge": sum(k for _, k in sched) / J}
    return forest, root_cond, [keys[p] for p, _ in order], info


def coarse_tail(start: int, num_steps: int, stride: int) -> list[int]:
    """The grid indices an ODE tail of ``stride`` visits from grid index ``start`` to the image (index
    ``num_steps``, sigma 0), as the reference's multi-granularity sampler (shengjun-zhang/VisualGRPO
    ``flux_sampler.sample``: the schedule ``sigma[:start+1] + sigma[start+1::stride]``, whose last executed step's
    x0-prediction is the image): ``[start] + S[:-1] + [num_steps]`` with ``S = start+1, start+1+stride, ...``
    (<= num_steps). Stride 1 is the full grid tail."""
    s = list(range(start + 1, num_steps + 1, stride))
    return [start] + s[:-1] + [num_steps]


@torch.no_grad()
def granular_tails(adapter, cond, latents: torch.Tensor, starts: torch.Tensor, sigmas: torch.Tensor,
                   timesteps: torch.Tensor, stride: int, micro_batch: int = 0) -> tuple[torch.Tensor, int]:
    """``(images' latents [n, *latent], nfe)``: every row of ``latents`` (at grid index ``starts[i]``) run to the image
    by the Euler ODE along :func:`coarse_tail`; rows with the same start share their forwards."""
    T = int(timesteps.numel())
    out = torch.empty_like(latents)
    fwd = Forwarder(adapter, micro_batch)
    sig = sigmas.to(latents.device)
    for e in torch.unique(starts).tolist():
        rows = torch.nonzero(starts == e).flatten().to(latents.device)
        x, c = latents[rows].clone(), cond[rows]
        path = coarse_tail(int(e), T, stride)
        for a, b in zip(path[:-1], path[1:]):
            v, _, _ = fwd(x, timesteps[a].expand(rows.numel()).to(latents.device), c)
            x = flow_step("ode", x, v, sig[a], sig[b], 0.0).next_sample
        out[rows] = x
    return out, fwd.nfe


@register_method
class EGRPO(EGRPOSpec, RolloutMethod):
    """E-GRPO: one group of ``rollout.group_size`` members per (prompt, consolidated SDE step)."""

    def grow(self, adapter, cond, keys, group_size, sigmas, timesteps, generator, iteration, k, first_forward_id):
        forest, root_cond, root_keys, info = egrpo_forest(
            adapter, cond, list(keys), sigmas, timesteps, self.settings, group_size, generator, k.kernel,
            k.noise_level, k.reduction, k.micro_batch, first_forward_id)
        R, J = len(root_keys), len(root_keys) // max(len(keys), 1)
        granular = {}
        if self.reward_granularities():  # each member's image again by coarser ODE tails from its SDE step's end
            sched, _ = merge_schedule(sigmas, k.kernel, k.noise_level, self.settings)
            ends = torch.tensor([i + m for i, m in sched], dtype=torch.long)
            leaves = forest.leaves()
            roots = forest.tree.group[leaves]
            start_latents = forest.latents[leaves.to(forest.latents.device), 1]
            for g in self.reward_granularities():
                granular[g], nfe = granular_tails(adapter, root_cond[roots.to(forest.latents.device)], start_latents,
                                                  ends[roots % J], sigmas, timesteps, g, k.micro_batch)
                forest.nfe += nfe
        # roots are prompt-major (root p * J + j: prompt p at consolidated step j); one group per root
        return Grown(forest, root_cond, torch.arange(R), root_keys, torch.arange(len(keys)).repeat_interleave(J), info,
                     granular)
