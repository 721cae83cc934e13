"""Per-task adapters in RL (``robotics.adapters``): how each task's adapter steps, and keeping each task's best one.

With ``rank`` > 0 every task of ``env.tasks`` gets a low-rank adapter on the fused features
(``policies.vla.TaskAdapters``), the only weights RL then trains, so one task's update cannot move another task's
actions. Two parts act on them:

- ``AdapterSteps`` (``steps: by_episodes``): each task adapter's AdamW step is scaled by its episodes in the
  minibatch / the most any task has there (AdamW normalises each weight's step, so without it a task informed by 8
  episodes moves as far as one informed by 40, and momentum moves a task that had none).
- ``KeepBestAdapters`` (``keep_best``): per-task early stopping; every evaluation scores each task's adapter on
  validation reset states, and the run ends with each task's best-scoring adapter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np
import torch

from shared_rl.errors import ConfigError

from .envs.metaworld_env import instruction_for
from .parts import Part
from .part_settings import VAL_FIRST_INDEX, AdaptersConfig  # noqa: F401  (torch-free, re-exported here)
from .policies.vla import TinyVLA


def add_adapters(policy: TinyVLA, cfg: AdaptersConfig, tasks: list[str], seed: int) -> None:
    """A rank-``cfg.rank`` adapter per task, seeded (a checkpoint that has the same ones already keeps its own)."""
    try:
        policy.add_task_adapters([instruction_for(t) for t in tasks], cfg.rank, torch.Generator().manual_seed(seed))
    except ValueError as e:
        raise ConfigError(f"robotics.adapters.rank: {e}") from None


class AdapterSteps(Part):
    """``steps``: with by_episodes, task t's adapter moves s_t = n_t / max_u n_u of AdamW's step, n_t its episodes
    in the step's minibatch (a task without episodes there does not move, not even by momentum). The mode is read
    at every step, so equal costs nothing."""

    def __init__(self, cfg: AdaptersConfig, policy: TinyVLA, num_tasks: int, num_processes: int):
        if cfg.steps == "by_episodes" and num_processes > 1:
            raise ConfigError("robotics.adapters.steps: by_episodes counts each process's own minibatch rows, which "
                              "would make N processes differ from one; launch one process or use steps: equal")
        self.cfg, self.policy = cfg, policy
        self.step_episodes = torch.zeros(num_tasks, dtype=torch.long)  # per task index, this optimizer step
        self.adapters_before: tuple[torch.Tensor, torch.Tensor] | None = None

    def on_training_forward(self, payload: dict[str, Any]) -> None:
        if self.cfg.steps != "by_episodes":
            return
        if self.policy.adapters.up.grad is None:  # the step's first forward (the trainer zeroes grads to None):
            self.step_episodes.zero_()  # a step skipped for non-finite gradients leaves no counts behind
        self.step_episodes += torch.bincount(payload["task_index"].cpu(), minlength=len(self.step_episodes))

    def before_optimizer_step(self) -> None:
        if self.cfg.steps == "by_episodes":
            a = self.policy.adapters
            self.adapters_before = (a.down.detach().clone(), a.up.detach().clone())

    def after_optimizer_step(self) -> None:
        if self.cfg.steps != "by_episodes":
            return
        n = self.step_episodes.double()
        scale = (n / n.max().clamp(min=1)).view(-1, 1, 1)
        a = self.policy.adapters
        with torch.no_grad():
            for w, before in zip((a.down, a.up), self.adapters_before):
                w.copy_(before + scale.to(w) * (w - before))
        self.step_episodes.zero_()
        self.adapters_before = None


class KeepBestAdapters(Part):
    """``keep_best``: per task the best validation success so far, the iteration that scored it, and that adapter
    (row t of ``best["down"]`` / ``best["up"]`` is task t's, as in ``TaskAdapters``).

    ``evaluate(per_task, split, first_index)``: the domain's ODE evaluation of the live policy on those states;
    ``held_out``: its held-out states (per task, split), for ``report_last``."""

    state_prefix = "best_adapters."

    def __init__(self, cfg: AdaptersConfig, policy: TinyVLA, tasks: list[str],
                 evaluate: Callable[[int, str, int], dict[str, float]], held_out: tuple[int, str], num_processes: int):
        if num_processes > 1:
            raise ConfigError("robotics.adapters.keep_best runs in one process (the evaluation that scores the "
                              "adapters runs on the main process only); launch one process")
        self.cfg, self.policy, self.tasks, self._evaluate, self.held_out = cfg, policy, tasks, evaluate, held_out
        self.best_score = {t: -1.0 for t in tasks}
        self.best_iteration = {t: -1 for t in tasks}
        self.best = {"down": policy.adapters.down.detach().clone(), "up": policy.adapters.up.detach().clone()}
        self.selected = False  # the best adapters are in place: the held-out evaluation that follows measures them

    def _score(self, iteration: int) -> dict[str, float]:
        """ODE success of every task on its validation states; a task's adapter that scores at least its best so
        far (ties: the later, longer-trained one) becomes its kept adapter."""
        val = self._evaluate(self.cfg.val_states_per_task, "train", VAL_FIRST_INDEX)
        adapters = self.policy.adapters
        out = {"select/val": val["eval/success"],
               "select/env_steps": val["eval/episode_length"] * len(self.tasks) * self.cfg.val_states_per_task}
        for t, task in enumerate(self.tasks):
            score = val[f"eval/success/{task}"]
            if score >= self.best_score[task]:
                self.best_score[task], self.best_iteration[task] = score, iteration
                self.best["down"][t].copy_(adapters.down[t].detach())
                self.best["up"][t].copy_(adapters.up[t].detach())
            out[f"select/val/{task}"] = score
            out[f"select/best_iteration/{task}"] = float(self.best_iteration[task])
        return out

    def evaluate(self, iteration: int) -> dict[str, float]:
        return {} if self.selected else self._score(iteration)

    def before_final_evaluation(self, iteration: int) -> dict[str, float]:
        """Score the final adapters too, then put every task's best one in place, so the final held-out evaluation,
        checkpoint and export are the selected policy (``select/best_iteration/<task>`` says where each came from)."""
        out = self._score(iteration)
        if self.cfg.report_last:
            last = self._evaluate(self.held_out[0], self.held_out[1], 0)
            out.update({k.replace("eval/", "eval_last/", 1): v for k, v in last.items() if k.startswith("eval/success")})
        with torch.no_grad():
            self.policy.adapters.down.copy_(self.best["down"])
            self.policy.adapters.up.copy_(self.best["up"])
        self.selected = True
        out["select/val_best"] = float(np.mean(list(self.best_score.values())))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{self.state_prefix}{k}": v.clone() for k, v in self.best.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        n = len(self.state_prefix)
        for k, v in state.items():
            if k.startswith(self.state_prefix):
                self.best[k[n:]].copy_(v)

    def extra_state(self) -> dict[str, Any]:
        return {"best_score": dict(self.best_score), "best_iteration": dict(self.best_iteration)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.best_score.update(state.get("best_score", {}))
        self.best_iteration.update(state.get("best_iteration", {}))
