"""The settings of the robotics domain's parts (``robotics.adapters``, ``robotics.critic``, ``robotics.replay``,
``robotics.rollout`` with its ``branch``), in a module that imports no torch: ``grove config show`` and the config's
checks build ``RoboticsConfig`` without the parts' tensor code (issue 64). Each class is re-exported by the module
of its part (``robotics.adapters.AdaptersConfig``, ``robotics.critic.CriticConfig``, ``robotics.replay.ReplayConfig``,
``robotics.branching.BranchConfig``, ``robotics.rollouts.RolloutSettings``), where it was defined before;
tests/core/test_part_index.py checks ``grove config show`` of the robotics recipes imports no torch."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from shared_rl.errors import ConfigError

from .world_model.settings import ImaginationSettings, ShortHorizonSettings, VerifySettings

if TYPE_CHECKING:
    from .envs.settings import EnvConfig


# keep_best's validation states: training-split indices from here on. RL's keys are 0 .. train_states_per_task and
# the demonstrations' 100_000 + attempt (collect.DEMO_INDEX_OFFSET), so validation shares a state with neither (nor
# with the held-out "eval" split); the BC asset never saw these states either.
VAL_FIRST_INDEX = 300_000


@dataclass
class AdaptersConfig:
    """``robotics.adapters``: per-task adapters and how they train."""

    rank: int = field(default=0, metadata={
        "help": "rank of a per-task low-rank adapter on the fused features, the only weights RL then trains (each "
                "task's update cannot move another task's actions); 0 = none, train the shared fusion and head"})
    steps: Literal["equal", "by_episodes"] = field(default="equal", metadata={
        "help": "equal = every task's adapter takes AdamW's full step whenever its task has episodes in the "
                "minibatch (AdamW normalises each weight's step, so a task informed by 8 episodes moves as far as one "
                "informed by 40); by_episodes = each task adapter's step is scaled by its episodes in the minibatch / "
                "the most any task has there (as one shared step would weigh them)"})
    keep_best: bool = field(default=False, metadata={
        "help": "at every evaluation score each task's adapter by ODE success on val_states_per_task validation "
                "reset states (training-split states the rollouts never draw, disjoint from the held-out ones) and "
                "end the run with each task's best-scoring adapter, ties to the later one: early stopping per task, "
                "so a task that regresses late ends where it scored best (the final checkpoint holds the kept "
                "adapters: extending a finished run with --resume iterations=N trains on from them, not from the "
                "last ones)"})
    val_states_per_task: int = field(default=20, metadata={
        "help": "validation reset states per task for keep_best (ODE episodes at every evaluation)"})
    report_last: bool = field(default=True, metadata={
        "help": "with keep_best: before the kept adapters replace the last ones, evaluate the last ones on the "
                "held-out states too (eval_last/success, eval_last/success/<task>: what the run would have ended at "
                "without the selection; one more evaluation)"})

    def check(self, where: str = "robotics.adapters") -> None:
        if self.rank < 0:
            raise ConfigError(f"{where}.rank is a rank (0 = no adapters), got {self.rank}")
        if self.steps == "by_episodes" and not self.rank:
            raise ConfigError(f"{where}.steps: by_episodes scales per-task adapter steps; set {where}.rank (16 in "
                              f"the five-task recipe) or steps: equal")
        if self.keep_best and not self.rank:
            raise ConfigError(f"{where}.keep_best selects per-task adapters; set {where}.rank (16 in the five-task "
                              f"recipe) or keep_best: false")
        if self.keep_best and self.val_states_per_task < 1:
            raise ConfigError(f"{where}.val_states_per_task must be >= 1, got {self.val_states_per_task}")

    def check_with(self, train_cfg, where: str = "robotics.adapters") -> None:
        if self.keep_best and train_cfg.optim.ema_decay > 0:
            raise ConfigError(f"{where}.keep_best selects the live adapters, optim.ema_decay evaluates an average of "
                              f"them; use one or the other")


@dataclass
class CriticConfig:
    """``robotics.critic``: the value head's architecture (its training settings are the gae estimator's)."""

    enabled: bool = field(default=False, metadata={
        "help": "a value head V(features, time) per action chunk (PPO: advantage.estimator {name: gae, value_coef, "
                "...})"})
    hidden: int = field(default=256, metadata={"help": "critic MLP width"})
    detach: bool = field(default=True, metadata={
        "help": "the critic reads the policy's fused features without gradient (true) or trains them too (false)"})
    init: float = field(default=0.0, metadata={"help": "the critic's initial value (its last layer starts at 0)"})
    input: Literal["prefix", "expert"] = field(default="prefix", metadata={
        "help": "a LeRobot policy's value input: prefix = the mean of the VLM's final prefix tokens (πRL's "
                "value_after_vlm, its π0.5 setting) | expert = the mean of the action expert's output tokens over the "
                "executed chunk (πRL's default, its π0 setting; read at the chain's start with the noise at its mean, "
                "so the value is a function of the observation). The tiny VLA has one fused feature vector: prefix"})

    def check(self, where: str = "robotics.critic") -> None:
        if self.hidden < 1:
            raise ConfigError(f"{where}.hidden is the MLP width, >= 1; got {self.hidden}")

    def check_with(self, train_cfg, where: str = "robotics.critic") -> None:
        """A critic estimator (gae) needs the value head; a value head without one would never be trained."""
        est = train_cfg.advantage.estimator.name
        if train_cfg.advantage.kind == "step" and not self.enabled:
            raise ConfigError(f"advantage.estimator {est!r} needs the policy's value head: set {where}.enabled: true "
                              f"(and the estimator's value_coef > 0 to train it)")
        if self.enabled and train_cfg.advantage.kind != "step":
            raise ConfigError(f"{where}.enabled: the value head is trained by a critic estimator, and "
                              f"advantage.estimator {est!r} is not one; use advantage.estimator: {{name: gae, "
                              f"value_coef: 0.5, ...}} or {where}.enabled: false")


@dataclass
class ReplayConfig:
    """``robotics.replay``: the BC term added at every optimizer step, and what it imitates."""

    coef: float = field(default=0.0, metadata={
        "help": "weight of the replay BC term at every optimizer step (loss/replay); 0 = off"})
    source: Literal["demos", "successes"] = field(default="demos", metadata={
        "help": "what the replay BC term imitates: demos = robotics.replay.data (an anchor to the BC data, "
                "DAPG); successes = the run's own successful rollout episodes (success_window iterations), every "
                "executed chunk, drawn equally per task (self-imitation: SIL, Oh et al. 2018; iRe-VLA's supervised "
                "phase on successes)"})
    data: str = field(default="", metadata={
        "help": "source demos: demonstrations (.npz of `grove robotics collect`) replayed with weight coef: the BC "
                "flow-matching / bin loss on them at every optimizer step, an anchor to the BC policy; '' = none"})
    batch: int = field(default=256, metadata={"help": "chunks per replay minibatch"})
    tasks: list[str] = field(default_factory=list, metadata={
        "help": "source demos: the tasks whose demos are replayed (e.g. [push-v3]: imitate the task the clone "
                "underfits, leave the others to RL alone); [] = every trained task"})
    success_window: int = field(default=1, metadata={
        "help": "source successes: iterations whose successful chunks are kept (1 = the current one; N = it and the "
                "N-1 before it, a growing set of successes of a rarely solved task; kept in checkpoints)"})

    def check(self, where: str = "robotics.replay") -> None:
        """Besides the ranges, refuse what would do nothing: a replay without its data, data or tasks unused."""
        if self.coef < 0:
            raise ConfigError(f"{where}.coef must be >= 0 (0 = off), got {self.coef}")
        if self.batch < 1:
            raise ConfigError(f"{where}.batch must be >= 1, got {self.batch}")
        if self.success_window < 1:
            raise ConfigError(f"{where}.success_window counts iterations (1 = the current one), got {self.success_window}")
        if self.source == "successes" and self.data:
            raise ConfigError(f"{where}.source: successes imitates the run's own successful episodes, so {where}.data "
                              f"({self.data!r}) would be unused; set it to '' or source: demos")
        coef, coef_key = self.coef, f"{where}.coef"
        if self.source == "successes" and coef <= 0:
            raise ConfigError(f"{where}.source: successes is the data of {coef_key}'s BC term; set {coef_key} > 0 "
                              f"(1.0 in the measured runs) or source: demos")
        if self.source == "demos" and coef > 0 and not self.data:
            raise ConfigError(f"{coef_key}={coef} replays demonstrations, but {where}.data is empty; give the demos "
                              f".npz (make one with `grove robotics collect --labels expert --out "
                              f"runs/robotics-demos/demos40_dart.npz`) or set {where}.source: successes "
                              f"(self-imitation of the run's successful episodes)")
        if self.tasks and (self.source != "demos" or coef <= 0):
            raise ConfigError(f"{where}.tasks {self.tasks} picks the demos {coef_key} replays; set {coef_key} > 0 "
                              f"with {where}.source: demos, or tasks: []")


@dataclass
class BranchConfig:
    """``robotics.rollout.branch``: where a group branches. Empty ``at_chunks`` = flat groups (G independent
    episodes)."""

    at_chunks: list[int] = field(default_factory=list, metadata={
        "help": "chunk boundaries where every live episode of a group branches, increasing, e.g. [0, 8, 16]"})
    factors: list[int] = field(default_factory=list, metadata={
        "help": "children per branch point, e.g. [2, 2, 2]; their product = rollout.group_size leaves"})

    def check(self, where: str = "robotics.rollout.branch") -> None:
        if len(self.at_chunks) != len(self.factors):
            raise ConfigError(f"{where}: at_chunks {self.at_chunks} and factors {self.factors} need the same length")
        if any(c < 0 for c in self.at_chunks) or any(b <= a for a, b in zip(self.at_chunks, self.at_chunks[1:])):
            raise ConfigError(f"{where}.at_chunks must be increasing chunk indices >= 0, got {self.at_chunks}")
        if any(f < 1 for f in self.factors):
            raise ConfigError(f"{where}.factors must be >= 1, got {self.factors}")

    @property
    def enabled(self) -> bool:
        return bool(self.at_chunks)

    @property
    def leaves(self) -> int:
        return int(math.prod(self.factors)) if self.factors else 1

    def spawn_schedule(self) -> dict[int, int]:
        """chunk -> children per live node spawned before that chunk (a shared prefix is a factor-1 spawn at 0)."""
        out = {} if (self.at_chunks and self.at_chunks[0] == 0) else {0: 1}
        out.update(dict(zip(self.at_chunks, self.factors)))
        return out


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
