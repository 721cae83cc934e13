"""Step plans: for each sample and denoising step, is the step stochastic (SDE) and is it trained?

A plan spec is a small typed dataclass built from config (``plan_from_config({"name": "mix_grpo", ...})``); its
``build(num_steps, batch_size, generator, iteration)`` returns a :class:`StepPlan` of two ``[B, T]`` bool masks.
Building is deterministic given the ``torch.Generator`` state and the iteration. Invariants (checked on every
plan): a trained step is stochastic, and the final step is never trained (its near-zero noise makes the density
explode).

Specs (method -> name):

- Flow-GRPO (Liu et al. 2025): ``flow_grpo`` — every step SDE, train the first ``int(train_fraction * T)`` steps
  (their ``timestep_fraction``), or a random subset per sample with ``select="random"`` (DDPO-style shuffling).
- DanceGRPO (Xue et al. 2025): ``dance_grpo`` — every step SDE, train a random ``train_fraction`` (0.6) of the steps,
  drawn independently per sample.
- Flow-GRPO-Fast: ``flow_grpo_fast`` — SDE (and training) only in a random window of 1-3 consecutive steps inside
  ``[range_start, range_end)``; ODE elsewhere. One window per call, or per sample with ``per_sample=True``.
- MixGRPO (Li et al., "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE", 2025): ``mix_grpo`` — a
  sliding SDE window of ``window_size`` steps, ODE elsewhere; ``schedule="progressive"`` moves the window by
  ``shift`` steps toward low noise every ``iters_per_shift`` iterations (``roll_back`` restarts it at the left
  boundary once it reaches the right one, otherwise it stays there); ``schedule="random"`` draws the window start
  uniformly each iteration.
- ``ode`` — deterministic sampling, nothing trained (evaluation).
- ``explicit`` — given lists of SDE steps and trained steps (tests, custom schedules).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shared_rl.config import ConfigError, from_dict

# each plan's fields and their checks are torch-free (visgen.method_settings: the config checks a plan without this
# module); the classes here add ``build``, the tensors
from .method_settings import (DanceGRPOPlanSettings, DPM2PlanSettings, ExplicitPlanSettings, FlowGRPOFastPlanSettings,
                              FlowGRPOPlanSettings, MixGRPOPlanSettings, ODEPlanSettings, PlanSettings)

__all__ = [
    "StepPlan",
    "PlanSpec",
    "FlowGRPOPlan",
    "DanceGRPOPlan",
    "FlowGRPOFastPlan",
    "MixGRPOPlan",
    "ODEPlan",
    "DPM2Plan",
    "ExplicitPlan",
    "PLANS",
    "plan_from_config",
]


@dataclass
class StepPlan:
    """Per-sample, per-step decisions. sde: ``[B, T]`` bool (stochastic step); train: ``[B, T]`` bool (trained)."""

    sde: torch.Tensor
    train: torch.Tensor

    def __post_init__(self) -> None:
        self.sde = self.sde.bool()
        self.train = self.train.bool()
        if self.sde.dim() != 2 or self.sde.shape != self.train.shape:
            raise ValueError(
                f"plan masks must both be [B, T], got sde {tuple(self.sde.shape)} and train {tuple(self.train.shape)}"
            )
        if bool((self.train & ~self.sde).any()):
            raise ValueError("plan trains a deterministic (ODE) step; trained steps must be SDE steps")
        if bool(self.train[:, -1].any()):
            raise ValueError("plan trains the final denoising step; its near-zero noise makes the density explode")

    @property
    def batch_size(self) -> int:
        return int(self.sde.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.sde.shape[1])

    def __getitem__(self, idx: Any) -> "StepPlan":
        return StepPlan(self.sde[idx], self.train[idx])

    @staticmethod
    def broadcast(sde_steps: torch.Tensor, train_steps: torch.Tensor, batch_size: int) -> "StepPlan":
        """A plan where every sample uses the same ``[T]`` masks."""
        return StepPlan(sde_steps.bool().expand(batch_size, -1).clone(), train_steps.bool().expand(batch_size, -1).clone())


def _randint(low: int, high_inclusive: int, generator: torch.Generator | None, size: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.randint(low, high_inclusive + 1, size, generator=generator)


class PlanSpec(PlanSettings):
    """Base class of plan specs: the plan's settings (``visgen.method_settings.PlanSettings``) with ``build``."""

    def build(
        self, num_steps: int, batch_size: int, generator: torch.Generator | None = None, iteration: int = 0
    ) -> StepPlan:
        raise NotImplementedError


class ODEPlan(ODEPlanSettings, PlanSpec):
    """Deterministic sampling: no SDE step, nothing trained."""

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        none = torch.zeros(batch_size, num_steps, dtype=torch.bool)
        return StepPlan(none, none.clone())


class DPM2Plan(DPM2PlanSettings, ODEPlan):
    """Deterministic sampling by DPM-Solver++(2M) (``DPM2PlanSettings``); ``build`` as ``ODEPlan``'s."""


class FlowGRPOPlan(FlowGRPOPlanSettings, PlanSpec):
    """All steps SDE; train the first (or random) ``num_trained`` steps per sample."""

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        self._need_steps(num_steps)
        k = self.num_trained(num_steps)
        sde = torch.ones(batch_size, num_steps, dtype=torch.bool)
        if self.select == "first":
            train = torch.zeros(num_steps, dtype=torch.bool)
            train[:k] = True
            return StepPlan(sde, train.expand(batch_size, -1).clone())
        return StepPlan(sde, _random_subsets(batch_size, num_steps, k, generator))


def _random_subsets(batch_size: int, num_steps: int, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``[B, T]`` masks with ``k`` random True entries per row among the first T - 1 steps."""
    train = torch.zeros(batch_size, num_steps, dtype=torch.bool)
    for b in range(batch_size):
        chosen = torch.randperm(num_steps - 1, generator=generator)[:k]
        train[b, chosen] = True
    return train


class DanceGRPOPlan(DanceGRPOPlanSettings, PlanSpec):
    """All steps SDE; each sample trains its own random ``train_fraction`` of the steps."""

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        self._need_steps(num_steps)
        k = max(1, min(int(self.train_fraction * num_steps), num_steps - 1))
        sde = torch.ones(batch_size, num_steps, dtype=torch.bool)
        return StepPlan(sde, _random_subsets(batch_size, num_steps, k, generator))


def _window_masks(batch_size: int, num_steps: int, starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    steps = torch.arange(num_steps).unsqueeze(0)
    return (steps >= starts.view(-1, 1)) & (steps < (starts + sizes).view(-1, 1))


class FlowGRPOFastPlan(FlowGRPOFastPlanSettings, PlanSpec):
    """SDE (trained) only in a random window of ``min_window..max_window`` steps."""

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        self._need_steps(num_steps)
        lo, hi = self.bounds(num_steps)
        n = batch_size if self.per_sample else 1
        sizes = _randint(self.min_window, self.max_window, generator, (n,))
        starts = torch.stack([_randint(lo, hi - int(s), generator) for s in sizes])
        mask = _window_masks(n, num_steps, starts, sizes).expand(batch_size, -1).clone()
        return StepPlan(mask, mask.clone())


class MixGRPOPlan(MixGRPOPlanSettings, PlanSpec):
    """MixGRPO sliding window: SDE (trained) inside ``[start, start + window_size)``."""

    def window_start(self, num_steps: int, iteration: int, generator: torch.Generator | None = None) -> int:
        left, right = self.bounds(num_steps)
        last_start = right - self.window_size
        if self.schedule == "random":
            return int(_randint(left, last_start, generator))
        moved = self.shift * (iteration // self.iters_per_shift)
        if self.roll_back:
            return left + moved % (last_start - left + 1)
        return min(left + moved, last_start)

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        self._need_steps(num_steps)
        start = self.window_start(num_steps, iteration, generator)
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[start:start + self.window_size] = True
        return StepPlan.broadcast(mask, mask, batch_size)


class ExplicitPlan(ExplicitPlanSettings, PlanSpec):
    """Given step indices (``ExplicitPlanSettings.masks``)."""

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        sde, train = self.masks(num_steps)  # the config check's own lists: one rule
        return StepPlan.broadcast(torch.tensor(sde, dtype=torch.bool), torch.tensor(train, dtype=torch.bool), batch_size)


PLANS: dict[str, type[PlanSpec]] = {
    cls.name: cls for cls in (FlowGRPOPlan, DanceGRPOPlan, FlowGRPOFastPlan, MixGRPOPlan, ODEPlan, DPM2Plan,
                              ExplicitPlan)
}


def plan_from_config(config: dict[str, Any] | str | PlanSpec) -> PlanSpec:
    """Build a plan spec from ``{"name": ..., **fields}`` (or a bare name) with ``shared_rl.config.from_dict``:
    unknown keys, wrong types and bad values raise ``ConfigError`` with one actionable line."""
    if isinstance(config, PlanSpec):
        return config
    if isinstance(config, str):
        config = {"name": config}
    config = dict(config)
    name = config.pop("name", None)
    if name not in PLANS:
        raise ConfigError(f"plan.name must be one of {sorted(PLANS)}, got {name!r}")
    return from_dict(PLANS[name], config, where=f"plan[{name}]")
