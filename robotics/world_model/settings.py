"""The settings of the world-model rollout strategies: ``robotics.rollout.world_model`` (where imagined episodes start
and how they are checked), ``robotics.rollout.verify`` (the two-stage verified rollout) and
``robotics.rollout.short_horizon`` (imagined branches bootstrapped by a critic)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shared_rl.errors import ConfigError
from shared_rl.part_index import selector_names


@dataclass
class ImaginationSettings:
    """``robotics.rollout.world_model`` (with ``rollout.name: world_model``)."""

    checkpoint: str = field(default="assets/metaworld-wm-tiny", metadata={
        "help": "world model + success model directory (grove train configs/robotics/world_model.yaml)"})
    data: str = field(default="", metadata={
        "help": "real chunk episodes (keyframes, refits); '' = the one named in the checkpoint's meta.json"})
    horizon: int = field(default=48, metadata={"help": "imagined env steps per rollout (from the keyframe)"})
    keyframe_stride: int = field(default=2, metadata={"help": "every n-th chunk boundary of a real trajectory is a keyframe"})
    keyframe_min_chunk: int = field(default=0, metadata={"help": "earliest boundary used as a keyframe (0 = the reset)"})
    keyframe_max_chunk: int = field(default=24, metadata={"help": "latest boundary used as a keyframe"})
    keyframe_limit: int = field(default=400, metadata={"help": "random subset of keyframes kept (0 = all)"})
    keyframe_states: int = field(default=10, metadata={
        "help": "keyframes come from real trajectories of the first n training reset states per task"})
    reward: Literal["classifier", "reference"] = field(default="classifier", metadata={
        "help": "classifier (success model) | reference (VLA-RFT: similarity to an expert demo's final frame)"})
    reference_tau: float = field(default=0.02, metadata={"help": "reference reward: exp(-mse / tau)"})
    reference_threshold: float = field(default=0.5, metadata={"help": "reference reward: success above this"})
    uncertainty_threshold: float = field(default=3.0, metadata={
        "help": "truncate when the disagreement exceeds this x its held-out 95th percentile (0 = never)"})
    pessimistic: bool = field(default=True, metadata={
        "help": "imagined success = the minimum success probability over the ensemble heads (against exploits)"})
    uncertain: Literal["truncate", "drop", "ignore"] = field(default="truncate", metadata={
        "help": "truncated rollouts: truncate (score the last trusted frame) | drop (NaN reward) | ignore"})
    coevolve_every: int = field(default=0, metadata={"help": "refit on fresh real rollouts every n iterations (0 = never)"})
    coevolve_episodes: int = field(default=16, metadata={
        "help": "fresh real policy episodes per co-evolution round (0 = refit only on the real episodes learned from "
                "since the last round: audit replays, verified candidates)"})
    refit_steps: int = field(default=200, metadata={"help": "world-model steps per refit"})
    refit_success_steps: int = field(default=200, metadata={"help": "success-model steps per refit"})
    refit_batch: int = field(default=16, metadata={"help": "windows per refit step"})
    refit_lr: float = field(default=3e-4, metadata={"help": "refit learning rate"})
    audit_fraction: float = field(default=0.25, metadata={
        "help": "share of imagined episodes replayed in MuJoCo (rollout.name world_model; the verified strategy "
                "re-executes its kept candidates anyway)"})
    learn_from_audit: bool = field(default=False, metadata={
        "help": "add audit replays to the real data (their steps then COUNT as real steps) for the next refit"})
    recalibrate: bool = field(default=False, metadata={
        "help": "re-choose the success threshold on the newest real data at each refit (noisy with few episodes)"})
    recent_weight: int = field(default=4, metadata={
        "help": "refits weigh data since the previous refit this many times (the policy's newest behaviour)"})

    def check(self, where: str = "robotics.rollout.world_model") -> None:
        if self.horizon < 1 or self.keyframe_stride < 1 or self.keyframe_states < 1:
            raise ConfigError(f"{where}: horizon, keyframe_stride and keyframe_states must be >= 1")
        if not 0.0 <= self.audit_fraction <= 1.0:
            raise ConfigError(f"{where}.audit_fraction must be in [0, 1], got {self.audit_fraction}")
        if self.uncertainty_threshold < 0 or self.coevolve_every < 0 or self.coevolve_episodes < 0:
            raise ConfigError(f"{where}: uncertainty_threshold, coevolve_every and coevolve_episodes must be >= 0")


@dataclass
class VerifySettings:
    """``robotics.rollout.verify`` (with ``rollout.name: verified``)."""

    candidates: int = field(default=16, metadata={
        "help": "imagined candidates per keyframe (N); rollout.group_size of them are re-executed in the simulator"})
    selector: str = field(default="max_variance", metadata={
        "help": "which k of the N candidates are re-executed (shared_rl.two_stage): max_variance (the k-subset of "
                "largest score variance) | top_bottom (half the best, half the worst)"})
    score: Literal["prob", "success", "ranker", "oracle"] = field(default="prob", metadata={
        "help": "the imagined score the selector ranks: prob = the best imagined P(success) along the episode "
                "(pessimistic over the ensemble when world_model.pessimistic) | success = the 0/1 imagined success | "
                "ranker = the sibling ranker's score of the whole imagined trajectory (world_model/ranker.py) | "
                "oracle = the real return (success + 0.5 dense) of every candidate, all N re-executed in the simulator "
                "and counted as real steps: the upper bound of any explorer's ranking (a measurement, not a saving)"})
    ranker: str = field(default="", metadata={
        "help": "score: ranker — the directory of the trained sibling ranker (ranker.json); '' = the world model's "
                "checkpoint directory (python -m bench.robotics_wm_probe --save-ranker DIR makes one)"})
    ranker_from: Literal["checkpoint", "own_groups"] = field(default="checkpoint", metadata={
        "help": "score: ranker — checkpoint = the trained ranker of verify.ranker (its sibling sets' real steps count "
                "in the budget) | own_groups = no pre-collected sets: a ranker learned from this run's own "
                "re-executed groups (costing nothing beyond the run), fitted on all of them at each co-evolution "
                "round; until its first fit the selector ranks by the imagined P(success)"})
    ranker_refit_steps: int = field(default=0, metadata={
        "help": "score: ranker — at each co-evolution round, fine-tune the ranker this many steps on the groups "
                "re-executed since the last round (the policy's own siblings and their real outcomes; 0 = never); "
                "with ranker_from: own_groups, fit a new ranker this many steps on every group of the run so far"})
    probe_every: int = field(default=0, metadata={
        "help": "every n iterations re-execute ALL candidates of probe_keys held-out keyframes: probe/spearman_within, "
                "probe/top_k_precision against the real outcomes (a measurement: its env steps are counted apart, "
                "probe/env_steps_total; 0 = never)"})
    probe_keys: int = field(default=4, metadata={"help": "keyframes per probe"})
    probe_states: int = field(default=0, metadata={
        "help": "the keyframes of the last n of world_model.keyframe_states reset states are held out for the probe "
                "(never training keys)"})
    learn_from_verified: bool = field(default=True, metadata={
        "help": "the re-executed real episodes join the world model's real data: the next co-evolution round refits "
                "on them and takes keyframes from them (their steps count as real steps either way)"})

    def check(self, where: str = "robotics.rollout.verify") -> None:
        if self.candidates < 1:
            raise ConfigError(f"{where}.candidates must be >= 1, got {self.candidates}")
        if self.selector not in selector_names():
            raise ConfigError(f"{where}.selector {self.selector!r} is unknown; choose one of {selector_names()}")
        if min(self.ranker_refit_steps, self.probe_every, self.probe_states) < 0 or self.probe_keys < 1:
            raise ConfigError(f"{where}: ranker_refit_steps, probe_every and probe_states must be >= 0, probe_keys >= 1")
        if self.ranker_from == "own_groups" and (self.score != "ranker" or self.ranker_refit_steps < 1):
            raise ConfigError(f"{where}.ranker_from: own_groups learns the ranker of score: ranker at each co-evolution "
                              f"round; set {where}.score: ranker and {where}.ranker_refit_steps >= 1")
        if self.probe_every and not self.probe_states:
            raise ConfigError(f"{where}.probe_every needs probe_states > 0 (held-out keyframes to probe on)")


@dataclass
class ShortHorizonSettings:
    """``robotics.rollout.short_horizon`` (with ``rollout.name: short_horizon``)."""

    horizon: int = field(default=12, metadata={
        "help": "env steps of an imagined branch from a real state (a few chunks: 12 = 3 chunks of 4)"})
    real_episodes: int = field(default=8, metadata={
        "help": "fresh real rollouts of the current policy per iteration (counted as real steps): their returns "
                "train the critic, their chunk boundaries become branch starts, they refit the world model"})
    gamma: float = field(default=0.97, metadata={
        "help": "discount per chunk of the critic's real returns and of the bootstrap (return = gamma^H V(s_H))"})
    critic_steps: int = field(default=100, metadata={"help": "critic Adam steps per iteration on all real boundaries"})
    critic_lr: float = field(default=1e-3, metadata={"help": "critic learning rate"})
    critic_batch: int = field(default=256, metadata={"help": "real boundaries per critic step"})
    critic_hidden: int = field(default=256, metadata={"help": "critic MLP width (policies.value_head.ValueHead)"})
    audit_groups: int = field(default=2, metadata={
        "help": "groups per iteration whose branches are re-executed in the simulator with the same noise streams "
                "(measurement only, not learned from, counted apart): short/rank_spearman of imagined vs real "
                "bootstrapped returns"})

    def check(self, where: str = "robotics.rollout.short_horizon") -> None:
        if self.horizon < 1 or self.real_episodes < 0 or self.critic_steps < 0 or self.audit_groups < 0:
            raise ConfigError(f"{where}: horizon must be >= 1; real_episodes, critic_steps, audit_groups >= 0")
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"{where}.gamma must be in (0, 1], got {self.gamma}")
        if self.critic_batch < 1 or self.critic_lr <= 0 or self.critic_hidden < 1:
            raise ConfigError(f"{where}: critic_batch and critic_hidden must be >= 1 and critic_lr > 0")
