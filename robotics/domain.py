"""The robotics domain: GRPO-family post-training of the tiny VLA in Meta-World (or the synthetic point env).

Contract mapping (``shared_rl/domain.py``):

- keys = training reset-state ids (``envs.metaworld_env.make_key(task, "train", i)``); evaluation uses the
  disjoint ``"eval"`` split, so held-out success is never measured on a training reset state.
- ``rollout(keys, G)``: G episodes from the SAME reset state per key (a GRPO group; RIPT-VLA/SimpleVLA-RL),
  all B = len(keys)·G envs stepped in lock-step with one batched policy forward per chunk.
- sequences = episodes; steps = (chunk c, denoising step s) pairs flattened to t = c·S + s (S = denoising
  steps; S = 1 for the discrete head). ``logp_old[n, t]`` is the behaviour log-prob of that step and ``mask``
  marks stochastic steps of executed chunks (flow_sde: all but the last denoising step; flow_noise: all;
  sde_one_step: the one random step per chunk; discrete: every chunk).
- rewards: ``success`` (0/1; "success once" or "success at end" per ``env.success_mode``) and, with
  ``dense_reward``, ``dense``: the best Meta-World shaped reward of the episode / 10, in [0, 1] (weight it via
  ``advantage.weights``). The *best*, not the mean: with "success once" a fast success has a short episode of
  mostly approach steps, so a mean over steps would rank it below a failure that hovers near the goal.
- ``evaluate``: deterministic (ODE / arg-max) episodes on held-out reset states -> ``eval/success`` and
  ``eval/success/<task>``; GIFs of one episode per task in ``run_dir/gifs``.
- KL (``loss.kl_coef > 0``): flow_sde / sde_one_step return the Flow-GRPO mean KL ‖μ_θ − μ_ref‖²/(2σ²) per step;
  flow_noise and discrete return reference log-probs (the trainer applies k1/k3). The reference is a frozen copy
  of the starting policy (1.3M parameters: a copy is cheaper than toggling adapters).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from shared_rl.config import ConfigError
from shared_rl.domain import DomainBase, RunContext, StepLogProbs
from shared_rl.rollout import Rollout
from shared_rl.flow_kernels import sde_mean_kl

from .evaluation import eval_keys, evaluate_policy
from .envs.metaworld_env import make_key
from .envs.vector import EnvConfig, make_vector_env
from .episodes import SamplingSettings, run_episodes
from .policies.vla import TinyVLA, VLAConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


ENV_ACTION_DIM = 4  # Meta-World's action: hand displacement xyz + gripper effort
# keep_best_adapters' validation states: training-split indices from here on. RL's keys are 0 .. train_states_per_task
# and the demonstrations' 100_000 + attempt (collect.DEMO_INDEX_OFFSET), so validation shares a state with neither
# (nor with the held-out "eval" split); the BC asset never saw these states either.
VAL_FIRST_INDEX = 300_000


@dataclass
class RoboticsConfig:
    """The ``robotics:`` section of an RL config."""

    env: EnvConfig = field(default_factory=EnvConfig)
    checkpoint: str = field(default="assets/metaworld-vla-tiny",
                            metadata={"help": "pretrained VLA directory; '' = a freshly initialised `model`"})
    model: VLAConfig = field(default_factory=VLAConfig)  # only used when checkpoint is ""
    head_mode: Literal["flow_sde", "flow_noise", "sde_one_step", "discrete"] = field(
        default="flow_sde", metadata={"help": "exploration: flow_sde | flow_noise (ReinFlow) | sde_one_step | discrete"})
    noise_level: float = field(default=0.7, metadata={"help": "Flow-GRPO SDE noise level a (flow_sde, sde_one_step)"})
    temperature: float = field(default=1.0, metadata={"help": "discrete head sampling temperature"})
    logp_reduce: Literal["sum", "mean"] = field(
        default="sum", metadata={"help": "sum | mean of log-probs over the chunk's action dims"})
    init_noise: float = field(default=1.0, metadata={
        "help": "flow head, rollouts: std of the chain's start x(sigma=1); 0 = only the SDE steps explore"})
    eval_init_noise: float = field(default=1.0, metadata={
        "help": "flow head, evaluation ODE: std of the chain's start; 0 = deterministic"})
    train_states_per_task: int = field(default=50, metadata={"help": "training reset states per task (the keys)"})
    eval_states_per_task: int = field(default=20, metadata={"help": "held-out reset states per task for evaluation"})
    eval_split: Literal["eval", "train"] = field(default="eval", metadata={
        "help": "eval = the held-out reset states; train = the first eval_states_per_task of the training states "
                "RL draws (grove eval RUN robotics.eval_split=train: the policy's generalisation gap)"})
    train_tasks: list[str] = field(default_factory=list,
                                   metadata={"help": "subset of env.tasks for training keys; [] = all"})
    dense_reward: bool = field(default=False, metadata={
        "help": "add the 'dense' reward: best shaped Meta-World reward / 10, in [0, 1]"})
    train_encoder: bool = field(default=True, metadata={
        "help": "train the image/text/proprio encoders; false = only the fusion MLP and the head"})
    gifs: bool = field(default=True, metadata={"help": "write a GIF of one evaluation episode per task"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    critic: bool = field(default=False, metadata={
        "help": "a value head V(features, time) per action chunk (PPO: advantage.estimator gae, loss.value_coef)"})
    critic_hidden: int = field(default=256, metadata={"help": "critic MLP width"})
    critic_detach: bool = field(default=True, metadata={
        "help": "the critic reads the policy's fused features without gradient (true) or trains them too (false)"})
    critic_init: float = field(default=0.0, metadata={"help": "the critic's initial value (its last layer starts at 0)"})
    replay_data: str = field(default="", metadata={
        "help": "demonstrations (.npz of `grove robotics collect`) replayed by loss.replay_coef: the BC "
                "flow-matching / bin loss on them at every optimizer step, an anchor to the BC policy; '' = none"})
    replay_batch: int = field(default=256, metadata={"help": "chunks per replay minibatch (loss.replay_coef)"})
    replay_tasks: list[str] = field(default_factory=list, metadata={
        "help": "replay_source demos: the tasks whose demos are replayed (e.g. [push-v3]: imitate the task the clone "
                "underfits, leave the others to RL alone); [] = every trained task"})
    replay_source: Literal["demos", "successes"] = field(default="demos", metadata={
        "help": "what loss.replay_coef's BC term imitates: demos = robotics.replay_data (an anchor to the BC data, "
                "DAPG); successes = the run's own successful rollout episodes (success_window iterations), every "
                "executed chunk, drawn equally per task (self-imitation: SIL, Oh et al. 2018; iRe-VLA's supervised "
                "phase on successes)"})
    success_window: int = field(default=1, metadata={
        "help": "replay_source successes: iterations whose successful chunks are kept (1 = the current one; N = "
                "it and the N-1 before it, a growing set of successes of a rarely solved task; kept in checkpoints)"})
    task_adapters: int = field(default=0, metadata={
        "help": "rank of a per-task low-rank adapter on the fused features, the only weights RL then trains (each "
                "task's update cannot move another task's actions); 0 = none, train the shared fusion and head"})
    adapter_steps: Literal["equal", "by_episodes"] = field(default="equal", metadata={
        "help": "with task_adapters: equal = every task's adapter takes AdamW's full step whenever its task has "
                "episodes in the minibatch (AdamW normalises each weight's step, so a task informed by 8 episodes "
                "moves as far as one informed by 40); by_episodes = each task adapter's step is scaled by its "
                "episodes in the minibatch / the most any task has there (as one shared step would weigh them)"})
    keep_best_adapters: bool = field(default=False, metadata={
        "help": "with task_adapters: at every evaluation score each task's adapter by ODE success on "
                "val_states_per_task validation reset states (training-split states the rollouts never draw, "
                "disjoint from the held-out ones) and end the run with each task's best-scoring adapter, ties to "
                "the later one: early stopping per task, so a task that regresses late ends where it scored best (the final "
                "checkpoint holds the kept adapters: extending a finished run with --resume iterations=N trains on "
                "from them, not from the last ones)"})
    val_states_per_task: int = field(default=20, metadata={
        "help": "validation reset states per task for keep_best_adapters (ODE episodes at every evaluation)"})
    report_last: bool = field(default=True, metadata={
        "help": "with keep_best_adapters: before the kept adapters replace the last ones, evaluate the last ones on "
                "the held-out states too (eval_last/success, eval_last/success/<task>: what the run would have ended "
                "at without the selection; one more evaluation)"})

    def check(self, where: str = "robotics") -> None:
        if self.train_states_per_task < 1 or self.eval_states_per_task < 1:
            raise ConfigError(f"{where}: train_states_per_task and eval_states_per_task must be >= 1")
        if self.noise_level <= 0 and self.head_mode in ("flow_sde", "sde_one_step"):
            raise ConfigError(f"{where}.noise_level must be > 0 for {self.head_mode} (0 is the deterministic ODE)")
        if self.init_noise < 0 or self.eval_init_noise < 0:
            raise ConfigError(f"{where}: init_noise and eval_init_noise must be >= 0 (1 = standard normal start)")
        if self.temperature <= 0:
            raise ConfigError(f"{where}.temperature must be > 0, got {self.temperature}")
        if self.replay_batch < 1:
            raise ConfigError(f"{where}.replay_batch must be >= 1, got {self.replay_batch}")
        if self.success_window < 1:
            raise ConfigError(f"{where}.success_window counts iterations (1 = the current one), got {self.success_window}")
        if self.task_adapters < 0:
            raise ConfigError(f"{where}.task_adapters is a rank (0 = none), got {self.task_adapters}")
        unknown = [t for t in self.train_tasks if t not in self.env.tasks]
        if unknown:
            raise ConfigError(f"{where}.train_tasks {unknown} are not in {where}.env.tasks {self.env.tasks}")
        if self.adapter_steps == "by_episodes" and not self.task_adapters:
            raise ConfigError(f"{where}.adapter_steps: by_episodes scales per-task adapter steps; set "
                              f"{where}.task_adapters to a rank (16 in the five-task recipe) or adapter_steps: equal")
        if self.keep_best_adapters:
            if not self.task_adapters:
                raise ConfigError(f"{where}.keep_best_adapters selects per-task adapters; set {where}.task_adapters "
                                  f"to a rank (16 in the five-task recipe) or keep_best_adapters: false")
            if self.val_states_per_task < 1:
                raise ConfigError(f"{where}.val_states_per_task must be >= 1, got {self.val_states_per_task}")
            if self.train_states_per_task > VAL_FIRST_INDEX:
                raise ConfigError(f"{where}.train_states_per_task must be <= {VAL_FIRST_INDEX} with keep_best_adapters "
                                  f"(the validation states start at index {VAL_FIRST_INDEX} of the training split)")

    def check_with(self, train_cfg) -> None:
        """A critic estimator (gae) needs ``critic: true``; a critic without one would never be trained; the
        per-task selection scores the live weights, not an average."""
        from shared_rl.advantages import STEP_ESTIMATORS

        if self.keep_best_adapters and train_cfg.optim.ema_decay > 0:
            raise ConfigError("robotics.keep_best_adapters selects the live adapters, optim.ema_decay evaluates an "
                              "average of them; use one or the other")

        if self.replay_source == "successes":
            if train_cfg.loss.replay_coef <= 0:
                raise ConfigError("robotics.replay_source: successes is the data of loss.replay_coef's BC term; set "
                                  "loss.replay_coef > 0 (1.0 in the measured runs) or replay_source: demos")
            if self.replay_data:
                raise ConfigError(f"robotics.replay_source: successes imitates the run's own successful episodes, "
                                  f"so robotics.replay_data ({self.replay_data!r}) would be unused; set it to '' or "
                                  f"replay_source: demos")
        elif train_cfg.loss.replay_coef > 0 and not self.replay_data:
            raise ConfigError(f"loss.replay_coef={train_cfg.loss.replay_coef} replays demonstrations, but "
                              f"robotics.replay_data is empty; give the demos .npz (make one with `grove robotics "
                              f"collect --labels expert --out runs/robotics-demos/demos40_dart.npz`) or set "
                              f"robotics.replay_source: successes (self-imitation of the run's successful episodes)")
        if self.replay_tasks and (self.replay_source != "demos" or train_cfg.loss.replay_coef <= 0):
            raise ConfigError(f"robotics.replay_tasks {self.replay_tasks} picks the demos loss.replay_coef replays; "
                              f"set loss.replay_coef > 0 with robotics.replay_source: demos, or replay_tasks: []")
        est = train_cfg.advantage.estimator
        if est in STEP_ESTIMATORS and not self.critic:
            raise ConfigError(f"advantage.estimator {est!r} needs the policy's value head: set robotics.critic: true "
                              f"(and loss.value_coef > 0 to train it)")

    def rollout_structure(self, train_cfg) -> str:
        """Flat: a group is ``group_size`` episodes from one reset state (the hook of ``shared_rl.domain``)."""
        return "flat"

    def reward_names(self, train_cfg) -> list[str]:
        """The rewards a rollout emits (the core checks ``advantage.weights`` against them before loading)."""
        return ["success"] + (["dense"] if self.dense_reward else [])


def _resolve(path: str) -> Path:
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    return REPO_ROOT / p


class RoboticsDomain(DomainBase):
    config_class = RoboticsConfig

    def __init__(self, cfg: RoboticsConfig, ctx: RunContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        torch.set_num_threads(max(1, cfg.threads))
        self.device = ctx.device
        if cfg.checkpoint:
            path = _resolve(cfg.checkpoint)
            try:
                self.policy = TinyVLA.load_pretrained(path)
            except FileNotFoundError as e:
                raise ConfigError(f"robotics.checkpoint: {e}; make it with `grove train configs/robotics/metaworld_bc.yaml` "
                                  f"or set robotics.checkpoint to '' for a fresh model") from None
        else:
            mc = copy.deepcopy(cfg.model)
            mc.image_channels, mc.proprio_dim, mc.image_size = cfg.env.image_channels, cfg.env.proprio_dim, cfg.env.image_size
            torch.manual_seed(ctx.seed)
            self.policy = TinyVLA(mc)
        self.policy.to(self.device)
        m = self.policy.cfg
        if (m.image_channels, m.proprio_dim, m.image_size) != (cfg.env.image_channels, cfg.env.proprio_dim, cfg.env.image_size):
            raise ConfigError(
                f"robotics: the policy expects {m.image_channels} image channels, proprio {m.proprio_dim}, size "
                f"{m.image_size}; env gives {cfg.env.image_channels} (cameras {cfg.env.cameras}), "
                f"{cfg.env.proprio_dim} (include_goal={cfg.env.include_goal}, include_object={cfg.env.include_object}), {cfg.env.image_size}"
            )
        if m.action_dim != ENV_ACTION_DIM:
            raise ConfigError(f"robotics: the policy's action_dim is {m.action_dim} but Meta-World and the point env "
                              f"take {ENV_ACTION_DIM} (hand xyz + gripper); set robotics.model.action_dim: {ENV_ACTION_DIM}")
        if cfg.env.kind == "metaworld":
            from .envs.metaworld_env import known_tasks

            unknown = [t for t in cfg.env.tasks if t not in known_tasks()]
            if unknown:
                raise ConfigError(f"robotics.env.tasks: unknown Meta-World task(s) {unknown}; v3 names look like "
                                  f"reach-v3, push-v3, door-open-v3 (50 in all, see metaworld.env_dict)")
        extra = sorted(set(cfg.train_tasks) - set(cfg.env.tasks))
        if extra:
            raise ConfigError(f"robotics.train_tasks {extra} are not in robotics.env.tasks {cfg.env.tasks}")
        if (m.head == "discrete") != (cfg.head_mode == "discrete"):
            raise ConfigError(f"robotics.head_mode {cfg.head_mode!r} does not fit the checkpoint's {m.head!r} head; "
                              f"use {'discrete' if m.head == 'discrete' else 'flow_sde, flow_noise or sde_one_step'}")
        if cfg.task_adapters:  # seeded, and added before a resume loads the trained adapters
            gen = torch.Generator().manual_seed(ctx.seed)
            try:
                self.policy.add_task_adapters([self._instruction(t) for t in cfg.env.tasks], cfg.task_adapters, gen)
            except ValueError as e:
                raise ConfigError(f"robotics.task_adapters: {e}") from None
        for name, p in self.policy.named_parameters():
            encoder = name.split(".")[0] in ("cnn", "image_proj", "text", "proprio")
            p.requires_grad_(cfg.train_encoder or not encoder)
            if cfg.task_adapters:
                p.requires_grad_(name.startswith(("adapters.", "flow.noise_std")))
            if cfg.head_mode != "flow_noise" and name.startswith("flow.noise_std"):
                p.requires_grad_(False)  # the learned std only exists in ReinFlow mode
        # the KL reference is the starting policy; made here, before a resume loads trained weights
        self._ref = copy.deepcopy(self.policy).eval()
        for q in self._ref.parameters():
            q.requires_grad_(False)
        self.critic = None
        if cfg.critic:
            from .policies.value_head import ValueHead

            self.critic = ValueHead(m.hidden, cfg.critic_hidden, init_value=cfg.critic_init).to(self.device)
        self.sampling = SamplingSettings(mode=cfg.head_mode, noise_level=cfg.noise_level, temperature=cfg.temperature,
                                         logp_reduce=cfg.logp_reduce, init_noise=cfg.init_noise)
        self.steps_per_chunk = m.num_denoise_steps if m.head == "flow" else 1
        self.n_chunks = math.ceil(cfg.env.horizon / m.chunk)
        tasks = cfg.train_tasks or cfg.env.tasks
        self._train_keys = [make_key(cfg.env.tasks.index(t), "train", i) for t in tasks for i in range(cfg.train_states_per_task)]
        self._replay = None
        if cfg.replay_data:  # loaded before the env workers start: a bad file fails in a second
            from .datasets import ChunkDataset
            from .data import load_episodes

            replayed = cfg.replay_tasks or tasks
            if set(replayed) - set(tasks):
                raise ConfigError(f"robotics.replay_tasks {sorted(set(replayed) - set(tasks))} are not trained tasks "
                                  f"{tasks}")
            demos = [e for e in load_episodes(_resolve(cfg.replay_data)) if e.task in replayed]
            if not demos:
                raise ConfigError(f"robotics.replay_data {cfg.replay_data!r} has no demos of the replayed tasks {replayed}")
            self._replay = ChunkDataset(demos, m.chunk, self.policy)
        # replay_source successes: per iteration (the last success_window), per task index, the successful chunks
        self._successes: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        if cfg.replay_source == "successes" and ctx.num_processes > 1:
            raise ConfigError("robotics.replay_source: successes imitates each process's own rollouts, which would "
                              "make N processes differ from one; launch one process or use replay_source: demos")
        # adapter_steps by_episodes: episodes per task index in the current optimizer step's minibatch (counted in
        # log_probs), and the adapters as they were before the step
        self._step_episodes = torch.zeros(len(cfg.env.tasks), dtype=torch.long)
        self._adapters_before: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.adapter_steps == "by_episodes" and ctx.num_processes > 1:
            raise ConfigError("robotics.adapter_steps: by_episodes counts each process's own minibatch rows, which "
                              "would make N processes differ from one; launch one process or use adapter_steps: equal")
        self.venv = make_vector_env(cfg.env)
        self._text_ids = {t: self.policy.text.token_ids([self._instruction(t)])[0] for t in cfg.env.tasks}
        # keep_best_adapters: per task the best validation success so far, the iteration that scored it, and that
        # adapter (row t of best_down / best_up is task t's, as in TaskAdapters)
        self._best_score = {t: -1.0 for t in cfg.env.tasks}
        self._best_iteration = {t: -1 for t in cfg.env.tasks}
        self._best_adapters: dict[str, torch.Tensor] = {}
        self._selected = False  # the best adapters are in place: the held-out evaluation that follows measures them
        if cfg.keep_best_adapters:
            if ctx.num_processes > 1:
                raise ConfigError("robotics.keep_best_adapters runs in one process (the evaluation that scores the "
                                  "adapters runs on the main process only); launch one process")
            self._best_adapters = {"down": self.policy.adapters.down.detach().clone(),
                                   "up": self.policy.adapters.up.detach().clone()}

    def before_optimizer_step(self) -> None:
        if self.cfg.adapter_steps == "by_episodes":
            a = self.policy.adapters
            self._adapters_before = (a.down.detach().clone(), a.up.detach().clone())

    def after_optimizer_step(self) -> None:
        """adapter_steps by_episodes: task t's adapter moves s_t = n_t / max_u n_u of AdamW's step, n_t its
        episodes in the minibatch (a task without episodes there does not move, not even by momentum)."""
        if self.cfg.adapter_steps != "by_episodes":
            return
        n = self._step_episodes.double()
        scale = (n / n.max().clamp(min=1)).view(-1, 1, 1)
        a = self.policy.adapters
        with torch.no_grad():
            for w, before in zip((a.down, a.up), self._adapters_before):
                w.copy_(before + scale.to(w) * (w - before))
        self._step_episodes.zero_()
        self._adapters_before = None

    @staticmethod
    def _instruction(task: str) -> str:
        from .envs.metaworld_env import instruction_for

        return instruction_for(task)

    def _task_of(self, key: int) -> str:
        from .envs.metaworld_env import decode_key

        return self.cfg.env.tasks[decode_key(key)[0]]

    # ------------------------------------------------------------------------------------------------------
    def train_keys(self) -> list[int]:
        return list(self._train_keys)

    def key_stratum(self, key: int) -> str:
        """The task of a reset-state key (``selection.balance: true`` draws every task equally often)."""
        return self._task_of(key)

    def eval_keys(self) -> list[int]:
        return eval_keys(self.cfg.env, self.cfg.eval_states_per_task, self.cfg.eval_split)[0]

    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        env_keys = [k for k in keys for _ in range(group_size)]
        tasks = [self._task_of(k) for k in env_keys]
        self.policy.eval()
        batch = run_episodes(self.policy, self.venv, env_keys, tasks, self.sampling, self.cfg.env.horizon, generator,
                             device=self.device)
        n, c, s = len(env_keys), self.n_chunks, self.steps_per_chunk
        mask = torch.from_numpy(batch.stochastic & batch.chunk_valid[..., None]).reshape(n, c * s)
        logp_old = torch.from_numpy(batch.logp).reshape(n, c * s) * mask
        succ = batch.success_once if self.cfg.env.success_mode == "once" else batch.success_end
        rewards = {"success": torch.from_numpy(succ.astype(np.float32))}
        if self.cfg.dense_reward:
            rewards["dense"] = torch.from_numpy(batch.dense)
        payload = {
            "images": torch.from_numpy(batch.images),
            "proprio": torch.from_numpy(batch.proprio),
            "chain": torch.from_numpy(batch.chain),
            "task_index": torch.tensor([self.cfg.env.tasks.index(t) for t in tasks]),
        }
        if self.cfg.replay_source == "successes":
            self._keep_successes(batch, succ, payload, iteration)
        if self.critic is not None:
            valid = torch.from_numpy(batch.chunk_valid)
            payload["value_mask"] = valid
            payload["values"] = self._rollout_values(payload["images"], payload["proprio"], payload["task_index"], valid)
        return Rollout(
            keys=list(keys), group_ids=torch.arange(len(keys)).repeat_interleave(group_size), rewards=rewards,
            logp_old=logp_old.float(), mask=mask, payload=payload, nfe=batch.nfe,
            info={"env/steps": int(batch.length.sum()), "env/episodes": n},
        )

    # ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _rollout_values(self, images, proprio, task_index, valid, batch: int = 512) -> torch.Tensor:
        """``[N, C]`` the critic's values of every executed chunk's observation (0 elsewhere), without grad."""
        ep, ch = torch.nonzero(valid, as_tuple=True)
        out = torch.zeros(valid.shape)
        for i in range(0, len(ep), batch):
            e, c = ep[i: i + batch], ch[i: i + batch]
            ids = [self._text_ids[self.cfg.env.tasks[j]] for j in task_index[e].tolist()]
            h = self._features(self.policy, images[e, c], proprio[e, c], ids)
            out[e, c] = self.critic(h, c.float().to(self.device) / self.n_chunks).float().cpu()
        return out

    def _features(self, policy: TinyVLA, images: torch.Tensor, proprio: torch.Tensor, text_ids) -> torch.Tensor:
        return policy.encode(images.to(self.device), proprio.to(self.device), text_ids)

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool) -> StepLogProbs:
        """Recompute the masked steps of episodes ``idx``: one encoder pass per needed chunk, one head pass per step."""
        p = rollout.index_payload(idx)
        n, c, s = len(idx), self.n_chunks, self.steps_per_chunk
        mask = rollout.mask[idx].reshape(n, c, s)
        if self.cfg.adapter_steps == "by_episodes" and torch.is_grad_enabled():  # a training forward of this step
            if self.policy.adapters.up.grad is None:  # the step's first forward (the trainer zeroes grads to None):
                self._step_episodes.zero_()  # a step skipped for non-finite gradients leaves no counts behind
            self._step_episodes += torch.bincount(p["task_index"].cpu(), minlength=len(self.cfg.env.tasks))
        chunks = mask.any(-1)  # chunks with a trained step (and, with a critic, every executed chunk)
        if self.critic is not None:
            chunks = chunks | p["value_mask"].bool()
        ep, ch = torch.nonzero(chunks, as_tuple=True)
        tasks = [self.cfg.env.tasks[i] for i in p["task_index"][ep].tolist()]
        text_ids = [self._text_ids[t] for t in tasks]
        self.policy.train()
        h = self._features(self.policy, p["images"][ep, ch], p["proprio"][ep, ch], text_ids)
        chunk_of = torch.full((n, c), -1, dtype=torch.long)
        chunk_of[ep, ch] = torch.arange(len(ep))
        pe, pc, ps = torch.nonzero(mask, as_tuple=True)  # trained (episode, chunk, step) triples
        rows = chunk_of[pe, pc].to(self.device)
        flat = (pe * c * s + pc * s + ps).to(self.device)
        logp, ent, kl, ref_logp = self._step_terms(self.policy, h[rows], p, pe, pc, ps, need_kl, text_ids, ep, ch, rows)
        out = torch.zeros(n * c * s, device=self.device)
        logp_full = out.index_put((flat,), logp).view(n, c * s)
        ent_full = out.detach().index_put((flat,), ent.detach()).view(n, c * s)
        kl_full = out.index_put((flat,), kl).view(n, c * s) if kl is not None else None
        ref_full = out.detach().index_put((flat,), ref_logp).view(n, c * s) if ref_logp is not None else None
        values = None
        if self.critic is not None:
            v = self.critic(h.detach() if self.cfg.critic_detach else h, ch.float().to(self.device) / c)
            values = torch.zeros(n * c, device=self.device).index_put(((ep * c + ch).to(self.device),), v).view(n, c)
        return StepLogProbs(logp=logp_full, kl=kl_full, ref_logp=ref_full, entropy=ent_full, nfe=int(len(pe)),
                            values=values)

    def _step_terms(self, policy, h, p, pe, pc, ps, need_kl, text_ids, ep, ch, rows):
        m = policy.cfg
        reduce = self.cfg.logp_reduce
        kl = ref_logp = None
        if m.head == "flow":
            chain = p["chain"].to(self.device)
            x, x_next = chain[pe, pc, ps], chain[pe, pc, ps + 1]
            step = ps.to(self.device)
            logp, ent, mean, std = policy.flow.step_log_prob(h, x, x_next, step, self.cfg.head_mode, self.cfg.noise_level, reduce)
            if need_kl:
                with torch.no_grad():
                    ref = self._reference()
                    h_ref = self._features(ref, p["images"][ep, ch], p["proprio"][ep, ch], text_ids)[rows]
                    ref_lp, _, ref_mean, _ = ref.flow.step_log_prob(h_ref, x, x_next, step, self.cfg.head_mode,
                                                                    self.cfg.noise_level, reduce)
                if self.cfg.head_mode in ("flow_sde", "sde_one_step"):  # Flow-GRPO's KL of equal-std step Gaussians
                    kl = sde_mean_kl(mean, ref_mean, std.detach(), reduction=reduce)
                else:
                    ref_logp = ref_lp
            return logp, ent, kl, ref_logp
        bins = p["chain"][pe, pc, 0].to(self.device)  # [P, D]
        logq = torch.log_softmax(policy.bin_logits(h) / self.cfg.temperature, -1)
        lp = logq.gather(-1, bins[..., None]).squeeze(-1)
        logp = lp.sum(-1) if reduce == "sum" else lp.mean(-1)
        e = -(logq.exp() * logq).sum(-1)
        ent = e.sum(-1) if reduce == "sum" else e.mean(-1)
        if need_kl:
            with torch.no_grad():
                ref = self._reference()
                h_ref = self._features(ref, p["images"][ep, ch], p["proprio"][ep, ch], text_ids)[rows]
                rq = torch.log_softmax(ref.bin_logits(h_ref) / self.cfg.temperature, -1).gather(-1, bins[..., None]).squeeze(-1)
                ref_logp = rq.sum(-1) if reduce == "sum" else rq.mean(-1)
        return logp, ent, kl, ref_logp

    def _reference(self) -> TinyVLA:
        return self._ref

    def _keep_successes(self, batch, succ: np.ndarray, payload: dict, iteration: int) -> None:
        """replay_source successes: keep every executed chunk of this iteration's successful episodes (observation,
        instruction, and the chunk of actions the env executed: the chain's clamped end, or the sampled bins'
        centres), per task. Rollout calls within one iteration add to its set; sets older than success_window
        iterations are dropped."""
        first_kept = iteration - self.cfg.success_window + 1
        self._successes = {it: v for it, v in self._successes.items() if first_kept <= it <= iteration}
        current = self._successes.setdefault(iteration, {})
        ep, ch = np.nonzero(batch.chunk_valid & succ[:, None])
        if ep.size == 0:
            return
        m = self.policy.cfg
        if m.head == "flow":
            acts = payload["chain"][ep, ch, -1].clamp(-1, 1)
        else:
            acts = self.policy.bin_centers(torch.device("cpu"))[payload["chain"][ep, ch, 0]]
        acts = acts.reshape(len(ep), m.chunk, m.action_dim)
        task_index = payload["task_index"][ep]
        for t in task_index.unique().tolist():
            rows = torch.nonzero(task_index == t).flatten()
            e, c = torch.from_numpy(ep)[rows], torch.from_numpy(ch)[rows]
            new = {"images": payload["images"][e, c], "proprio": payload["proprio"][e, c], "actions": acts[rows]}
            old = current.get(t)
            current[t] = new if old is None else {k: torch.cat([old[k], v]) for k, v in new.items()}

    def _success_batch(self, rng: np.random.Generator):
        """``replay_batch`` chunks of the kept successes: each row's task uniform over the tasks with kept successes
        (a solved task cannot crowd out a rare one), then a chunk uniform over that task's kept chunks."""
        tasks = self._kept_tasks()
        pick = rng.integers(0, len(tasks), size=self.cfg.replay_batch)
        imgs, pro, tids, acts = [], [], [], []
        for j, t in enumerate(tasks):
            n_rows = int((pick == j).sum())
            if n_rows == 0:
                continue
            kept = self._kept_chunks(t)
            idx = torch.from_numpy(rng.integers(0, len(kept["actions"]), size=n_rows))
            imgs.append(kept["images"][idx])
            pro.append(kept["proprio"][idx])
            acts.append(kept["actions"][idx])
            tids += [self._text_ids[self.cfg.env.tasks[t]]] * n_rows
        return torch.cat(imgs), torch.cat(pro), tids, torch.cat(acts)  # images uint8 [B, H, W, C], as rollouts

    def _kept_tasks(self) -> list[int]:
        return sorted({t for per_task in self._successes.values() for t in per_task})

    def _kept_chunks(self, task: int) -> dict[str, torch.Tensor]:
        """Task ``task``'s kept successful chunks, oldest iteration first."""
        sets = [self._successes[it][task] for it in sorted(self._successes) if task in self._successes[it]]
        return {k: torch.cat([s[k] for s in sets]) for k in ("images", "proprio", "actions")}

    def replay_loss(self, iteration: int, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """The BC loss (``TinyVLA.bc_loss``: flow matching, or cross-entropy over bins) on ``replay_batch`` chunks
        drawn from (seed, iteration, step), the term of ``loss.replay_coef``. ``replay_source: demos``: demonstration
        chunks, an anchor to the pretraining data (DAPG, Rajeswaran et al. 2018, and the SFT term of VLA RL
        recipes); this rank's rows ``rank::world`` of the global batch, weighted by their share.
        ``replay_source: successes``: the kept successful chunks (this iteration's and those of the
        ``success_window`` − 1 before), equally per task — self-imitation
        (SIL, Oh et al. 2018; filtered BC on the policy's successes as iRe-VLA / ReST), which turns every success of a
        rarely solved task into supervised data for its adapter; 0 (no gradient) when nothing succeeded."""
        seed = [self.ctx.seed, iteration, step]
        if self.cfg.replay_source == "successes":
            if not self._kept_tasks():
                return torch.zeros((), requires_grad=True)
            imgs, pro, tids, chunks = self._success_batch(np.random.default_rng(seed))
            gen = torch.Generator().manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))
            self.policy.train()
            h = self._features(self.policy, imgs, pro, tids)
            return self.policy.bc_loss(h, chunks.to(self.device), gen)
        if self._replay is None:
            raise ConfigError("loss.replay_coef > 0 needs robotics.replay_data (a demos .npz)")
        idx = np.random.default_rng(seed).integers(0, len(self._replay), size=self.cfg.replay_batch)[rank::world]
        if idx.size == 0:
            return torch.zeros((), device=self.device)
        imgs, pro, tids, chunks = self._replay.batch(idx, 0, None)
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence(seed + [rank]).generate_state(1)[0]))
        self.policy.train()
        h = self._features(self.policy, imgs, pro, tids)
        return self.policy.bc_loss(h, chunks.to(self.device), gen) * (idx.size / self.cfg.replay_batch)

    # ------------------------------------------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        critic = list(self.critic.parameters()) if self.critic is not None else []
        return [q for q in self.policy.parameters() if q.requires_grad] + critic

    def critic_parameters(self) -> list[torch.nn.Parameter]:
        """The value head's parameters (the trainer steps them at ``optim.critic_lr`` when set)."""
        return list(self.critic.parameters()) if self.critic is not None else []

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        if self.critic is not None:
            out.update({f"critic.{k}": v.detach().clone() for k, v in self.critic.state_dict().items()})
        out.update({f"best_adapters.{k}": v.clone() for k, v in self._best_adapters.items()})
        if self.cfg.success_window > 1:  # the kept successes of earlier iterations (exact resume of self-imitation)
            for it, per_task in self._successes.items():
                for t, kept in per_task.items():
                    out.update({f"successes.{it}.{t}.{k}": v.clone() for k, v in kept.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        critic = {k[len("critic."):]: v for k, v in state.items() if k.startswith("critic.")}
        best = {k[len("best_adapters."):]: v for k, v in state.items() if k.startswith("best_adapters.")}
        self.policy.load_state_dict({k: v for k, v in state.items()
                                     if not k.startswith(("critic.", "best_adapters.", "successes."))})
        self._successes = {}
        for k, v in state.items():
            if k.startswith("successes."):
                _, it, t, name = k.split(".")
                self._successes.setdefault(int(it), {}).setdefault(int(t), {})[name] = v
        if self.critic is not None:
            self.critic.load_state_dict(critic)
        if self._best_adapters and best:
            for k, v in best.items():
                self._best_adapters[k].copy_(v)

    def extra_state(self) -> dict:
        if not self.cfg.keep_best_adapters:
            return {}
        return {"best_score": dict(self._best_score), "best_iteration": dict(self._best_iteration)}

    def load_extra_state(self, state: dict) -> None:
        self._best_score.update(state.get("best_score", {}))
        self._best_iteration.update(state.get("best_iteration", {}))

    def _score_adapters(self, iteration: int) -> dict[str, float]:
        """keep_best_adapters: ODE success of every task on its validation states; a task's adapter that scores at
        least its best so far (ties: the later, longer-trained one) becomes its kept adapter."""
        cfg = self.cfg
        val = evaluate_policy(self.policy, cfg.env, cfg.val_states_per_task, self.venv, None, split="train",
                              first_index=VAL_FIRST_INDEX, init_noise=cfg.eval_init_noise)
        adapters = self.policy.adapters
        out = {"select/val": val["eval/success"],
               "select/env_steps": val["eval/episode_length"] * len(cfg.env.tasks) * cfg.val_states_per_task}
        for t, task in enumerate(cfg.env.tasks):
            score = val[f"eval/success/{task}"]
            if score >= self._best_score[task]:
                self._best_score[task], self._best_iteration[task] = score, iteration
                self._best_adapters["down"][t].copy_(adapters.down[t].detach())
                self._best_adapters["up"][t].copy_(adapters.up[t].detach())
            out[f"select/val/{task}"] = score
            out[f"select/best_iteration/{task}"] = float(self._best_iteration[task])
        return out

    def before_final_evaluation(self, iteration: int) -> dict[str, float]:
        """keep_best_adapters: score the final adapters too, then put every task's best one in place, so the final
        held-out evaluation, checkpoint and export are the selected policy (``select/best_iteration/<task>`` says
        where each came from)."""
        if not self.cfg.keep_best_adapters:
            return {}
        out = self._score_adapters(iteration)
        if self.cfg.report_last:
            last = evaluate_policy(self.policy, self.cfg.env, self.cfg.eval_states_per_task, self.venv, None,
                                   init_noise=self.cfg.eval_init_noise, split=self.cfg.eval_split)
            out.update({k.replace("eval/", "eval_last/", 1): v for k, v in last.items() if k.startswith("eval/success")})
        with torch.no_grad():
            self.policy.adapters.down.copy_(self._best_adapters["down"])
            self.policy.adapters.up.copy_(self._best_adapters["up"])
        self._selected = True
        out["select/val_best"] = float(np.mean(list(self._best_score.values())))
        return out

    def evaluate(self, iteration: int) -> dict[str, float]:
        out = self._score_adapters(iteration) if self.cfg.keep_best_adapters and not self._selected else {}
        gif_dir = self.ctx.run_dir / "gifs" if (self.cfg.gifs and self.ctx.run_dir is not None) else None
        out.update(evaluate_policy(self.policy, self.cfg.env, self.cfg.eval_states_per_task, self.venv, gif_dir,
                                   tag=f"it{iteration:04d}-", init_noise=self.cfg.eval_init_noise,
                                   split=self.cfg.eval_split))
        return out

    def save_pretrained(self, out_dir: Path) -> None:
        self.policy.save_pretrained(out_dir)

    def close(self) -> None:
        self.venv.close()
