"""Imagined GRPO: the robotics domain's rollouts in the learned world model (``robotics.rollout.name: world_model``).

The trainer, the VLA, the group layout and the log-prob recompute are the simulator's (``robotics.domain``, with
branching groups from ``robotics.branching`` when ``rollout.branch`` is set); this rollout strategy changes only
where episodes come from:

- **Keyframe starts** (WoVR, "World models as Verifiable RL environments": keyframe-initialised rollouts): the
  training keys are real chunk boundaries along recorded real trajectories of *training* reset states; an
  imagined rollout starts from the real frame there and runs ``rollout.world_model.horizon`` env steps (short: the
  world-model error grows with depth).
- **Imagined rewards**: the success model (``reward.SuccessModel``) or VLA-RFT's reference-frame similarity
  (``reward: reference``) decides success at every imagined chunk; ``dense`` = the best success probability.
- **Uncertainty**: the ensemble disagreement truncates a rollout (``WorldModelEnv``); ``uncertain: truncate``
  keeps its steps up to there and rewards its last trusted success probability, ``drop`` removes it from its
  group (NaN reward, no trained step), ``ignore`` keeps it as if nothing happened. Rollouts that end early are
  length-normalised by the loss aggregation (``seq-mean-token-mean``: every episode weighs the same).
- **Co-evolution** (WMPO / World-Env style): every ``coevolve_every`` iterations a small batch of *real* rollouts
  of the current policy on training reset states is recorded, the world model and the success model are refit
  on all real data, and the new trajectories add keyframes.
- **Audit**: a sampled ``audit_fraction`` of imagined episodes is replayed in MuJoCo from the keyframe's restored
  state with the same actions (``audit.replay``) → ``audit/hallucinated_success_rate``,
  ``audit/reward_model_precision`` / ``recall``, ``audit/image_mse_step<k>``. Audit steps are counted apart from
  the real steps that feed learning (``wm/real_env_steps``), which is the budget the benchmark compares.
- **Evaluation** is always in the physics simulator, on the held-out reset states of the simulation recipes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from shared_rl.errors import ConfigError
from shared_rl.packing import pack, unpack

from ..branching import run_branching_episodes, tree_rollout
from ..envs.metaworld_env import EnvState, decode_key, make_key
from ..envs.point import PointState
from ..episodes import run_episodes
from ..rollouts import RolloutStrategy, flat_rollout
from .audit import audit, replay
from .data import ChunkEpisode, load_chunk_episodes
from .env import Keyframe, WorldModelEnv, sample_keyframes
from .model import WorldModel, WorldModelConfig
from .reward import ReferenceSimilarity, SuccessModel, SuccessModelConfig, calibrate_threshold, fit_success_model
from .train import calibrate_uncertainty, collect_policy_episodes, fit_world_model, resolve

# How the world-model strategies' metrics combine over the rollout calls of an iteration (``Rollout.info_reduce``):
# running totals are the newest call's, counts of a call are summed, every other metric (rates, scores, rank
# agreements) is the mean over calls weighted by their episodes
RUNNING_TOTALS = frozenset({"wm/model_steps", "wm/real_env_steps", "audit/env_steps_total", "probe/env_steps_total"})
CALL_COUNTS = frozenset({"env/steps", "env/episodes", "wm/imagined_steps", "coevolve/real_steps", "coevolve/new_keyframes",
                         "coevolve/refit_episodes", "coevolve/ranker_groups", "short/new_keyframes",
                         "short/critic_boundaries"})


def info_reduce(info: dict) -> dict[str, str]:
    return {k: "last" if k in RUNNING_TOTALS else "sum" if k in CALL_COUNTS else "mean" for k in info}


WM_STATE_PREFIX = "wm_rollout."  # the world-model strategies' packed learned state (robotics.domain names it too)
KEYFRAME_ID_BASE = 300_000  # keyframe keys: make_key(task, "train", 300000 + n), apart from reset states and demos


class WorldModelRollout(RolloutStrategy):
    """Imagined episodes from keyframes; the simulator (``venv``) serves co-evolution, audits and evaluation."""

    def __init__(self, cfg, ctx, policy, venv, sampling) -> None:
        super().__init__(cfg, ctx, policy, venv, sampling)
        w = cfg.rollout.world_model
        ck = resolve(w.checkpoint)
        try:
            self.wm = WorldModel.load(ck)
            self.success = SuccessModel.load(ck)
        except FileNotFoundError as e:
            recipe = "libero_wm.yaml" if cfg.env.kind == "libero" else "world_model.yaml"
            raise ConfigError(f"robotics.rollout.world_model.checkpoint: {e}; make it with "
                              f"`grove train configs/robotics/{recipe}`") from None
        meta = json.loads((ck / "meta.json").read_text()) if (ck / "meta.json").is_file() else {}
        data = w.data or meta.get("data", "")
        if not data:
            raise ConfigError("robotics.rollout.world_model.data: no real data named here nor in the checkpoint's "
                              "meta.json")
        if not resolve(data).is_file() and "config" in meta:  # a fresh checkout has the asset, not runs/: re-collect
            from shared_rl.config import from_dict

            from .data import save_chunk_episodes
            from .train import WorldModelTrainConfig, collect_real_data

            ctx.log(f"robotics world model: {data} missing; re-collecting the world model's real data as its "
                    f"meta.json says")
            eps, _ = collect_real_data(from_dict(WorldModelTrainConfig, meta["config"], "meta.json"), ctx.log)
            save_chunk_episodes(eps, resolve(data))
        self.real_data = load_chunk_episodes(resolve(data))
        self.real_steps_initial = int(meta.get("real_env_steps", sum(e.env_steps for e in self.real_data)))
        self.real_steps_coevolve = 0  # fresh real rollouts (and VLA-RFT reference demos)
        self.real_steps_replay = 0  # audit replays learned from (learn_from_audit)
        self.audit_steps = 0
        self.task_index = {t: i for i, t in enumerate(cfg.env.tasks)}
        self._wm_opt = None
        self._pending: list = []  # audit replays learned from since the last refit
        self._audit_rng = np.random.default_rng(ctx.seed + 17)
        self._coevolved_at = -1  # the iteration of the last co-evolution (one per iteration, refills included)
        self.keyframes = self._keyframes(self.real_data, first_id=KEYFRAME_ID_BASE)
        if not self.keyframes:
            raise ConfigError(f"robotics.rollout.world_model: no keyframe in {data} for tasks {cfg.trained_tasks} "
                              f"(policy rollouts with simulator states on the first {w.keyframe_states} training states)")
        reference = self._references() if w.reward == "reference" else None
        self.imagine = WorldModelEnv(self.wm, self.keyframes, w.horizon, success=self.success, reference=reference,
                                     success_mode=cfg.env.success_mode, uncertainty_threshold=w.uncertainty_threshold,
                                     pessimistic=w.pessimistic)
        self.last_audit: dict = {}
        # what the run started from (rebuilt identically by every construction): the checkpoint stores only the rest
        self._initial_episodes = len(self.real_data)
        self._initial_keyframes = set(self.keyframes)

    # -- keyframes
    def _keyframes(self, episodes, first_id: int):
        w = self.cfg.rollout.world_model
        tasks = set(self.cfg.trained_tasks)
        eps = [e for e in episodes if e.task in tasks and e.source in ("policy", "verified") and e.states is not None
               and decode_key(e.key)[1] == "train" and decode_key(e.key)[2] < w.keyframe_states]
        return sample_keyframes(eps, self.task_index, stride=w.keyframe_stride, max_chunk=w.keyframe_max_chunk,
                                min_chunk=w.keyframe_min_chunk,
                                first_id=first_id, rng=np.random.default_rng(self.ctx.seed),
                                limit=w.keyframe_limit or None)

    @torch.no_grad()
    def _references(self) -> ReferenceSimilarity:
        """VLA-RFT references: the scripted expert from each keyframe's restored state; its final frame's latent."""
        import warnings

        from ..collect import expert_for
        from ..envs.metaworld_env import MetaWorldTaskEnv, TaskRenderer

        refs, envs, rends = {}, {}, {}
        for key, kf in self.keyframes.items():
            if kf.task not in envs:
                envs[kf.task] = MetaWorldTaskEnv(kf.task)
                rends[kf.task] = TaskRenderer(envs[kf.task].model, self.cfg.env.render_settings())
            env, expert = envs[kf.task], expert_for(kf.task)
            env.set_state(kf.sim_state[0])
            for _ in range(self.cfg.env.horizon):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _, _, ok = env.step(np.clip(expert.get_action(env.last_obs), -1, 1))
                self.real_steps_coevolve += 1  # reference demos are real interaction: counted
                if ok:
                    break
            frame = rends[kf.task].render(env.data)
            refs[key] = self.wm.encode(torch.from_numpy(frame[None]))[0]
        for r in rends.values():
            r.close()
        w = self.cfg.rollout.world_model
        return ReferenceSimilarity(refs, w.reference_tau, w.reference_threshold)

    def train_keys(self) -> list[int]:
        """The keyframes (their keys decode to their task, as reset-state keys do)."""
        return list(self.keyframes)

    @property
    def real_env_steps(self) -> int:
        return self.real_steps_initial + self.real_steps_coevolve + self.real_steps_replay

    # -- co-evolution
    def coevolve(self, generator: torch.Generator, log=None) -> dict[str, float]:
        """Real rollouts of the current policy (``coevolve_episodes``, may be 0) + the real episodes learned from
        since the last round (audit replays, verified candidates) -> refit world model + success model -> new
        keyframes."""
        w = self.cfg.rollout.world_model
        tasks = self.cfg.trained_tasks
        n = w.coevolve_episodes
        eps: list = []
        if n:
            idx = torch.randint(0, w.keyframe_states, (n,), generator=generator).tolist()
            keys = [make_key(self.cfg.env.tasks.index(tasks[i % len(tasks)]), "train", j) for i, j in enumerate(idx)]
            eps = collect_policy_episodes(self.policy, self.venv, keys,
                                          [self.cfg.env.tasks[decode_key(k)[0]] for k in keys], self.cfg.head_mode,
                                          self.cfg.noise_level, self.cfg.env.horizon, generator,
                                          state_max_chunk=w.keyframe_max_chunk)  # later boundaries never keyframes
        steps = sum(e.env_steps for e in eps)
        self.real_steps_coevolve += steps
        self.real_data += eps
        recent = eps + self._pending
        self._pending = []
        if not recent:  # nothing new to learn from: no refit
            return {"coevolve/real_steps": 0.0, "coevolve/new_keyframes": 0.0}
        mix = self.real_data + recent * max(0, w.recent_weight - 1)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        if self._wm_opt is None:
            self._wm_opt = torch.optim.Adam(self.wm.parameters(), lr=w.refit_lr)
        fit_world_model(self.wm, mix, w.refit_steps, w.refit_batch, 3, w.refit_lr, seed, opt=self._wm_opt)
        self.wm.cfg.uncertainty_ref = calibrate_uncertainty(self.wm, eps or recent)  # the newest real transitions
        self.success = fit_success_model(self.wm, mix, w.refit_success_steps, seed=seed, model=self.success)
        if w.recalibrate:
            calibrate_threshold(self.wm, self.success, recent)  # the cut that is precise on the newest behaviour
        self.imagine.success = self.success
        new = self._keyframes(eps + [e for e in recent if e.source == "verified"],
                              first_id=max(int(k) % 500_000 for k in self.keyframes) + 1)
        self.keyframes.update(new)
        self.imagine.keyframes = self.keyframes
        for e in recent:  # their keyframes are taken: the simulator states of the whole trajectory are not needed
            if e.source == "verified":
                e.states = None
        out = {"coevolve/real_steps": float(steps), "coevolve/new_keyframes": float(len(new)),
               "coevolve/refit_episodes": float(len(recent))}
        if eps:
            out["coevolve/success"] = float(np.mean([e.succeeded for e in eps]))
        return out

    # -- rollouts
    def rollout(self, keys, group_size, generator, iteration):
        w = self.cfg.rollout.world_model
        info: dict[str, float] = {}
        if w.coevolve_every and iteration > 0 and iteration % w.coevolve_every == 0 and self._coevolved_at != iteration:
            self._coevolved_at = iteration
            info.update(self.coevolve(generator))
        self.policy.eval()
        if self.cfg.rollout.branch.enabled:
            tree = run_branching_episodes(self.policy, self.imagine, list(keys), [self.task_of(k) for k in keys],
                                          self.sampling, w.horizon, self.cfg.rollout.branch, generator, self.device)
            ro = tree_rollout(tree, list(keys), self.cfg.env.tasks, self.cfg.env.success_mode, self.cfg.dense_reward)
            leaves = np.nonzero(tree.leaf)[0]
            slots = tree.leaf_slot[leaves]
        else:
            env_keys = [k for k in keys for _ in range(group_size)]
            batch = run_episodes(self.policy, self.imagine, env_keys, [self.task_of(k) for k in env_keys], self.sampling,
                                 w.horizon, generator, device=self.device)
            ro = flat_rollout(batch, keys, group_size, self.cfg.env.tasks, self.cfg.env.success_mode, self.cfg.dense_reward)
            leaves = np.arange(len(env_keys))
            slots = leaves
        info.update(self._uncertain(ro, leaves, slots))
        info["wm/imagined_success"] = float(np.mean([self.imagine.slots[s].success_once for s in slots]))
        info["wm/model_steps"] = float(self.imagine.model_steps)
        info["wm/real_env_steps"] = float(self.real_env_steps)
        if w.audit_fraction > 0:
            info.update(self._audit(slots))
        ro.info.update(info)
        ro.info_reduce.update(info_reduce(ro.info))
        return ro, None  # imagined episodes: no part learns from them directly

    def _uncertain(self, ro, leaves: np.ndarray, slots: np.ndarray) -> dict[str, float]:
        """``uncertain``: the rewards (and trained steps) of the leaves whose imagination was truncated."""
        w = self.cfg.rollout.world_model
        slot_states = self.imagine.slots
        truncated = np.array([slot_states[s].truncated for s in slots])
        if w.uncertain != "ignore" and truncated.any():
            rows = torch.from_numpy(leaves[truncated])
            for name in ro.rewards:
                if w.uncertain == "drop":
                    ro.rewards[name][rows] = float("nan")
                else:  # truncate: the last trusted frame's success probability
                    last = [slot_states[s].trace["prob"][-2] if len(slot_states[s].trace["prob"]) > 1 else 0.0
                            for s in slots[truncated]]
                    ro.rewards[name][rows] = torch.tensor(last, dtype=torch.float32)
            if w.uncertain == "drop":
                ro.mask[rows] = False
                ro.logp_old[rows] = 0.0
        return {"wm/truncated_frac": float(truncated.mean()) if len(truncated) else 0.0}

    def _audit(self, slots: np.ndarray) -> dict[str, float]:
        w = self.cfg.rollout.world_model
        n = max(1, int(round(w.audit_fraction * len(slots))))
        pick = self._audit_rng.choice(len(slots), n, replace=False)
        states = [self.imagine.slots[int(slots[i])] for i in pick]
        kfs = [self.keyframes[s.key] for s in states]
        imagined = [{"success": s.success_once, "frames": s.trace["frames"], "prob": s.trace["prob"]} for s in states]
        reps = replay(self.venv, [kf.episode_key for kf in kfs], [kf.sim_state for kf in kfs],
                      [np.stack(s.trace["actions"]) for s in states], start_frames=[kf.frame for kf in kfs],
                      start_proprio=[kf.proprio for kf in kfs])
        steps = sum(r.env_steps for r in reps)
        if w.learn_from_audit:  # real interaction that feeds learning: counted as real steps
            for r, kf in zip(reps, kfs):
                r.task, r.key = kf.task, kf.episode_key
            self.real_data += reps
            self._pending += reps
            self.real_steps_replay += steps
        else:
            self.audit_steps += steps
        res = audit(imagined, reps, self.wm, self.success)
        self.last_audit = res
        out = {f"audit/{k}": float(v) for k, v in res.items() if not isinstance(v, list)}
        for d, v in enumerate(res["image_mse_by_step"][:12]):
            if np.isfinite(v):
                out[f"audit/image_mse_step{d + 1}"] = v
        out["audit/env_steps_total"] = float(self.audit_steps)
        return out

    def evaluate(self, iteration: int) -> dict[str, float]:
        """The domain evaluates in the physics simulator, on held-out reset states; this adds the real-step budget."""
        return {"eval/real_env_steps": float(self.real_env_steps)}

    # -- exact resume: everything co-evolution, audits and refits change, in the checkpoint's tensors
    state_prefix = WM_STATE_PREFIX
    STATE_CLASSES = {c.__name__: c for c in (ChunkEpisode, Keyframe, EnvState, PointState, WorldModelConfig,
                                             SuccessModelConfig)}

    def learned_state(self) -> dict:
        """What this strategy learned since it was built: the real episodes it added (co-evolution, audits learned
        from, re-executions), those not yet refit on, the keyframes they added, the refit world model and success
        model (their weights, calibration and optimizer) and the audit's RNG. The starting data and keyframes are
        rebuilt from the asset by the constructor, so only the additions are stored."""
        position = {id(e): i for i, e in enumerate(self.real_data)}
        out = {"real_data": self.real_data[self._initial_episodes:], "pending": [position[id(e)] for e in self._pending],
               "keyframes": {k: kf for k, kf in self.keyframes.items() if k not in self._initial_keyframes},
               "audit_rng": self._audit_rng, "coevolved_at": self._coevolved_at,
               "model_steps": self.imagine.model_steps}
        w = self.cfg.rollout.world_model
        if w.coevolve_every:  # the models change only at co-evolution rounds: their calibration at every round, their
            # weights only when refit (steps 0 leave them the asset's, which the constructor loads again: 1.7 MB less
            # per checkpoint of the ranker recipe)
            out |= {"wm_cfg": self.wm.cfg, "success_cfg": self.success.cfg}
            if w.refit_steps:
                out |= {"wm": self.wm.state_dict(),
                        "wm_opt": self._wm_opt.state_dict() if self._wm_opt is not None else None}
            if w.refit_success_steps:
                out["success"] = self.success.state_dict()
        return out

    def load_learned_state(self, s: dict) -> None:
        self.real_data = self.real_data[:self._initial_episodes] + list(s["real_data"])
        self._pending = [self.real_data[i] for i in s["pending"]]
        self.keyframes.update(s["keyframes"])
        self.imagine.keyframes = self.keyframes
        self._audit_rng, self._coevolved_at = s["audit_rng"], int(s["coevolved_at"])
        self.imagine.model_steps = int(s["model_steps"])
        if "wm_cfg" in s:
            vars(self.wm.cfg).update(vars(s["wm_cfg"]))
            vars(self.success.cfg).update(vars(s["success_cfg"]))
        if "wm" in s:
            self.wm.load_state_dict(s["wm"])
            if s["wm_opt"] is not None:
                self._wm_opt = torch.optim.Adam(self.wm.parameters(), lr=self.cfg.rollout.world_model.refit_lr)
                self._wm_opt.load_state_dict(s["wm_opt"])
        if "success" in s:
            self.success.load_state_dict(s["success"])
        self.imagine.success = self.success

    def _classes(self) -> dict[str, type]:
        """The dataclasses the packed state may hold; LIBERO's simulator state when its env module is loaded (a
        LIBERO run loads it before any state exists; importing it otherwise would load the simulator for nothing)."""
        libero = sys.modules.get("robotics.envs.libero_env")
        return self.STATE_CLASSES | ({"LiberoState": libero.LiberoState} if libero is not None else {})

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{WM_STATE_PREFIX}learned": pack(self.learned_state(), self._classes())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        packed = state.get(f"{WM_STATE_PREFIX}learned")
        if packed is not None:  # an older checkpoint without it: ``missing_state`` reports the gap at resume
            self.load_learned_state(unpack(packed, self._classes()))

    def extra_state(self) -> dict:
        return {"real_steps_coevolve": self.real_steps_coevolve, "real_steps_replay": self.real_steps_replay,
                "audit_steps": self.audit_steps}

    def load_extra_state(self, state: dict) -> None:
        self.real_steps_coevolve = int(state.get("real_steps_coevolve", 0))
        self.audit_steps = int(state.get("audit_steps", 0))
        self.real_steps_replay = int(state.get("real_steps_replay", 0))

    def save_pretrained(self, out_dir: Path) -> None:
        """Next to the policy (saved by the domain): the refit world model and success model."""
        self.wm.save(Path(out_dir) / "world_model")
        self.success.save(Path(out_dir) / "world_model")
