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

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from shared_rl.config import ConfigError, from_dict

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


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _randint(low: int, high_inclusive: int, generator: torch.Generator | None, size: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.randint(low, high_inclusive + 1, size, generator=generator)


class PlanSpec:
    """Base class of plan specs: a dataclass with a registered ``name`` and a ``build`` method."""

    name: ClassVar[str] = ""

    def build(
        self, num_steps: int, batch_size: int, generator: torch.Generator | None = None, iteration: int = 0
    ) -> StepPlan:
        raise NotImplementedError

    @staticmethod
    def _need_steps(num_steps: int, minimum: int = 2) -> None:
        _check(num_steps >= minimum, f"a step plan needs at least {minimum} denoising steps, got {num_steps}")


@dataclass
class ODEPlan(PlanSpec):
    """Deterministic sampling: no SDE step, nothing trained."""

    name: ClassVar[str] = "ode"
    ode_solver: ClassVar[str] = "euler"

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        none = torch.zeros(batch_size, num_steps, dtype=torch.bool)
        return StepPlan(none, none.clone())


@dataclass
class DPM2Plan(ODEPlan):
    """Deterministic sampling by the multistep DPM-Solver++(2M) (``shared_rl.flow_kernels.dpm2_step``): DiffusionOPSD's
    and DiffusionNFT's reference rollout sampler (``solver: dpm2``); no SDE step, nothing trained."""

    name: ClassVar[str] = "dpm2"
    ode_solver: ClassVar[str] = "dpm2"


@dataclass
class FlowGRPOPlan(PlanSpec):
    """All steps SDE; train ``min(int(train_fraction * T), T - 1)`` steps per sample.

    select: ``"first"`` trains the first (high-noise) steps as Flow-GRPO's ``timestep_fraction`` does;
    ``"random"`` trains a random subset per sample (drawn from the first T - 1 steps).
    """

    name: ClassVar[str] = "flow_grpo"
    train_fraction: float = field(default=1.0,
                                  metadata={"help": "fraction of the T denoising steps trained per sample (capped at "
                                                    "T-1)"})
    select: Literal["first", "random"] = field(default="first",
                                               metadata={"help": "'first': the first (high-noise) steps, as "
                                                                 "Flow-GRPO's timestep_fraction; 'random': a random "
                                                                 "subset per sample"})

    def __post_init__(self) -> None:
        _check(0.0 < self.train_fraction <= 1.0, f"flow_grpo.train_fraction must be in (0, 1], got {self.train_fraction}")
        _check(self.select in ("first", "random"), f"flow_grpo.select must be 'first' or 'random', got {self.select!r}")

    def num_trained(self, num_steps: int) -> int:
        return max(1, min(int(self.train_fraction * num_steps), num_steps - 1))

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


@dataclass
class DanceGRPOPlan(PlanSpec):
    """All steps SDE; each sample trains its own random ``train_fraction`` of the steps (DanceGRPO: 0.6)."""

    name: ClassVar[str] = "dance_grpo"
    train_fraction: float = field(default=0.6,
                                  metadata={"help": "fraction of the steps trained, a fresh random subset per sample "
                                                    "(DanceGRPO: 0.6)"})

    def __post_init__(self) -> None:
        _check(0.0 < self.train_fraction <= 1.0, f"dance_grpo.train_fraction must be in (0, 1], got {self.train_fraction}")

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        self._need_steps(num_steps)
        k = max(1, min(int(self.train_fraction * num_steps), num_steps - 1))
        sde = torch.ones(batch_size, num_steps, dtype=torch.bool)
        return StepPlan(sde, _random_subsets(batch_size, num_steps, k, generator))


def _window_masks(batch_size: int, num_steps: int, starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    steps = torch.arange(num_steps).unsqueeze(0)
    return (steps >= starts.view(-1, 1)) & (steps < (starts + sizes).view(-1, 1))


@dataclass
class FlowGRPOFastPlan(PlanSpec):
    """SDE (trained) only in a random window of ``min_window..max_window`` steps, ODE elsewhere.

    The window lies inside ``[range_start, range_end)`` (``range_end`` None: the first half of the schedule, at
    least ``max_window`` steps) and never touches the final step.
    """

    name: ClassVar[str] = "flow_grpo_fast"
    min_window: int = field(default=1, metadata={"help": "smallest SDE window (consecutive steps)"})
    max_window: int = field(default=3, metadata={"help": "largest SDE window"})
    range_start: int = field(default=0, metadata={"help": "first grid step a window may start at"})
    range_end: int | None = field(default=None,
                                  metadata={"help": "windows end before this grid step (null: half the schedule)"})
    per_sample: bool = field(default=False,
                             metadata={"help": "draw a window per sample instead of one per rollout call"})

    def __post_init__(self) -> None:
        _check(1 <= self.min_window <= self.max_window,
               f"flow_grpo_fast needs 1 <= min_window <= max_window, got {self.min_window}, {self.max_window}")
        _check(self.range_start >= 0, f"flow_grpo_fast.range_start must be >= 0, got {self.range_start}")

    def bounds(self, num_steps: int) -> tuple[int, int]:
        end = self.range_end if self.range_end is not None else max(num_steps // 2, self.range_start + self.max_window)
        end = min(end, num_steps - 1)  # the final step is never in the window
        _check(end - self.range_start >= self.max_window,
               f"flow_grpo_fast: range [{self.range_start}, {end}) of {num_steps} steps cannot hold a window of "
               f"{self.max_window}; lower max_window or widen the range")
        return self.range_start, end

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        self._need_steps(num_steps)
        lo, hi = self.bounds(num_steps)
        n = batch_size if self.per_sample else 1
        sizes = _randint(self.min_window, self.max_window, generator, (n,))
        starts = torch.stack([_randint(lo, hi - int(s), generator) for s in sizes])
        mask = _window_masks(n, num_steps, starts, sizes).expand(batch_size, -1).clone()
        return StepPlan(mask, mask.clone())


@dataclass
class MixGRPOPlan(PlanSpec):
    """MixGRPO sliding window: SDE (trained) inside ``[start, start + window_size)``, ODE elsewhere.

    The window moves inside ``[left_boundary, right_boundary)`` (None: the last step is excluded).
    progressive: ``start = left + shift * (iteration // iters_per_shift)``, clamped at the right end (or wrapped
    back to the left boundary with ``roll_back``); random: a uniform start drawn from ``generator`` per iteration.
    """

    name: ClassVar[str] = "mix_grpo"
    window_size: int = field(default=4, metadata={"help": "SDE steps in the sliding window"})
    shift: int = field(default=1, metadata={"help": "steps the window moves toward low noise per move"})
    iters_per_shift: int = field(default=25, metadata={"help": "iterations between moves (progressive schedule)"})
    schedule: Literal["progressive", "random"] = field(default="progressive",
                                                       metadata={"help": "'progressive': slide with the iteration; "
                                                                         "'random': a uniform start every iteration"})
    left_boundary: int = field(default=0, metadata={"help": "the window's first possible start step"})
    right_boundary: int | None = field(default=None,
                                       metadata={"help": "the window's last possible end step (null: T-1)"})
    roll_back: bool = field(default=False,
                            metadata={"help": "restart at the left boundary after reaching the right one (else stay "
                                              "there)"})

    def __post_init__(self) -> None:
        _check(self.window_size >= 1, f"mix_grpo.window_size must be >= 1, got {self.window_size}")
        _check(self.shift >= 1, f"mix_grpo.shift must be >= 1, got {self.shift}")
        _check(self.iters_per_shift >= 1, f"mix_grpo.iters_per_shift must be >= 1, got {self.iters_per_shift}")
        _check(self.schedule in ("progressive", "random"),
               f"mix_grpo.schedule must be 'progressive' or 'random', got {self.schedule!r}")
        _check(self.left_boundary >= 0, f"mix_grpo.left_boundary must be >= 0, got {self.left_boundary}")

    def bounds(self, num_steps: int) -> tuple[int, int]:
        right = num_steps - 1 if self.right_boundary is None else min(self.right_boundary, num_steps - 1)
        _check(right - self.left_boundary >= self.window_size,
               f"mix_grpo: window_size {self.window_size} does not fit in steps [{self.left_boundary}, {right}) of "
               f"{num_steps} (the final step is never trained); lower window_size or raise num_inference_steps")
        return self.left_boundary, right

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


@dataclass
class ExplicitPlan(PlanSpec):
    """Given step indices: ``sde_steps`` (None: all) and ``train_steps`` (None: all SDE steps but the last)."""

    name: ClassVar[str] = "explicit"
    sde_steps: list[int] | None = field(default=None, metadata={"help": "grid steps that are SDE (null: all)"})
    train_steps: list[int] | None = field(default=None,
                                          metadata={"help": "grid steps that are trained (null: every SDE step but the "
                                                            "last)"})

    def build(self, num_steps, batch_size, generator=None, iteration=0) -> StepPlan:
        sde = torch.zeros(num_steps, dtype=torch.bool)
        if self.sde_steps is None:
            sde[:] = True
        else:
            _check(all(0 <= s < num_steps for s in self.sde_steps), f"explicit.sde_steps out of range 0..{num_steps - 1}")
            sde[list(self.sde_steps)] = True
        train = torch.zeros(num_steps, dtype=torch.bool)
        if self.train_steps is None:
            train = sde.clone()
            train[-1] = False
        else:
            _check(all(0 <= s < num_steps for s in self.train_steps),
                   f"explicit.train_steps out of range 0..{num_steps - 1}")
            train[list(self.train_steps)] = True
        return StepPlan.broadcast(sde, train, batch_size)


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
