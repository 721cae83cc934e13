"""The rollout-method registry and the base class (see ``visgen.methods`` for the methods and how to add one)."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from shared_rl.config import ConfigError, from_dict
from shared_rl.flow_kernels import DEFAULT_NOISE_LEVEL

from ..engine import Forest

__all__ = ["KernelSettings", "Grown", "RolloutMethod", "METHODS", "register_method", "method_from_config", "require"]


def require(condition: bool, message: str) -> None:
    """A settings check: ``ConfigError(message)`` (one actionable line) unless ``condition``."""
    if not condition:
        raise ConfigError(message)


@dataclass
class KernelSettings:
    """How stochastic steps are drawn and scored (the domain's sampling settings, the same for every method)."""

    kernel: str = "sde"
    noise_level: float = DEFAULT_NOISE_LEVEL
    reduction: str = "mean"
    micro_batch: int = 0  # samples per transformer forward while sampling (0: the whole level)
    shared_noise: bool = False  # flat methods: one initial noise per prompt for its whole group


@dataclass
class Grown:
    """One rollout call's forest and how its roots map to groups.

    root_cond: the prompt conditioning of each root; root_group: ``[R]`` the group of each root's leaves;
    group_keys: the key (prompt id) of each group — several groups may share a key (E-GRPO);
    key_index: ``[G]`` the position in the requested ``keys`` each group was grown for (``Rollout.key_index``).
    """

    forest: Forest
    root_cond: Any
    root_group: torch.Tensor
    group_keys: list[int]
    key_index: torch.Tensor
    info: dict[str, float] = field(default_factory=dict)
    # stride g -> [leaves, *latent] the leaves' images again by a coarser ODE tail (E-GRPO's multi-granularity
    # rewards), in ``forest.leaves()`` order; the rollout scores them as ``<output>@g<g>``
    granular_latents: dict[int, torch.Tensor] = field(default_factory=dict)


class RolloutMethod:
    """A registered rollout method: ``name``, its ``settings_class`` and whether its rollouts are trees."""

    name: ClassVar[str] = ""
    structure: ClassVar[Literal["flat", "tree"]] = "tree"
    settings_class: ClassVar[type] = object

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def check(self, num_steps: int, group_size: int, where: str) -> None:
        """Validate against the denoising-step count and ``rollout.group_size`` (ConfigError, one line)."""

    def with_trainer(self, train_cfg, where: str) -> "RolloutMethod":
        """This method as the trainer's sections ``train_cfg`` complete it (a new method, or ``self``; the config
        is never changed), checked against them (ConfigError, one line)."""
        return self

    def grow(self, adapter, cond, keys: list[int], group_size: int, sigmas: torch.Tensor, timesteps: torch.Tensor,
             generator: torch.Generator, iteration: int, k: KernelSettings, first_forward_id: int) -> Grown:
        """Sample the forest for prompt ids ``keys`` (``cond``: one row per key)."""
        raise NotImplementedError

    def trains_steps(self, num_steps: int) -> bool:
        """Whether the rollouts have trained SDE steps (what the log-prob objective recomputes)."""
        return True

    def after_rewards(self, forest: Forest, rewards: dict[str, torch.Tensor], iteration: int) -> dict[str, float]:
        """Called with the leaf rewards on the forest before it becomes a ``Rollout`` (e.g. pruning); returns info."""
        return {}

    def reward_granularities(self) -> list[int]:
        """ODE strides > 1 at which the leaves are scored again (``Grown.granular_latents``; E-GRPO), none by
        default."""
        return []

    def fusion_logit(self, forest: Forest) -> torch.Tensor | None:
        """``[N]`` per-node logits of the trainer's softmax-weighted tree-value fusion (``Rollout.fusion_logit``);
        None (the default): a node's value is the mean of the leaf rewards below it."""
        return None

    def describe(self) -> str:
        return self.name


METHODS: dict[str, type[RolloutMethod]] = {}


def register_method(cls: type[RolloutMethod]) -> type[RolloutMethod]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in METHODS:
        raise ValueError(f"visgen method {cls.name!r} is already registered by {METHODS[cls.name].__module__}")
    METHODS[cls.name] = cls
    return cls


# names that earlier configs used, and what replaced them (a one-line error beats a silent default)
RENAMED = {"branch": "branch_grpo", "tree": "tree_grpo", "none": "flow_grpo"}


def method_from_config(config: dict[str, Any] | str, where: str = "visgen.method") -> RolloutMethod:
    """``{"name": ..., **that method's fields}`` -> the configured method; unknown names/fields are ConfigErrors."""
    if isinstance(config, str):
        config = {"name": config}
    if not isinstance(config, dict):
        raise ConfigError(f"{where} must be a mapping like {{name: flow_grpo, train_fraction: 0.3}}, got {config!r}")
    config = dict(config)
    name = config.pop("name", None)
    if name not in METHODS:
        if name in RENAMED:
            raise ConfigError(f"{where}.name {name!r} is now {RENAMED[name]!r}")
        close = difflib.get_close_matches(str(name), list(METHODS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}.name {name!r} is unknown{hint}; choose one of {sorted(METHODS)}")
    cls = METHODS[name]
    return cls(from_dict(cls.settings_class, config, f"{where}[{name}]"))


