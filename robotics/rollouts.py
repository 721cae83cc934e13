"""Where a rollout's episodes come from (``robotics.rollout``): the strategy the robotics domain is given.

``rollout.name`` picks a registered strategy (``ROLLOUTS``); the domain, the VLA, the log-prob recompute and every
other part stay the same:

- ``flat`` (``FlatRollout``): ``group_size`` independent episodes from each key's reset state in the simulator
  (RIPT-VLA / SimpleVLA-RL groups);
- ``tree`` (``TreeRollout``): each group is a tree of episodes that share prefixes and branch at
  ``rollout.branch.at_chunks`` (``branching.py``), for the shared tree estimators;
- ``world_model`` (``world_model/rollout.py``): imagined episodes from keyframes in the learned world model, flat
  or branching, with co-evolution and audits;
- ``verified`` (``world_model/verified.py``): two-stage — ``verify.candidates`` imagined episodes per keyframe,
  the shared selector (``shared_rl.two_stage``) keeps ``rollout.group_size``, those are re-executed in the
  simulator from the keyframe's restored state with the same noise streams, and only their real rewards train;
- ``short_horizon`` (``world_model/short_horizon.py``): MBPO-style — imagined branches of a few chunks from real
  states, each branch's return the critic's value of where it ends (the critic trained on real returns only).

A strategy is a ``Part`` as well (its state, metrics and export go through the same hooks) plus ``train_keys()``
and ``rollout(...)``, which returns the ``Rollout`` and, for flat groups, the episodes it was made from (the parts
that learn from episodes read those: the critic's values, the successes kept for replay).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from shared_rl.domain import RunContext
from shared_rl.errors import ConfigError
from shared_rl.metrics import Progress
from shared_rl.rollout import Rollout

from . import evaluation
from .branching import BranchConfig, run_branching_episodes, tree_rollout
from .envs.metaworld_env import decode_key, make_key
from .envs.vector import EnvConfig
from .episodes import EpisodeBatch, SamplingSettings, run_episodes
from .fpo import attach_pairs
from .parts import Part
from .part_settings import ROLLOUTS, WORLD_MODEL_ROLLOUTS, RolloutSettings  # noqa: F401  (torch-free, re-exported)
from .policies.vla import TinyVLA
from .world_model.settings import ImaginationSettings, ShortHorizonSettings, VerifySettings

if TYPE_CHECKING:
    from .config import RoboticsConfig


def rollout_class(name: str) -> type[RolloutStrategy]:
    module, _, attr = ROLLOUTS[name].partition(":")  # imported on demand: the world model only when it is chosen
    return getattr(importlib.import_module(module), attr)


class RolloutStrategy(Part):
    """What every strategy is given: the config, the run context, the policy, the simulator and the sampling."""

    def __init__(self, cfg: RoboticsConfig, ctx: RunContext, policy: TinyVLA, venv, sampling: SamplingSettings):
        self.cfg, self.ctx, self.policy, self.venv, self.sampling = cfg, ctx, policy, venv, sampling
        self.device = ctx.device

    def task_of(self, key: int) -> str:
        return self.cfg.env.tasks[decode_key(key)[0]]

    def train_keys(self) -> list[int]:
        """The training reset states: ``train_states_per_task`` per trained task."""
        cfg = self.cfg
        return [make_key(cfg.env.tasks.index(t), "train", i) for t in cfg.trained_tasks
                for i in range(cfg.train_states_per_task)]

    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator,
                iteration: int) -> tuple[Rollout, EpisodeBatch | None]:
        raise NotImplementedError


class FlatRollout(RolloutStrategy):
    def rollout(self, keys, group_size, generator, iteration):
        env_keys = [k for k in keys for _ in range(group_size)]
        tasks = [self.task_of(k) for k in env_keys]
        self.policy.eval()
        start_seeds = None
        if self.cfg.group_start_noise == "shared":  # one start-noise stream per group (members share its key too)
            start_seeds = [int(s) for s in torch.randint(0, 2 ** 62, (len(keys),), generator=generator)
                           for _ in range(group_size)]
        # an iteration's episodes can take half an hour on a CPU (LIBERO at 512 episodes): say how far they are, with
        # an ETA, once every PROGRESS_EVERY seconds (a rollout shorter than that stays quiet)
        progress = Progress(self.ctx.log, f"rollout ({len(env_keys)} episodes)", self.cfg.env.horizon, "env steps",
                            every=evaluation.PROGRESS_EVERY)
        batch = run_episodes(self.policy, self.venv, env_keys, tasks, self.sampling, self.cfg.env.horizon, generator,
                             device=self.device, episode_noise_seed=start_seeds, on_chunk=progress.update)
        ro = flat_rollout(batch, keys, group_size, self.cfg.env.tasks, self.cfg.env.success_mode, self.cfg.dense_reward)
        if self.sampling.mode == "fpo":  # the flow-matching pairs of FPO's likelihood surrogate (fpo.py)
            attach_pairs(ro, self.cfg.fpo, self.policy.flow.sigmas, generator)
        return ro, batch


class TreeRollout(RolloutStrategy):
    def rollout(self, keys, group_size, generator, iteration):
        self.policy.eval()
        tree = run_branching_episodes(self.policy, self.venv, list(keys), [self.task_of(k) for k in keys],
                                      self.sampling, self.cfg.env.horizon, self.cfg.rollout.branch, generator,
                                      self.device)
        return tree_rollout(tree, list(keys), self.cfg.env.tasks, self.cfg.env.success_mode, self.cfg.dense_reward), None


def flat_rollout(batch: EpisodeBatch, keys: list[int], group_size: int, env_tasks: list[str], success_mode: str,
                 dense: bool) -> Rollout:
    """The trainer's view of flat groups (``group_size`` consecutive episodes of ``batch`` per key)."""
    n, c, s = batch.stochastic.shape
    mask = torch.from_numpy(batch.stochastic & batch.chunk_valid[..., None]).reshape(n, c * s)
    logp_old = torch.from_numpy(batch.logp).reshape(n, c * s) * mask
    succ = batch.success_once if success_mode == "once" else batch.success_end
    rewards = {"success": torch.from_numpy(succ.astype(np.float32))}
    if dense:
        rewards["dense"] = torch.from_numpy(batch.dense)
    payload = {"images": torch.from_numpy(batch.images), "proprio": torch.from_numpy(batch.proprio),
               "chain": torch.from_numpy(batch.chain), "task_index": torch.tensor([env_tasks.index(t) for t in batch.tasks])}
    return Rollout(keys=list(keys), group_ids=torch.arange(len(keys)).repeat_interleave(group_size), rewards=rewards,
                   logp_old=logp_old.float(), mask=mask, payload=payload, nfe=batch.nfe,
                   info={"env/steps": int(batch.length.sum()), "env/episodes": n})
