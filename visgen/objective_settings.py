"""The training objectives of ``visgen.objectives`` as a config needs them — each objective's settings, the policy
loss it brings, its default sampler and its config-time checks — in a module that imports no torch, so ``grove
config show`` and the config's checks answer without the tensor code (issue 64).

One definition of each: ``visgen.objectives.Objective`` is an :class:`ObjectiveSpec` with the training-time parts
(the training slots, the loss terms), each built-in objective there subclasses its spec here
(``NFTObjective(NFTSpec, Objective)``), and the settings dataclasses keep their names in ``visgen.objectives``.
``OBJECTIVE_SPECS`` names the built-ins; ``visgen.config`` builds an objective from it while ``visgen.objectives`` is
not imported, and from the live ``visgen.objectives.OBJECTIVES`` once it is. tests/core/test_part_index.py checks
the two agree.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional

from shared_rl.config import from_dict
from shared_rl.errors import ConfigError

if TYPE_CHECKING:
    from .policy import FlowPolicy

AWM_WEIGHTINGS = ("ghuber", "Uniform", "t", "t**2", "huber")


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
        from shared_rl.loss_settings import NFTSettings as NFTLossSettings

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
        from shared_rl.loss_settings import AWMSettings as AWMLossSettings

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
        from shared_rl.loss_settings import DGPOSettings as DGPOLossSettings

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
    reference: Literal["adapter_off", "ref_adapter"] = field(default="adapter_off", metadata={
        "help": "the loss's reference and who samples: adapter_off (verl-omni: the live policy samples, the reference "
                "is the adapter switched off) | ref_adapter (yifan123/flow_grpo train_sd3_dpo.py: a copy of the "
                "trained weights samples and is the reference, refreshed every ref_update_step optimizer steps)"})
    ref_update_step: int = field(default=40, metadata={
        "help": "reference: ref_adapter: the copy becomes the trained weights before an iteration's rollout when the "
                "optimizer steps so far are a positive multiple of this (flow_grpo config/dpo.py: 40 for online DPO "
                "per its comment; its shipped 10000000 never refreshes)"})

    def loss_settings(self):
        from shared_rl.loss_settings import DPOSettings as DPOLossSettings

        return DPOLossSettings(self.beta)

    def check(self, where: str) -> None:
        self.loss_settings().check(where)
        if not 0 < self.timestep_fraction <= 1:
            raise ConfigError(f"{where}.timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.timesteps_per_sample is not None and self.timesteps_per_sample < 1:
            raise ConfigError(f"{where}.timesteps_per_sample must be >= 1 or null, got {self.timesteps_per_sample}")
        if not self.logit_std > 0 or not self.timestep_shift > 0 or self.num_train_timesteps < 1:
            raise ConfigError(f"{where}.logit_std and timestep_shift must be > 0 and num_train_timesteps >= 1")
        if self.ref_update_step < 1:
            raise ConfigError(f"{where}.ref_update_step must be >= 1, got {self.ref_update_step}")
        if self.reference == "ref_adapter" and self.pairs:
            raise ConfigError(f"{where}.reference: ref_adapter samples the rollouts with its copy; offline pairs "
                              "sample nothing (use reference: adapter_off)")


@dataclass
class FlowDPPOSettings:
    kl_threshold: float = field(default=1e-5, metadata={
        "help": "tau of the KL mask: a step's term is dropped once mean ||mu - mu_old||^2 / (2 sigma_t^2) >= tau and "
                "its ratio moved in the advantage's direction (UniRL FlowDPPO kl_mask_threshold: 1e-5)"})

    def loss_settings(self):
        from shared_rl.loss_settings import FlowDPPOSettings as FlowDPPOLossSettings

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
        from shared_rl.loss_settings import OPDSettings as OPDLossSettings

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
        from shared_rl.loss_settings import CRDSettings as CRDLossSettings

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
        from shared_rl.loss_settings import DiffusionOPSDSettings as OPSDLossSettings

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


@dataclass(frozen=True)
class TeacherSource:
    """The ``update`` of an old-policy schedule whose "old" copy is a frozen teacher loaded from ``model`` (a diffusers
    pipeline directory or hub id of the student's family and scheduler): only its transformer is kept."""

    model: str

    def enable(self, policy: "FlowPolicy", decay_max: float, decay_ramp, decay_flat: int) -> None:
        policy._enable_teacher(self.model)


@dataclass(frozen=True)
class RefreshEvery:
    """The ``update`` of an old-policy schedule whose "old" copy is replaced by the trained weights before an
    iteration's first rollout when the optimizer steps so far are a positive multiple of ``every``, and kept as it is
    otherwise (yifan123/flow_grpo ``train_sd3_dpo.py``'s "ref" adapter: ``copy_learner_to_ref`` when ``global_step >
    0 and global_step % ref_update_step == 0``, before sampling)."""

    every: int

    def enable(self, policy: "FlowPolicy", decay_max: float, decay_ramp, decay_flat: int) -> None:
        policy.enable_old_policy(1.0, None, 0, "iteration")
        policy._old_refresh_every = int(self.every)


@dataclass
class Snapshots:
    """The ``update`` of an old-policy schedule that keeps, beside the old copy (updated once per iteration on the
    schedule's own decay, from ``main_start`` before its flat steps), further named snapshots each on its own decay
    (name -> (decay_max, ramp, flat, start)): CRD's "sampling" (the old copy) and "old" models. After ``enable`` it
    holds the policy (``self.policy``), so that the objective that made it reaches its snapshots."""

    extra: dict
    main_start: float = 0.0
    policy: "FlowPolicy | None" = None

    def enable(self, policy: "FlowPolicy", decay_max: float, decay_ramp, decay_flat: int) -> None:
        policy.enable_old_policy(decay_max, decay_ramp, decay_flat, "iteration")
        policy._old_start = float(self.main_start)
        for name, schedule in self.extra.items():
            policy.add_snapshot(name, *schedule)
        self.policy = policy


class ObjectiveSpec:
    """An objective as the config sees it: its ``name``, settings, the policy loss it brings, the old policy it reads
    (``old_policy``: what ``--dry-run`` asks under FSDP2 too) and its checks."""

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

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def loss_choice(self):
        """The policy loss this objective trains with, with its settings (a ``shared_rl.config.PolicyLossChoice``),
        or None when any ratio-based loss fits."""
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss) if self.policy_loss is not None else None

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

    def old_policy(self) -> OldPolicySchedule | None:
        """The lagging copy of the adapter this objective reads (NFT's old policy, AWM's EMA), or None."""
        return None


class LogProbSpec(ObjectiveSpec):
    name = "log_prob"
    settings_class = LogProbSettings


class NFTSpec(ObjectiveSpec):
    name = "nft"
    settings_class = NFTSettings
    likelihood_free = True
    policy_loss = "nft"
    default_method = {"name": "ode"}

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice
        from shared_rl.loss_settings import NFTSettings as NFTLossSettings

        return PolicyLossChoice("nft", NFTLossSettings(adv_max=self.settings.adv_max,
                                                       adv_mode=self.settings.adv_mode))

    @property
    def samples_with_old(self) -> bool:
        return self.settings.sample_with == "old"

    def num_slots(self, num_steps: int) -> int:
        s = self.settings
        return s.timesteps_per_sample if s.timesteps_per_sample is not None else max(1, int(num_steps * s.timestep_fraction))

    def old_policy(self) -> OldPolicySchedule:
        s = self.settings
        return OldPolicySchedule(s.old_decay_max, s.old_decay_ramp, s.old_decay_flat, s.old_update)


class AWMSpec(ObjectiveSpec):
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


class DGPOSpec(ObjectiveSpec):
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

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def check_steps(self, num_steps: int, where: str) -> None:
        if self.settings.trunc_steps >= num_steps:
            raise ConfigError(f"{where}: trunc_steps {self.settings.trunc_steps} must be below the {num_steps} grid "
                              "steps (visgen.num_inference_steps)")

    def old_policy(self) -> OldPolicySchedule | None:
        """The reference's ``ema_ref``: θ_old ← d·θ_old + (1 − d)·θ after every optimizer step, d = min(0.3, 0.001·k)
        with k the optimizer steps before it (``FlowPolicy.old_policy_step``, update ``step``)."""
        s = self.settings
        if s.old_policy != "ema":
            return None
        return OldPolicySchedule(s.old_decay_max, s.old_decay_ramp, 0, "step")


class DPOSpec(ObjectiveSpec):
    name = "dpo"
    settings_class = DPOSettings
    likelihood_free = True
    policy_loss = "dpo"
    whole_groups = True
    default_method = {"name": "flow_grpo"}  # the reference rolls out with its SDE sampler (pipeline_with_logprob)

    @property
    def samples_with_old(self) -> bool:
        """``reference: ref_adapter``: flow_grpo's "ref" copy samples the rollouts."""
        return self.settings.reference == "ref_adapter"

    def old_policy(self) -> OldPolicySchedule | None:
        """``reference: ref_adapter``: the "ref" copy (the shared old-policy copy, refreshed every
        ``ref_update_step`` optimizer steps, ``RefreshEvery``); ``adapter_off``: none."""
        if self.settings.reference != "ref_adapter":
            return None
        return OldPolicySchedule(1.0, None, 0, RefreshEvery(int(self.settings.ref_update_step)))

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def num_slots(self, num_steps: int) -> int:
        s = self.settings
        return s.timesteps_per_sample if s.timesteps_per_sample is not None else max(1, int(num_steps * s.timestep_fraction))

    def check_steps(self, num_steps: int, where: str) -> None:
        """Its timesteps come from the training scheduler's grid, not the rollout's: any count fits."""


class FlowDPPOSpec(ObjectiveSpec):
    name = "flow_dppo"
    settings_class = FlowDPPOSettings
    policy_loss = "flow_dppo"
    needs_old_means = True

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def old_policy(self) -> OldPolicySchedule:
        return OldPolicySchedule(0.0, None, 0, "iteration")


class OPDSpec(ObjectiveSpec):
    name = "opd"
    settings_class = OPDSettings
    policy_loss = "opd"
    needs_old_means = True

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    def old_policy(self) -> OldPolicySchedule:
        return OldPolicySchedule(0.0, None, 0, TeacherSource(str(self.settings.teacher)))


class CRDSpec(ObjectiveSpec):
    name = "crd"
    settings_class = CRDSettings
    likelihood_free = True
    policy_loss = "crd"
    whole_groups = True
    default_method = {"name": "ode"}  # the reference's dynamics_type ODE
    OLD = "crd_old"

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    @property
    def samples_with_old(self) -> bool:
        return True

    def check_steps(self, num_steps: int, where: str) -> None:
        """Stratified timesteps repeat grid steps when there are more slots than steps (the reference's 20 of 10)."""

    def old_policy(self) -> OldPolicySchedule:
        s = self.settings
        self._setup = Snapshots({self.OLD: (s.old_decay_max, s.old_decay_slope, s.old_decay_flat, s.old_decay_start)},
                                main_start=s.sampling_decay_start)
        return OldPolicySchedule(s.sampling_decay_max, s.sampling_decay_slope, s.sampling_decay_flat, self._setup)


class DiffusionOPSDSpec(ObjectiveSpec):
    name = "diffusion_opsd"
    settings_class = DiffusionOPSDSettings
    likelihood_free = True
    policy_loss = "diffusion_opsd"
    default_method = {"name": "dpm2"}  # the reference's sample.solver: dpm2, deterministic
    builds_targets = True

    def loss_choice(self):
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss, self.settings.loss_settings())

    @property
    def samples_with_old(self) -> bool:
        return True

    def num_slots(self, num_steps: int) -> int:
        return 1

    def check_steps(self, num_steps: int, where: str) -> None:
        if num_steps < 2:
            raise ConfigError(f"{where}: the query state is a rollout state after step 0; use at least 2 denoising "
                              "steps (visgen.num_inference_steps)")

    def old_policy(self) -> OldPolicySchedule:
        s = self.settings
        return OldPolicySchedule(s.old_decay_max, s.old_decay_ramp, s.old_decay_flat, "iteration")


def check_offline(objective, group_size: int) -> None:
    """The config checks of offline DPO (one line each, before weights load): two rows per group, a pair file of a
    known format; a file that does not exist yet is reported when the domain loads (a recipe names the file a user
    makes or downloads first, so it parses before it exists)."""
    if group_size != 2:
        raise ConfigError(f"visgen.objective dpo with pairs trains one stored pair per group: set rollout.group_size: 2, "
                          f"got {group_size}")
    from pathlib import Path

    path = Path(str(objective.settings.pairs))
    if path.suffix.lower() not in (".jsonl", ".json", ".csv", ".parquet"):
        raise ConfigError(f"visgen.objective.pairs {str(path)!r}: expected a .jsonl, .csv or .parquet file")


OBJECTIVE_SPECS: dict[str, type[ObjectiveSpec]] = {
    c.name: c for c in (LogProbSpec, NFTSpec, AWMSpec, DGPOSpec, DPOSpec, FlowDPPOSpec, OPDSpec, CRDSpec,
                        DiffusionOPSDSpec)}


def objective_from_registry(registry: dict[str, type], config: dict[str, Any] | str,
                            where: str = "visgen.objective") -> Any:
    """``{"name": ..., **that objective's fields}`` -> the objective of ``registry`` (``OBJECTIVE_SPECS`` or the live
    ``visgen.objectives.OBJECTIVES``) with its settings (ConfigError on bad input)."""
    if isinstance(config, str):
        config = {"name": config}
    if not isinstance(config, dict):
        raise ConfigError(f"{where} must be a mapping like {{name: nft, beta: 1.0}}, got {config!r}")
    config = dict(config)
    name = config.pop("name", "log_prob")
    if name not in registry:
        close = difflib.get_close_matches(str(name), list(registry), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}.name {name!r} is unknown{hint}; choose one of {sorted(registry)}")
    cls = registry[name]
    return cls(from_dict(cls.settings_class, config, f"{where}[{name}]"))
