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
from shared_rl.rollout import Rollout

from .branching import BranchConfig, run_branching_episodes, tree_rollout
from .envs.metaworld_env import decode_key, make_key
from .envs.vector import EnvConfig
from .episodes import EpisodeBatch, SamplingSettings, run_episodes
from .fpo import attach_pairs
from .parts import Part
from .policies.vla import TinyVLA
from .world_model.settings import ImaginationSettings, ShortHorizonSettings, VerifySettings

if TYPE_CHECKING:
    from .config import RoboticsConfig

ROLLOUTS: dict[str, str] = {
    "flat": "robotics.rollouts:FlatRollout",
    "tree": "robotics.rollouts:TreeRollout",
    "world_model": "robotics.world_model.rollout:WorldModelRollout",
    "verified": "robotics.world_model.verified:VerifiedRollout",
    "short_horizon": "robotics.world_model.short_horizon:ShortHorizonRollout",
}
WORLD_MODEL_ROLLOUTS = ("world_model", "verified", "short_horizon")  # the strategies that read rollout.world_model


@dataclass
class RolloutSettings:
    """``robotics.rollout``: the strategy and its settings."""

    name: Literal["flat", "tree", "world_model", "verified", "short_horizon"] = field(default="flat", metadata={
        "help": "flat = independent episodes per reset state in the simulator | tree = branching groups in the "
                "simulator (branch) | world_model = imagined episodes in the learned world model (world_model; "
                "branching when branch is set) | verified = imagined candidates from keyframes, the selected ones "
                "re-executed in the simulator and trained on their real rewards (world_model, verify) | "
                "short_horizon = imagined branches of a few chunks from real states, their return bootstrapped by a "
                "critic of real returns (world_model, short_horizon)"})
    branch: BranchConfig = field(default_factory=BranchConfig, metadata={
        "help": "tree and world_model: branch points and factors (their product = rollout.group_size leaves)"})
    world_model: ImaginationSettings = field(default_factory=ImaginationSettings, metadata={
        "help": "world_model and verified: the world model, its keyframes, rewards, co-evolution and audits"})
    verify: VerifySettings = field(default_factory=VerifySettings, metadata={
        "help": "verified: imagined candidates per keyframe, the shared selector, the imagined score"})
    short_horizon: ShortHorizonSettings = field(default_factory=ShortHorizonSettings, metadata={
        "help": "short_horizon: branch length, fresh real rollouts, the critic of real returns, the audit"})

    def check(self, where: str = "robotics.rollout") -> None:
        if self.name in ("flat", "verified", "short_horizon") and self.branch.enabled:
            raise ConfigError(f"{where}.branch makes tree groups; set {where}.name: tree (or world_model), or leave "
                              f"branch empty for flat groups")
        if self.name == "tree" and not self.branch.enabled:
            raise ConfigError(f"{where}.name: tree branches at {where}.branch.at_chunks with branch.factors; set them "
                              f"(e.g. at_chunks: [0, 8], factors: [2, 4]) or use name: flat")
        if self.name not in WORLD_MODEL_ROLLOUTS and self.world_model != ImaginationSettings():
            raise ConfigError(f"{where}.world_model is read by name: {' | '.join(WORLD_MODEL_ROLLOUTS)} only; set "
                              f"{where}.name or remove the world_model settings")
        for section, owner, default in (("verify", "verified", VerifySettings()),
                                        ("short_horizon", "short_horizon", ShortHorizonSettings())):
            if self.name != owner and getattr(self, section) != default:
                raise ConfigError(f"{where}.{section} is read by name: {owner} only; set {where}.name: {owner} or "
                                  f"remove the {section} settings")

        if self.name == "verified" and self.verify.probe_states >= self.world_model.keyframe_states:
            raise ConfigError(f"{where}.verify.probe_states ({self.verify.probe_states}) must be below "
                              f"{where}.world_model.keyframe_states ({self.world_model.keyframe_states}): training "
                              f"needs keyframes too")

    def check_with(self, train_cfg, where: str = "robotics.rollout") -> None:
        if self.branch.enabled and self.branch.leaves != train_cfg.rollout.group_size:
            raise ConfigError(f"{where}.branch.factors {self.branch.factors} make {self.branch.leaves} leaves per group "
                              f"but rollout.group_size is {train_cfg.rollout.group_size}; make them equal")
        if self.name == "verified" and self.verify.candidates < train_cfg.rollout.group_size:
            raise ConfigError(f"{where}.verify.candidates ({self.verify.candidates}) must be >= rollout.group_size "
                              f"({train_cfg.rollout.group_size}): a group is the k re-executed of the N imagined")

    def structure(self) -> str:
        return "tree" if self.branch.enabled else "flat"

    def horizon(self, env: EnvConfig) -> int:
        """Env steps of one episode: the imagined horizon from a keyframe (imagined, or re-executed from it in the
        simulator), else the env's."""
        if self.name == "short_horizon":
            return self.short_horizon.horizon
        return self.world_model.horizon if self.name in WORLD_MODEL_ROLLOUTS else env.horizon


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
        batch = run_episodes(self.policy, self.venv, env_keys, tasks, self.sampling, self.cfg.env.horizon, generator,
                             device=self.device, episode_noise_seed=start_seeds)
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
