"""visgen training objectives, registered by name: what ``log_probs`` computes for the configured policy loss.

``visgen.objective: {name: ...}`` (a tagged union like ``visgen.method``):

- ``log_prob`` (default) — the Flow-GRPO family: the stored SDE steps' log-probs are recomputed with grad
  (``visgen.recompute``) for a ratio-based policy loss (``loss.policy_loss``: clipped, gspo, cispo, sapo, guard).
- ``nft`` — DiffusionNFT (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
  NVlabs, ICLR 2026), as NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``: rollouts are sampled with the *old*
  policy (a lagging copy of the adapter), which is soft-updated once per iteration, θ_old ← d·θ_old + (1 − d)·θ
  with d = min(0.5, 0.001·optimizer steps so far) (the reference's ``return_decay`` type 1), and stays fixed during
  the iteration's optimizer steps. Training uses only the clean samples x0 and rewards: at
  ``int(timestep_fraction · T)`` grid timesteps t per sample (a per-sample permutation, 9 of 10 by default; fresh
  noise ε and a fresh permutation every inner epoch) ``x_t = (1 − t)·x0 + t·ε``;
  ``v⁺ = β·v_θ + (1 − β)·v_old``, ``v⁻ = (1 + β)·v_old − β·v_θ``; ``x̂0(v) = x_t − t·v``;
  ``P = ‖x̂0(v⁺) − x0‖² / (β·w⁺)``, ``N = ‖x̂0(v⁻) − x0‖² / (β·w⁻)`` (mean over elements), with the adaptive
  weights ``w = mean|x̂0 − x0|`` detached. The ``nft`` policy loss mixes them: ``A_max·[r·P + (1 − r)·N]``,
  ``r = clip(A/A_max/2 + 1/2, 0, 1)`` after the reference's ``adv_mode``. ``branches: positive | negative`` is
  grove's own ablation (drops one branch loss), not the reference's knob.
- ``awm`` — Advantage Weighted Matching (Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining
  in Diffusion Models", 2025), as scxue/advantage_weighted_matching ``train_sd3_awm.py``: the likelihood
  ``log p = −w(t)·‖v_θ(x_t, t) − (ε − x0)‖²`` (``weighting``: the released ``ghuber`` with power 0.25, × t) in a
  PPO clipped surrogate (the ``awm`` policy loss; the behaviour log p is the trainer's first forward, so the first
  optimizer step on a batch has ratio 1), ``advantage_max`` rescaling, and an EMA-KL term ``‖v_θ − v_ema‖²`` to
  an EMA of the adapter updated once per iteration with d = min(0.3, 0.001·steps). Timesteps: ``time_type``
  ``discrete_wo_init`` (the released geneval/ocr configs): one per stratum of the grid steps 1..int(0.9·T).
- ``dgpo`` — Direct Group Preference Optimization (Luo, Hu & Tang, ICLR 2026; Luo-Yihong/DGPO
  ``train_sd3_dgpo.py``): ``timesteps_per_sample`` timesteps drawn once per rollout call among grid steps
  ``0..trunc_steps`` (shared by every sample), one noise per group and timestep (``shared_noise``); per sample the
  denoising loss ``dsm = ‖v_θ − (ε − x0)‖²`` and the reference's (the adapter off); the ``dgpo`` policy loss weights
  each sample's dsm by its group's preference σ(β/G Σ A_i (dsm_i − dsm_ref,i)).
- ``dpo`` — online Diffusion-DPO (yifan123/flow_grpo ``scripts/train_sd3_dpo.py``, verl-omni ``DPOLoss``): the
  live policy samples (SDE), per group its best and worst sample form the pair (the ``dpo`` loss picks them by
  advantage), ``int(timestep_fraction · T)`` slots per sample, each with one noise and one logit-normal timestep per
  group (chosen and rejected share both), velocity errors under the policy and the reference (the adapter off),
  ``−log σ(−β/2·[(err_w − err_ref,w) − (err_l − err_ref,l)])``.
- ``flow_dppo`` — Flow-DPPO (arXiv 2606.11025; Tencent-Hunyuan/UniRL ``flowdppo.py``): not likelihood-free; the
  Flow-GRPO recompute plus the KL of each step's mean to the old policy's (the weights that sampled the batch,
  frozen for it), which the ``flow_dppo`` loss masks with in place of the ratio clip.
- ``opd`` — diffusion on-policy distillation (verl-omni ``DistillKLLoss``): the student's own SDE trajectories
  replayed by a frozen teacher of the same family; the ``opd`` loss is mean ‖μ_θ − μ_T‖²/(2σ_t²) over the trained
  steps, alone or added to Flow-GRPO's clipped surrogate (``with_grpo``) with ``distill_coef``.
- ``crd`` — Centered Reward Distillation (arXiv 2603.14128; Flow-Factory ``trainers/crd.py``): rollouts by a
  "sampling" snapshot; the implicit reward from the policy's and an "old" snapshot's normalised velocity errors,
  centred per group with the mapped advantages and regressed (``crd`` loss), plus the velocity KL to the CFG-guided
  reference; both snapshots on their own decay schedules.

- ``diffusion_opsd`` — DiffusionOPSD (worldbench/DiffusionOPSD ``train_opsd_ri_sd3.py``): the EMA behaviour policy
  (the old copy, sampling by DPM-Solver++(2M)) predicts the clean image at one low-noise query state per
  trajectory; moved up and down a differentiable reward's gradient inside a trust ball it gives the targets of
  NFT-like positive/negative branch losses at that state, mixed by the clipped advantage.

A likelihood-free objective is chosen once: it brings its policy loss (``VisgenConfig.policy_loss``, with its
settings) and, unless ``visgen.method`` says otherwise, the deterministic ODE sampler (``default_method``; each
reference samples deterministically, and all train on clean samples from any sampler).

All take the optional velocity KL to the adapter-off reference, ``‖v_θ − v_ref‖²`` (``loss.kl_coef``; DGPO
computes the reference's velocity anyway). Their training timesteps ("slots") are drawn at rollout time from the
rollout's own grid, so the trained "steps" of a rollout row are the K slots (columns ``0..K-1`` of its mask) rather
than SDE steps, and only leaves (rows that end in an image) train. Everything a slot needs (x0, t, ε) is stored
at rollout time (NFT redraws t and ε for inner epochs after the first from a per-row seed), so recomputation is
deterministic and splitting a minibatch into micro-batches gives the same gradient.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ContextManager

import torch

from shared_rl.config import ConfigError
from shared_rl.domain import StepLogProbs

from .engine import stock_randn_tensor
# each objective's settings, policy loss and config-time checks are torch-free (the config reads them without this
# module); their names stay here (visgen.objectives.NFTSettings, ...)
from .objective_settings import (AWM_WEIGHTINGS, AWMSettings, AWMSpec, CRDSettings, CRDSpec, DGPOSettings,  # noqa: F401
                                 DGPOSpec, DiffusionOPSDSettings, DiffusionOPSDSpec, DPOSettings, DPOSpec,
                                 FlowDPPOSettings, FlowDPPOSpec, LogProbSettings, LogProbSpec, NFTSettings, NFTSpec,
                                 ObjectiveSpec, OldPolicySchedule, OPDSettings, OPDSpec, objective_from_registry)

__all__ = ["OBJECTIVES", "Objective", "LogProbObjective", "NFTObjective", "AWMObjective", "DGPOObjective",
           "DPOObjective", "FlowDPPOObjective", "OPDObjective", "CRDObjective", "DiffusionOPSDObjective", "logit_normal_sigmas",
           "OldPolicySchedule", "objective_from_config", "nft_branch_losses", "flow_matching_loss",
           "awm_log_likelihood", "stratified_steps", "AWM_WEIGHTINGS", "opsd_query_index", "trust_ball_targets",
           "opsd_branch_losses"]


def _mean_elements(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(1)


def nft_branch_losses(x0: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor,
                      v_old: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DiffusionNFT's per-sample positive and negative branch losses ``(P, N)`` ``[m]`` (formulas in the module
    docstring). ``sigma`` ``[m]`` is the noise level t of ``x_t``; ``v_old`` carries no grad."""
    s = sigma.reshape(-1, *([1] * (x0.dim() - 1))).to(x0)
    v_old = v_old.detach()
    v_pos = beta * v + (1.0 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v
    err_pos = (x_t - s * v_pos) - x0
    err_neg = (x_t - s * v_neg) - x0
    w_pos = _mean_elements(err_pos.detach().abs()).clamp(min=1e-5)
    w_neg = _mean_elements(err_neg.detach().abs()).clamp(min=1e-5)
    return _mean_elements(err_pos**2) / (beta * w_pos), _mean_elements(err_neg**2) / (beta * w_neg)


def flow_matching_loss(x0: torch.Tensor, eps: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The rectified-flow (pretraining) loss ``‖v − (ε − x0)‖²`` per sample (mean over elements)."""
    return _mean_elements((v - (eps - x0)) ** 2)




def awm_log_likelihood(x0: torch.Tensor, eps: torch.Tensor, v: torch.Tensor, t: torch.Tensor, weighting: str,
                       ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's per-sample log-likelihood ``[m]`` (scxue/advantage_weighted_matching ``compute_log_prob_awm``), with
    e = ‖v − (ε − x0)‖² (mean over elements, in float64) and t the noise level:
    ``Uniform`` −e; ``t`` −e·t; ``t**2`` −e·t²; ``huber`` −(√(e + 1e-10) − 1e-5)·t;
    ``ghuber`` −((e + 1e-10)^p − (1e-10)^p)·t/p (p = ``ghuber_power``)."""
    e = _mean_elements((v.double() - (eps.double() - x0.double())) ** 2)
    t = t.reshape(-1).double()
    if weighting == "Uniform":
        out = -e
    elif weighting == "t":
        out = -e * t
    elif weighting == "t**2":
        out = -e * t**2
    elif weighting == "huber":
        out = -(torch.sqrt(e + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        p = float(ghuber_power)
        out = -((e + 1e-10) ** p - 1e-10**p) * t / p
    else:
        raise ValueError(f"unknown AWM weighting {weighting!r}; choose one of {AWM_WEIGHTINGS}")
    return out.float()


def stratified_steps(num_steps: int, k: int, fraction: float, time_type: str, n: int,
                     generator: torch.Generator | None) -> torch.Tensor:
    """``[n, k]`` grid-step indices per row, as AWM's discrete time types: the range ``[lo, int(fraction·T)]``
    (``discrete`` lo 0, ``discrete_wo_init`` lo 1) cut into k strata at ``linspace(lo, hi, k + 1)`` (truncated to
    integers), one uniform index per stratum; ``discrete_with_init``: index 0 then k − 1 strata of [1, hi]."""
    hi = int(num_steps * fraction)
    if time_type == "discrete_with_init":
        first = torch.zeros(n, 1, dtype=torch.long)
        if k == 1:
            return first
        return torch.cat([first, stratified_steps(num_steps, k - 1, fraction, "discrete_wo_init", n, generator)], 1)
    lo = 0 if time_type == "discrete" else 1
    bounds = torch.linspace(lo, hi, k + 1).long()
    lower, upper = bounds[:-1], bounds[1:]
    u = torch.rand(n, k, generator=generator)
    return lower + (u * (upper - lower)).long()


def opsd_query_index(sigmas: torch.Tensor, num_steps: int, query_sigma: float) -> int:
    """DiffusionOPSD's query step: the grid step of the rollout states ``0..num_steps-1`` whose sigma is nearest
    ``query_sigma``, at least 1 (the reference's ``max(argmin |sigma - q|, 1)``)."""
    sig = sigmas.detach().float().cpu()[:num_steps]
    return max(int(torch.argmin((sig - float(query_sigma)).abs())), 1)


def _row_norm(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).norm(dim=1).reshape(-1, *([1] * (x.dim() - 1)))


def trust_ball_targets(y0: torch.Tensor, reward_grad: Callable[[torch.Tensor], torch.Tensor], rho: float,
                       n_ascent: int, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DiffusionOPSD's targets ``(y⁺, y⁻)`` (the reference's ``_opa_tr_step`` in both directions): from the anchor
    y0, ``n_ascent`` steps of length ``eta·ρ‖y0‖/n_ascent`` along ±g/(‖g‖ + 1e-12), g = ∇R at the current point
    (``reward_grad``; the first one at y0 is shared by both directions), each followed by the clamp into the ball
    ‖y − y0‖ ≤ ρ‖y0‖ (``y0 + d·min(1, ρ‖y0‖/(‖d‖ + 1e-12))``). Norms per sample over all latent elements."""
    y0 = y0.detach().float()
    budget = rho * _row_norm(y0)
    step = eta * budget / max(n_ascent, 1)
    first = reward_grad(y0) if n_ascent > 0 else None
    out = []
    for sign in (1.0, -1.0):
        y = y0.clone()
        for i in range(n_ascent):
            g = first if i == 0 else reward_grad(y)
            y = y + sign * step * g / (_row_norm(g) + 1e-12)
            d = y - y0
            y = (y0 + d * torch.clamp(budget / (_row_norm(d) + 1e-12), max=1.0)).detach()
        out.append(y)
    return out[0], out[1]


def opsd_branch_losses(z_q: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor, v_old: torch.Tensor,
                       y_plus: torch.Tensor, y_minus: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DiffusionOPSD's per-sample branch losses ``(P, N)`` ``[m]`` at the query state z_q (noise level σ_q):
    ``v⁺ = β v + (1 − β) v_old``, ``v⁻ = (1 + β) v_old − β v``, ``ŷ± = z_q − σ_q v±``;
    ``P = mean (ŷ⁺ − y⁺)²/w⁺``, ``N = mean (ŷ⁻ − y⁻)²/w⁻``, ``w± = mean |ŷ± − y±|`` detached (float64), clipped at
    1e-5; no division by β (the reference's OPA loss)."""
    s = sigma.reshape(-1, *([1] * (z_q.dim() - 1))).to(z_q)
    v_old = v_old.detach().float()
    v = v.float()
    pred_pos = z_q - s * (beta * v + (1.0 - beta) * v_old)
    pred_neg = z_q - s * ((1.0 + beta) * v_old - beta * v)
    w_pos = _mean_elements((pred_pos.detach().double() - y_plus.double()).abs()).clamp(min=1e-5)
    w_neg = _mean_elements((pred_neg.detach().double() - y_minus.double()).abs()).clamp(min=1e-5)
    shape = (-1, *([1] * (z_q.dim() - 1)))
    pos = _mean_elements((pred_pos - y_plus) ** 2 / w_pos.reshape(shape).to(pred_pos))
    neg = _mean_elements((pred_neg - y_minus) ** 2 / w_neg.reshape(shape).to(pred_neg))
    return pos, neg


def logit_normal_sigmas(n: int, mean: float, std: float, shift: float, num_train_timesteps: int,
                        generator: torch.Generator | None) -> torch.Tensor:
    """``[n]`` noise levels as flow_grpo's DPO trainer draws them (diffusers ``compute_density_for_timestep_sampling``
    ``logit_normal``): u = sigmoid(N(mean, std)), index = int(u·N), sigma of the shifted N-step training grid at that
    index, s = (N − index)/N, sigma = shift·s / (1 + (shift − 1)·s)."""
    u = torch.sigmoid(torch.randn(n, generator=generator) * std + mean)
    index = (u * num_train_timesteps).long().clamp(max=num_train_timesteps - 1)
    s = (num_train_timesteps - index).double() / num_train_timesteps
    return (shift * s / (1 + (shift - 1) * s)).float()


# ------------------------------------------------------------------------------------------------ registry
class Objective(ObjectiveSpec):
    """A registered objective: ``ObjectiveSpec`` (its ``name``, settings, the policy loss it feeds, the old policy it
    reads and its checks) with the training-time parts: its training slots and its loss terms."""

    def select_rows(self, scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor | None:
        """``[n]`` bool: the rows of a rollout that train, from each row's trained reward ``scores`` (the weighted sum
        of the trained outputs) and group; None: every leaf (default)."""
        return None
    def slot_steps(self, n: int, num_steps: int, generator, groups: torch.Tensor) -> torch.Tensor:
        """``[n, K]`` grid-step indices of each row's training slots (default: K distinct uniform steps per row)."""
        return torch.rand(n, num_steps, generator=generator).argsort(1)[:, : self.num_slots(num_steps)]

    def slot_noise(self, n: int, k: int, shape: tuple, device, generator, groups: torch.Tensor) -> torch.Tensor:
        """``[n, K, *latent]`` fresh noise of each slot (default: independent per row)."""
        return stock_randn_tensor((n, k, *shape), generator=generator, device=device, dtype=torch.float32)

    def training_slots(self, is_leaf: torch.Tensor, node_latent: torch.Tensor, num_columns: int,
                       sigmas: torch.Tensor, timesteps: torch.Tensor, generator,
                       groups: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """``(mask [n, max(num_columns, K)], payload entries)``: ``K`` grid timesteps per leaf row (the objective's
        ``slot_steps``), their noise levels, model timesteps and fresh noise (drawn from ``generator`` after
        sampling and scoring), and a per-row seed for later inner epochs (``redraw_slots``)."""
        T = int(timesteps.numel())
        K = self.num_slots(T)
        n = int(is_leaf.numel())
        self.check_steps(T, f"visgen.objective {self.name}")
        groups = torch.zeros(n, dtype=torch.long) if groups is None else groups.cpu()
        choice = self.slot_steps(n, T, generator, groups)
        sig, ts = sigmas.detach().float().cpu(), timesteps.detach().float().cpu()
        noise = self.slot_noise(n, K, tuple(node_latent.shape[1:]), node_latent.device, generator, groups)
        seeds = torch.randint(0, 2**62, (n,), generator=generator)
        mask = torch.zeros(n, max(num_columns, K), dtype=torch.bool)
        mask[is_leaf, :K] = True
        return mask, {"x0": node_latent.float(), "obj_sigma": sig[choice], "obj_timestep": ts[choice],
                      "obj_noise": noise, "obj_seed": seeds, "obj_grid_sigma": sig[None, :T].expand(n, T),
                      "obj_grid_timestep": ts[None, :T].expand(n, T)}

    def redraw_slots(self, payload: dict[str, Any], epoch: int) -> dict[str, Any]:
        """The payload an inner epoch trains on: the rollout's draw for epoch 0 (default: every epoch)."""
        return payload

    def terms(self, adapter, payload: dict[str, Any], mask: torch.Tensor, cond,
              reference: Callable[[], ContextManager] | None, old: Callable[[], ContextManager] | None,
              need_kl: bool = False) -> StepLogProbs:
        raise NotImplementedError

    def _slots(self, payload: dict[str, Any], mask: torch.Tensor, k: int):
        rows = torch.nonzero(mask[:, k].cpu()).flatten()
        x0 = payload["x0"]
        d = rows.to(x0.device)
        sigma = payload["obj_sigma"][rows, k].to(x0.device)
        eps = payload["obj_noise"][d, k]
        s = sigma.reshape(-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - s) * x0[d] + s * eps
        return rows, d, x0[d], eps, x_t, sigma, payload["obj_timestep"][rows, k].to(x0.device)

    def _live_slots(self, payload: dict[str, Any], mask: torch.Tensor):
        slots = [(k, *self._slots(payload, mask, k)) for k in range(payload["obj_sigma"].shape[1])]
        return [sl for sl in slots if sl[1].numel()]


OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(cls: type[Objective]) -> type[Objective]:
    if cls.name in OBJECTIVES:
        raise ValueError(f"visgen objective {cls.name!r} is already registered")
    OBJECTIVES[cls.name] = cls
    return cls


def _velocity_kl(adapter, x_t, t, c, v, reference):
    """``(‖v − v_ref‖² per row, v_ref)`` under the reference (no grad)."""
    with torch.no_grad(), reference():
        v_ref = adapter.velocity(x_t, t, c)
    return _mean_elements((v - v_ref) ** 2), v_ref


@register_objective
class LogProbObjective(LogProbSpec, Objective):
    """Flow-GRPO and its flat/tree relatives: recomputed step log-probs (``visgen.recompute``)."""


@register_objective
class NFTObjective(NFTSpec, Objective):
    """DiffusionNFT (NVlabs, ICLR 2026): implicit positive / negative velocities around the old policy's, at
    fresh-noise slots of the clean samples."""

    def redraw_slots(self, payload: dict[str, Any], epoch: int) -> dict[str, Any]:
        """Inner epoch ``epoch`` >= 1 trains on a fresh permutation of the grid and fresh noise per row, drawn from
        the row's seed (the reference draws both anew in every inner epoch), the same for any micro-batching."""
        if epoch <= 0:
            return payload
        x0 = payload["x0"]
        n, K = payload["obj_sigma"].shape
        T = payload["obj_grid_sigma"].shape[1]
        choice, noise = torch.zeros(n, K, dtype=torch.long), []
        for i, seed in enumerate(payload["obj_seed"].tolist()):
            gen = torch.Generator().manual_seed((int(seed) + 1_000_003 * epoch) % 2**63)
            choice[i] = torch.randperm(T, generator=gen)[:K]
            noise.append(torch.randn((K, *x0.shape[1:]), generator=gen))
        out = dict(payload)
        out["obj_sigma"] = payload["obj_grid_sigma"].gather(1, choice)
        out["obj_timestep"] = payload["obj_grid_timestep"].gather(1, choice)
        out["obj_noise"] = torch.stack(noise).to(x0.device)
        return out

    def terms(self, adapter, payload, mask, cond, reference, old, need_kl=False):
        s = self.settings
        if old is None:
            raise RuntimeError("the nft objective needs the old policy (FlowPolicy.enable_old_policy)")
        n, L = mask.shape
        dev = payload["x0"].device
        pos, neg = torch.zeros(n, L, device=dev), torch.zeros(n, L, device=dev)
        kl = torch.zeros(n, L, device=dev) if need_kl else None
        per_forward, nfe = adapter.forwards_per_step(cond), 0
        slots = self._live_slots(payload, mask)
        # the old policy's velocities first, under ONE weight swap: swapping weights in place between forwards
        # that keep their graph for backward would invalidate that graph
        with torch.no_grad(), old():
            v_olds = [adapter.velocity(x_t, t, cond[d]) for _k, _rows, d, _x0, _eps, x_t, _sigma, t in slots]
        for (k, rows, d, x0, _eps, x_t, sigma, t), v_old in zip(slots, v_olds):
            c = cond[d]
            v = adapter.velocity(x_t, t, c)
            p, q = nft_branch_losses(x0, x_t, sigma, v, v_old, s.beta)
            if s.branches == "positive":
                q = q * 0.0
            elif s.branches == "negative":
                p = p * 0.0
            cols = torch.full_like(d, k)
            pos, neg = pos.index_put((d, cols), p), neg.index_put((d, cols), q)
            nfe += 2 * per_forward * rows.numel()
            if kl is not None:
                value, _ = _velocity_kl(adapter, x_t, t, c, v, reference)
                kl = kl.index_put((d, cols), value)
                nfe += per_forward * rows.numel()
        return StepLogProbs(logp=torch.zeros(n, L, device=dev), kl=kl, nfe=nfe, objective_pos=pos, objective_neg=neg)


@register_objective
class AWMObjective(AWMSpec, Objective):
    """AWM (Xue et al., 2025): the pretraining flow-matching loss on the policy's own samples, weighted by the advantage."""

    def slot_steps(self, n, num_steps, generator, groups):
        s = self.settings
        if s.time_type == "random":
            return super().slot_steps(n, num_steps, generator, groups)
        return stratified_steps(num_steps, s.timesteps_per_sample, s.timestep_fraction, s.time_type, n, generator)

    def terms(self, adapter, payload, mask, cond, reference, old, need_kl=False):
        s = self.settings
        n, L = mask.shape
        dev = payload["x0"].device
        logp, ema_kl = torch.zeros(n, L, device=dev), torch.zeros(n, L, device=dev)
        kl = torch.zeros(n, L, device=dev) if need_kl else None
        per_forward, nfe = adapter.forwards_per_step(cond), 0
        slots = self._live_slots(payload, mask)
        v_emas = [None] * len(slots)
        # the EMA copy's velocities first, under one weight swap (see NFTObjective.terms); without grad (the
        # trainer's up-front behaviour log p of a several-minibatch iteration) only log p is read: no EMA forward
        if s.ema_beta > 0 and torch.is_grad_enabled():
            with torch.no_grad(), old():
                v_emas = [adapter.velocity(x_t, t, cond[d]) for _k, _rows, d, _x0, _eps, x_t, _sigma, t in slots]
        for (k, rows, d, x0, eps, x_t, sigma, t), v_ema in zip(slots, v_emas):
            c = cond[d]
            v = adapter.velocity(x_t, t, c)
            cols = torch.full_like(d, k)
            logp = logp.index_put((d, cols), awm_log_likelihood(x0, eps, v, sigma, s.weighting, s.ghuber_power))
            nfe += per_forward * rows.numel()
            if v_ema is not None:
                ema_kl = ema_kl.index_put((d, cols), _mean_elements((v - v_ema) ** 2))
                nfe += per_forward * rows.numel()
            if kl is not None:
                value, _ = _velocity_kl(adapter, x_t, t, c, v, reference)
                kl = kl.index_put((d, cols), value)
                nfe += per_forward * rows.numel()
        return StepLogProbs(logp=logp, kl=kl, nfe=nfe, objective_pos=ema_kl)


@register_objective
class DGPOObjective(DGPOSpec, Objective):
    """DGPO: group-level preference of the flow-matching errors, the whole group in one forward call."""

    def slot_steps(self, n, num_steps, generator, groups):
        """``timesteps_per_sample`` distinct grid steps of ``0..trunc_steps``, the same for every row (the reference
        draws one set per inner epoch for the whole batch)."""
        K, pool = self.settings.timesteps_per_sample, self.settings.trunc_steps + 1
        pick = torch.rand(pool, generator=generator).argsort()[:K]
        return pick[None, :].expand(n, K).clone()

    def slot_noise(self, n, k, shape, device, generator, groups):
        if not self.settings.shared_noise:
            return super().slot_noise(n, k, shape, device, generator, groups)
        uniq, inverse = torch.unique(groups, return_inverse=True)
        per_group = stock_randn_tensor((uniq.numel(), k, *shape), generator=generator, device=device, dtype=torch.float32)
        return per_group[inverse.to(device)]

    def terms(self, adapter, payload, mask, cond, reference, old, need_kl=False):
        """Per trained slot: dsm under the policy (with grad) and under the reference (the adapter off), and with the
        ``ema`` old policy dsm under the EMA copy (``logp_old`` = −dsm_old, no grad) — the reference's ``model_v``,
        ``ref_old_v`` and ``old_v``. Without ``train_cfg`` every forward is the conditional branch alone (the
        reference's ``predict_v(..., cfg=False)``), whatever CFG the rollout used."""
        if reference is None:
            raise RuntimeError("the dgpo objective needs the reference policy (the adapter switched off)")
        s = self.settings
        if s.old_policy == "ema" and old is None:
            raise RuntimeError("the dgpo objective's ema old policy needs the policy's old copy (enable_old_policy)")
        if not s.train_cfg and cond.do_cfg:
            cond = dataclasses.replace(cond, do_cfg=False)
        n, L = mask.shape
        dev = payload["x0"].device
        dsm, ref_dsm = torch.zeros(n, L, device=dev), torch.zeros(n, L, device=dev)
        old_dsm = torch.zeros(n, L, device=dev) if s.old_policy == "ema" else None
        kl = torch.zeros(n, L, device=dev) if need_kl else None
        per_forward, nfe = adapter.forwards_per_step(cond), 0
        slots = self._live_slots(payload, mask)
        v_olds = [None] * len(slots)
        if old_dsm is not None:  # the EMA copy's velocities first, under one weight swap (see NFTObjective.terms)
            with torch.no_grad(), old():
                v_olds = [adapter.velocity(x_t, t, cond[d]) for _k, _rows, d, _x0, _eps, x_t, _sigma, t in slots]
        for (k, rows, d, x0, eps, x_t, _sigma, t), v_old in zip(slots, v_olds):
            c = cond[d]
            v = adapter.velocity(x_t, t, c)
            value, v_ref = _velocity_kl(adapter, x_t, t, c, v, reference)
            cols = torch.full_like(d, k)
            dsm = dsm.index_put((d, cols), flow_matching_loss(x0, eps, v))
            ref_dsm = ref_dsm.index_put((d, cols), flow_matching_loss(x0, eps, v_ref))
            if kl is not None:
                kl = kl.index_put((d, cols), value)
            nfe += 2 * per_forward * rows.numel()
            if v_old is not None:
                old_dsm = old_dsm.index_put((d, cols), flow_matching_loss(x0, eps, v_old))
                nfe += per_forward * rows.numel()
        return StepLogProbs(logp=-dsm, kl=kl, nfe=nfe, objective_pos=dsm, objective_neg=ref_dsm,
                            logp_old=None if old_dsm is None else -old_dsm)


@register_objective
class DPOObjective(DPOSpec, Objective):
    """Online Diffusion-DPO (yifan123/flow_grpo ``train_sd3_dpo.py``, verl-omni ``DPOLoss``): the live policy
    samples and the reference is the adapter off (verl-omni); ``reference: ref_adapter``: flow_grpo's lagging "ref"
    copy, refreshed every ``ref_update_step`` optimizer steps, samples and is the reference; per group its best and worst sample (the ``dpo`` loss picks them by advantage) at
    ``K`` slots, each with one noise and one logit-normal timestep per group (so chosen and rejected share both)."""

    def slot_noise(self, n, k, shape, device, generator, groups):
        """One noise per group and slot: chosen and rejected share it (the reference's ``noise[:bsz]`` twice)."""
        uniq, inverse = torch.unique(groups, return_inverse=True)
        per_group = stock_randn_tensor((uniq.numel(), k, *shape), generator=generator, device=device, dtype=torch.float32)
        return per_group[inverse.to(device)]

    def select_rows(self, scores, groups):
        """Only each group's best and worst row train (``shared_rl.losses.dpo_pairs`` on the trained reward, as the
        reference's ``PerPromptStatTracker`` type ``dpo`` on its rewards): the others are never forwarded. The loss
        picks the pair again by advantage among the rows of the call, which are then exactly these two."""
        from shared_rl.losses import dpo_pairs

        scored = torch.nonzero(~torch.isnan(scores)).flatten()  # leaves with a reward (not a tree's inner node)
        chosen, rejected = dpo_pairs(scores[scored].float(), groups[scored])
        chosen, rejected = scored[chosen], scored[rejected]
        keep = torch.zeros(scores.numel(), dtype=torch.bool)
        keep[chosen], keep[rejected] = True, True
        return keep

    def training_slots(self, is_leaf, node_latent, num_columns, sigmas, timesteps, generator, groups=None):
        """The base slots (mask, x0, per-group noise), their noise levels replaced by logit-normal draws, one per group
        and slot; the model timestep is sigma times the grid's timestep scale (SD3: 1000)."""
        mask, payload = super().training_slots(is_leaf, node_latent, num_columns, sigmas, timesteps, generator, groups)
        n, K = payload["obj_sigma"].shape
        groups = torch.zeros(n, dtype=torch.long) if groups is None else groups.cpu()
        uniq, inverse = torch.unique(groups, return_inverse=True)
        s = self.settings
        per_group = logit_normal_sigmas(uniq.numel() * K, s.logit_mean, s.logit_std, s.timestep_shift,
                                        s.num_train_timesteps, generator).reshape(uniq.numel(), K)
        sig = per_group[inverse]
        grid_sig, grid_t = sigmas.detach().float().cpu(), timesteps.detach().float().cpu()
        scale = float(grid_t[0] / grid_sig[0])
        payload["obj_sigma"], payload["obj_timestep"] = sig, sig * scale
        return mask, payload

    def terms(self, adapter, payload, mask, cond, reference, old, need_kl=False):
        """Per trained slot the velocity error ‖v − (ε − x0)‖² under the policy (with grad, ``objective_pos``) and the
        reference (the adapter off, or ``reference: ref_adapter`` the "ref" copy's weights, ``objective_neg``); without
        ``train_cfg`` the conditional branch alone."""
        copy = self.settings.reference == "ref_adapter"
        if copy and old is None:
            raise RuntimeError("the dpo objective's ref adapter is not set up (old_policy() then enable_old_policy)")
        if not copy and reference is None:
            raise RuntimeError("the dpo objective needs the reference policy (the adapter switched off)")
        if not self.settings.train_cfg and cond.do_cfg:
            cond = dataclasses.replace(cond, do_cfg=False)
        n, L = mask.shape
        dev = payload["x0"].device
        err, ref_err = torch.zeros(n, L, device=dev), torch.zeros(n, L, device=dev)
        kl = torch.zeros(n, L, device=dev) if need_kl else None
        per_forward, nfe = adapter.forwards_per_step(cond), 0
        slots = self._live_slots(payload, mask)
        v_refs = [None] * len(slots)
        if copy:  # the "ref" copy (flow_grpo: the same copy sampled the rollouts), all slots under ONE weight swap
            # first: swapping weights in place between forwards that keep their graph would invalidate that graph
            with torch.no_grad(), old():
                v_refs = [adapter.velocity(x_t, t, cond[d]) for _k, _rows, d, _x0, _eps, x_t, _sigma, t in slots]
        for (k, rows, d, x0, eps, x_t, _sigma, t), v_ref in zip(slots, v_refs):
            c = cond[d]
            v = adapter.velocity(x_t, t, c)
            if v_ref is None:
                value, v_ref = _velocity_kl(adapter, x_t, t, c, v, reference)
            else:
                value = _mean_elements((v - v_ref) ** 2)
            cols = torch.full_like(d, k)
            err = err.index_put((d, cols), flow_matching_loss(x0, eps, v))
            ref_err = ref_err.index_put((d, cols), flow_matching_loss(x0, eps, v_ref))
            if kl is not None:
                kl = kl.index_put((d, cols), value)
            nfe += 2 * per_forward * rows.numel()
        return StepLogProbs(logp=torch.zeros(n, L, device=dev), kl=kl, nfe=nfe, objective_pos=err,
                            objective_neg=ref_err)


@register_objective
class FlowDPPOObjective(FlowDPPOSpec, Objective):
    """Flow-DPPO (arXiv 2606.11025; Tencent-Hunyuan/UniRL ``flowdppo.py``): the Flow-GRPO recompute of the stored
    SDE steps, plus the KL between the policy's and the old policy's step means for the ``flow_dppo`` loss's mask.
    The old policy is a copy of the adapter set to the live weights once per iteration before its rollout (decay 0):
    the weights that sampled the batch, frozen for its inner steps (the reference's ``prepare_segment`` replay at the
    pre-update weights; its old log-probs are the rollout's, ``old_logp_source: rollout``)."""


@register_objective
class OPDObjective(OPDSpec, Objective):
    """Diffusion on-policy distillation (verl-omni ``DistillKLLoss``, docs/algo/diffusion_opd.md): the student samples
    its own SDE trajectories (the ``flow_grpo`` sampler), a frozen teacher of the same family and scheduler replays
    every stored trained state, and the ``opd`` loss moves the student's step means to the teacher's. Not
    likelihood-free: the Flow-GRPO recompute of the stored steps gives μ_θ (and the log-probs ``with_grpo`` uses);
    the teacher is the shared old-policy slot filled by a frozen transformer (``TeacherSource``: never updated,
    never checkpointed), so the recompute's ``old_kl`` is ‖μ_θ − μ_T‖²/(2σ_t²), kept with grad."""


@register_objective
class CRDObjective(CRDSpec, Objective):
    """Centered Reward Distillation (arXiv 2603.14128; X-GenGroup/Flow-Factory ``trainers/crd.py``): rollouts by the
    "sampling" snapshot (the old copy, an on-policy copy for the first ``sampling_decay_flat`` steps, then lagging),
    the implicit reward r_θ = −mean[(v_θ − u)²/w_θ − (v_old − u)²/w_old] (u = ε − x0, w the detached mean absolute
    errors) against the "old" snapshot at ``timesteps_per_sample`` stratified grid timesteps per group, and the
    velocity KL to the CFG-guided reference (the adapter off); the ``crd`` loss centres and matches. Both snapshots
    are updated once per iteration, each on its own decay schedule (``visgen.policy.Snapshots``)."""


    def __init__(self, settings) -> None:
        super().__init__(settings)
        self._setup = None  # the Snapshots hook handed to the policy: it reaches the "old" snapshot
        self._negatives: dict = {}
    def slot_steps(self, n, num_steps, generator, groups):
        """One stratified draw per group over grid steps 0..int(fraction·T) (Flow-Factory ``TimeSampler.discrete``:
        one draw per batch, the rows sharing each slot's timestep), expanded to the group's rows."""
        s = self.settings
        uniq, inverse = torch.unique(groups, return_inverse=True)
        per_group = stratified_steps(num_steps, s.timesteps_per_sample, s.timestep_fraction, "discrete",
                                     uniq.numel(), generator)
        return per_group[inverse]

    def training_slots(self, is_leaf, node_latent, num_columns, sigmas, timesteps, generator, groups=None):
        mask, payload = super().training_slots(is_leaf, node_latent, num_columns, sigmas, timesteps, generator, groups)
        n = int(is_leaf.numel())
        groups = torch.zeros(n, dtype=torch.long) if groups is None else groups.cpu()
        leaf = is_leaf.cpu()
        uniq, inverse, counts = torch.unique(groups[leaf], return_inverse=True, return_counts=True)
        size = torch.zeros(n, dtype=torch.long)
        size[leaf] = counts[inverse]
        # a random token per group (not its id: rollout calls renumber groups when their batches are concatenated)
        token = torch.full((n,), -1, dtype=torch.long)
        token[leaf] = torch.randint(0, 2**62, (uniq.numel(),), generator=generator)[inverse]
        payload["obj_group"], payload["obj_group_size"] = token, size  # for the whole-group check
        return mask, payload

    def _check_whole_groups(self, payload, mask) -> None:
        rows = mask.any(1).cpu()
        g, size = payload["obj_group"][rows], payload["obj_group_size"][rows]
        uniq, inverse, counts = torch.unique(g, return_inverse=True, return_counts=True)
        if bool((counts[inverse] != size).any()):
            raise ConfigError("visgen.objective crd centres each group's rewards, so one forward call must hold whole "
                              "groups: set optim.minibatches_per_epoch: 1 and optim.micro_batch_size: 0 "
                              "(optim.backward_steps may split the timesteps)")

    def _cfg_cond(self, adapter, cond, scale: float):
        """The reference's conditioning at CFG ``scale``: the rollout's negative embeddings, or (a rollout without
        CFG, the reference's guidance 1) the empty prompt's, encoded once with the rollout's text length (SD3)."""
        if scale <= 1:
            return dataclasses.replace(cond, do_cfg=False)
        tensors = dict(cond.tensors)
        if "negative_prompt_embeds" not in tensors:
            embeds = tensors["prompt_embeds"]
            key = (id(adapter), tuple(embeds.shape[1:]))
            if key not in self._negatives:
                length = embeds.shape[1] - int(getattr(adapter.pipe, "tokenizer_max_length", 0) or 0)
                empty = adapter.encode_prompts([""], num_images_per_prompt=1, guidance_scale=1.0,
                                               max_sequence_length=max(length, 1), height=cond.height, width=cond.width)
                if set(empty.tensors) != {"prompt_embeds", "pooled_prompt_embeds"} or \
                        tuple(empty.tensors["prompt_embeds"].shape[1:]) != tuple(embeds.shape[1:]):
                    raise ConfigError("visgen.objective crd: kl_cfg > 1 needs negative prompt embeddings this pipeline's "
                                      "rollout did not keep; sample with visgen.guidance_scale > 1 or set kl_cfg: 1")
                self._negatives[key] = empty.tensors
            empty = self._negatives[key]
            n = embeds.shape[0]
            tensors["negative_prompt_embeds"] = empty["prompt_embeds"].to(embeds).expand(n, *embeds.shape[1:])
            pooled = tensors["pooled_prompt_embeds"]
            tensors["negative_pooled_prompt_embeds"] = empty["pooled_prompt_embeds"].to(pooled).expand(n, *pooled.shape[1:])
        return dataclasses.replace(cond, tensors=tensors, guidance_scale=float(scale), do_cfg=True)

    def terms(self, adapter, payload, mask, cond, reference, old, need_kl=False):
        """Per trained slot: r_θ (with grad, ``objective_pos``) and ‖v_θ − v_ref‖² to the CFG-guided reference (with
        grad, ``objective_neg``); the old snapshot's and the reference's velocities first, each under one swap."""
        s = self.settings
        if reference is None:
            raise RuntimeError("the crd objective needs the reference policy (the adapter switched off)")
        if s.use_old_for_loss and (self._setup is None or self._setup.policy is None):
            raise RuntimeError("the crd objective's old snapshot is not set up (old_policy() then enable_old_policy)")
        self._check_whole_groups(payload, mask)
        n, L = mask.shape
        dev = payload["x0"].device
        r_theta, kl_ref = torch.zeros(n, L, device=dev), torch.zeros(n, L, device=dev)
        kl = torch.zeros(n, L, device=dev) if need_kl else None
        per_forward, nfe = adapter.forwards_per_step(cond), 0
        slots = self._live_slots(payload, mask)
        baseline = (lambda: self._setup.policy.snapshot_weights(self.OLD)) if s.use_old_for_loss else reference
        with torch.no_grad(), baseline():
            v_olds = [adapter.velocity(x_t, t, cond[d]) for _k, _rows, d, _x0, _eps, x_t, _sigma, t in slots]
        v_refs = [None] * len(slots)
        if s.kl_beta > 0:
            ref_cond = self._cfg_cond(adapter, cond, s.kl_cfg)
            with torch.no_grad(), reference():
                v_refs = [adapter.velocity(x_t, t, ref_cond[d]) for _k, _rows, d, _x0, _eps, x_t, _sigma, t in slots]
            nfe += sum(adapter.forwards_per_step(ref_cond) * sl[1].numel() for sl in slots)
        for (k, rows, d, x0, eps, x_t, _sigma, t), v_old, v_ref in zip(slots, v_olds, v_refs):
            c = cond[d]
            v = adapter.velocity(x_t, t, c)
            u = eps - x0
            err, err_old = (v - u) ** 2, (v_old - u) ** 2
            if s.adaptive_logp:
                w = _mean_elements((v.detach().double() - u.double()).abs()).clamp(min=1e-5)
                w_old = _mean_elements((v_old.double() - u.double()).abs()).clamp(min=1e-5)
                shape = (-1, *([1] * (v.dim() - 1)))
                err, err_old = err / w.reshape(shape).to(err), err_old / w_old.reshape(shape).to(err_old)
            cols = torch.full_like(d, k)
            r_theta = r_theta.index_put((d, cols), -_mean_elements(err - err_old))
            nfe += 2 * per_forward * rows.numel()
            if v_ref is not None:
                kl_ref = kl_ref.index_put((d, cols), _mean_elements((v - v_ref) ** 2))
            if kl is not None:
                value, _ = _velocity_kl(adapter, x_t, t, c, v, reference)
                kl = kl.index_put((d, cols), value)
                nfe += per_forward * rows.numel()
        return StepLogProbs(logp=torch.zeros(n, L, device=dev), kl=kl, nfe=nfe, objective_pos=r_theta,
                            objective_neg=kl_ref)


@register_objective
class DiffusionOPSDObjective(DiffusionOPSDSpec, Objective):
    """DiffusionOPSD (worldbench/DiffusionOPSD ``scripts/train_opsd_ri_sd3.py``, its canonical OPA path): no teacher
    — the EMA behaviour policy (the old copy, which samples the rollouts by DPM-Solver++(2M)) predicts the clean
    image y0 = z_q − σ_q·v_old(z_q) at one low-noise query state z_q of each trajectory; y0 moved up and down the
    reward's gradient (through the differentiable VAE decode) inside the trust ball ‖y − y0‖ ≤ ρ‖y0‖ gives the
    targets y⁺ / y⁻ (``trust_ball_targets``, built once per rollout); training fits NFT's implicit positive /
    negative clean predictions at z_q to them (``opsd_branch_losses``), mixed by the clipped advantage (the
    ``diffusion_opsd`` loss). Needs a differentiable reward (``RewardInfo.differentiable``)."""
    def training_slots(self, is_leaf, node_latent, num_columns, sigmas, timesteps, generator, groups=None):
        """One slot per leaf: the query step's noise level and model timestep (the targets come from
        ``rollout_targets``, which needs the rollout's states)."""
        T = int(timesteps.numel())
        self.check_steps(T, f"visgen.objective {self.name}")
        n = int(is_leaf.numel())
        k = opsd_query_index(sigmas, T, self.settings.query_sigma)
        sig_q = float(sigmas.detach().float().cpu()[k])
        scale = float(timesteps.detach().float().cpu()[0] / sigmas.detach().float().cpu()[0])
        t_q = math.floor(sig_q * scale) if self.settings.timestep_rounding == "floor" else float(timesteps[k])
        mask = torch.zeros(n, max(num_columns, 1), dtype=torch.bool)
        mask[is_leaf, 0] = True
        return mask, {"x0": node_latent.float(), "obj_sigma": torch.full((n, 1), sig_q),
                      "obj_timestep": torch.full((n, 1), float(t_q)), "obj_query_step": torch.full((n,), k)}

    def rollout_targets(self, adapter, states: torch.Tensor, payload: dict[str, Any], mask: torch.Tensor, cond,
                        old: Callable[[], ContextManager], reward: Callable, prompts: list[str], metas: list[dict],
                        micro_batch: int = 0) -> tuple[dict[str, Any], dict[str, float]]:
        """The query states z_q (``states`` ``[n, L+1, *latent]``: the rollout's states per row), the EMA anchor y0
        and the targets y⁺ / y⁻ of every trained row, built under the old weights (no grad but the reward's);
        ``reward(images, prompts, metas)`` is the trained reward with the graph to the images."""
        s = self.settings
        rows = torch.nonzero(mask[:, 0].cpu()).flatten()
        k = int(payload["obj_query_step"][0]) if rows.numel() else 0
        dev = states.device
        z_q = torch.zeros_like(states[:, 0])
        y_plus, y_minus = torch.zeros_like(z_q), torch.zeros_like(z_q)
        size = s.target_micro_batch or max(rows.numel(), 1)
        vsize = micro_batch or max(rows.numel(), 1)
        nfe, res = 0, []
        for start in range(0, rows.numel(), size):
            r = rows[start:start + size]
            d = r.to(dev)
            zq = states[d, k].float()
            sigma = payload["obj_sigma"][r, 0].to(dev)
            t = payload["obj_timestep"][r, 0].to(dev)
            with torch.no_grad(), old():
                v_old = torch.cat([adapter.velocity(zq[i:i + vsize], t[i:i + vsize], cond[d[i:i + vsize]])
                                   for i in range(0, r.numel(), vsize)])
            nfe += adapter.forwards_per_step(cond) * r.numel()
            y0 = zq - sigma.reshape(-1, *([1] * (zq.dim() - 1))) * v_old
            c, p, m = cond[d], [prompts[i] for i in r.tolist()], [metas[i] for i in r.tolist()]

            def grad(y: torch.Tensor, c=c, p=p, m=m) -> torch.Tensor:
                with torch.enable_grad():
                    y = y.detach().requires_grad_(True)
                    value = reward(adapter.decode_differentiable(y, c), p, m)
                    (g,) = torch.autograd.grad(value.sum(), y)
                return g.detach().float()

            yp, ym = trust_ball_targets(y0, grad, s.rho, s.n_ascent, s.eta)
            z_q[d], y_plus[d], y_minus[d] = zq, yp, ym
            res.append(((yp - y0).flatten(1).norm(dim=1) / (y0.flatten(1).norm(dim=1) + 1e-8)).cpu())
        info = {"opsd/query_step": float(k), "opsd/query_sigma": float(payload["obj_sigma"][0, 0]) if rows.numel() else 0.0,
                "opsd/delta_res": float(torch.cat(res).mean()) if res else 0.0, "nfe/opsd_targets": float(nfe),
                "opsd/reward_grads": float(max(2 * s.n_ascent - 1, 0) * rows.numel())}
        return {"obj_zq": z_q, "obj_y_plus": y_plus, "obj_y_minus": y_minus}, info

    def terms(self, adapter, payload, mask, cond, reference, old, need_kl=False):
        """Per trained row at its query state: the old copy's velocity (no grad) and the policy's (with grad), the
        branch losses toward y⁺ / y⁻ (``objective_pos`` / ``objective_neg``, column 0); the velocity KL to the
        reference when asked (``loss.kl_coef``; the reference's OPA path has none)."""
        if old is None:
            raise RuntimeError("the diffusion_opsd objective needs the old policy (FlowPolicy.enable_old_policy)")
        s = self.settings
        n, L = mask.shape
        dev = payload["x0"].device
        pos, neg = torch.zeros(n, L, device=dev), torch.zeros(n, L, device=dev)
        kl = torch.zeros(n, L, device=dev) if need_kl else None
        rows = torch.nonzero(mask[:, 0].cpu()).flatten()
        if not rows.numel():
            return StepLogProbs(logp=torch.zeros(n, L, device=dev), kl=kl, nfe=0, objective_pos=pos,
                                objective_neg=neg)
        d = rows.to(dev)
        z_q = payload["obj_zq"][d].float()
        sigma = payload["obj_sigma"][rows, 0].to(dev)
        t = payload["obj_timestep"][rows, 0].to(dev)
        c = cond[d]
        with torch.no_grad(), old():
            v_old = adapter.velocity(z_q, t, c)
        v = adapter.velocity(z_q, t, c)
        p, q = opsd_branch_losses(z_q, sigma, v, v_old, payload["obj_y_plus"][d].float(),
                                  payload["obj_y_minus"][d].float(), s.beta)
        cols = torch.zeros_like(d)
        pos, neg = pos.index_put((d, cols), p), neg.index_put((d, cols), q)
        nfe = 2 * adapter.forwards_per_step(cond) * rows.numel()
        if kl is not None:
            value, _ = _velocity_kl(adapter, z_q, t, c, v, reference)
            kl = kl.index_put((d, cols), value)
            nfe += adapter.forwards_per_step(cond) * rows.numel()
        return StepLogProbs(logp=torch.zeros(n, L, device=dev), kl=kl, nfe=nfe, objective_pos=pos, objective_neg=neg)


def objective_from_config(config: dict[str, Any] | str, where: str = "visgen.objective") -> Objective:
    """``{"name": ..., **that objective's fields}`` -> the configured objective (ConfigError on bad input)."""
    return objective_from_registry(OBJECTIVES, config, where)
