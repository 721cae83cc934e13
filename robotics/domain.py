"""The robotics domain: GRPO-family post-training of the tiny VLA in Meta-World (or the synthetic point env).

Contract mapping (``shared_rl/domain.py``):

- keys = training reset-state ids (``envs.metaworld_env.make_key(task, "train", i)``); evaluation uses the
  disjoint ``"eval"`` split, so held-out success is never measured on a training reset state.
- ``rollout(keys, G)``: G episodes from the SAME reset state per key (a GRPO group; RIPT-VLA/SimpleVLA-RL),
  all B = len(keys)·G envs stepped in lock-step with one batched policy forward per chunk.
- sequences = episodes; steps = (chunk c, denoising step s) pairs flattened to t = c·S + s (S = denoising
  steps; S = 1 for the discrete head). ``logp_old[n, t]`` is the behaviour log-prob of that step and ``mask``
  marks stochastic steps of executed chunks (flow_sde: all but the last denoising step; flow_noise: all;
  sde_one_step: the one random step per chunk; fpo: slot 0 of every executed chunk, which carries the chunk's
  flow-matching likelihood surrogate, its ``logp_old`` deferred to the first forward (``fpo.py``); discrete: every
  chunk).
- rewards: ``success`` (0/1; "success once" or "success at end" per ``env.success_mode``) and, with
  ``dense_reward``, ``dense``: the best Meta-World shaped reward of the episode / 10, in [0, 1] (weight it via
  ``advantage.weights``). The *best*, not the mean: with "success once" a fast success has a short episode of
  mostly approach steps, so a mean over steps would rank it below a failure that hovers near the goal.
- ``evaluate``: deterministic (ODE / arg-max) episodes on held-out reset states -> ``eval/success`` and
  ``eval/success/<task>``; GIFs of one episode per task in ``run_dir/gifs``.
- KL (``loss.kl_coef > 0``): flow_sde / sde_one_step return the Flow-GRPO mean KL ‖μ_θ − μ_ref‖²/(2σ²) per step;
  flow_noise, fpo and discrete return reference log-probs (the trainer applies k1/k3). The reference is a frozen copy
  of the starting policy (1.3M parameters: a copy is cheaper than toggling adapters).

Features beyond that are parts (``robotics.parts.Part``), each with its own config section and module: the value
head (``critic.py``), the replay of demonstrations or successes (``replay.py``), the task adapters' step scaling and
keep-best selection (``adapters.py``), and the rollout strategy that says where episodes come from (``rollouts.py``:
flat or tree groups in the simulator, or imagination in the learned world model). The domain builds the parts its
config asks for and forwards every hook to each of them.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch

from shared_rl.config import ConfigError
from shared_rl.domain import DomainBase, RunContext, StepLogProbs
from shared_rl.flow_kernels import sde_mean_kl
from shared_rl.rollout import Rollout
from shared_rl.rundir import atomic_write_text
from shared_rl.selection import UniformSampler

from .adapters import AdapterSteps, KeepBestAdapters, add_adapters
from .config import RoboticsConfig, check_policy_fits_env, missing_checkpoint_hint, resolve
from .critic import Critic, vector
from .envs.metaworld_env import decode_key, instruction_for
from .envs.vector import make_vector_env
from .episodes import SamplingSettings
from .evaluation import EvalOutcomes, eval_keys, eval_settings, evaluate_policy, paired_delta, policy_digest
from .held import episode_rewards, held_policy, score_episodes
from .parameter_count import ENCODER_MODULES, trains as trainable  # noqa: F401 — the one rule
from .parts import Part
from .policies.lerobot.load import load_lerobot_policy
from .policies.vla import TinyVLA, libero_vocab
from .fpo import log_likelihood as fpo_log_likelihood
from .fsdp import load_policy_on_rank0
from .replay import DemoReplay, SuccessReplay
from .rollouts import rollout_class

SHORT_HORIZON_PREFIX = "short_horizon."  # the short-horizon strategy's critic (world_model/short_horizon.py; loaded
# on demand, so its prefix is named here rather than imported)
WORLD_MODEL_PREFIX = "wm_rollout."  # the world-model strategies' learned state (world_model/rollout.py, likewise)

def load_policy(cfg: RoboticsConfig, seed: int, objects: dict | None = None) -> TinyVLA:
    """The checkpoint's VLA, or a fresh ``cfg.model`` sized for the env (seeded), checked against the env; with
    ``robotics.policy.type: lerobot`` the LeRobot policy at ``robotics.policy.path`` behind the same interface
    (``policies/lerobot/``; its features checked against the env there). A policy in ``objects`` (one the caller
    holds: ``robotics.api``, ``held.py``) is used instead of loading one, with the same checks."""
    held = held_policy(cfg, objects or {}, seed, cfg.env.action_dim)
    if held is not None and cfg.policy.type == "lerobot":
        return held
    if held is not None:
        policy = held
    elif cfg.policy.type == "lerobot":
        path = resolve(cfg.policy.path)
        return load_lerobot_policy(cfg.policy, cfg.env, str(path) if path.exists() else cfg.policy.path, seed,
                                   cfg.env.action_dim, noise_head=cfg.head_mode == "flow_noise")
    elif cfg.checkpoint:
        try:
            policy = TinyVLA.load_pretrained(resolve(cfg.checkpoint))
        except FileNotFoundError:
            raise ConfigError(f"robotics.checkpoint {cfg.checkpoint}: "
                              f"{missing_checkpoint_hint(resolve(cfg.checkpoint), cfg.env.kind)}") from None
    else:
        mc = copy.deepcopy(cfg.model)
        mc.image_channels, mc.proprio_dim, mc.image_size = cfg.env.image_channels, cfg.env.proprio_dim, cfg.env.image_size
        if cfg.env.kind == "libero":  # LIBERO's instructions are not in the Meta-World vocabulary
            mc.vocab = libero_vocab(mc.vocab)
        torch.manual_seed(seed)
        policy = TinyVLA(mc)
    check_policy_fits_env(policy.cfg, cfg)  # what the preflight checked from config.json, for a held policy too
    return policy


class RoboticsDomain(DomainBase):
    config_class = RoboticsConfig

    def __init__(self, cfg: RoboticsConfig, ctx: RunContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        torch.set_num_threads(max(1, cfg.threads))
        self.device = ctx.device
        self.episode_rewards = episode_rewards(cfg.rewards, ctx.objects)  # robotics.rewards (from robotics.api)
        self.policy = load_policy_on_rank0(cfg, ctx, load_policy)  # processes > 0 build on meta under fsdp2 (robotics/fsdp.py)
        if cfg.adapters.rank:  # seeded, and added before a resume loads the trained adapters
            add_adapters(self.policy, cfg.adapters, cfg.env.tasks, ctx.seed)
        if cfg.policy.type == "tiny_vla":  # a LeRobot policy keeps its own choice (its config's, or LoRA's)
            for name, p in self.policy.named_parameters():
                p.requires_grad_(trainable(name, cfg))
        # the KL reference is the starting policy; made here, before a resume loads trained weights
        self._ref = self.policy.kl_reference()
        m = self.policy.cfg
        self.sampling = SamplingSettings(mode=cfg.head_mode, noise_level=cfg.noise_level, temperature=cfg.temperature,
                                         logp_reduce=cfg.logp_reduce, init_noise=cfg.init_noise)
        self.steps_per_chunk = m.num_denoise_steps if m.head == "flow" else 1
        self.n_chunks = math.ceil(cfg.rollout.horizon(cfg.env) / m.chunk)
        self._text_ids = {t: self.policy.text.token_ids([instruction_for(t)])[0] for t in cfg.env.tasks}
        self.critic = None
        if cfg.critic.enabled:  # critic.input: expert (a LeRobot policy's action-expert tokens) or the features
            expert = cfg.critic.input == "expert"
            self.critic = Critic(cfg.critic, m.expert_hidden if expert else m.hidden, self.n_chunks, self.device,
                                 self._encode_tasks, self.policy.expert_value_features if expert else vector)
        self.replay = self._make_replay()  # demos are loaded before the env workers start: a bad file fails in a second
        if cfg.adapters.steps == "by_episodes" and ctx.train_cfg is not None and ctx.train_cfg.loss.policy_coef == 0:
            raise ConfigError("robotics.adapters.steps: by_episodes counts each step's policy-gradient episodes, and "
                              "loss.policy_coef: 0 has none, so no adapter would move; set robotics.adapters.steps: "
                              "equal")
        self.adapter_steps = (AdapterSteps(cfg.adapters, self.policy, len(cfg.env.tasks), ctx.num_processes)
                              if cfg.adapters.rank else None)
        self.venv = make_vector_env(cfg.env)
        self.keep_best = (KeepBestAdapters(cfg.adapters, self.policy, cfg.env.tasks, self._evaluate,
                                           (cfg.eval_states_per_task, cfg.eval_split), ctx.num_processes)
                          if cfg.adapters.keep_best else None)
        # where episodes come from: the simulator (flat or tree groups) or the world model (robotics.rollout.name)
        self.rollouts = rollout_class(cfg.rollout.name)(cfg, ctx, self.policy, self.venv, self.sampling)
        # the held-out evaluation before training: every later one is compared with it episode by episode
        self.start_digest = policy_digest(self.policy) if cfg.policy.type == "tiny_vla" else ""
        self.eval_baseline: EvalOutcomes | None = self._saved_baseline() if cfg.eval_baseline else None
        # every hook goes to each part in this order (the state dict's too)
        self.parts: list[Part] = [p for p in (self.critic, self.keep_best, self.replay, self.adapter_steps,
                                              self.rollouts) if p is not None]

    def _saved_baseline(self) -> EvalOutcomes:
        """``robotics.eval_baseline``: the file's episodes, when they are this run's evaluation of this start."""
        cfg = self.cfg
        path = resolve(cfg.eval_baseline)
        where = f"robotics.eval_baseline {cfg.eval_baseline}"
        try:
            base = EvalOutcomes.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such file (an evaluation's RUN/eval_episodes/itNNNN.json)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{where}: not an evaluation's episodes file ({type(e).__name__}: {e})") from None
        if not self.start_digest:
            raise ConfigError(f"{where}: a saved baseline pairs with the tiny VLA only; set eval.at_start: true")
        want = eval_settings(cfg.env, cfg.eval_states_per_task, cfg.eval_split, 0, cfg.eval_seed,
                             cfg.eval_noise_draws, cfg.eval_init_noise)
        diff = sorted(k for k in set(want) | set(base.settings) if want.get(k) != base.settings.get(k))
        if diff:
            k = diff[0]
            raise ConfigError(f"{where} holds other episodes: its {k} is {base.settings.get(k)!r}, this run's "
                              f"{want.get(k)!r}")
        if base.policy != self.start_digest:
            raise ConfigError(f"{where} evaluated other weights than this run starts from ({cfg.checkpoint}); "
                              f"evaluate this start (eval.at_start: true) or name its own file")
        return base

    def _make_replay(self) -> DemoReplay | SuccessReplay | None:
        cfg, ctx = self.cfg, self.ctx
        if cfg.replay.source == "successes":
            return SuccessReplay(cfg.replay, self.policy, ctx.seed, self._encode,
                                 [self._text_ids[t] for t in cfg.env.tasks], cfg.env.success_mode, ctx.num_processes)
        if cfg.replay.data:
            return DemoReplay(cfg.replay, resolve(cfg.replay.data), cfg.trained_tasks, self.policy, ctx.seed,
                              self.device, self._encode)
        return None

    def _encode(self, images: torch.Tensor, proprio: torch.Tensor, text_ids, policy: TinyVLA | None = None) -> torch.Tensor:
        """The fused features of observations (``policy``: the trained one by default)."""
        return (policy or self.policy).encode(images.to(self.device), proprio.to(self.device), text_ids)

    def _encode_tasks(self, images: torch.Tensor, proprio: torch.Tensor, task_index: torch.Tensor) -> torch.Tensor:
        return self._encode(images, proprio, [self._text_ids[self.cfg.env.tasks[j]] for j in task_index.tolist()])

    def _task_of(self, key: int) -> str:
        return self.cfg.env.tasks[decode_key(key)[0]]

    # ------------------------------------------------------------------------------------------------------
    def train_keys(self) -> list[int]:
        return self.rollouts.train_keys()

    def key_sampler(self, sampler: UniformSampler) -> UniformSampler:
        """The configured sampler, drawing per task when ``robotics.balance.enabled`` (``balance.py``)."""
        return self.cfg.balance.wrap(sampler, self._task_of)

    def eval_keys(self) -> list[int]:
        return eval_keys(self.cfg.env, self.cfg.eval_states_per_task, self.cfg.eval_split)[0]

    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        ro, episodes = self.rollouts.rollout(list(keys), group_size, generator, iteration)
        if self.episode_rewards:  # robotics.rewards: the caller's functions of the episodes (flat rollouts only)
            ro.rewards.update(score_episodes(self.episode_rewards, episodes))
        if episodes is not None:  # flat groups in the simulator: the parts that learn from episodes see them
            for part in self.parts:
                part.on_rollout(episodes, ro.payload, iteration)
        return ro

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool) -> StepLogProbs:
        """Recompute the masked steps of episodes ``idx``: one encoder pass per needed chunk, one head pass per step."""
        p = rollout.index_payload(idx)
        n, c, s = len(idx), self.n_chunks, self.steps_per_chunk
        mask = rollout.mask[idx].reshape(n, c, s)
        if torch.is_grad_enabled():  # a training forward of this optimizer step
            for part in self.parts:
                part.on_training_forward(p)
        chunks = mask.any(-1)  # chunks with a trained step (and, with a critic, every executed chunk)
        if self.critic is not None:
            chunks = chunks | p["value_mask"].bool()
        ep, ch = torch.nonzero(chunks, as_tuple=True)
        text_ids = [self._text_ids[self.cfg.env.tasks[i]] for i in p["task_index"][ep].tolist()]
        self.policy.train()
        h = self._encode(p["images"][ep, ch], p["proprio"][ep, ch], text_ids)
        chunk_of = torch.full((n, c), -1, dtype=torch.long)
        chunk_of[ep, ch] = torch.arange(len(ep))
        pe, pc, ps = torch.nonzero(mask, as_tuple=True)  # trained (episode, chunk, step) triples
        rows = chunk_of[pe, pc].to(self.device)
        flat = (pe * c * s + pc * s + ps).to(self.device)
        logp, ent, kl, ref_logp = self._step_terms(h[rows], p, pe, pc, ps, need_kl, text_ids, ep, ch, rows)
        out = torch.zeros(n * c * s, device=self.device)
        logp_full = out.index_put((flat,), logp).view(n, c * s)
        ent_full = out.detach().index_put((flat,), ent.detach()).view(n, c * s)
        kl_full = out.index_put((flat,), kl).view(n, c * s) if kl is not None else None
        ref_full = out.detach().index_put((flat,), ref_logp).view(n, c * s) if ref_logp is not None else None
        values = self.critic.values(h, ep, ch, n) if self.critic is not None else None
        return StepLogProbs(logp=logp_full, kl=kl_full, ref_logp=ref_full, entropy=ent_full, nfe=int(len(pe)),
                            values=values)

    def _step_terms(self, h, p, pe, pc, ps, need_kl, text_ids, ep, ch, rows):
        """Log-prob, entropy and KL terms of the trained steps (features ``h``, one row per step)."""
        policy, reduce = self.policy, self.cfg.logp_reduce
        kl = ref_logp = None

        def ref_features():  # the reference policy's features of the same rows (no grad)
            return self._encode(p["images"][ep, ch], p["proprio"][ep, ch], text_ids, policy=self._ref)[rows]

        if self.cfg.head_mode == "fpo":  # FPO: log p-hat = -(flow-matching loss of the executed chunk) on its pairs
            actions = p["chain"][pe, pc, -1].to(self.device)
            eps, tau = p["fpo_eps"][pe, pc].to(self.device), p["fpo_tau"][pe, pc].to(self.device)
            how = (self.cfg.fpo.target, self.cfg.fpo.reduce)
            logp = fpo_log_likelihood(policy.flow.velocity_at, h, actions, eps, tau, *how)
            if need_kl:  # the reference's surrogate on the same pairs (the k1 / k3 estimators read it)
                with torch.no_grad():
                    ref_logp = fpo_log_likelihood(self._ref.flow.velocity_at, ref_features(), actions, eps, tau, *how)
            return logp, torch.zeros_like(logp).detach(), kl, ref_logp
        if policy.cfg.head == "flow":
            chain = p["chain"].to(self.device)
            x, x_next = chain[pe, pc, ps], chain[pe, pc, ps + 1]
            step = ps.to(self.device)
            logp, ent, mean, std = policy.flow.step_log_prob(h, x, x_next, step, self.cfg.head_mode, self.cfg.noise_level, reduce)
            if need_kl:
                with torch.no_grad():
                    ref_lp, _, ref_mean, _ = self._ref.flow.step_log_prob(ref_features(), x, x_next, step,
                                                                          self.cfg.head_mode, self.cfg.noise_level, reduce)
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
                ref_logq = torch.log_softmax(self._ref.bin_logits(ref_features()) / self.cfg.temperature, -1)
                rq = ref_logq.gather(-1, bins[..., None]).squeeze(-1)
                ref_logp = rq.sum(-1) if reduce == "sum" else rq.mean(-1)
        return logp, ent, kl, ref_logp

    def auxiliary_loss_names(self) -> list[str]:
        return ["replay"] if self.replay is not None and self.cfg.replay.coef > 0 else []

    def auxiliary_losses(self, iteration: int, step: int, rank: int, world: int) -> dict[str, tuple[float, torch.Tensor]]:
        """``replay``: the BC loss of ``robotics.replay`` (demonstrations or the run's successes) on a batch drawn from
        (seed, iteration, step), weighted ``robotics.replay.coef`` (``replay.py``)."""
        if self.replay is None or self.cfg.replay.coef <= 0:
            return {}
        return {"replay": (self.cfg.replay.coef, self.replay.loss(iteration, step, rank, world))}

    # ------------------------------------------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        return [q for q in self.policy.parameters() if q.requires_grad] + [q for part in self.parts for q in part.parameters()]

    def critic_parameters(self) -> list[torch.nn.Parameter]:
        """The value head's parameters (stepped at the gae estimator's own ``lr`` when set)."""
        return self.critic.parameters() if self.critic is not None else []

    def before_optimizer_step(self) -> None:
        for part in self.parts:
            part.before_optimizer_step()

    def after_optimizer_step(self) -> None:
        for part in self.parts:
            part.after_optimizer_step()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        for part in self.parts:
            out.update(part.state_dict())
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        # every part's prefix, built or not: a checkpoint of a run with a part this config leaves out still loads
        parts = (Critic.state_prefix, KeepBestAdapters.state_prefix, SuccessReplay.state_prefix,
                 SHORT_HORIZON_PREFIX, WORLD_MODEL_PREFIX)
        self.policy.load_state_dict({k: v for k, v in state.items() if not k.startswith(parts)})
        for part in self.parts:
            part.load_state_dict(state)

    def extra_state(self) -> dict:
        out = {k: v for part in self.parts for k, v in part.extra_state().items()}
        out["eval_baseline"] = None if self.eval_baseline is None else self.eval_baseline.to_json()
        return out

    def load_extra_state(self, state: dict) -> None:
        for part in self.parts:
            part.load_extra_state(state)
        base = state.get("eval_baseline")
        self.eval_baseline = None if base is None else EvalOutcomes.from_json(base)

    def before_final_evaluation(self, iteration: int) -> dict[str, float]:
        return {k: v for part in self.parts for k, v in part.before_final_evaluation(iteration).items()}

    def evaluate(self, iteration: int) -> dict[str, float]:
        """The held-out evaluation: ``eval/success`` (+ per task, standard errors, the draws' spread); the first one
        of a run (iteration 0, ``eval.at_start``) is the baseline every later one is paired with
        (``eval/success_delta`` ± ``eval/success_delta_se``, ``evaluation.paired_delta``). Each evaluation's episodes
        are written to ``RUN/eval_episodes/itNNNN.json`` (``EvalOutcomes``: pair runs with each other later)."""
        cfg = self.cfg
        out = {k: v for part in self.parts for k, v in part.evaluate(iteration).items()}
        gif_dir = self.ctx.run_dir / "gifs" if (cfg.gifs and self.ctx.run_dir is not None) else None
        sink: list[EvalOutcomes] = []
        out.update(evaluate_policy(self.policy, cfg.env, cfg.eval_states_per_task, self.venv, gif_dir,
                                   f"it{iteration:04d}-", seed=cfg.eval_seed, init_noise=cfg.eval_init_noise,
                                   split=cfg.eval_split, standard_errors=cfg.eval_standard_error, log=self.ctx.log,
                                   noise_draws=cfg.eval_noise_draws, outcomes=sink))
        if not sink:  # an evaluation that kept no episodes (a stand-in in the tests): nothing to pair
            return out
        outcomes = sink[0]
        if self.start_digest:  # which weights these episodes are of (a later run may pair with this file)
            from shared_rl.distributed import shards_gathered

            from .fsdp import gathered_digest

            outcomes.policy = gathered_digest(self.policy) if shards_gathered() else policy_digest(self.policy)
        if iteration == 0 and self.eval_baseline is None:
            self.eval_baseline = outcomes
        elif self.eval_baseline is not None:
            out.update(paired_delta(self.eval_baseline, outcomes))
        if self.ctx.run_dir is not None:
            folder = self.ctx.run_dir / "eval_episodes"
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(folder / f"it{iteration:04d}.json", json.dumps(outcomes.to_json()) + "\n")
        return out

    def _evaluate(self, per_task: int, split: str, first_index: int = 0, gif_dir: Path | None = None,
                  tag: str = "") -> dict[str, float]:
        """ODE (arg-max) success of the live policy on ``per_task`` states per task of ``split`` from ``first_index``
        (one start-noise draw, ``robotics.eval_seed``): the validation of ``robotics.adapters.keep_best``."""
        return evaluate_policy(self.policy, self.cfg.env, per_task, self.venv, gif_dir, tag=tag, seed=self.cfg.eval_seed,
                               init_noise=self.cfg.eval_init_noise, split=split, first_index=first_index,
                               standard_errors=self.cfg.eval_standard_error, log=self.ctx.log)

    def save_pretrained(self, out_dir: Path) -> None:
        from .fsdp import is_sharded, save_sharded

        if is_sharded(self.policy):  # FSDP2: called on every process, which gather; process 0 writes
            save_sharded(self.policy, out_dir)
            if self.ctx.process_index != 0:
                return
        else:
            self.policy.save_pretrained(out_dir)
        for part in self.parts:
            part.save_pretrained(out_dir)

    def fsdp_modules(self) -> list[torch.nn.Module]:
        """FSDP2 units of the tiny VLA and its KL reference (``robotics/fsdp.py``); refused settings raise there."""
        from .fsdp import fsdp_units

        return fsdp_units(self)

    def fsdp_sampling_modules(self) -> list[torch.nn.Module]:
        """The units rollouts and evaluation gather: the policy's, not its KL reference's (``robotics/fsdp.py``)."""
        from .fsdp import sampling_modules

        return sampling_modules(self)

    def close(self) -> None:
        self.venv.close()

