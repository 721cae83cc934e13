"""The rollout-method registry and the base class (see ``visgen.methods`` for the methods and how to add one)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import Forest
# the config-time half of every method (settings, structure, checks) is torch-free, so the config builds and checks a
# method without this package; the names keep their place here (visgen.methods.KernelSettings, require, ...)
from ..method_settings import RENAMED, KernelSettings, MethodSpec, method_from_registry, require  # noqa: F401

__all__ = ["KernelSettings", "Grown", "RolloutMethod", "METHODS", "register_method", "method_from_config", "require"]


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


class RolloutMethod(MethodSpec):
    """A registered rollout method: ``MethodSpec`` (its ``name``, ``settings_class``, structure and checks) with the
    sampling and the hooks after the rewards."""

    def grow(self, adapter, cond, keys: list[int], group_size: int, sigmas: torch.Tensor, timesteps: torch.Tensor,
             generator: torch.Generator, iteration: int, k: KernelSettings, first_forward_id: int) -> Grown:
        """Sample the forest for prompt ids ``keys`` (``cond``: one row per key)."""
        raise NotImplementedError

    def after_rewards(self, forest: Forest, rewards: dict[str, torch.Tensor], iteration: int) -> dict[str, float]:
        """Called with the leaf rewards on the forest before it becomes a ``Rollout`` (e.g. pruning); returns info."""
        return {}

    def fusion_logit(self, forest: Forest) -> torch.Tensor | None:
        """``[N]`` per-node logits of the trainer's softmax-weighted tree-value fusion (``Rollout.fusion_logit``);
        None (the default): a node's value is the mean of the leaf rewards below it."""
        return None


METHODS: dict[str, type[RolloutMethod]] = {}


def register_method(cls: type[RolloutMethod]) -> type[RolloutMethod]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in METHODS:
        raise ValueError(f"visgen method {cls.name!r} is already registered by {METHODS[cls.name].__module__}")
    METHODS[cls.name] = cls
    return cls


def method_from_config(config: dict[str, Any] | str, where: str = "visgen.method") -> RolloutMethod:
    """``{"name": ..., **that method's fields}`` -> the configured method; unknown names/fields are ConfigErrors."""
    return method_from_registry(METHODS, config, where)
