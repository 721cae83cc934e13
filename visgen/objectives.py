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

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Literal, Optional

import torch

from shared_rl.config import ConfigError, from_dict
from shared_rl.domain import StepLogProbs

from .engine import stock_randn_tensor

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


AWM_WEIGHTINGS = ("ghuber", "Uniform", "t", "t**2", "huber")


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


# ------------------------------------------------------------------------------------------------ settings
@dataclass
class OldPolicySchedule:
    """A lagging copy of the adapter, θ_old ← d·θ_old + (1 − d)·θ with d = 0 before ``flat`` optimizer steps, then
    min(``decay_max``, ``ramp``·(steps − ``flat``)) (``ramp`` null: ``decay_max`` always); applied once per
    iteration before its rollout (``update: iteration``, the references) or after every optimizer step (``step``);
    ``update`` a ``visgen.policy.TeacherSource``: the "old" copy is a frozen teacher model, never updated (OPD)."""

    decay_max: float
    ramp: Optional[float]
    flat: int = 0
    update: Any = "iteration"


@dataclass
class LogProbSettings:
    """The Flow-GRPO family has no settings of its own here (kernel and method live in the visgen section)."""


@dataclass
class NFTSettings:
    adv_max: float = field(default=5.0, metadata={"help": "A_max of the nft policy loss: r = clip(A/A_max/2 + 1/2, "
                                                          "0, 1) (the loss's adv_max; the reference's adv_clip_max)"})
    adv_mode: str = field(default="all", metadata={
        "help": "the reference's adv_mode: all | positive_only | negative_only | one_only | binary (how A is reshaped "
                "before r; both branch losses always train)"})
    beta: float = field(default=1.0, metadata={"help": "NFT's beta: how far the implicit positive/negative "
                                                       "velocities step from the old policy's"})
    timestep_fraction: float = field(default=0.99, metadata={
        "help": "grid timesteps trained per sample: int(fraction * num_inference_steps), a per-sample permutation "
                "(the reference's 0.99: 9 of 10)"})
    timesteps_per_sample: Optional[int] = field(default=None, metadata={
        "help": "an explicit count instead of timestep_fraction (null: from the fraction)"})
    sample_with: Literal["old", "live"] = field(default="old", metadata={
        "help": "rollouts sampled by the old policy (the reference) or by the live one (grove before 2026-12)"})
    old_decay_max: float = field(default=0.5, metadata={"help": "old policy: the largest EMA decay (reference 0.5)"})
    old_decay_ramp: float = field(default=0.001, metadata={
        "help": "old policy: d = min(old_decay_max, old_decay_ramp * (optimizer steps - old_decay_flat)) "
                "(the reference's decay_type 1: 0.001; type 2: flat 75, ramp 0.0075, max 0.999)"})
    old_decay_flat: int = field(default=0, metadata={"help": "old policy: d = 0 for the first this many steps"})
    old_update: Literal["iteration", "step"] = field(default="iteration", metadata={
        "help": "soft-update the old policy once per iteration, before its rollout (the reference: v_old fixed "
                "during the iteration's optimizer steps) or after every optimizer step (grove before 2026-12)"})
    branches: Literal["both", "positive", "negative"] = field(default="both", metadata={
        "help": "grove's ablation, not the reference's: train both branch losses, or drop the negative / positive "
                "one (the reference's own knob is adv_mode)"})

    def check(self, where: str) -> None:
        from shared_rl.losses import NFTSettings as NFTLossSettings

        NFTLossSettings(self.adv_max, self.adv_mode).check(where)
        if self.beta <= 0:
            raise ConfigError(f"{where}.beta must be > 0, got {self.beta}")
        if not 0 < self.timestep_fraction <= 1:
            raise ConfigError(f"{where}.timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.timesteps_per_sample is not None and self.timesteps_per_sample < 1:
            raise ConfigError(f"{where}.timesteps_per_sample must be >= 1 or null, got {self.timesteps_per_sample}")
        if not 0 <= self.old_decay_max < 1 or self.old_decay_ramp < 0 or self.old_decay_flat < 0:
            raise ConfigError(f"{where}.old_decay_max must be in [0, 1), old_decay_ramp and old_decay_flat >= 0")


@dataclass
class AWMSettings:
    timesteps_per_sample: int = field(default=6, metadata={"help": "timesteps trained per sample (the released "
                                                                   "train_timesteps: 6)"})
    timestep_fraction: float = field(default=0.9, metadata={"help": "timesteps come from grid steps up to "
                                                                    "int(fraction * T) (released: 0.9)"})
    time_type: Literal["discrete_wo_init", "discrete", "discrete_with_init", "random"] = field(
        default="discrete_wo_init", metadata={
            "help": "discrete_wo_init (released geneval/ocr): one step per stratum of 1..int(fraction*T); discrete "
                    "(released pickscore): strata of 0..; discrete_with_init: step 0 plus strata; random: distinct "
                    "uniform steps (grove before 2026-12)"})
    weighting: str = field(default="ghuber", metadata={
        "help": "w(t) in log p = -w(t)||v - (eps - x0)||^2: ghuber (released: ((e+1e-10)^p - 1e-10^p) t / p), "
                "Uniform, t, t**2, huber"})
    ghuber_power: float = field(default=0.25, metadata={"help": "p of the ghuber weighting (released 0.25)"})
    clip_range: float = field(default=1.0, metadata={"help": "PPO ratio clip of the awm loss (released 1)"})
    adv_clip_max: float = field(default=5.0, metadata={"help": "A clipped to +-adv_clip_max (released 5)"})
    advantage_max: Optional[float] = field(default=1.0, metadata={
        "help": "then rescaled by advantage_max / adv_clip_max (released 1; null: not rescaled)"})
    ema_beta: float = field(default=1.0, metadata={"help": "weight of the EMA-KL term ||v - v_ema||^2 (released 1; "
                                                           "0: no EMA copy, one forward less)"})
    ema_decay_max: float = field(default=0.3, metadata={"help": "EMA copy: the largest decay (released "
                                                                "kl_ema_decay 0.3)"})
    ema_decay_ramp: Optional[float] = field(default=0.001, metadata={
        "help": "EMA copy: d = min(ema_decay_max, ramp * optimizer steps), updated once per iteration (released "
                "'linear'); null: d = ema_decay_max always ('constant')"})

    def loss_settings(self):
        from shared_rl.losses import AWMSettings as AWMLossSettings

        return AWMLossSettings(self.clip_range, self.adv_clip_max, self.advantage_max, self.ema_beta)

    def check(self, where: str) -> None:
        self.loss_settings().check(where)
        if self.timesteps_per_sample < 1:
            raise ConfigError(f"{where}.timesteps_per_sample must be >= 1, got {self.timesteps_per_sample}")
        if not 0 < self.timestep_fraction <= 1:
            raise ConfigError(f"{where}.timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.weighting not in AWM_WEIGHTINGS:
            raise ConfigError(f"{where}.weighting must be one of {', '.join(AWM_WEIGHTINGS)}, got {self.weighting!r}")
        if self.ghuber_power <= 0:
            raise ConfigError(f"{where}.ghuber_power must be > 0, got {self.ghuber_power}")
        if not 0 <= self.ema_decay_max < 1 or (self.ema_decay_ramp is not None and self.ema_decay_ramp < 0):
            raise ConfigError(f"{where}.ema_decay_max must be in [0, 1) and ema_decay_ramp >= 0 or null")


@dataclass
class DGPOSettings:
    beta_dpo: float = field(default=100.0, metadata={"help": "DPO beta of the group preference (reference 100)"})
    clip_range: float = field(default=1e-2, metadata={
        "help": "PPO-style clip of the denoising loss (reference geneval/ocr 1e-2; its CFG-free recipes 1e-5)"})
    timesteps_per_sample: int = field(default=4, metadata={
        "help": "timesteps trained per sample, drawn once per rollout call for every sample (reference "
                "num_train_timesteps: 4)"})
    trunc_steps: int = field(default=4, metadata={
        "help": "the timesteps are drawn among grid steps 0..trunc_steps (reference geneval 4 of a 10-step grid)"})
    shared_noise: bool = field(default=True, metadata={"help": "one noise per group and timestep (reference "
                                                               "use_shared_noise: true)"})
    old_policy: Literal["ema", "iteration_start"] = field(default="ema", metadata={
        "help": "the clip ratio's old policy: ema = the reference's ema_ref, a lagging copy of the adapter updated after "
                "every optimizer step with d = min(old_decay_max, old_decay_ramp * steps before it), its velocity one "
                "more forward per timestep | iteration_start = the weights at the iteration's start (the trainer's "
                "first forward; with one optimizer step per batch the ratio is then 1 and the clip never acts)"})
    old_decay_max: float = field(default=0.3, metadata={"help": "ema old policy: the largest decay (reference 0.3)"})
    old_decay_ramp: float = field(default=0.001, metadata={
        "help": "ema old policy: d = min(old_decay_max, old_decay_ramp * optimizer steps before the update) "
                "(reference 0.001)"})
    train_cfg: bool = field(default=False, metadata={
        "help": "train on CFG-combined velocities (visgen.guidance_scale, the unconditional branch too) instead of the "
                "conditional branch alone (false: the reference's train.cfg, whatever CFG the rollout used)"})

    def loss_settings(self):
        from shared_rl.losses import DGPOSettings as DGPOLossSettings

        return DGPOLossSettings(self.beta_dpo, self.clip_range)

    def check(self, where: str) -> None:
        self.loss_settings().check(where)
        if self.timesteps_per_sample < 1 or self.trunc_steps < 0:
            raise ConfigError(f"{where}.timesteps_per_sample must be >= 1 and trunc_steps >= 0")
        if self.timesteps_per_sample > self.trunc_steps + 1:
            raise ConfigError(f"{where}.timesteps_per_sample ({self.timesteps_per_sample}) is more than the "
                              f"{self.trunc_steps + 1} grid steps 0..trunc_steps it draws from; raise trunc_steps")
        if not 0 <= self.old_decay_max < 1 or self.old_decay_ramp < 0:
            raise ConfigError(f"{where}.old_decay_max must be in [0, 1) and old_decay_ramp >= 0")


@dataclass
class DPOSettings:
    beta: float = field(default=100.0, metadata={
        "help": "Diffusion-DPO beta (yifan123/flow_grpo config/dpo.py train.beta: 100; verl-omni DPOLoss: 2000, its "
                "Qwen-Image recipe 100)"})
    timestep_fraction: float = field(default=0.99, metadata={
        "help": "timesteps trained per pair: int(fraction * num_inference_steps) (the reference's num_train_timesteps "
                "from train.timestep_fraction 0.99: 9 of 10), each with fresh noise and a fresh logit-normal timestep"})
    timesteps_per_sample: Optional[int] = field(default=None, metadata={
        "help": "an explicit count instead of timestep_fraction (null: from the fraction)"})
    logit_mean: float = field(default=0.0, metadata={"help": "logit-normal timestep density: mean (reference 0)"})
    logit_std: float = field(default=1.0, metadata={"help": "logit-normal timestep density: std (reference 1)"})
    timestep_shift: float = field(default=3.0, metadata={
        "help": "the training scheduler's shift: sigma = shift*s / (1 + (shift - 1)*s) of the 1000-step grid the "
                "logit-normal index picks (SD3.5's FlowMatchEulerDiscreteScheduler: 3)"})
    num_train_timesteps: int = field(default=1000, metadata={
        "help": "the training scheduler's steps: the index int(u * N) picks sigma of grid step (N - index) / N"})
    train_cfg: bool = field(default=False, metadata={
        "help": "train on CFG-combined velocities instead of the conditional branch alone (false: the reference's "
                "plain transformer call, whatever CFG the rollout used)"})
    pairs: Optional[str] = field(default=None, metadata={
        "help": "offline DPO: a .jsonl/.csv/.parquet of stored pairs (prompt, chosen, rejected image paths; or "
                "Pick-a-Pic's caption, jpg_0, jpg_1, label_0) trained instead of the policy's own samples "
                "(visgen.offline_dpo; rollout.group_size 2); null: online"})

    def loss_settings(self):
        from shared_rl.losses import DPOSettings as DPOLossSettings

        return DPOLossSettings(self.beta)

    def check(self, where: str) -> None:
        self.loss_settings().check(where)
        if not 0 < self.timestep_fraction <= 1:
            raise ConfigError(f"{where}.timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.timesteps_per_sample is not None and self.timesteps_per_sample < 1:
            raise ConfigError(f"{where}.timesteps_per_sample must be >= 1 or null, got {self.timesteps_per_sample}")
        if not self.logit_std > 0 or not self.timestep_shift > 0 or self.num_train_timesteps < 1:
            raise ConfigError(f"{where}.logit_std and timestep_shift must be > 0 and num_train_timesteps >= 1")


@dataclass
class FlowDPPOSettings:
    kl_threshold: float = field(default=1e-5, metadata={
        "help": "tau of the KL mask: a step's term is dropped once mean ||mu - mu_old||^2 / (2 sigma_t^2) >= tau and "
                "its ratio moved in the advantage's direction (UniRL FlowDPPO kl_mask_threshold: 1e-5)"})

    def loss_settings(self):
        from shared_rl.losses import FlowDPPOSettings as FlowDPPOLossSettings

        return FlowDPPOLossSettings(self.kl_threshold)

    def check(self, where: str) -> None:
        self.loss_settings().check(where)


@dataclass
class OPDSettings:
    teacher: str = field(default="", metadata={
        "help": "the frozen teacher: a diffusers pipeline directory or hub id of the student's family and scheduler "
                "(verl-omni distillation.teacher_models.teacher_model.model_path; required; LoRA merged into it)"})
    distill_coef: float = field(default=1.0, metadata={
        "help": "weight of the teacher KL (verl-omni distill_loss_coef 1.0; pure distillation is weight 1)"})
    with_grpo: bool = field(default=False, metadata={
        "help": "train Flow-GRPO's clipped surrogate plus distill_coef * the teacher KL (verl-omni loss_mode "
                "flow_grpo with use_distill_loss) instead of the teacher KL alone (loss_mode distill_kl, its recipe)"})

    def loss_settings(self):
        from shared_rl.losses import OPDSettings as OPDLossSettings

        return OPDLossSettings(self.distill_coef, self.with_grpo)

    def check(self, where: str) -> None:
        self.loss_settings().check(where)
        if not str(self.teacher).strip():
            raise ConfigError(f"{where}.teacher is required: a diffusers pipeline directory or hub id of the student's "
                              "family (e.g. a reward-tuned checkpoint with its LoRA merged)")
        from pathlib import Path

        # a teacher directory that exists must be a pipeline with a transformer and a scheduler; one that does not
        # exist yet is reported when it loads (the shipped recipes name the teacher a user makes first, so they
        # parse before it exists); its family and scheduler are compared with the student's when both load
        local = [b / str(self.teacher) for b in (Path.cwd(), Path(__file__).resolve().parents[1])]
        location = next((c for c in local if c.is_dir()), None)
        if location is not None:
            import json

            index = location / "model_index.json"
            if not index.is_file():
                raise ConfigError(f"{where}.teacher {self.teacher!r} is not a diffusers pipeline (no model_index.json)")
            parts = json.loads(index.read_text())
            if not parts.get("transformer") or not parts.get("scheduler"):
                raise ConfigError(f"{where}.teacher {self.teacher!r} has no transformer or scheduler to replay the "
                                  "student's states with")


@dataclass
class CRDSettings:
    beta: float = field(default=1.0, metadata={"help": "CRD's beta (Flow-Factory crd_beta: 1.0)"})
    loss_type: Literal["mse", "bce"] = field(default="mse", metadata={"help": "crd_loss_type (reference mse)"})
    adaptive_logp: bool = field(default=True, metadata={
        "help": "divide each squared velocity error by its detached mean absolute error (clipped at 1e-5) before "
                "the implicit reward (Flow-Factory adaptive_logp: true)"})
    weight_temp: float = field(default=-1.0, metadata={
        "help": "centring weights: < 0 uniform (the reference default -1); the softmax / hard dual-direction "
                "centring (>= 0) is not implemented"})
    use_old_for_loss: bool = field(default=True, metadata={
        "help": "the implicit reward's baseline velocity from the 'old' snapshot (true, the reference) or from the "
                "reference model, the adapter off (false)"})
    adv_clip_max: float = field(default=5.0, metadata={"help": "A clipped to +-adv_clip_max, then mapped to [0, 1] "
                                                               "(reference adv_clip_range 5)"})
    kl_beta: float = field(default=0.1, metadata={"help": "velocity KL weight to the CFG-guided reference "
                                                          "(reference kl_beta 0.1; 0: no reference forward)"})
    kl_cfg: float = field(default=4.5, metadata={"help": "CFG scale of the reference's velocity in the KL (reference "
                                                         "kl_cfg 4.5; <= 1: the conditional branch alone)"})
    reward_adaptive_kl: bool = field(default=True, metadata={"help": "scale each sample's KL by c + a(1 - c), "
                                                                     "c = 1e-4/kl_beta (reference true)"})
    timesteps_per_sample: int = field(default=20, metadata={
        "help": "training timesteps per sample (reference num_train_timesteps 20), stratified over grid steps "
                "0..int(timestep_fraction * T), one draw per group (its rows share each slot's timestep)"})
    timestep_fraction: float = field(default=0.99, metadata={"help": "reference timestep_range 0.99"})
    old_decay_start: float = field(default=0.25, metadata={
        "help": "'old' snapshot: d = min(old_decay_max, old_decay_start + old_decay_slope * (steps - "
                "old_decay_flat)), old_decay_start before old_decay_flat steps (reference old_model_decay "
                "0-0.25-0.005-0.999)"})
    old_decay_slope: float = field(default=0.005, metadata={"help": "'old' snapshot decay slope per optimizer step"})
    old_decay_max: float = field(default=0.999, metadata={"help": "'old' snapshot: the largest decay"})
    old_decay_flat: int = field(default=0, metadata={"help": "'old' snapshot: steps before the ramp starts"})
    sampling_decay_start: float = field(default=0.0, metadata={
        "help": "'sampling' snapshot (the rollouts' weights): the same form (reference sampling_model_decay "
                "75-0.0-0.0075-0.999)"})
    sampling_decay_slope: float = field(default=0.0075, metadata={"help": "'sampling' snapshot decay slope"})
    sampling_decay_max: float = field(default=0.999, metadata={"help": "'sampling' snapshot: the largest decay"})
    sampling_decay_flat: int = field(default=75, metadata={"help": "'sampling' snapshot: steps before the ramp "
                                                                   "(an on-policy copy until then)"})

    def loss_settings(self):
        from shared_rl.losses import CRDSettings as CRDLossSettings

        return CRDLossSettings(self.beta, self.loss_type, self.adv_clip_max, self.kl_beta, self.reward_adaptive_kl)

    def check(self, where: str) -> None:
        self.loss_settings().check(where)
        if self.weight_temp >= 0:
            raise ConfigError(f"{where}.weight_temp {self.weight_temp}: only uniform centring (< 0, the reference's "
                              "-1) is implemented")
        if self.timesteps_per_sample < 1 or not 0 < self.timestep_fraction <= 1:
            raise ConfigError(f"{where}.timesteps_per_sample must be >= 1 and timestep_fraction in (0, 1]")
        for name in ("old", "sampling"):
            start, slope, top, flat = (getattr(self, f"{name}_decay_{k}") for k in ("start", "slope", "max", "flat"))
            if not (0 <= start <= top <= 1 and slope >= 0 and flat >= 0):
                raise ConfigError(f"{where}.{name}_decay_*: need 0 <= start <= max <= 1, slope >= 0, flat >= 0; got "
                                  f"start {start}, max {top}, slope {slope}, flat {flat}")


@dataclass
class DiffusionOPSDSettings:
    beta: float = field(default=1.0, metadata={
        "help": "NFT's beta of the implicit velocities v+ = b v + (1 - b) v_old, v- = (1 + b) v_old - b v "
                "(worldbench/DiffusionOPSD config.beta: 1.0; its open3 preset 0.1)"})
    adv_clip_max: float = field(default=5.0, metadata={"help": "A clipped to +-adv_clip_max, r = clip(A/A_max/2 + "
                                                               "1/2, 0, 1), the loss x A_max (reference 5)"})
    query_sigma: float = field(default=0.278, metadata={
        "help": "the query state: the rollout state at the grid step whose sigma is nearest this (at least step 1) "
                "(reference opa_query_sigma: SD3.5-M 0.278, Z-Image-Turbo 0.273)"})
    rho: float = field(default=0.10, metadata={
        "help": "trust-ball radius relative to the anchor: ||y - y0|| <= rho ||y0|| per sample (reference opa_rho "
                "0.10; 0: the targets are the EMA clean prediction y0 itself)"})
    n_ascent: int = field(default=2, metadata={"help": "reward-gradient steps per target (reference opa_n_ascent 2)"})
    eta: float = field(default=1.0, metadata={
        "help": "each step's length is eta * rho ||y0|| / n_ascent before the ball's clamp (reference opa_eta 1.0: "
                "the steps alone reach the ball's edge at most)"})
    dual_negative: bool = field(default=True, metadata={
        "help": "train the negative branch toward the descended target y- (reference opa_dual_neg 1)"})
    target_micro_batch: int = field(default=6, metadata={
        "help": "samples per reward-gradient call while building the targets (reference opa_mb 6; 0: all at once)"})
    timestep_rounding: Literal["floor", "exact"] = field(default="floor", metadata={
        "help": "the query forward's model timestep: floor(1000 sigma_q) as the reference's long cast, or the grid's "
                "own (exact)"})
    old_decay_max: float = field(default=0.5, metadata={"help": "the EMA behaviour policy: the largest decay "
                                                                "(reference decay_type 1: 0.5)"})
    old_decay_ramp: float = field(default=0.001, metadata={
        "help": "d = min(old_decay_max, old_decay_ramp * optimizer steps), applied once per iteration before its "
                "rollout (reference decay_type 1: 0.001)"})
    old_decay_flat: int = field(default=0, metadata={"help": "d = 0 for the first this many optimizer steps"})

    def loss_settings(self):
        from shared_rl.losses import DiffusionOPSDSettings as OPSDLossSettings

        return OPSDLossSettings(self.adv_clip_max, self.dual_negative)

    def check(self, where: str) -> None:
        self.loss_settings().check(where)
        if not self.beta > 0:
            raise ConfigError(f"{where}.beta must be > 0, got {self.beta}")
        if not 0 < self.query_sigma < 1:
            raise ConfigError(f"{where}.query_sigma must be in (0, 1), got {self.query_sigma}")
        if not self.rho >= 0 or self.n_ascent < 0 or not self.eta >= 0 or self.target_micro_batch < 0:
            raise ConfigError(f"{where}: rho, eta must be >= 0 and n_ascent, target_micro_batch >= 0; got rho "
                              f"{self.rho}, eta {self.eta}, n_ascent {self.n_ascent}, target_micro_batch "
                              f"{self.target_micro_batch}")
        if not 0 <= self.old_decay_max < 1 or self.old_decay_ramp < 0 or self.old_decay_flat < 0:
            raise ConfigError(f"{where}.old_decay_max must be in [0, 1), old_decay_ramp and old_decay_flat >= 0")


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
class Objective:
    """A registered objective: its ``name``, settings and the policy losses it feeds."""

    name: ClassVar[str] = ""
    settings_class: ClassVar[type] = object
    likelihood_free: ClassVar[bool] = False
    policy_loss: ClassVar[str | None] = None  # the one policy loss it needs (None: any ratio-based one)
    default_method: ClassVar[dict[str, Any]] = {"name": "flow_grpo"}  # visgen.method when the config leaves it null
    # logp_old is the trainer's first forward before any update (Rollout.logp_deferred): AWM / DGPO ratios
    deferred_logp: ClassVar[bool] = False
    # the recompute also returns the KL between the policy's and the old copy's step means (StepLogProbs.old_kl)
    needs_old_means: ClassVar[bool] = False
    # the policy loss needs every member of a group in one forward call (DGPO's group sums, DPO's pairs)
    whole_groups: ClassVar[bool] = False
    # the rollout also calls ``rollout_targets`` with its states and a differentiable reward (DiffusionOPSD)
    builds_targets: ClassVar[bool] = False

    def select_rows(self, scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor | None:
        """``[n]`` bool: the rows of a rollout that train, from each row's trained reward ``scores`` (the weighted sum
        of the trained outputs) and group; None: every leaf (default)."""
        return None

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def loss_choice(self):
        """The policy loss this objective trains with, with its settings (a ``shared_rl.config.PolicyLossChoice``),
        or None when any ratio-based loss fits."""
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss) if self.policy_loss is not None else None

    def old_policy(self) -> OldPolicySchedule | None:
        """The lagging copy of the adapter this objective reads (NFT's old policy, AWM's EMA), or None."""
        return None

    @property
    def samples_with_old(self) -> bool:
        """Whether rollouts are sampled with the old policy's weights (DiffusionNFT)."""
        return False

    # likelihood-free objectives: training slots chosen at rollout time ------------------------------------------
    def num_slots(self, num_steps: int) -> int:
        return int(self.settings.timesteps_per_sample)

    def check_steps(self, num_steps: int, where: str) -> None:
        """Its training timesteps fit a grid of ``num_steps`` (ConfigError, one line)."""
        if self.num_slots(num_steps) > num_steps:
            raise ConfigError(f"{where}: {self.num_slots(num_steps)} training timesteps per sample is more than the "
                              f"{num_steps} steps of the grid (visgen.num_inference_steps); lower "
                              "timesteps_per_sample")

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
class LogProbObjective(Objective):
    """Flow-GRPO and its flat/tree relatives: recomputed step log-probs (``visgen.recompute``)."""

    name = "log_prob"
    settings_class = LogProbSettings


@register_objective
class NFTObjective(Objective):
    name = "nft"
    settings_class = NFTSettings
    likelihood_free = True
    policy_loss = "nft"
    default_method = {"name": "ode"}

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice
        from shared_rl.losses import NFTSettings as NFTLossSettings

        return PolicyLossChoice("nft", NFTLossSettings(adv_max=self.settings.adv_max,
                                                       adv_mode=self.settings.adv_mode))

    def old_policy(self) -> OldPolicySchedule:
        s = self.settings
        return OldPolicySchedule(s.old_decay_max, s.old_decay_ramp, s.old_decay_flat, s.old_update)

    @property
    def samples_with_old(self) -> bool:
        return self.settings.sample_with == "old"

    def num_slots(self, num_steps: int) -> int:
        s = self.settings
        return s.timesteps_per_sample if s.timesteps_per_sample is not None else max(1, int(num_steps * s.timestep_fraction))

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
class AWMObjective(Objective):
    name = "awm"
    settings_class = AWMSettings
    likelihood_free = True
    policy_loss = "awm"
    default_method = {"name": "ode"}
    deferred_logp = True

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def old_policy(self) -> OldPolicySchedule | None:
        s = self.settings
        return OldPolicySchedule(s.ema_decay_max, s.ema_decay_ramp) if s.ema_beta > 0 else None

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
class DGPOObjective(Objective):
    name = "dgpo"
    settings_class = DGPOSettings
    likelihood_free = True
    whole_groups = True
    policy_loss = "dgpo"
    default_method = {"name": "ode"}

    @property
    def deferred_logp(self) -> bool:
        """``iteration_start``: the clip's old log p is the trainer's first forward (Rollout.logp_deferred); ``ema``:
        each call computes it with the EMA copy (``StepLogProbs.logp_old``)."""
        return self.settings.old_policy == "iteration_start"

    def old_policy(self) -> OldPolicySchedule | None:
        """The reference's ``ema_ref``: θ_old ← d·θ_old + (1 − d)·θ after every optimizer step, d = min(0.3, 0.001·k)
        with k the optimizer steps before it (``FlowPolicy.old_policy_step``, update ``step``)."""
        s = self.settings
        if s.old_policy != "ema":
            return None
        return OldPolicySchedule(s.old_decay_max, s.old_decay_ramp, 0, "step")

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def check_steps(self, num_steps: int, where: str) -> None:
        if self.settings.trunc_steps >= num_steps:
            raise ConfigError(f"{where}: trunc_steps {self.settings.trunc_steps} must be below the {num_steps} grid "
                              "steps (visgen.num_inference_steps)")

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
class DPOObjective(Objective):
    """Online Diffusion-DPO (yifan123/flow_grpo ``train_sd3_dpo.py``, verl-omni ``DPOLoss``): the live policy
    samples (verl-omni; flow_grpo samples with a lagging "ref" adapter refreshed every ``ref_update_step``), the
    reference is the adapter off; per group its best and worst sample (the ``dpo`` loss picks them by advantage) at
    ``K`` slots, each with one noise and one logit-normal timestep per group (so chosen and rejected share both)."""

    name = "dpo"
    settings_class = DPOSettings
    likelihood_free = True
    policy_loss = "dpo"
    whole_groups = True
    default_method = {"name": "flow_grpo"}  # the reference rolls out with its SDE sampler (pipeline_with_logprob)

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def num_slots(self, num_steps: int) -> int:
        s = self.settings
        return s.timesteps_per_sample if s.timesteps_per_sample is not None else max(1, int(num_steps * s.timestep_fraction))

    def check_steps(self, num_steps: int, where: str) -> None:
        """Its timesteps come from the training scheduler's grid, not the rollout's: any count fits."""

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
        reference (the adapter off, ``objective_neg``); without ``train_cfg`` the conditional branch alone."""
        if reference is None:
            raise RuntimeError("the dpo objective needs the reference policy (the adapter switched off)")
        if not self.settings.train_cfg and cond.do_cfg:
            cond = dataclasses.replace(cond, do_cfg=False)
        n, L = mask.shape
        dev = payload["x0"].device
        err, ref_err = torch.zeros(n, L, device=dev), torch.zeros(n, L, device=dev)
        kl = torch.zeros(n, L, device=dev) if need_kl else None
        per_forward, nfe = adapter.forwards_per_step(cond), 0
        for k, rows, d, x0, eps, x_t, _sigma, t in self._live_slots(payload, mask):
            c = cond[d]
            v = adapter.velocity(x_t, t, c)
            value, v_ref = _velocity_kl(adapter, x_t, t, c, v, reference)
            cols = torch.full_like(d, k)
            err = err.index_put((d, cols), flow_matching_loss(x0, eps, v))
            ref_err = ref_err.index_put((d, cols), flow_matching_loss(x0, eps, v_ref))
            if kl is not None:
                kl = kl.index_put((d, cols), value)
            nfe += 2 * per_forward * rows.numel()
        return StepLogProbs(logp=torch.zeros(n, L, device=dev), kl=kl, nfe=nfe, objective_pos=err,
                            objective_neg=ref_err)


@register_objective
class FlowDPPOObjective(Objective):
    """Flow-DPPO (arXiv 2606.11025; Tencent-Hunyuan/UniRL ``flowdppo.py``): the Flow-GRPO recompute of the stored
    SDE steps, plus the KL between the policy's and the old policy's step means for the ``flow_dppo`` loss's mask.
    The old policy is a copy of the adapter set to the live weights once per iteration before its rollout (decay 0):
    the weights that sampled the batch, frozen for its inner steps (the reference's ``prepare_segment`` replay at the
    pre-update weights; its old log-probs are the rollout's, ``old_logp_source: rollout``)."""

    name = "flow_dppo"
    settings_class = FlowDPPOSettings
    policy_loss = "flow_dppo"
    needs_old_means = True

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def old_policy(self) -> OldPolicySchedule:
        return OldPolicySchedule(0.0, None, 0, "iteration")


@register_objective
class OPDObjective(Objective):
    """Diffusion on-policy distillation (verl-omni ``DistillKLLoss``, docs/algo/diffusion_opd.md): the student samples
    its own SDE trajectories (the ``flow_grpo`` sampler), a frozen teacher of the same family and scheduler replays
    every stored trained state, and the ``opd`` loss moves the student's step means to the teacher's. Not
    likelihood-free: the Flow-GRPO recompute of the stored steps gives μ_θ (and the log-probs ``with_grpo`` uses);
    the teacher is the shared old-policy slot filled by a frozen transformer (``TeacherSource``: never updated,
    never checkpointed), so the recompute's ``old_kl`` is ‖μ_θ − μ_T‖²/(2σ_t²), kept with grad."""

    name = "opd"
    settings_class = OPDSettings
    policy_loss = "opd"
    needs_old_means = True

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def old_policy(self) -> OldPolicySchedule:
        from .policy import TeacherSource

        return OldPolicySchedule(0.0, None, 0, TeacherSource(str(self.settings.teacher)))


@register_objective
class CRDObjective(Objective):
    """Centered Reward Distillation (arXiv 2603.14128; X-GenGroup/Flow-Factory ``trainers/crd.py``): rollouts by the
    "sampling" snapshot (the old copy, an on-policy copy for the first ``sampling_decay_flat`` steps, then lagging),
    the implicit reward r_θ = −mean[(v_θ − u)²/w_θ − (v_old − u)²/w_old] (u = ε − x0, w the detached mean absolute
    errors) against the "old" snapshot at ``timesteps_per_sample`` stratified grid timesteps per group, and the
    velocity KL to the CFG-guided reference (the adapter off); the ``crd`` loss centres and matches. Both snapshots
    are updated once per iteration, each on its own decay schedule (``visgen.policy.Snapshots``)."""

    name = "crd"
    settings_class = CRDSettings
    likelihood_free = True
    policy_loss = "crd"
    whole_groups = True
    default_method = {"name": "ode"}  # the reference's dynamics_type ODE
    OLD = "crd_old"

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self._setup = None  # the Snapshots hook handed to the policy: it reaches the "old" snapshot
        self._negatives: dict = {}

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def old_policy(self) -> OldPolicySchedule:
        from .policy import Snapshots

        s = self.settings
        self._setup = Snapshots({self.OLD: (s.old_decay_max, s.old_decay_slope, s.old_decay_flat, s.old_decay_start)},
                                main_start=s.sampling_decay_start)
        return OldPolicySchedule(s.sampling_decay_max, s.sampling_decay_slope, s.sampling_decay_flat, self._setup)

    @property
    def samples_with_old(self) -> bool:
        return True

    def check_steps(self, num_steps: int, where: str) -> None:
        """Stratified timesteps repeat grid steps when there are more slots than steps (the reference's 20 of 10)."""

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
class DiffusionOPSDObjective(Objective):
    """DiffusionOPSD (worldbench/DiffusionOPSD ``scripts/train_opsd_ri_sd3.py``, its canonical OPA path): no teacher
    — the EMA behaviour policy (the old copy, which samples the rollouts by DPM-Solver++(2M)) predicts the clean
    image y0 = z_q − σ_q·v_old(z_q) at one low-noise query state z_q of each trajectory; y0 moved up and down the
    reward's gradient (through the differentiable VAE decode) inside the trust ball ‖y − y0‖ ≤ ρ‖y0‖ gives the
    targets y⁺ / y⁻ (``trust_ball_targets``, built once per rollout); training fits NFT's implicit positive /
    negative clean predictions at z_q to them (``opsd_branch_losses``), mixed by the clipped advantage (the
    ``diffusion_opsd`` loss). Needs a differentiable reward (``RewardInfo.differentiable``)."""

    name = "diffusion_opsd"
    settings_class = DiffusionOPSDSettings
    likelihood_free = True
    policy_loss = "diffusion_opsd"
    default_method = {"name": "dpm2"}  # the reference's sample.solver: dpm2, deterministic
    builds_targets = True

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def old_policy(self) -> OldPolicySchedule:
        s = self.settings
        return OldPolicySchedule(s.old_decay_max, s.old_decay_ramp, s.old_decay_flat, "iteration")

    @property
    def samples_with_old(self) -> bool:
        return True

    def num_slots(self, num_steps: int) -> int:
        return 1

    def check_steps(self, num_steps: int, where: str) -> None:
        if num_steps < 2:
            raise ConfigError(f"{where}: the query state is a rollout state after step 0; use at least 2 denoising "
                              "steps (visgen.num_inference_steps)")

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
    if isinstance(config, str):
        config = {"name": config}
    if not isinstance(config, dict):
        raise ConfigError(f"{where} must be a mapping like {{name: nft, beta: 1.0}}, got {config!r}")
    config = dict(config)
    name = config.pop("name", "log_prob")
    if name not in OBJECTIVES:
        close = difflib.get_close_matches(str(name), list(OBJECTIVES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}.name {name!r} is unknown{hint}; choose one of {sorted(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    return cls(from_dict(cls.settings_class, config, f"{where}[{name}]"))
