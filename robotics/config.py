"""The ``robotics:`` section of an RL config: the policy, the env, exploration and evaluation, plus one section per
part of the domain (``critic``, ``replay``, ``adapters``, and the ``rollout`` strategy), each checking its own
fields."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shared_rl.domain_config import DomainConfig
from shared_rl.errors import ConfigError
# the path checks are torch-free so the CLI runs them before importing this module; ``resolve`` and
# ``missing_checkpoint_hint`` keep their names here (robotics.domain loads with them)
from shared_rl.prechecks import check_eval_baseline, check_vla_checkpoint
from shared_rl.prechecks import missing_checkpoint_hint  # noqa: F401
from shared_rl.prechecks import resolve_repo_path as resolve

from shared_rl.kernel_settings import DEFAULT_NOISE_LEVEL

# every section's class comes from a module that imports no torch (nor MuJoCo): grove config show and the config's
# checks build this config without them (issue 64; tests/core/test_part_index.py)
from .balance import BalanceConfig
from .envs.settings import EnvConfig
from .fpo import FPOConfig
from .part_settings import VAL_FIRST_INDEX, AdaptersConfig, CriticConfig, ReplayConfig, RolloutSettings
from .policies.lerobot.settings import PolicySettings
from .policies.vla_config import VLAConfig


def _saved_vla_config(path: Path) -> VLAConfig | None:
    """The tiny VLA's ``config.json`` as a ``VLAConfig``, or None when it does not read as one (a damaged file is
    the loader's to name, in its own words)."""
    import json

    try:
        return VLAConfig(**json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def policy_vla_config(cfg: "RoboticsConfig") -> VLAConfig | None:
    """The ``VLAConfig`` the domain builds its tiny VLA from: the checkpoint's ``config.json``, or a fresh
    ``robotics.model`` sized for the env (``robotics.domain.load_policy``); None when the checkpoint cannot be
    read here."""
    if cfg.checkpoint:
        return _saved_vla_config(resolve(cfg.checkpoint))
    mc = copy.deepcopy(cfg.model)
    mc.image_channels, mc.proprio_dim, mc.image_size = cfg.env.image_channels, cfg.env.proprio_dim, cfg.env.image_size
    if cfg.env.kind == "libero":
        from .policies.vla_config import libero_vocab

        mc.vocab = libero_vocab(mc.vocab)
    return mc


def check_policy_fits_env(m: VLAConfig, cfg: "RoboticsConfig") -> None:
    """The tiny VLA's sizes (``m``: its ``config.json``, or ``robotics.model`` for a fresh one) against the env and
    the head mode, and the Meta-World task names: what ``RoboticsConfig.preflight`` reads before any weights load
    (``--dry-run`` included). ConfigError naming the setting to change."""
    env = cfg.env
    if (m.image_channels, m.proprio_dim, m.image_size) != (env.image_channels, env.proprio_dim, env.image_size):
        raise ConfigError(
            f"robotics: the policy expects {m.image_channels} image channels, proprio {m.proprio_dim}, size "
            f"{m.image_size}; env gives {env.image_channels} (cameras {env.cameras}), "
            f"{env.proprio_dim} (include_goal={env.include_goal}, include_object={env.include_object}), {env.image_size}"
        )
    if m.action_dim != env.action_dim:
        what = "LIBERO takes 7 (OSC_POSE delta + gripper)" if env.kind == "libero" else \
            "Meta-World and the point env take 4 (hand xyz + gripper)"
        raise ConfigError(f"robotics: the policy's action_dim is {m.action_dim} but {what}; set "
                          f"robotics.model.action_dim: {env.action_dim}")
    if env.kind == "metaworld":
        from .envs.metaworld_env import known_tasks

        unknown = [t for t in env.tasks if t not in known_tasks()]
        if unknown:
            from shared_rl.registry import did_you_mean

            raise ConfigError(f"robotics.env.tasks: unknown Meta-World task(s) {unknown}"
                              f"{did_you_mean(unknown[0], known_tasks())}; v3 names look like "
                              f"reach-v3, push-v3, door-open-v3 (50 in all, see metaworld.env_dict)")
    if (m.head == "discrete") != (cfg.head_mode == "discrete"):
        raise ConfigError(f"robotics.head_mode {cfg.head_mode!r} does not fit the checkpoint's {m.head!r} head; "
                          f"use {'discrete' if m.head == 'discrete' else 'flow_sde, flow_noise or sde_one_step'}")


def _moved(new: str) -> str:
    return f"use {new}"


@dataclass
class RoboticsConfig(DomainConfig):
    """The ``robotics:`` section of an RL config."""

    # keys of earlier configs -> where they live now (shared_rl.config.from_dict names the new key in one line)
    moved_keys = {
        "critic_hidden": _moved("robotics.critic.hidden"),
        "critic_detach": _moved("robotics.critic.detach"),
        "critic_init": _moved("robotics.critic.init"),
        "replay_source": _moved("robotics.replay.source"),
        "replay_data": _moved("robotics.replay.data"),
        "replay_batch": _moved("robotics.replay.batch"),
        "replay_tasks": _moved("robotics.replay.tasks"),
        "success_window": _moved("robotics.replay.success_window"),
        "task_adapters": _moved("robotics.adapters.rank"),
        "adapter_steps": _moved("robotics.adapters.steps"),
        "keep_best_adapters": _moved("robotics.adapters.keep_best"),
        "val_states_per_task": _moved("robotics.adapters.val_states_per_task"),
        "report_last": _moved("robotics.adapters.report_last"),
        "branch": _moved("robotics.rollout: {name: tree, branch: {at_chunks: [...], factors: [...]}} (domain: "
                         "robotics)"),
        "world_model": _moved("robotics.rollout: {name: world_model, world_model: {...}} (domain: robotics)"),
    }

    env: EnvConfig = field(default_factory=EnvConfig)
    checkpoint: str = field(default="assets/metaworld-vla-tiny",
                            metadata={"help": "pretrained VLA directory; '' = a freshly initialised `model`"})
    model: VLAConfig = field(default_factory=VLAConfig)  # only used when checkpoint is ""
    policy: PolicySettings = field(default_factory=PolicySettings, metadata={
        "help": "which policy RL post-trains: {type: tiny_vla} (robotics.checkpoint, the default) or {type: lerobot, "
                "path: DIR_OR_HUB_ID} (a LeRobot SmolVLA; docs/methods/lerobot_policies.md)"})
    head_mode: Literal["flow_sde", "flow_noise", "sde_one_step", "fpo", "discrete"] = field(
        default="flow_sde", metadata={"help": "exploration: flow_sde | flow_noise (ReinFlow) | sde_one_step | fpo (FPO: "
                                              "ODE rollouts from a random start, the flow-matching likelihood "
                                              "surrogate; robotics.fpo) | discrete"})
    fpo: FPOConfig = field(default_factory=FPOConfig, metadata={
        "help": "head_mode fpo: the (ε, τ) pairs of its flow-matching likelihood surrogate (robotics/fpo.py)"})
    noise_level: float = field(default=DEFAULT_NOISE_LEVEL, metadata={
        "help": "Flow-GRPO SDE noise level a (flow_sde, sde_one_step)"})
    temperature: float = field(default=1.0, metadata={"help": "discrete head sampling temperature"})
    logp_reduce: Literal["sum", "mean"] = field(
        default="sum", metadata={"help": "sum | mean of log-probs over the chunk's action dims"})
    init_noise: float = field(default=1.0, metadata={
        "help": "flow head, rollouts: std of the chain's start x(sigma=1); 0 = only the SDE steps explore"})
    group_start_noise: Literal["independent", "shared"] = field(default="independent", metadata={
        "help": "flow head, rollouts: independent = each episode draws its chains' start noise; shared = the members "
                "of a group draw the same start noise at each chunk (DanceGRPO's shared initial noise per prompt), so "
                "their outcomes differ only by the exploration noise whose log-prob the update credits"})
    eval_init_noise: float = field(default=1.0, metadata={
        "help": "flow head, evaluation ODE: std of the chain's start; 0 = deterministic"})
    train_states_per_task: int = field(default=50, metadata={"help": "training reset states per task (the keys)"})
    eval_states_per_task: int = field(default=20, metadata={"help": "held-out reset states per task for evaluation"})
    eval_standard_error: bool = field(default=False, metadata={
        "help": "also log eval/success_se and eval/success_se/<task>: the binomial standard error sqrt(p(1-p)/n) "
                "of each held-out success (the overall one stratified over tasks); with 100 states per task a "
                "success near 0.8 has se 0.04"})
    eval_seed: int = field(default=0, metadata={
        "help": "start-noise seed of the evaluation ODE: episode (state, draw j) starts from noise seeded by "
                "(eval_seed + j, the state's key), so every evaluation of a run meets the same start noise and "
                "before -> after is paired (eval/success_delta); another seed measures how far the start noise "
                "alone moves the score"})
    eval_noise_draws: int = field(default=1, metadata={
        "help": "start-noise draws per held-out state (seeds eval_seed .. eval_seed + n - 1); > 1 also logs "
                "eval/success_draw_sd, the spread of a one-draw score over draws"})
    eval_baseline: str = field(default="", metadata={
        "help": "an earlier evaluation of the starting policy (RUN/eval_episodes/it0000.json, or the file `grove "
                "bench robotics-libero-rl` writes for a clone) to pair every evaluation of this run with, instead "
                "of evaluating at start (eval.at_start: false saves that evaluation; the file must hold the same "
                "episodes and the same starting weights, checked when the run is built)"})
    eval_split: Literal["eval", "train"] = field(default="eval", metadata={
        "help": "eval = the held-out reset states; train = the first eval_states_per_task of the training states "
                "RL draws (grove eval RUN robotics.eval_split=train: the policy's generalisation gap)"})
    train_tasks: list[str] = field(default_factory=list,
                                   metadata={"help": "subset of env.tasks for training keys; [] = all"})
    dense_reward: bool = field(default=False, metadata={
        "help": "add the 'dense' reward: best shaped Meta-World reward / 10, in [0, 1]"})
    rewards: list[str] = field(default_factory=list, metadata={
        "help": "more rewards of flat rollouts: names of Python functions fn(episodes) -> a value per episode, "
                "handed over by robotics.api (VLAGRPOTrainer(reward_funcs=...)); weigh them in advantage.weights"})
    train_encoder: bool = field(default=True, metadata={
        "help": "train the image/text/proprio encoders; false = only the fusion MLP and the head"})
    gifs: bool = field(default=True, metadata={"help": "write a GIF of one evaluation episode per task"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    critic: CriticConfig = field(default_factory=CriticConfig, metadata={
        "help": "the value head of PPO (advantage.estimator gae)"})
    replay: ReplayConfig = field(default_factory=ReplayConfig, metadata={
        "help": "a BC term at every optimizer step (coef): on demonstrations or on the run's own successes"})
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig, metadata={
        "help": "per-task adapters: rank, how each task's adapter steps, per-task early stopping"})
    rollout: RolloutSettings = field(default_factory=RolloutSettings, metadata={
        "help": "where episodes come from: flat or tree groups in the simulator, or the learned world model"})
    balance: BalanceConfig = field(default_factory=BalanceConfig, metadata={
        "help": "how many of an iteration's reset states each task gets (wraps selection.sampler)"})

    def check(self, where: str = "robotics") -> None:
        """The sections check themselves (``from_dict`` calls their ``check``); here this section's own fields and
        what crosses sections."""
        if self.train_states_per_task < 1 or self.eval_states_per_task < 1:
            raise ConfigError(f"{where}: train_states_per_task and eval_states_per_task must be >= 1")
        self.env.check_eval_states(self.eval_states_per_task, where)
        if self.eval_noise_draws < 1:
            raise ConfigError(f"{where}.eval_noise_draws must be >= 1 (start-noise draws per held-out state), got "
                              f"{self.eval_noise_draws}")
        if not 0 <= self.eval_seed <= 2 ** 32 - 1 - self.eval_noise_draws:
            raise ConfigError(f"{where}.eval_seed must be in [0, 2^32 - eval_noise_draws), got {self.eval_seed}")
        if self.noise_level <= 0 and self.head_mode in ("flow_sde", "sde_one_step"):
            raise ConfigError(f"{where}.noise_level must be > 0 for {self.head_mode} (0 is the deterministic ODE)")
        if self.head_mode == "fpo":
            self._check_fpo(where)
        if self.group_start_noise == "shared" and self.rollout.name != "flat":
            raise ConfigError(f"{where}.group_start_noise: shared is drawn by the flat simulator rollout only; "
                              f"{where}.rollout.name is {self.rollout.name!r} (use flat or group_start_noise: independent)")
        if self.group_start_noise == "shared" and self.head_mode == "discrete":
            raise ConfigError(f"{where}.group_start_noise: shared is for a flow head's start noise; head_mode discrete "
                              f"has none (set group_start_noise: independent)")
        if self.init_noise < 0 or self.eval_init_noise < 0:
            raise ConfigError(f"{where}: init_noise and eval_init_noise must be >= 0 (1 = standard normal start)")
        if self.temperature <= 0:
            raise ConfigError(f"{where}.temperature must be > 0, got {self.temperature}")
        unknown = [t for t in self.train_tasks if t not in self.env.tasks]
        if unknown:
            raise ConfigError(f"{where}.train_tasks {unknown} are not in {where}.env.tasks {self.env.tasks}")
        if self.adapters.keep_best and self.train_states_per_task > VAL_FIRST_INDEX:
            raise ConfigError(f"{where}.train_states_per_task must be <= {VAL_FIRST_INDEX} with adapters.keep_best "
                              f"(the validation states start at index {VAL_FIRST_INDEX} of the training split)")
        if self.rollout.name != "flat" and (self.critic.enabled or self.replay.source == "successes"):
            what = "critic.enabled" if self.critic.enabled else "replay.source: successes"
            raise ConfigError(f"{where}.{what} learns from the episodes of flat groups in the simulator; with "
                              f"{where}.rollout.name: {self.rollout.name} set rollout.name: flat or turn it off")
        if self.rollout.name == "short_horizon" and (self.dense_reward or self.rollout.world_model.reward != "classifier"):
            raise ConfigError(f"{where}.rollout.name: short_horizon rewards a branch with the critic's value only "
                              f"(reward name 'return'): set {where}.dense_reward: false and keep "
                              f"rollout.world_model.reward: classifier")
        if self.rollout.world_model.reward == "reference" and self.env.kind != "metaworld":
            raise ConfigError(f"{where}.rollout.world_model.reward: reference needs Meta-World (scripted expert demos)")
        if self.rewards:
            clash = [n for n in self.rewards if n in ("success", "dense", "return")]
            if clash or len(set(self.rewards)) != len(self.rewards):
                raise ConfigError(f"{where}.rewards {self.rewards}: names must be unique and not success, dense or "
                                  f"return (the domain's own rewards)")
            if self.rollout.name != "flat":
                raise ConfigError(f"{where}.rewards score the episodes of flat groups in the simulator; with "
                                  f"{where}.rollout.name: {self.rollout.name} set rollout.name: flat or drop them")
        if self.policy.type == "lerobot":
            self._check_lerobot(where)
        elif self.critic.input != "prefix":
            raise ConfigError(f"{where}.critic.input: {self.critic.input} reads a LeRobot policy's action expert; the "
                              f"tiny VLA has one fused feature vector (critic.input: prefix)")

    def _check_fpo(self, where: str) -> None:
        """FPO explores with the ODE's start noise alone, in flat groups of the tiny VLA's flow head."""
        if self.init_noise <= 0:
            raise ConfigError(f"{where}.head_mode: fpo explores with the ODE's start noise only; {where}.init_noise "
                              f"must be > 0 (1 = standard normal), got {self.init_noise}")
        if self.group_start_noise == "shared":
            raise ConfigError(f"{where}.head_mode: fpo samples the deterministic ODE, so members sharing their start "
                              f"noise would run the same episode; set {where}.group_start_noise: independent")
        if self.rollout.name != "flat" or self.policy.type != "tiny_vla":
            what = (f"rollout.name: {self.rollout.name}" if self.rollout.name != "flat"
                    else f"policy.type: {self.policy.type}")
            raise ConfigError(f"{where}.head_mode: fpo runs flat groups of the tiny VLA in the simulator, not "
                              f"{where}.{what}; use sde_one_step there")

    def _check_lerobot(self, where: str) -> None:
        """What a LeRobot policy runs with: flat groups in the simulator, Flow-GRPO's SDE steps or the learned noise
        head (flow_noise), the value head on its pooled prefix; no part that reads the tiny VLA's fused feature
        vector otherwise (task adapters, BC replay)."""
        lerobot = f"with {where}.policy.type: lerobot"
        if self.head_mode not in ("flow_sde", "sde_one_step", "flow_noise"):
            raise ConfigError(f"{where}.head_mode: {self.head_mode} {lerobot}; use flow_sde, sde_one_step or "
                              f"flow_noise (the policy has no bins)")
        if self.rollout.name != "flat":
            raise ConfigError(f"{where}.rollout.name: {self.rollout.name} {lerobot}; use flat")
        for what, on in (("adapters.rank", self.adapters.rank),
                         ("replay", self.replay.coef > 0 or bool(self.replay.data) or self.replay.source != "demos"),
                         ("train_encoder: false", not self.train_encoder)):
            if on:
                raise ConfigError(f"{where}.{what} {lerobot}: not supported (it reads the tiny VLA's features); "
                                  f"RL trains LoRA ({where}.policy.lora.rank) or what the policy's config leaves "
                                  f"trainable")

    def preflight(self, train_cfg) -> None:
        """The files this section names, before any model loads (``--dry-run`` runs it too): the tiny VLA's
        checkpoint directory, with the command that makes it for this env, a LeRobot policy's directory or cached
        hub id (its config.json), and ``eval_baseline``."""
        from .held import HELD_PREFIX

        if train_cfg.distributed.strategy == "fsdp2":  # what FSDP2 refuses from the config alone, as the real run
            from .fsdp import refuse_config

            refuse_config(self)
        # a checkpoint path under held/ only labels a policy the caller holds (robotics.api): nothing to read
        path = check_vla_checkpoint(self.checkpoint, self.env.kind, self.policy.type)
        if path is not None:
            saved = _saved_vla_config(path)
            if saved is not None:
                check_policy_fits_env(saved, self)
        elif self.policy.type == "tiny_vla" and not self.checkpoint:  # a fresh VLA: sized for the env but action_dim
            fresh = copy.deepcopy(self.model)
            fresh.image_channels, fresh.proprio_dim = self.env.image_channels, self.env.proprio_dim
            fresh.image_size = self.env.image_size
            check_policy_fits_env(fresh, self)
        if self.policy.type == "lerobot" and self.policy.path and not self.policy.path.startswith(HELD_PREFIX):
            from .policies.lerobot.load import read_policy_config

            path = resolve(self.policy.path)  # as the domain resolves it: a local folder, else a hub id in the cache
            read_policy_config(str(path) if path.exists() else self.policy.path, self.env.kind)
        check_eval_baseline(self.eval_baseline)

    def parameter_groups(self, train_cfg):
        """The tiny VLA counted on the meta device, its KL reference and the value head, as the domain holds them
        (``robotics.parameter_count``; None for a LeRobot policy and the world-model strategies)."""
        from .parameter_count import parameter_groups

        return parameter_groups(self, policy_vla_config(self))

    def check_with(self, train_cfg) -> None:
        self.rollout.check_with(train_cfg)
        self.adapters.check_with(train_cfg)
        self.critic.check_with(train_cfg)

    def rollout_structure(self, train_cfg) -> str:
        """Flat (a group is ``group_size`` episodes from one reset state) or tree (``rollout.branch``)."""
        return self.rollout.structure()

    def reward_names(self, train_cfg) -> list[str]:
        """The rewards a rollout emits (the core checks ``advantage.weights`` against them before loading):
        ``return`` for short imagined branches (the critic's bootstrapped value), else ``success`` (+ ``dense``)."""
        if self.rollout.name == "short_horizon":
            return ["return"]
        return ["success"] + (["dense"] if self.dense_reward else []) + list(self.rewards)

    @property
    def trained_tasks(self) -> list[str]:
        return self.train_tasks or self.env.tasks
