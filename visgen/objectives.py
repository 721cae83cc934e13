"""visgen training objectives, registered by name: what ``log_probs`` computes for the configured policy loss.

``visgen.objective: {name: ...}`` (a tagged union like ``visgen.method``):

- ``log_prob`` (default) — the Flow-GRPO family: the stored SDE steps' log-probs are recomputed with grad
  (``visgen.recompute``) for a ratio-based policy loss (``loss.policy_loss``: clipped, gspo, cispo, sapo, guard).
- ``nft`` — DiffusionNFT (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
  NVlabs, ICLR 2026), likelihood-free: only clean samples x0 and rewards, from any sampler (ODE included). At
  ``timesteps_per_sample`` grid timesteps t per sample (fresh noise ε drawn at rollout time):
  ``x_t = (1 − t)·x0 + t·ε``; ``v⁺ = β·v_θ + (1 − β)·v_old``, ``v⁻ = (1 + β)·v_old − β·v_θ`` with v_old the
  "old" policy (a lagging copy of the adapter, ramped decay); ``x̂0(v) = x_t − t·v``;
  ``P = ‖x̂0(v⁺) − x0‖² / (β·w⁺)``, ``N = ‖x̂0(v⁻) − x0‖² / (β·w⁻)`` (mean over elements), with the adaptive
  weights ``w = mean|x̂0 − x0|`` detached. The ``nft`` policy loss mixes them: ``A_max·[r·P + (1 − r)·N]``,
  ``r = clip(A/A_max/2 + 1/2, 0, 1)``. ``branches: positive | negative`` keeps one term (the paper's ablations).
- ``awm`` — Advantage Weighted Matching (Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining
  in Diffusion Models", 2025): the pretraining flow-matching loss on the policy's own samples,
  ``P = ‖v_θ(x_t, t) − (ε − x0)‖²``, weighted by the advantage in the ``awm`` policy loss (``A·P``).

A likelihood-free objective is chosen once: it brings its policy loss (``VisgenConfig.policy_loss``, with NFT's
``adv_max``) and, unless ``visgen.method`` says otherwise, the deterministic ODE sampler (``default_method``; the
DiffusionNFT reference samples deterministically, and both train on clean samples from any sampler).

Both likelihood-free objectives take the optional velocity KL to the adapter-off reference, ``‖v_θ − v_ref‖²``
(``loss.kl_coef``). Their training timesteps are drawn per sample from the rollout's own grid, so the trained
"steps" of a rollout row are ``timesteps_per_sample`` slots (columns ``0..K-1`` of its mask) rather than SDE steps,
and only leaves (rows that end in an image) train. Everything a slot needs (x0, t, ε) is stored at rollout time,
so recomputation is deterministic and splitting a minibatch into micro-batches gives the same gradient.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Literal

import torch
from diffusers.utils.torch_utils import randn_tensor

from shared_rl.config import ConfigError, from_dict
from shared_rl.domain import StepLogProbs

__all__ = ["OBJECTIVES", "Objective", "LogProbObjective", "NFTObjective", "AWMObjective", "objective_from_config",
           "nft_branch_losses", "flow_matching_loss"]


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
    """The rectified-flow (pretraining) loss ``‖v − (ε − x0)‖²`` per sample (mean over elements) — AWM's term."""
    return _mean_elements((v - (eps - x0)) ** 2)


# ------------------------------------------------------------------------------------------------ settings
@dataclass
class LogProbSettings:
    """The Flow-GRPO family has no settings of its own here (kernel and method live in the visgen section)."""


@dataclass
class NFTSettings:
    adv_max: float = field(default=5.0, metadata={"help": "A_max of the nft policy loss: r = clip(A/A_max/2 + 1/2, "
                                                          "0, 1) (the loss's adv_max)"})
    beta: float = field(default=1.0, metadata={"help": "NFT's beta: how far the implicit positive/negative "
                                                       "velocities step from the old policy's"})
    timesteps_per_sample: int = field(default=3, metadata={"help": "grid timesteps trained per sample (fresh "
                                                                   "noise each)"})
    old_decay_max: float = field(default=0.5, metadata={"help": "old policy: the largest EMA decay"})
    old_decay_ramp: float = field(default=0.05, metadata={"help": "old policy: decay_k = min(old_decay_max, "
                                                                  "old_decay_ramp * optimizer step k)"})
    branches: Literal["both", "positive", "negative"] = field(default="both", metadata={
        "help": "train both branch losses, or only the positive / only the negative one (ablations)"})

    def check(self, where: str) -> None:
        if self.adv_max <= 0:
            raise ConfigError(f"{where}.adv_max must be > 0, got {self.adv_max}")
        if self.beta <= 0:
            raise ConfigError(f"{where}.beta must be > 0, got {self.beta}")
        if self.timesteps_per_sample < 1:
            raise ConfigError(f"{where}.timesteps_per_sample must be >= 1, got {self.timesteps_per_sample}")
        if not 0 <= self.old_decay_max < 1 or self.old_decay_ramp < 0:
            raise ConfigError(f"{where}.old_decay_max must be in [0, 1) and old_decay_ramp >= 0")


@dataclass
class AWMSettings:
    timesteps_per_sample: int = field(default=3, metadata={"help": "grid timesteps trained per sample (fresh "
                                                                   "noise each)"})

    def check(self, where: str) -> None:
        if self.timesteps_per_sample < 1:
            raise ConfigError(f"{where}.timesteps_per_sample must be >= 1, got {self.timesteps_per_sample}")


# ------------------------------------------------------------------------------------------------ registry
class Objective:
    """A registered objective: its ``name``, settings and the policy losses it feeds."""

    name: ClassVar[str] = ""
    settings_class: ClassVar[type] = object
    likelihood_free: ClassVar[bool] = False
    policy_loss: ClassVar[str | None] = None  # the one policy loss it needs (None: any ratio-based one)
    default_method: ClassVar[dict[str, Any]] = {"name": "flow_grpo"}  # visgen.method when the config leaves it null

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def loss_choice(self):
        """The policy loss this objective trains with, with its settings (a ``shared_rl.config.PolicyLossChoice``),
        or None when any ratio-based loss fits."""
        from shared_rl.config import PolicyLossChoice

        return PolicyLossChoice(self.policy_loss) if self.policy_loss is not None else None

    # likelihood-free objectives: training slots chosen at rollout time ------------------------------------------
    def training_slots(self, is_leaf: torch.Tensor, node_latent: torch.Tensor, num_columns: int,
                       sigmas: torch.Tensor, timesteps: torch.Tensor, generator) -> tuple[torch.Tensor, dict]:
        """``(mask [n, num_columns], payload entries)``: ``K`` distinct grid timesteps per leaf row, their noise
        levels, model timesteps and fresh noise (drawn from ``generator`` after sampling and scoring)."""
        K = self.settings.timesteps_per_sample
        T = int(timesteps.numel())
        n = int(is_leaf.numel())
        if K > T or K > num_columns:
            raise ConfigError(f"visgen.objective.timesteps_per_sample {K} is more than the {min(T, num_columns)} "
                              f"steps a rollout row holds here; lower it")
        choice = torch.rand(n, T, generator=generator).argsort(1)[:, :K]
        sig, ts = sigmas.detach().float().cpu(), timesteps.detach().float().cpu()
        noise = randn_tensor((n, K, *node_latent.shape[1:]), generator=generator, device=node_latent.device,
                             dtype=torch.float32)
        mask = torch.zeros(n, num_columns, dtype=torch.bool)
        mask[is_leaf, :K] = True
        return mask, {"x0": node_latent.float(), "obj_sigma": sig[choice], "obj_timestep": ts[choice],
                      "obj_noise": noise}

    def terms(self, adapter, payload: dict[str, Any], mask: torch.Tensor, cond,
              reference: Callable[[], ContextManager] | None, old: Callable[[], ContextManager] | None
              ) -> StepLogProbs:
        raise NotImplementedError

    def _slots(self, payload: dict[str, Any], mask: torch.Tensor, k: int):
        rows = torch.nonzero(mask[:, k].cpu()).flatten()
        x0 = payload["x0"]
        d = rows.to(x0.device)
        sigma = payload["obj_sigma"][rows, k].to(x0.device)
        eps = payload["obj_noise"][d, k]
        x_t = (1 - sigma.reshape(-1, *([1] * (x0.dim() - 1)))) * x0[d] + sigma.reshape(-1, *([1] * (x0.dim() - 1))) * eps
        return rows, d, x0[d], eps, x_t, sigma, payload["obj_timestep"][rows, k].to(x0.device)


OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(cls: type[Objective]) -> type[Objective]:
    if cls.name in OBJECTIVES:
        raise ValueError(f"visgen objective {cls.name!r} is already registered")
    OBJECTIVES[cls.name] = cls
    return cls


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

        return PolicyLossChoice("nft", NFTLossSettings(adv_max=self.settings.adv_max))

    def terms(self, adapter, payload, mask, cond, reference, old):
        s = self.settings
        if old is None:
            raise RuntimeError("the nft objective needs the old policy (FlowPolicy.enable_old_policy)")
        n, L = mask.shape
        dev = payload["x0"].device
        pos, neg = torch.zeros(n, L, device=dev), torch.zeros(n, L, device=dev)
        kl = torch.zeros(n, L, device=dev) if reference is not None else None
        per_forward, nfe = adapter.forwards_per_step(cond), 0
        slots = [(k, *self._slots(payload, mask, k)) for k in range(payload["obj_sigma"].shape[1])]
        slots = [sl for sl in slots if sl[1].numel()]
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
                with torch.no_grad(), reference():
                    v_ref = adapter.velocity(x_t, t, c)
                kl = kl.index_put((d, cols), _mean_elements((v - v_ref) ** 2))
                nfe += per_forward * rows.numel()
        return StepLogProbs(logp=torch.zeros(n, L, device=dev), kl=kl, nfe=nfe, objective_pos=pos, objective_neg=neg)


@register_objective
class AWMObjective(Objective):
    name = "awm"
    settings_class = AWMSettings
    likelihood_free = True
    policy_loss = "awm"
    default_method = {"name": "ode"}

    def terms(self, adapter, payload, mask, cond, reference, old):
        n, L = mask.shape
        dev = payload["x0"].device
        pos = torch.zeros(n, L, device=dev)
        kl = torch.zeros(n, L, device=dev) if reference is not None else None
        per_forward, nfe = adapter.forwards_per_step(cond), 0
        for k in range(payload["obj_sigma"].shape[1]):  # the K training slots (mask columns 0..K-1)
            rows, d, x0, eps, x_t, _sigma, t = self._slots(payload, mask, k)
            if rows.numel() == 0:
                continue
            c = cond[d]
            v = adapter.velocity(x_t, t, c)
            cols = torch.full_like(d, k)
            pos = pos.index_put((d, cols), flow_matching_loss(x0, eps, v))
            nfe += per_forward * rows.numel()
            if kl is not None:
                with torch.no_grad(), reference():
                    v_ref = adapter.velocity(x_t, t, c)
                kl = kl.index_put((d, cols), _mean_elements((v - v_ref) ** 2))
                nfe += per_forward * rows.numel()
        return StepLogProbs(logp=torch.zeros(n, L, device=dev), kl=kl, nfe=nfe, objective_pos=pos)


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
