"""The policy losses' own settings (``loss.policy_loss: {name: .., <its settings>}``), in a module that imports no
torch, so a config naming a loss is read and checked without it (``shared_rl.part_index`` finds a settings class
named in a ``@register_policy_loss(..., settings=X)`` line here). The losses are in ``shared_rl.losses``, which
re-exports these classes; a settings class defined there instead still works (the config loader then imports
``shared_rl.losses``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError

NFT_ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")


@dataclass
class GuardSettings:
    scale: str = field(default="sigma", metadata={
        "help": "sigma: the log-ratio times the step's transition std sigma_t (Flow-Factory's GRPOGuardTrainer, the "
                "reference) | relative: times sigma_t / mean sigma (grove before 2026-12; the same up to a per-call "
                "constant, which then changes the effective clip range)"})
    center: bool = field(default=True, metadata={
        "help": "remove the ratio-below-1 bias of each step column (detached mean over the call's rows; the "
                "reference adds the analytic +||mu - mu_old||^2 / (2 sigma_t), which needs the rollout's means)"})
    step_weight: str = field(default="balanced", metadata={
        "help": "balanced: no further factor, so unclipped steps of every noise level pull alike (the paper's "
                "reweighting; the reference) | flow_grpo: divide each step's loss by its scale, restoring plain "
                "Flow-GRPO's 1/sigma_t gradient (normalisation then only decides which steps clip)"})

    def check(self, where: str) -> None:
        if self.scale not in ("sigma", "relative"):
            raise ConfigError(f"{where}.scale must be sigma or relative, got {self.scale!r}")
        if self.step_weight not in ("balanced", "flow_grpo"):
            raise ConfigError(f"{where}.step_weight must be balanced or flow_grpo, got {self.step_weight!r}")


@dataclass
class GSPOSettings:
    max_log_ratio: float = field(default=10.0, metadata={
        "help": "clamp of the sequence log-ratio (verl's compute_policy_loss_gspo: value bounded, gradient 0 beyond)"})


@dataclass
class CispoSettings:
    max_weight: float | None = field(default=None, metadata={
        "help": "the importance weight's upper cap as an absolute value (TRL's epsilon_high for cispo, ScaleRL's "
                "eps_max 5.0); null = 1 + loss.clip_high"})
    level: str = field(default="step", metadata={
        "help": "step (each token's ratio) | sequence (the sequence's length-normalised ratio on every step, GSPO's)"})

    def check(self, where: str) -> None:
        if self.max_weight is not None and self.max_weight <= 0:
            raise ConfigError(f"{where}.max_weight must be > 0 (e.g. 5.0), got {self.max_weight}")
        if self.level not in ("step", "sequence"):
            raise ConfigError(f"{where}.level must be 'step' or 'sequence', got {self.level!r}")


@dataclass
class SapoSettings:
    tau_pos: float = field(default=1.0, metadata={"help": "gate temperature for positive advantages"})
    tau_neg: float = field(default=1.05, metadata={"help": "gate temperature for advantages <= 0"})

    def check(self, where: str) -> None:
        for name in ("tau_pos", "tau_neg"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class NFTSettings:
    adv_max: float = field(default=5.0, metadata={
        "help": "A_max, the advantage clip that maps A to DiffusionNFT's optimality weight r in [0, 1]"})
    adv_mode: str = field(default="all", metadata={
        "help": "the reference's train.adv_mode: all (the default) | positive_only (A clamped to [0, A_max]) | "
                "negative_only ([-A_max, 0]) | one_only (1 where A > 0, else 0) | binary (sign A); both branch "
                "losses always train"})

    def check(self, where: str) -> None:
        if self.adv_max <= 0:
            raise ConfigError(f"{where}.adv_max must be > 0, got {self.adv_max}")
        if self.adv_mode not in NFT_ADV_MODES:
            raise ConfigError(f"{where}.adv_mode must be one of {', '.join(NFT_ADV_MODES)}, got {self.adv_mode!r}")


@dataclass
class DiffusionOPSDSettings:
    adv_clip_max: float = field(default=5.0, metadata={
        "help": "A clipped to +-adv_clip_max and mapped to r = clip(A/adv_clip_max/2 + 1/2, 0, 1); the loss is scaled "
                "by adv_clip_max (worldbench/DiffusionOPSD train.adv_clip_max: 5)"})
    dual_negative: bool = field(default=True, metadata={
        "help": "train the negative branch toward the descended target (the reference's opa_dual_neg: 1); false: the "
                "positive branch only (its ablation)"})

    def check(self, where: str) -> None:
        if not self.adv_clip_max > 0:
            raise ConfigError(f"{where}.adv_clip_max must be > 0, got {self.adv_clip_max}")


@dataclass
class AWMSettings:
    clip_range: float = field(default=1.0, metadata={
        "help": "PPO clip of the ratio exp(log p - log p_old) of AWM's likelihood log p = -w(t)||v - (eps - x0)||^2 "
                "(the released configs' train.clip_range: 1)"})
    adv_clip_max: float = field(default=5.0, metadata={"help": "A is clipped to +-adv_clip_max first"})
    advantage_max: float | None = field(default=1.0, metadata={
        "help": "then rescaled to +-advantage_max (A * advantage_max / adv_clip_max; the released configs: 1); "
                "null: no rescale"})
    ema_beta: float = field(default=1.0, metadata={
        "help": "weight of the EMA-KL term ||v - v_ema||^2 (the domain's objective_pos; the released ema_beta: 1)"})

    def check(self, where: str) -> None:
        if self.clip_range <= 0 or self.adv_clip_max <= 0:
            raise ConfigError(f"{where}.clip_range and adv_clip_max must be > 0")
        if self.advantage_max is not None and self.advantage_max <= 0:
            raise ConfigError(f"{where}.advantage_max must be > 0 or null, got {self.advantage_max}")
        if self.ema_beta < 0:
            raise ConfigError(f"{where}.ema_beta must be >= 0, got {self.ema_beta}")


@dataclass
class DGPOSettings:
    beta_dpo: float = field(default=100.0, metadata={
        "help": "DPO beta of the group preference sigma(beta/G * sum_g A_i (dsm_i - dsm_ref_i)) (the reference's "
                "train.beta_dpo: 100)"})
    clip_range: float = field(default=1e-2, metadata={
        "help": "PPO-style clip: a sample's denoising loss keeps no gradient once exp(dsm_old - dsm) leaves "
                "1 +- clip_range in its advantage's direction (the reference's clip_dsm; geneval/ocr configs 1e-2)"})

    def check(self, where: str) -> None:
        if self.beta_dpo <= 0 or self.clip_range <= 0:
            raise ConfigError(f"{where}.beta_dpo and clip_range must be > 0")


@dataclass
class DPOSettings:
    beta: float = field(default=100.0, metadata={
        "help": "Diffusion-DPO beta in -log sigmoid(-beta/2 [(err_w - err_ref_w) - (err_l - err_ref_l)]) (yifan123/"
                "flow_grpo config/dpo.py train.beta: 100; verl-omni DPOLoss defaults to 2000, its Qwen-Image recipe 100)"})

    def check(self, where: str) -> None:
        if not self.beta > 0:
            raise ConfigError(f"{where}.beta must be > 0, got {self.beta}")


@dataclass
class FlowDPPOSettings:
    kl_threshold: float = field(default=1e-5, metadata={
        "help": "tau: a step's term is dropped once the KL between the policy's and the old policy's step Gaussians, "
                "mean(||mu - mu_old||^2 / (2 sigma_t^2)), reaches tau AND its ratio moved in the advantage's direction "
                "(Tencent-Hunyuan/UniRL FlowDPPO kl_mask_threshold: 1e-5)"})

    def check(self, where: str) -> None:
        if not self.kl_threshold > 0:
            raise ConfigError(f"{where}.kl_threshold must be > 0, got {self.kl_threshold}")


@dataclass
class OPDSettings:
    distill_coef: float = field(default=1.0, metadata={
        "help": "weight of the teacher KL mean ||mu - mu_T||^2 / (2 sigma_t^2) (verl-omni distill_loss_coef: 1.0; "
                "its pure distillation, loss_mode distill_kl, is this weight 1)"})
    with_grpo: bool = field(default=False, metadata={
        "help": "add the teacher KL to Flow-GRPO's clipped surrogate (verl-omni loss_mode flow_grpo with "
                "use_distill_loss) instead of training on the teacher KL alone (loss_mode distill_kl, the recipe)"})

    def check(self, where: str) -> None:
        if not self.distill_coef > 0:
            raise ConfigError(f"{where}.distill_coef must be > 0, got {self.distill_coef}")


@dataclass
class CRDSettings:
    beta: float = field(default=1.0, metadata={
        "help": "CRD's beta: the implicit reward is matched as beta * r_theta (Flow-Factory crd_beta: 1.0)"})
    loss_type: str = field(default="mse", metadata={
        "help": "mse: (beta*Rc_theta - Rc)^2 | bce: BCE-with-logits of beta*Rc_theta against sigmoid(Rc) "
                "(Flow-Factory crd_loss_type: mse)"})
    adv_clip_max: float = field(default=5.0, metadata={
        "help": "A clipped to +-adv_clip_max, then a = A/adv_clip_max/2 + 1/2 in [0, 1]; the loss is scaled by "
                "adv_clip_max / beta (Flow-Factory adv_clip_range: 5)"})
    kl_beta: float = field(default=0.1, metadata={
        "help": "weight of the velocity KL ||v - v_ref||^2 to the CFG-guided reference (Flow-Factory kl_beta: 0.1; "
                "0: none)"})
    reward_adaptive_kl: bool = field(default=True, metadata={
        "help": "scale each sample's KL by c + a*(1 - c), c = 1e-4 / kl_beta (Flow-Factory reward_adaptive_kl: true)"})

    def check(self, where: str) -> None:
        if not self.beta > 0:
            raise ConfigError(f"{where}.beta must be > 0, got {self.beta}")
        if self.loss_type not in ("mse", "bce"):
            raise ConfigError(f"{where}.loss_type must be mse or bce, got {self.loss_type!r}")
        if not self.adv_clip_max > 0 or self.kl_beta < 0:
            raise ConfigError(f"{where}.adv_clip_max must be > 0 and kl_beta >= 0")
