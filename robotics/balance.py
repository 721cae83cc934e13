"""Per-task key balance (``robotics.balance``): the reset states of each iteration drawn per task.

The domain's ``key_sampler`` hook wraps the configured key sampler (``selection.sampler``: uniform, history, ...) in
``shared_rl.selection.StratifiedSampler`` over the tasks, which still lets the wrapped sampler choose the keys within
each task and logs ``selection/keys/<task>`` (by need) and ``selection/success/<task>`` (per-task training curves).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from shared_rl.errors import ConfigError


@dataclass
class BalanceConfig:
    """``robotics.balance``: how many of an iteration's keys each task gets."""

    enabled: bool = field(default=False, metadata={
        "help": "draw the keys of every iteration per task, as `by` says (false: the key sampler draws over all "
                "tasks' reset states at once)"})
    by: Literal["equal", "need"] = field(default="equal", metadata={
        "help": "equal = the same number of keys per task | need = need_floor keys each, the rest in proportion to "
                "each task's recent failure rate 1 - EMA(success)"})
    need_decay: float = field(default=0.7, metadata={
        "help": "by need: weight of the past in each task's success-rate average, in [0, 1)"})
    need_floor: int = field(default=1, metadata={
        "help": "by need: keys every task gets before the rest is split by need (1 = every task stays observed; 0 = "
                "a task whose success average reaches 1 gets no rollouts, so none of the budget goes to all-success "
                "groups, and with per-task adapters its weights stop moving)"})

    def check(self, where: str = "robotics.balance") -> None:
        if not 0 <= self.need_decay < 1:
            raise ConfigError(f"{where}.need_decay must be in [0, 1), got {self.need_decay}")
        if self.by == "need" and not self.enabled:
            raise ConfigError(f"{where}.by: need weights the tasks of {where}; set enabled: true")
        if self.need_floor < 0:
            raise ConfigError(f"{where}.need_floor must be >= 0, got {self.need_floor}")
        if self.need_floor != 1 and self.by != "need":
            raise ConfigError(f"{where}.need_floor={self.need_floor} is the per-task minimum of by: need; set by: need "
                              f"or leave need_floor at 1")

    def wrap(self, sampler, task_of: Callable[[int], str]):
        """``sampler`` drawing per task (``task_of(key)``), or ``sampler`` itself when balance is off."""
        if not self.enabled:
            return sampler
        from shared_rl.selection import StratifiedSampler  # torch: imported when a run builds its sampler

        return StratifiedSampler(sampler, task_of, by_need=self.by == "need", need_decay=self.need_decay,
                                 need_floor=self.need_floor)
