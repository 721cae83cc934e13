"""Policy losses (a registry: clipped / GSPO / CISPO / SAPO / Flow-DPPO / on-policy distillation, and the likelihood-free NFT / DiffusionOPSD / AWM / DGPO / DPO / CRD), aggregation modes
and KL estimators (a registry too).

All losses take per-step tensors ``[n, T]`` with a step mask, so the same code trains denoising steps (visgen,
robot action heads) and tokens (LLM). Aggregations are normalised by **global** counts of the whole optimizer
step (``Normalizer``), so splitting a minibatch into micro-batches and accumulating gradients gives the same
gradient as one big batch (``tests/core/test_losses.py`` checks it).

**Policy losses** (``loss.policy_loss``), registered with ``@register_policy_loss(name, settings=...)`` in
``POLICY_LOSSES`` (the pattern of verl's ``register_policy_loss``); each owns its settings dataclass, written in
YAML beside its name (``policy_loss: {name: sapo, tau_pos: 1.0}``). Every entry has the one signature::

    fn(logp, logp_old, advantages, mask, cfg: LossConfig, settings, terms: StepLogProbs) -> (loss [n, T], stats)

``logp`` ``[n, T]`` (with grad), ``logp_old`` ``[n, T]`` behaviour log-probs, ``advantages`` ``[n]`` (one per
sequence) or ``[n, T]``, ``mask`` ``[n, T]`` trained steps; ``loss`` is per step and already multiplied by the
mask (the trainer then ``aggregate``s it); ``stats`` holds detached ``[n, T]`` tensors ``ratio`` (the importance
ratio the loss used), ``clipped`` (1.0 where the loss cut the step's gradient) and ``log_ratio``.
``cfg`` holds the settings several losses share (the ratio clip, the dual clip); ``settings`` the loss's own;
``terms`` is the domain's ``StepLogProbs`` of the micro-batch, which likelihood-free losses (``nft``, ``awm``,
``dgpo``) read (``objective_pos``/``objective_neg``, combined with the advantage) and GRPO-Guard too (``step_std``).

**KL estimators** (``loss.kl_estimator``), registered with ``@register_kl_estimator(name)`` in ``KL_ESTIMATORS``,
all ``fn(logp, ref_logp, domain_kl) -> [n, T]`` per-step KL(π‖π_ref) with grad: ``k1`` and ``k3`` estimate it from
reference log-probs, ``domain`` takes the domain's own (``StepLogProbs.kl``, e.g. Flow-GRPO's Gaussian-mean KL).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .errors import ConfigError
from .loss_settings import (  # noqa: F401  (torch-free: the config loader reads them; shared_rl.losses.X as before)
    NFT_ADV_MODES,
    AWMSettings,
    CRDSettings,
    CispoSettings,
    DGPOSettings,
    DPOSettings,
    DiffusionOPSDSettings,
    FlowDPPOSettings,
    GSPOSettings,
    GuardSettings,
    NFTSettings,
    OPDSettings,
    SapoSettings,
)
from .part_index import NoSettings  # noqa: F401  (torch-free: the config loader reads it)

if TYPE_CHECKING:  # only for annotations: config imports this module lazily, never the other way at import time
    from .config import LossConfig

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class Normalizer:
    """Global denominators for one optimizer step: trained steps in total, sequences with ≥ 1 trained step, and
    the constant length for ``seq-mean-token-sum-norm``."""

    num_steps: float
    num_seqs: float
    max_steps: float

    @classmethod
    def from_mask(cls, mask: torch.Tensor, max_steps: int | None = None) -> "Normalizer":
        mask = mask.bool()
        return cls(
            num_steps=max(float(mask.sum()), 1.0),
            num_seqs=max(float(mask.any(dim=1).sum()), 1.0),
            max_steps=float(max_steps or mask.shape[1]),
        )


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, norm: Normalizer,
              row_steps: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-step ``values[n, T]`` to a scalar (names as verl ``agg_loss``).

    - ``token-mean`` (DAPO): Σ_{i,t} m·x / N_steps(global).
    - ``seq-mean-token-mean`` (GRPO): Σ_i [Σ_t m·x / Σ_t m] / N_seqs(global).
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): Σ_i [Σ_t m·x / L] / N_seqs(global), L a constant max length.

    ``row_steps`` ``[n]``: each row's Σ_t m over all its trained steps when ``mask`` covers a chunk of them (the
    trainer's ``optim.backward_steps``), so that the chunks' aggregates sum to the whole rows' (default Σ_t m).
    """
    m = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * m).sum() / norm.num_steps
    if mode == "seq-mean-token-mean":
        per_row = m.sum(1) if row_steps is None else row_steps.to(values.dtype)
        per_seq = (values * m).sum(1) / per_row.clamp(min=1)
        return per_seq.sum() / norm.num_seqs
    if mode == "seq-mean-token-sum-norm":
        return (values * m).sum() / norm.max_steps / norm.num_seqs
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, level: str = "step") -> torch.Tensor:
    """Per-step log importance ratio.

    ``step``: log ρ_t = logp_t − logp_old_t (PPO/GRPO).  ``sequence`` (GSPO, Zheng et al. 2025): every step of
    sequence i carries log s_i = mean_t m·(logp_t − logp_old_t) (length-normalised sequence ratio).
    """
    lr = (logp - logp_old) * mask
    if level == "step":
        return lr
    if level == "sequence":
        seq = lr.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        return seq.expand_as(logp)
    raise ValueError(f"unknown ratio level {level!r}; choose 'step' or 'sequence'")


def clipped_surrogate(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "step",
    max_log_ratio: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-step clipped surrogate loss (PPO, Schulman et al. 2017; GRPO; DAPO clip-higher, Yu et al. 2025): the
    implementation of the registered ``clipped`` (``ratio_level="step"``) and ``gspo`` (``"sequence"``) losses.

    ρ = exp(log_ratio);  L = −min(ρ·A, clip(ρ, 1−ε_lo, 1+ε_hi)·A).
    Dual clip (Ye et al. 2020) for A < 0: L = min(L, −c·A).
    ``advantages`` is ``[n]`` (one per sequence) or ``[n, T]``. Returns (loss ``[n, T]``, per-step stats).
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    hi = clip_low if clip_high is None else clip_high
    lr = log_ratio(logp, logp_old, mask, ratio_level)
    if max_log_ratio is not None:  # GSPO as verl: a bounded value, no gradient beyond the bound
        lr = lr.clamp(max=max_log_ratio)
    ratio = torch.exp(lr)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + hi)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    is_clipped = (clipped > unclipped).to(logp.dtype)
    stats = {"ratio": ratio.detach(), "clipped": is_clipped.detach(), "log_ratio": lr.detach()}
    return loss * mask, stats


# ---------------------------------------------------------------------------------------------------------------
# Policy-loss registry

PolicyLoss = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, settings: type = NoSettings,
                         whole_sequence: bool | Callable[[object], bool] = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: make ``fn(logp, logp_old, advantages, mask, cfg, settings, terms) -> (loss [n, T], stats)``
    selectable as ``loss.policy_loss: name`` (register before the config is loaded; the name is checked there).
    ``settings``: the loss's own settings dataclass (fields with defaults and ``metadata["help"]``), built from the
    keys written beside its name. ``whole_sequence``: a step's loss depends on the sequence's other steps (GSPO's
    sequence ratio), so the trainer must not split a sequence's steps over backward passes; a bool, or a function
    of the loss's settings where one of them decides it (cispo's ``level``). ``fn.whole_sequence(settings)``."""

    def wrap(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES and POLICY_LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered ({POLICY_LOSSES[name].__qualname__})")
        fn.settings_class = settings
        fn.whole_sequence = whole_sequence if callable(whole_sequence) else (lambda _s, v=whole_sequence: v)
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def _unknown(kind: str, name: str, known) -> str:
    close = difflib.get_close_matches(str(name), sorted(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{kind} {name!r} is unknown{hint}; choose one of {sorted(known)}"


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss ``name`` (KeyError with a did-you-mean when there is none)."""
    if name not in POLICY_LOSSES:
        raise KeyError(_unknown("policy loss", name, POLICY_LOSSES))
    return POLICY_LOSSES[name]


def _per_step(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    adv = advantages.to(like.dtype)
    return adv[:, None].expand_as(like) if adv.dim() == 1 else adv


@register_policy_loss("clipped")
def clipped_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 cfg: "LossConfig", settings: NoSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate with a per-step ratio (PPO, Schulman et al. 2017; GRPO, Shao et al. 2024; DAPO
    clip-higher, Yu et al. 2025; dual clip, Ye et al. 2020).

    ρ_t = exp(logp_t − logp_old_t);  L_t = max(−A·ρ_t, −A·clip(ρ_t, 1−ε_lo, 1+ε_hi)) with ε_lo = ``clip_low``,
    ε_hi = ``clip_high`` (default ε_lo); for A < 0 with ``dual_clip`` c: L_t = min(L_t, −c·A).
    """
    return clipped_surrogate(logp, logp_old, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip, "step")


@register_policy_loss("guard", settings=GuardSettings)
def guard_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               cfg: "LossConfig", settings: GuardSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard (Wang et al., "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated
    Clipping", 2025): the clipped surrogate on a per-step *normalised* ratio, so that one clip range acts on high-
    and low-noise denoising steps alike, and every step's gradient has the same scale.

    For a Gaussian step of std σ_t the log-ratio is ℓ_t = mean(ε·Δμ)/σ_t − ‖Δμ‖²/(2σ_t²) (mean-reduced, ε the
    step's noise): its spread scales like 1/σ_t and its mean is biased below 0, so a fixed clip cuts low-noise
    steps and never touches high-noise ones, and their gradients differ by σ_max/σ_min. RatioNorm, as the reference
    (X-GenGroup/Flow-Factory ``GRPOGuardTrainer``): ``ℓ̂_t = ℓ_t·σ_t + b_t`` = mean(ε·Δμ), with σ_t the domain's
    ``StepLogProbs.step_std``; the bias b_t is the detached mean of ``ℓ_t·σ_t`` over the call's rows at step t
    (setting ``center``; the reference's analytic ‖Δμ‖²/(2σ_t) needs the rollout's means, which grove does not
    store). The gradient of ``ℓ̂_t`` no longer carries 1/σ_t: unclipped steps of every noise level pull alike
    (setting ``step_weight: balanced``, the paper's equalised gradients). ``step_weight: flow_grpo`` divides each
    step's loss by its scale instead, which restores plain Flow-GRPO's gradient. ``scale: relative`` uses
    σ_t/σ̄ (σ̄ the call's mean std) in place of σ_t.

    ρ̂ = 1 exactly at the first inner step (ℓ = 0), like the plain surrogate."""
    if terms is None or terms.step_std is None:
        raise ConfigError("loss.policy_loss 'guard' (GRPO-Guard) needs a domain that reports each step's transition "
                          "std (StepLogProbs.step_std): the visgen flow domains do")
    m = mask.to(logp.dtype)
    std = terms.step_std.to(logp).detach()
    trained = m.bool() & (std > 0)
    if settings.scale == "relative":
        mean_std = std[trained].mean() if trained.any() else torch.ones((), dtype=logp.dtype, device=logp.device)
        std = std / mean_std
    scale = torch.where(trained, std, torch.ones_like(std))
    lr = (logp - logp_old) * m * scale
    if settings.center:
        centre = (lr.detach() * m).sum(0, keepdim=True) / m.sum(0, keepdim=True).clamp(min=1)
        lr = (lr - centre) * m
    loss, st = clipped_surrogate(logp_old + lr, logp_old, advantages, mask, cfg.clip_low, cfg.clip_high,
                                 cfg.dual_clip, "step")
    if settings.step_weight == "flow_grpo":
        loss = loss / scale
    return loss, st


@register_policy_loss("gspo", settings=GSPOSettings, whole_sequence=True)
def gspo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              cfg: "LossConfig", settings: GSPOSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the clipped surrogate on the
    length-normalised sequence ratio.

    s_i = exp((1/|y_i|) Σ_t m_t·(logp_t − logp_old_t)), the same for every step of sequence i (gradient through
    the mean); L_t = max(−A·s_i, −A·clip(s_i, 1−ε_lo, 1+ε_hi)) (+ dual clip as ``clipped``). As verl, log s_i is
    clamped at ``max_log_ratio`` (10): beyond it the value stays e^10 and the gradient is 0, so one runaway sequence
    cannot blow up a negative-advantage loss.
    """
    return clipped_surrogate(logp, logp_old, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                             "sequence", max_log_ratio=settings.max_log_ratio)


@register_policy_loss("cispo", settings=CispoSettings, whole_sequence=lambda s: s.level == "sequence")
def cispo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               cfg: "LossConfig", settings: CispoSettings,
               terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, MiniMax 2025, "Scaling Test-Time Compute Efficiently with Lightning Attention"): clip
    the importance weight, not the update — every step keeps a gradient.

    ρ_t = exp(logp_t − logp_old_t);  L_t = −sg(clip(ρ_t, 1−ε_lo, w_max))·A·logp_t  (sg = stop-gradient), so
    ∇L_t = −clip(ρ_t)·A·∇logp_t; at ρ = 1 this equals the unclipped surrogate's gradient −A·∇ρ_t. ``w_max`` is
    ``max_weight``, else 1 + ε_hi; with ``level: sequence`` ρ is the sequence's length-normalised ratio (as TRL's
    ``importance_sampling_level='sequence'``). ``clipped`` marks the steps whose weight was clipped.
    """
    m = mask.to(logp.dtype)
    adv = _per_step(advantages, logp)
    hi = cfg.clip_low if cfg.clip_high is None else cfg.clip_high
    top = settings.max_weight if settings.max_weight is not None else 1.0 + hi
    lr = log_ratio(logp, logp_old, m, settings.level)
    ratio = torch.exp(lr)
    weight = ratio.detach().clamp(min=1.0 - cfg.clip_low).clamp(max=top)
    loss = -weight * adv * logp
    is_clipped = (weight != ratio.detach()).to(logp.dtype)
    return loss * m, {"ratio": ratio.detach(), "clipped": is_clipped, "log_ratio": lr.detach()}


@register_policy_loss("sapo", settings=SapoSettings)
def sapo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              cfg: "LossConfig", settings: SapoSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, Qwen team, "Soft Adaptive Policy Optimization"): a smooth sigmoid gate instead of the
    hard clip.

    ρ_t = exp(logp_t − logp_old_t);  L_t = −f(ρ_t)·A with f(ρ) = σ(τ(ρ−1))·4/τ, τ = ``tau_pos`` for A > 0 and
    ``tau_neg`` for A ≤ 0 (the paper's 1.0 / 1.05: negative-advantage gradients fade faster).
    f'(ρ) = 4σ(1−σ) is 1 at ρ = 1 (the unclipped surrogate's gradient) and decays smoothly away from it.
    ``clipped`` marks the steps whose gate weight 4σ(1−σ) fell below 1/2 (gradient more than halved).
    """
    m = mask.to(logp.dtype)
    adv = _per_step(advantages, logp)
    lr = (logp - logp_old) * m
    ratio = torch.exp(lr)
    tau = torch.where(adv > 0, torch.full_like(adv, settings.tau_pos), torch.full_like(adv, settings.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -gate * (4.0 / tau) * adv
    weight = (4.0 * gate * (1.0 - gate)).detach()
    return loss * m, {"ratio": ratio.detach(), "clipped": (weight < 0.5).to(logp.dtype), "log_ratio": lr.detach()}


def _no_ratio_stats(logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """A likelihood-free loss has no importance ratio: report ratio 1, nothing clipped."""
    zeros = torch.zeros_like(logp).detach()
    return {"ratio": zeros + 1.0, "clipped": zeros, "log_ratio": zeros}


def _domain_terms(name: str, terms, need_neg: bool):
    if terms is None or terms.objective_pos is None or (need_neg and terms.objective_neg is None):
        raise ConfigError(f"loss.policy_loss {name!r} is likelihood-free: it needs a domain that computes its "
                          f"objective terms (visgen: visgen.objective: {{name: {name}}})")
    return terms.objective_pos, terms.objective_neg


def nft_optimality(advantages: torch.Tensor, adv_max: float, adv_mode: str = "all") -> torch.Tensor:
    """DiffusionNFT's optimality weight r ∈ [0, 1] of each advantage, as NVlabs/DiffusionNFT ``train_nft_sd3.py``:
    A is clipped to ±A_max, then ``adv_mode`` reshapes it, then r = clip(A/A_max/2 + 1/2, 0, 1)."""
    a = advantages.clamp(-adv_max, adv_max)
    if adv_mode == "positive_only":
        a = a.clamp(0.0, adv_max)
    elif adv_mode == "negative_only":
        a = a.clamp(-adv_max, 0.0)
    elif adv_mode == "one_only":
        a = (a > 0).to(a.dtype)
    elif adv_mode == "binary":
        a = torch.sign(a)
    return (a / adv_max / 2 + 0.5).clamp(0.0, 1.0)


@register_policy_loss("nft", settings=NFTSettings)
def nft_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg,
             settings: NFTSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", NVlabs,
    ICLR 2026): the optimality weight r (``nft_optimality``: A clipped to ±A_max, reshaped by ``adv_mode``,
    r = clip(A/A_max/2 + 1/2, 0, 1)) mixes the domain's implicit positive and negative branch losses,
    L = A_max · [r · P + (1 − r) · N] (P, N already divided by NFT's β and their adaptive weights by the domain).
    A_max = setting ``adv_max``."""
    pos, neg = _domain_terms("nft", terms, need_neg=True)
    a_max = float(settings.adv_max)
    adv = advantages.to(pos.dtype)
    adv = adv[:, None].expand_as(pos) if adv.dim() == 1 else adv
    r = nft_optimality(adv, a_max, settings.adv_mode)
    loss = a_max * (r * pos + (1 - r) * neg)
    return loss * mask.to(loss.dtype), _no_ratio_stats(logp)


@register_policy_loss("diffusion_opsd", settings=DiffusionOPSDSettings)
def diffusion_opsd_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg,
                        settings: DiffusionOPSDSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionOPSD (worldbench/DiffusionOPSD ``scripts/train_opsd_ri_sd3.py``, its OPA loss): the domain's branch
    losses toward the reward-moved targets, ``P = mean (ŷ⁺ − y⁺)²/w⁺`` and ``N = mean (ŷ⁻ − y⁻)²/w⁻``
    (``objective_pos``/``objective_neg``: ŷ± the clean predictions of NFT's implicit velocities at the query state, w
    their detached mean absolute errors clipped at 1e-5), mixed by the clipped advantage:
    ``L = A_max · [r·P + (1 − r)·N]``, ``r = clip(clip(A, ±A_max)/A_max/2 + 1/2, 0, 1)`` (no ``adv_mode``; P and N are
    not divided by NFT's β, unlike ``nft``). ``dual_negative: false`` drops N."""
    pos, neg = _domain_terms("diffusion_opsd", terms, need_neg=True)
    a_max = float(settings.adv_clip_max)
    adv = advantages.to(pos.dtype)
    adv = adv[:, None].expand_as(pos) if adv.dim() == 1 else adv
    r = nft_optimality(adv, a_max, "all")
    neg = neg if settings.dual_negative else neg * 0.0
    loss = a_max * (r * pos + (1 - r) * neg)
    return loss * mask.to(loss.dtype), _no_ratio_stats(logp)


@register_policy_loss("awm", settings=AWMSettings)
def awm_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg,
             settings: AWMSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantage Weighted Matching (Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in
    Diffusion Models", 2025), as scxue/advantage_weighted_matching ``train_sd3_awm.py`` (``loss_type: exp_first``):
    the PPO clipped surrogate on the per-timestep ratio ρ = exp(log p − log p_old) of AWM's likelihood
    log p = −w(t)·‖v_θ(x_t, t) − (ε − x0)‖² (``logp``, computed by the domain; ``logp_old`` the same before this
    iteration's first update, so the first optimizer step on a batch has ρ = 1 and the gradient A·∇‖…‖²·w), with
    A' = clip(A, ±adv_clip_max)·advantage_max/adv_clip_max:
    L = max(−A'ρ, −A'·clip(ρ, 1 − clip_range, 1 + clip_range)) + ema_beta·‖v_θ − v_ema‖² (``objective_pos``)."""
    ema, _ = _domain_terms("awm", terms, need_neg=False)
    adv = advantages.to(logp.dtype).clamp(-settings.adv_clip_max, settings.adv_clip_max)
    if settings.advantage_max is not None:
        adv = adv / settings.adv_clip_max * settings.advantage_max
    loss, st = clipped_surrogate(logp, logp_old, adv, mask, settings.clip_range, settings.clip_range, None, "step")
    if settings.ema_beta:
        loss = loss + settings.ema_beta * ema.to(loss.dtype) * mask.to(loss.dtype)
    return loss, st


@register_policy_loss("dgpo", settings=DGPOSettings)
def dgpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg,
              settings: DGPOSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DGPO (Luo, Hu & Tang, "Reinforcing Diffusion Models by Direct Group Preference Optimization", ICLR 2026;
    Luo-Yihong/DGPO ``compute_group_dgpo_loss_allreduce``): maximise log σ(R(G⁺) − R(G⁻)), the likelihood that a
    group's better-than-average samples are preferred, with the implicit DPO reward of the denoising loss.

    Per sample i and timestep slot t: dsm_i = ‖v_θ − (ε − x0)‖² (``objective_pos``, with grad; ``logp`` = −dsm),
    dsm_ref,i the reference's (``objective_neg``). Per group g (``terms.group``) and slot:
    S_g = β/G_g · Σ_{i∈g} A_i·(dsm_i − dsm_ref,i) (detached; G_g the group's rows in the slot), w_g = σ(S_g), and
    L_i = w_g·A_i·dsm_i — the gradient of −log σ(−S_g) up to the constant β/G. PPO-style clipping (``clip_dsm``):
    ρ = exp(logp − logp_old) = exp(dsm_old − dsm); where A > 0 and ρ > 1 + c, or A ≤ 0 and ρ < 1 − c, dsm is
    detached (no gradient). The group sums need every member of a group in the same call (visgen refuses layouts
    that would split one); rows without a group (``terms.group`` None) form one group."""
    dsm, ref = _domain_terms("dgpo", terms, need_neg=True)
    group = terms.group  # a call without groups is one group
    if group is None:
        group = torch.zeros(dsm.shape[0], dtype=torch.long)
    m = mask.to(dsm.dtype)
    adv = _per_step(advantages, dsm)
    lr = (logp - logp_old) * m
    ratio = torch.exp(lr)
    should_clip = torch.where(adv > 0, ratio > 1.0 + settings.clip_range, ratio < 1.0 - settings.clip_range) & m.bool()
    dsm_c = torch.where(should_clip, dsm.detach(), dsm)
    per = adv * settings.beta_dpo * (dsm.detach() - ref.detach()) * m  # [n, T]
    _, g = torch.unique(group.to(dsm.device), return_inverse=True)
    n_groups = int(g.max()) + 1 if g.numel() else 0
    sums = torch.zeros(n_groups, dsm.shape[1], dtype=dsm.dtype, device=dsm.device).index_add_(0, g, per)
    counts = torch.zeros(n_groups, dsm.shape[1], dtype=dsm.dtype, device=dsm.device).index_add_(0, g, m)
    weight = torch.sigmoid(sums / counts.clamp(min=1))[g].detach()
    loss = weight * adv * dsm_c
    return loss * m, {"ratio": ratio.detach(), "clipped": should_clip.to(dsm.dtype), "log_ratio": lr.detach()}


def dpo_pairs(advantages: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` row indices ``[P]``, one pair per group: the rows of the largest and the smallest
    advantage (the first of ties, torch.argmax / argmin), as flow_grpo's ``PerPromptStatTracker`` type ``dpo`` picks
    them from the rewards; a group whose advantages are all equal pairs its first two rows (the reference's
    ``min_idx = 0, max_idx = 1``); a group of one row has no pair."""
    chosen, rejected = [], []
    for g in torch.unique(group).tolist():
        rows = torch.nonzero(group == g).flatten()
        if rows.numel() < 2:
            continue
        a = advantages[rows]
        hi, lo = int(torch.argmax(a)), int(torch.argmin(a))
        if hi == lo:  # every advantage equal: the reference trains its first two samples anyway
            hi, lo = 1, 0
        chosen.append(int(rows[hi]))
        rejected.append(int(rows[lo]))
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


@register_policy_loss("dpo", settings=DPOSettings)
def dpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg,
             settings: DPOSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Online Diffusion-DPO (Wallace et al. 2024, as yifan123/flow_grpo ``scripts/train_sd3_dpo.py`` and verl-omni
    ``DPOLoss``): per group (``terms.group``) the pair of its best and worst sample (``dpo_pairs`` on the
    advantages), and per timestep slot the pair loss
    ``L = −log σ(−β/2 · [(err_w − err_ref,w) − (err_l − err_ref,l)])`` with ``err = ‖v − (ε − x0)‖²`` under the
    policy (``objective_pos``, with grad) and the reference (``objective_neg``); chosen and rejected share the slot's
    noise and timestep (the domain draws them per group).

    Layout: a pair's loss is written on both its rows scaled by G_g/2 (G_g the group's rows in the call), the other
    rows get 0, so that ``token-mean`` and ``seq-mean-token-mean`` over a call of equal-sized groups give the mean
    over pairs and slots, the reference's ``mean`` of each slot's pair losses averaged over its accumulated
    timesteps. Needs every member of a group in the call (visgen refuses layouts that would split one).
    ``clipped`` reports the pairs the implicit reward already orders (inside term > 0, the reference's implicit_acc)."""
    err, ref = _domain_terms("dpo", terms, need_neg=True)
    group = terms.group if terms.group is not None else torch.zeros(err.shape[0], dtype=torch.long)
    group = group.to(err.device)
    adv = advantages.to(err.dtype)
    if adv.dim() != 1:
        adv = adv[:, 0]
    m = mask.to(err.dtype)
    loss = torch.zeros_like(err)
    acc = torch.zeros_like(err)
    w, l = dpo_pairs(adv.detach().cpu(), group.cpu())
    if w.numel():
        w, l = w.to(err.device), l.to(err.device)
        both = m[w] * m[l]  # a slot trains when both rows of the pair carry it (they share the slot's draw)
        inside = -0.5 * settings.beta * ((err[w] - ref[w].detach()) - (err[l] - ref[l].detach()))
        pair = -torch.nn.functional.logsigmoid(inside) * both
        _, inv, counts = torch.unique(group, return_inverse=True, return_counts=True)
        scale = (counts[inv].to(err.dtype) / 2.0)[:, None]
        loss = loss.index_put((w,), pair * scale[w], accumulate=True).index_put((l,), pair * scale[l], accumulate=True)
        hit = (inside.detach() > 0).to(err.dtype) * both
        acc = acc.index_put((w,), hit, accumulate=True).index_put((l,), hit, accumulate=True)
    stats = _no_ratio_stats(logp)
    stats["clipped"] = acc.detach()
    return loss * m, stats


@register_policy_loss("flow_dppo", settings=FlowDPPOSettings)
def flow_dppo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg,
                   settings: FlowDPPOSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO (arXiv 2606.11025; Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py``): Flow-GRPO's surrogate
    with the ratio clip replaced by a KL mask. ρ = exp(logp − logp_old), KL_t = the domain's per-step KL between the
    policy's and the old policy's step Gaussians (``terms.old_kl``, ‖μ − μ_old‖²/(2σ_t²) mean over latent elements;
    the old means frozen for the batch). A step is dropped (loss 0, no gradient) when KL_t ≥ τ and (A > 0, ρ > 1)
    or (A < 0, ρ < 1); otherwise L = −A·ρ, unclipped. At the first inner step ρ = 1 and KL = 0: nothing is dropped.
    τ = setting ``kl_threshold``. ``clipped`` reports the dropped steps."""
    if terms is None or getattr(terms, "old_kl", None) is None:
        raise ConfigError("loss.policy_loss 'flow_dppo' needs the KL between the policy's and the old policy's step "
                          "means (StepLogProbs.old_kl): visgen computes it with visgen.objective: {name: flow_dppo}")
    m = mask.to(logp.dtype)
    adv = _per_step(advantages, logp).detach()
    lr = (logp - logp_old) * m
    ratio = torch.exp(lr.detach())
    far = terms.old_kl.to(logp).detach() >= settings.kl_threshold
    drop = far & (((ratio > 1.0) & (adv > 0)) | ((ratio < 1.0) & (adv < 0))) & m.bool()
    # the dropped steps' log-ratio is zeroed BEFORE exp: an overflowing ratio would otherwise send 0 * inf = nan
    # back through torch.where's unselected branch (the reference's where guards the value only)
    kept = torch.exp(torch.where(drop, torch.zeros_like(lr), lr))
    loss = torch.where(drop, torch.zeros_like(kept), -adv * kept)
    return loss * m, {"ratio": ratio, "clipped": drop.to(logp.dtype).detach(), "log_ratio": lr.detach()}


@register_policy_loss("opd", settings=OPDSettings)
def opd_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg,
             settings: OPDSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Diffusion on-policy distillation (verl-omni ``DistillKLLoss``, docs/algo/diffusion_opd.md): per stored SDE
    step of the student's own trajectory, the closed-form KL between the student's and a frozen teacher's step
    Gaussians (they share the student's std), ``KL_t = mean over latent elements of ‖μ_θ − μ_T‖² / (2σ_t²)``
    (``terms.old_kl``, with grad through μ_θ; the domain replays the stored state through the teacher).
    ``L_t = c·KL_t`` (c = ``distill_coef``), plus with ``with_grpo`` the Flow-GRPO clipped surrogate of
    ``clipped`` (verl-omni's ``flow_grpo`` loss + ``distill_loss_coef``·distill). The ratio stats are the
    surrogate's (ρ reported, nothing clipped without it)."""
    if terms is None or getattr(terms, "old_kl", None) is None:
        raise ConfigError("loss.policy_loss 'opd' needs the KL between the student's and the teacher's step means "
                          "(StepLogProbs.old_kl): visgen computes it with visgen.objective: {name: opd, teacher: ...}")
    m = mask.to(logp.dtype)
    distill = settings.distill_coef * terms.old_kl.to(logp)
    if settings.with_grpo:
        pg, stats = clipped_surrogate(logp, logp_old, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                                      "step")
        return pg + distill * m, stats
    lr = (logp - logp_old) * m
    return distill * m, {"ratio": torch.exp(lr.detach()), "clipped": torch.zeros_like(lr).detach(),
                         "log_ratio": lr.detach()}


def crd_targets(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """CRD's reward in [0, 1] from the advantage: clamp(clip(A, ±A_max)/A_max/2 + 1/2, 0, 1)."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max / 2.0 + 0.5
    return a.clamp(0.0, 1.0)


@register_policy_loss("crd", settings=CRDSettings)
def crd_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg,
             settings: CRDSettings, terms=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Centered Reward Distillation (arXiv 2603.14128; X-GenGroup/Flow-Factory ``trainers/crd.py``): per training
    slot the implicit reward r_θ (``terms.objective_pos``, with grad; from the velocity errors of the policy and an
    old snapshot) and the external reward a = ``crd_targets(A)`` are both centred over the slot's centring set —
    the rows of one group (``terms.group``), which share the slot's timestep — R_c = a − mean(a),
    R_θ,c = r_θ − mean(r_θ) (the mean detached), and matched:
    ``mse``: L = (A_max/β)·(β·R_θ,c − R_c)²;  ``bce``: L = (A_max/β)·BCE_logits(β·R_θ,c, σ(R_c));
    plus ``kl_beta``·(c + a·(1 − c))·KL (c = 1e-4/kl_beta; ``reward_adaptive_kl``; else kl_beta·KL), KL =
    ``terms.objective_neg`` = ‖v_θ − v_ref‖² to the CFG-guided reference. Needs every member of a group in the call."""
    r, kl = _domain_terms("crd", terms, need_neg=settings.kl_beta > 0)
    m = mask.to(r.dtype)
    adv = advantages.to(r.dtype)
    if adv.dim() != 1:
        adv = adv[:, 0]
    a = crd_targets(adv.detach(), settings.adv_clip_max)[:, None].expand_as(r)
    group = terms.group if terms.group is not None else torch.zeros(r.shape[0], dtype=torch.long)
    _, inv = torch.unique(group.to(r.device), return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, r.shape[1], dtype=r.dtype, device=r.device).index_add_(0, inv, m).clamp(min=1)

    def group_mean(x):  # per row and slot: the mean over the slot's trained rows of the row's group
        return (torch.zeros(n_groups, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, inv, x * m) / count)[inv]

    rc, r_theta_c = a - group_mean(a), r - group_mean(r.detach())
    scale = settings.adv_clip_max / settings.beta
    if settings.loss_type == "bce":
        target = torch.sigmoid(rc)
        logits = settings.beta * r_theta_c
        loss = scale * torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
    else:
        loss = scale * (settings.beta * r_theta_c - rc) ** 2
    if settings.kl_beta > 0:
        if settings.reward_adaptive_kl:
            c = 1e-4 / settings.kl_beta
            loss = loss + settings.kl_beta * (c + a * (1.0 - c)) * kl
        else:
            loss = loss + settings.kl_beta * kl
    return loss * m, _no_ratio_stats(logp)


# ---------------------------------------------------------------------------------------------------------------
# KL estimators: KL(π‖π_ref) per step, ``fn(logp, ref_logp, domain_kl) -> [n, T]``

KLEstimator = Callable[..., torch.Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {}


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator: make ``fn(logp, ref_logp, domain_kl) -> [n, T]`` selectable as ``loss.kl_estimator: name``."""

    def wrap(fn: KLEstimator) -> KLEstimator:
        KL_ESTIMATORS[name] = fn
        return fn

    return wrap


def _need_ref(name: str, ref_logp: torch.Tensor | None) -> torch.Tensor:
    if ref_logp is None:
        raise ConfigError(f"loss.kl_coef > 0 with loss.kl_estimator {name!r}, but the domain returned neither its own "
                          f"kl nor ref_logp; set loss.kl_coef: 0 or use a domain that computes a KL")
    return ref_logp


@register_kl_estimator("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor | None, domain_kl: torch.Tensor | None = None) -> torch.Tensor:
    """k1 estimator of KL(π‖π_ref) (Schulman 2020, "Approximating KL divergence"): log π − log π_ref."""
    return logp - _need_ref("k1", ref_logp)


@register_kl_estimator("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor | None, domain_kl: torch.Tensor | None = None) -> torch.Tensor:
    """k3 estimator (Schulman 2020; GRPO): exp(log π_ref − log π) − (log π_ref − log π) − 1 ≥ 0."""
    d = _need_ref("k3", ref_logp) - logp
    return torch.exp(d) - d - 1.0


@register_kl_estimator("domain")
def kl_domain(logp: torch.Tensor, ref_logp: torch.Tensor | None, domain_kl: torch.Tensor | None = None) -> torch.Tensor:
    """The domain's own per-step KL (``StepLogProbs.kl``, e.g. Flow-GRPO's Gaussian-mean KL ``shared_rl.flow_kernels.sde_mean_kl``);
    k3 on ``ref_logp`` for a domain that returns reference log-probs instead."""
    return domain_kl if domain_kl is not None else kl_k3(logp, ref_logp)


def kl_per_step(name: str, logp: torch.Tensor, ref_logp: torch.Tensor | None,
                domain_kl: torch.Tensor | None) -> torch.Tensor:
    """The KL term of ``loss.kl_estimator`` ``name``. A domain that computes its own KL (``domain_kl``, exact for
    what it samples, e.g. the SDE-step Gaussians) is used whatever the estimator; the estimator then only
    matters for domains that return reference log-probs."""
    if name not in KL_ESTIMATORS:
        raise KeyError(_unknown("KL estimator", name, KL_ESTIMATORS))
    return KL_ESTIMATORS["domain" if domain_kl is not None else name](logp, ref_logp, domain_kl)


# ---------------------------------------------------------------------------------------------------------------
# Off-policy sequence masking (``loss.off_policy_mask``).


def off_policy_sequence_mask(advantages: torch.Tensor, logp: torch.Tensor, logp_behaviour: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9; TRL ``get_off_policy_mask``): 1 keeps a
    sequence, 0 drops it. A sequence is dropped when its advantage is negative and its mean per-step KL estimate
    ``Σ_t m·(logp_behaviour − logp) / Σ_t m`` (the sampling policy against the current one, detached) exceeds
    ``threshold``: a negative update on samples the policy has moved far from is the one that destabilises.
    ``advantages`` ``[n]``, ``[n, 1]`` or ``[n, T]`` (then per step); returns ``[n, 1]`` (or ``[n, T]``)."""
    m = mask.to(logp.dtype)
    seq_kl = ((logp_behaviour - logp.detach()) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    return ((adv >= 0) | (seq_kl <= threshold)).to(m.dtype)


# ---------------------------------------------------------------------------------------------------------------
# The entropy bonus and the high-entropy token mask (``loss.entropy``).


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """Beyond the 80/20 Rule (Wang et al. 2025, arXiv 2506.01939; TRL ``get_high_entropy_mask``): the trained steps
    whose entropy is at or above the ``1 - top_quantile`` quantile (linear interpolation, ``torch.quantile``) of the
    trained steps' entropies; ``top_quantile`` 1 keeps every trained step, 0 only the highest (ties kept)."""
    m = mask.bool()
    if top_quantile >= 1 or not m.any():
        return m
    h = entropy.detach()
    threshold = torch.quantile(h[m].float(), 1.0 - top_quantile)
    return m & (h >= threshold.to(h.dtype))


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """``Σ_{i,t} m·H / N_steps``: the step's mean per-step entropy over its trained steps (the global count, so the
    micro-batches' shares sum to it), whatever the policy loss's aggregation (TRL's documented meaning)."""
    return (entropy * mask.to(entropy.dtype)).sum() / norm.num_steps


class EntropyCoefficient:
    """The entropy bonus's coefficient over a run (``loss.entropy``): fixed, or adaptive (Skywork-OR1 as TRL runs
    it). ``applied()`` is the coefficient of the current optimizer step: ``coef``, or when adaptive ``coef`` while
    the previous step's entropy was at or below ``target``, else 0 (so the first step applies 0: no entropy measured
    yet counts as infinite, as in TRL). ``update(h)`` after each optimizer step with its mean entropy ``h``: ``coef``
    rises by ``coef_step`` if ``h <= target``, else falls by it, within ``[coef_min, coef_max]``."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.coef = float(cfg.coef)
        self.last_entropy = float("inf")

    @property
    def adaptive(self) -> bool:
        return self.cfg.target is not None

    def applied(self) -> float:
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.cfg.target else 0.0

    def update(self, entropy: float) -> None:
        if not self.adaptive:
            return
        c = self.cfg
        step = c.coef_step if entropy <= c.target else -c.coef_step
        self.coef = min(max(self.coef + step, c.coef_min), c.coef_max)
        self.last_entropy = float(entropy)

    def state(self) -> dict[str, float]:
        """JSON (an infinite entropy written as null)."""
        last = self.last_entropy
        return {"coef": self.coef, "last_entropy": None if last == float("inf") else last}

    def load(self, state: dict) -> None:
        self.coef = float(state["coef"])
        self.last_entropy = float("inf") if state.get("last_entropy") is None else float(state["last_entropy"])


# ---------------------------------------------------------------------------------------------------------------
# The critic's loss (PPO with ``advantage.estimator: gae``).


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = None) -> torch.Tensor:
    """Per-decision value loss ``[n, C]`` (times the mask), PPO2's clipped form (as RL4VLA / πRL):

    L = ½·(V − R)²  without a clip;  L = ½·max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²)  with clip ε,

    ``values`` V (with grad), ``old_values`` V_old (the critic at rollout time), ``returns`` R (the GAE targets).
    """
    m = mask.to(values.dtype)
    err = (values - returns) ** 2
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (v_clip - returns) ** 2)
    return 0.5 * err * m
