"""Two-stage robot rollouts: the world model explores, the simulator decides (``robotics.rollout.name: verified``).

Imagined GRPO lets the learned model be the final judge of reward, and the policy learns to fool it
(docs/methods/world_model.md: hallucinated imagined successes 0–30% → 80–100% within a few updates). Here the world
model only *ranks*; the reward that trains is always the simulator's. The visgen two-stage rollout (Sol-RL) has
the same shape — a cheap explorer ranks many candidates, a contrastive subset is regenerated exactly at full
fidelity and only that trains — and both use the one shared core (``shared_rl.two_stage``: the selectors, Spearman
rank agreement, kept agreement). Per group key (a keyframe: a real chunk boundary on a recorded real trajectory,
as WoVR):

1. **Explore**: ``verify.candidates`` (N) episodes are imagined in the world model from the keyframe, each with
   its own recorded noise stream (``episodes.chunk_noise``: every draw of the flow head — start, SDE steps,
   sde_one_step's step — from a generator per (stream, chunk)), and scored by the imagined success probability
   (``verify.score``: the best P(success) along the episode, or the 0/1 imagined success).
2. **Select**: ``shared_rl.two_stage.select_candidates`` keeps ``rollout.group_size`` (k) per keyframe
   (``verify.selector``: ``max_variance`` or ``top_bottom``).
3. **Re-execute**: exactly those k run in the simulator from the keyframe's restored state (``RestoredEnv``) with
   the same noise streams, closed loop on the real observations: the same stream and the same observations give
   the same chunk, so a candidate whose imagination is faithful is reproduced exactly, and one that is not shows
   the difference in its real outcome.
4. **Train on the real outcomes only**: the rollout the trainer sees is the k real episodes per keyframe (their
   recorded chains and log-probs, their simulator rewards); nothing imagined reaches the update.

The re-executed episodes are real interaction: counted as real steps (``env/steps`` per iteration,
``wm/real_env_steps`` in total), added to the real data, and — every ``world_model.coevolve_every`` iterations —
the world model and the success model are refit on them (with ``world_model.coevolve_episodes`` fresh full
rollouts, 0 allowed) and their chunk boundaries become keyframes (co-evolution).

Metrics: ``verify/rank_spearman`` (imagined score vs real success over all kept episodes, as visgen's
``two_stage/rank_spearman``) and ``verify/rank_spearman_group`` (within each keyframe's kept group, mean over
groups where it is defined), ``verify/kept_agreement`` (the share of kept episodes whose upper/lower side the real
outcomes confirm), ``verify/imagined_success`` (all candidates), ``verify/imagined_success_kept``,
``verify/real_success``, ``verify/hallucinated_success_rate`` (kept imagined successes the simulator does not
confirm), ``verify/mixed_groups_real`` (groups whose real outcomes differ: the ones GRPO learns from),
``wm/imagined_steps`` and ``env/steps`` (this iteration), ``wm/real_env_steps`` (all real steps so far).
"""
from __future__ import annotations

import numpy as np
import torch

from shared_rl.errors import ConfigError
from shared_rl.two_stage import kept_agreement, select_candidates, spearman

from ..envs.metaworld_env import decode_key
from ..episodes import run_episodes
from ..rollouts import flat_rollout
from .data import RecordingEnv
from .env import Keyframe
from .probe import SiblingSets, imagined_scores, ranking_metrics, slot_features
from .ranker import RankerConfig, SiblingRanker, fit_ranker, outcome, trajectories_from
from .rollout import WorldModelRollout, info_reduce
from .train import resolve


class RestoredEnv:
    """The simulator started at keyframes: ``reset(keys)`` resets slot i to the reset state keyframe ``keys[i]``'s
    trajectory came from, restores the simulator state recorded at the keyframe and observes what the real episode
    observed there (the recorded frame and proprio); every other call goes to the simulator. The episode runner then
    runs closed loop from the keyframe exactly as from a reset.

    The recorded frame, not a fresh render: a frame rendered right after ``mj_step`` shows the bodies where that
    step's kinematics put them (before integration), a render of the restored state where ``mj_forward`` puts them,
    a grey level apart where the camera rides the arm (LIBERO's wrist view). The imagined candidates start from the
    recorded frame too, so a re-executed candidate sees exactly what its imagination saw."""

    def __init__(self, venv, keyframes: dict[int, Keyframe]):
        self.venv, self.keyframes = venv, keyframes
        self.cfg = getattr(venv, "cfg", None)

    def task_of_key(self, key: int) -> str:
        return self.keyframes[key].task

    def reset(self, keys: list[int]) -> dict[str, np.ndarray]:
        kfs = [self.keyframes[k] for k in keys]
        if any(kf.sim_state is None for kf in kfs):
            raise ValueError("a keyframe without a recorded simulator state cannot be re-executed")
        obs = self.venv.reset([kf.episode_key for kf in kfs])
        idx = list(range(len(kfs)))
        self.venv.set_states(idx, [kf.sim_state for kf in kfs])
        return {"image": np.stack([kf.frame for kf in kfs]), "proprio": np.stack([kf.proprio for kf in kfs]).astype(np.float32),
                "state": np.zeros_like(obs["state"])}

    def step_chunk(self, actions, active=None):
        return self.venv.step_chunk(actions, active)

    def get_states(self, idx):
        return self.venv.get_states(idx)

    def set_states(self, idx, states):
        self.venv.set_states(idx, states)

    def render(self, idx):
        return self.venv.render(idx)

    def close(self) -> None:
        pass


class VerifiedRollout(WorldModelRollout):
    """Explore N candidates per keyframe in the world model, re-execute the selected k in the simulator, train on
    their real outcomes (see the module docstring). The world model, keyframes and co-evolution are
    ``WorldModelRollout``'s."""

    def __init__(self, cfg, ctx, policy, venv, sampling) -> None:
        super().__init__(cfg, ctx, policy, venv, sampling)
        self.real_steps_verified = 0
        self.imagined_steps = 0
        self.probe_steps = 0  # the probe's re-executions: a measurement, counted apart from the real-step budget
        self.last: dict = {}  # the last call's seeds, scores, kept indices (tests and analysis read them)
        v = cfg.rollout.verify
        self.ranker = None
        self._ranker_history: list[SiblingSets] = []  # ranker_from own_groups: every re-executed group of the run
        if v.score == "ranker" and v.ranker_from == "checkpoint":
            where = resolve(v.ranker or cfg.rollout.world_model.checkpoint)
            try:
                self.ranker = SiblingRanker.load(where)
            except FileNotFoundError as e:
                raise ConfigError(f"robotics.rollout.verify.ranker: {e}; make one with `python -m "
                                  f"bench.robotics_wm_probe --save-ranker {where}`") from None
        self._ranker_pending: list[SiblingSets] = []  # re-executed groups since the last refit
        self._probe_gen = torch.Generator().manual_seed(ctx.seed + 29)  # the probe never moves training's streams

    # -- keyframes held out for the probe
    def _probe_state(self, key: int) -> bool:
        w, v = self.cfg.rollout.world_model, self.cfg.rollout.verify
        return v.probe_states > 0 and decode_key(self.keyframes[key].episode_key)[2] >= w.keyframe_states - v.probe_states

    def train_keys(self) -> list[int]:
        """The keyframes, less those of the reset states held out for the probe (``verify.probe_states``)."""
        return [k for k in self.keyframes if not self._probe_state(k)]

    def probe_keys(self) -> list[int]:
        return [k for k in self.keyframes if self._probe_state(k)]

    # -- scores
    def _scores(self, keys: list[int], n: int) -> tuple[np.ndarray, np.ndarray, dict | None]:
        """The selector's score of the N candidates per key now imagined (``[G*N]``), their 0/1 imagined success,
        and the ranker's features (``score: ranker``; None otherwise)."""
        v = self.cfg.rollout.verify
        if v.score != "ranker":
            score, imag = imagined_scores(self.imagine.slots, "prob" if v.score == "oracle" else v.score)
            return score, imag, None
        t_max = -(-self.cfg.rollout.world_model.horizon // self.policy.cfg.chunk)
        feats = slot_features(self.imagine, keys, n, self.policy.cfg.chunk, t_max)
        if self.ranker is None:  # own_groups before its first fit: the imagined P(success), as score: prob
            score = feats["score"].reshape(-1).astype(np.float64)
        else:
            with torch.no_grad():
                score = self.ranker(trajectories_from(feats)).double().numpy()
        return score, feats["imagined_success"].reshape(-1).astype(np.float64), feats

    @property
    def real_env_steps(self) -> int:
        # the ranker's training sibling sets were real re-executions too: counted like the world model's data
        ranker_data = self.ranker.cfg.trained_real_steps if self.ranker is not None else 0
        return super().real_env_steps + self.real_steps_verified + ranker_data

    def rollout(self, keys, group_size, generator, iteration):
        w, v = self.cfg.rollout.world_model, self.cfg.rollout.verify
        info: dict[str, float] = {}
        if w.coevolve_every and iteration > 0 and iteration % w.coevolve_every == 0 and self._coevolved_at != iteration:
            self._coevolved_at = iteration
            info.update(self.coevolve(generator))
        keys = list(keys)
        G, N, k = len(keys), v.candidates, group_size
        if k > N:
            raise ConfigError(f"robotics.rollout.verify.candidates ({N}) must be >= rollout.group_size ({k}): the "
                              f"group is the k re-executed of the N imagined")
        seeds = torch.randint(0, 2**62, (G, N), generator=generator)
        self.policy.eval()
        # 1. explore: N imagined candidates per keyframe, each with its own noise stream
        cand_keys = [kk for kk in keys for _ in range(N)]
        imagined = run_episodes(self.policy, self.imagine, cand_keys, [self.task_of(kk) for kk in cand_keys],
                                self.sampling, w.horizon, generator, device=self.device,
                                noise_seeds=seeds.flatten().tolist())
        score, imag_success, feats = self._scores(keys, N)
        oracle_steps = 0
        if v.score == "oracle":  # the explorer's upper bound: every candidate's real return (all N re-executed)
            full = run_episodes(self.policy, RestoredEnv(self.venv, self.keyframes), cand_keys,
                                [self.task_of(kk) for kk in cand_keys], self.sampling, w.horizon, generator,
                                device=self.device, noise_seeds=seeds.flatten().tolist())
            score = full.success_once.astype(np.float64) + 0.5 * full.dense.astype(np.float64)
            oracle_steps = int(full.length.sum())
        imag_steps = int(imagined.length.sum())
        self.imagined_steps += imag_steps
        # 2. select k per keyframe with the shared selector
        score_t = torch.from_numpy(score).view(G, N)
        keep = select_candidates(score_t, k, v.selector)  # [G, k]
        kept_seeds = seeds.gather(1, keep)
        # 3. re-execute exactly those in the simulator from the keyframe's restored state, same noise streams
        env_keys = [kk for kk in keys for _ in range(k)]
        # states up to keyframe_max_chunk boundaries after the keyframe: a superset of the absolute boundaries <=
        # keyframe_max_chunk that can become keyframes (the rest would be stored for nothing: ~37 KB each in LIBERO)
        rec = RecordingEnv(RestoredEnv(self.venv, self.keyframes), record_states=v.learn_from_verified,
                           state_max_chunk=w.keyframe_max_chunk)
        real = run_episodes(self.policy, rec, env_keys, [self.task_of(kk) for kk in env_keys], self.sampling,
                            w.horizon, generator, device=self.device, noise_seeds=kept_seeds.flatten().tolist())
        # (oracle: the k are replays of candidates already run and counted; the same streams give the same episodes)
        real_steps = oracle_steps or int(real.length.sum())
        self.real_steps_verified += real_steps
        if v.learn_from_verified:
            eps = rec.episodes(source="verified")
            for e, kk in zip(eps, env_keys):  # where they came from: the real reset state and the keyframe's time
                kf = self.keyframes[kk]
                e.key, e.start_steps = kf.episode_key, kf.chunk * self.policy.cfg.chunk
            self.real_data += eps
            self._pending += eps
        if feats is not None and v.ranker_refit_steps:  # the kept groups with their real outcomes: sibling sets
            self._ranker_pending.append(_kept_sets(feats, keep, keys, kept_seeds, real, self.keyframes))
        # 4. the trainer sees the real episodes and their simulator rewards only
        ro = flat_rollout(real, keys, k, self.cfg.env.tasks, self.cfg.env.success_mode, self.cfg.dense_reward)
        info.update(self._agreement(score_t.gather(1, keep), torch.from_numpy(imag_success).view(G, N).gather(1, keep),
                                    ro.rewards["success"].view(G, k), imag_success))
        info.update({"env/steps": real_steps, "wm/imagined_steps": float(imag_steps),
                     "wm/model_steps": float(self.imagine.model_steps), "wm/real_env_steps": float(self.real_env_steps)})
        if v.probe_every and iteration % v.probe_every == 0:
            info.update(self.probe(N, k))
        ro.info.update(info)
        ro.info_reduce.update(info_reduce(ro.info))
        self.last = {"keys": keys, "seeds": seeds, "score": score_t, "keep": keep, "imagined": imagined, "real": real}
        return ro, real

    def coevolve(self, generator: torch.Generator, log=None) -> dict[str, float]:
        out = super().coevolve(generator, log)
        pending, self._ranker_pending = self._ranker_pending, []
        v = self.cfg.rollout.verify
        if v.ranker_from == "own_groups":  # all the run's groups so far, the ranker fitted anew on them each round
            self._ranker_history += pending
            pending = list(self._ranker_history)
        if (self.ranker is not None or v.ranker_from == "own_groups") and v.ranker_refit_steps and pending:
            sets = SiblingSets.concat(pending)
            y = outcome(sets)
            if (y.max(1) > y.min(1)).any():  # some group's real outcomes differ: an order to learn
                seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
                with torch.enable_grad():  # refits run inside the trainer's no-grad rollout
                    self.ranker = fit_ranker(sets, steps=v.ranker_refit_steps, val_fraction=0.0, seed=seed,
                                             model=None if v.ranker_from == "own_groups" else self.ranker.train())
                out["coevolve/ranker_groups"] = float(len(sets.keys))
        return out

    @torch.no_grad()
    def probe(self, n: int, k: int) -> dict[str, float]:
        """The ranking probe during training: ``verify.probe_keys`` held-out keyframes, ``n`` candidates each
        imagined and ALL re-executed; the selector's score against the real outcomes (``probe.ranking_metrics``)."""
        v, w = self.cfg.rollout.verify, self.cfg.rollout.world_model
        pool = self.probe_keys()
        if not pool:
            return {}
        pick = torch.randperm(len(pool), generator=self._probe_gen)[:v.probe_keys].tolist()
        keys = [pool[i] for i in pick]
        seeds = torch.randint(0, 2**62, (len(keys), n), generator=self._probe_gen)
        cand = [kk for kk in keys for _ in range(n)]
        tasks = [self.task_of(kk) for kk in cand]
        run_episodes(self.policy, self.imagine, cand, tasks, self.sampling, w.horizon, self._probe_gen,
                     device=self.device, noise_seeds=seeds.flatten().tolist())
        score = self._scores(keys, n)[0]
        real = run_episodes(self.policy, RestoredEnv(self.venv, self.keyframes), cand, tasks, self.sampling,
                            w.horizon, self._probe_gen, device=self.device, noise_seeds=seeds.flatten().tolist())
        self.probe_steps += int(real.length.sum())
        m = ranking_metrics(score.reshape(len(keys), n), real.success_once.reshape(len(keys), n).astype(float), k)
        out = {f"probe/{name}": m[name] for name in ("spearman_within", "spearman_within_max", "top_k_precision",
                                                     "base_rate", "mixed_selected", "mixed_random")}
        out["probe/env_steps_total"] = float(self.probe_steps)
        return out

    @staticmethod
    def _agreement(score_kept: torch.Tensor, imag_kept: torch.Tensor, real: torch.Tensor,
                   imag_all: np.ndarray) -> dict[str, float]:
        """Rank agreement of the kept candidates' imagined scores with their real successes (``[G, k]`` each)."""
        per_group = [spearman(score_kept[g], real[g]) for g in range(len(real))]
        per_group = [x for x in per_group if np.isfinite(x)]
        imagined_yes = imag_kept.bool()
        real_yes = real.bool()
        mixed = (real.max(1).values > real.min(1).values).double().mean()
        return {
            "verify/rank_spearman": spearman(score_kept, real),
            "verify/rank_spearman_group": float(np.mean(per_group)) if per_group else float("nan"),
            "verify/kept_agreement": kept_agreement(score_kept, real),
            "verify/imagined_success": float(np.mean(imag_all)),
            "verify/imagined_success_kept": float(imagined_yes.double().mean()),
            "verify/real_success": float(real_yes.double().mean()),
            "verify/hallucinated_success_rate": (float((imagined_yes & ~real_yes).sum() / imagined_yes.sum())
                                                 if imagined_yes.any() else float("nan")),
            "verify/mixed_groups_real": float(mixed),
        }

    STATE_CLASSES = WorldModelRollout.STATE_CLASSES | {c.__name__: c for c in (SiblingSets, RankerConfig)}

    def learned_state(self) -> dict:
        """The world model's learned state plus the ranker's: its re-executed sibling sets (all of them with
        ``ranker_from: own_groups``, the ranker refit anew on them every round; those since the last refit), the
        refit ranker itself (weights and config) and the probe's RNG."""
        v = self.cfg.rollout.verify
        out = super().learned_state() | {"ranker_history": self._ranker_history, "ranker_pending": self._ranker_pending,
                                         "probe_gen": self._probe_gen}
        if self.ranker is not None and (v.ranker_from == "own_groups" or v.ranker_refit_steps):  # it changes
            out |= {"ranker": self.ranker.state_dict(), "ranker_cfg": self.ranker.cfg}
        return out

    def load_learned_state(self, s: dict) -> None:
        super().load_learned_state(s)
        self._ranker_history, self._ranker_pending = list(s["ranker_history"]), list(s["ranker_pending"])
        self._probe_gen = s["probe_gen"]
        if "ranker" in s:
            if self.ranker is None:
                self.ranker = SiblingRanker(s["ranker_cfg"])
            else:
                vars(self.ranker.cfg).update(vars(s["ranker_cfg"]))
            self.ranker.load_state_dict(s["ranker"])
            self.ranker.eval()

    def extra_state(self) -> dict:
        return super().extra_state() | {"real_steps_verified": self.real_steps_verified,
                                        "imagined_steps": self.imagined_steps, "probe_steps": self.probe_steps}

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        self.real_steps_verified = int(state.get("real_steps_verified", 0))
        self.imagined_steps = int(state.get("imagined_steps", 0))
        self.probe_steps = int(state.get("probe_steps", 0))

    def save_pretrained(self, out_dir) -> None:
        super().save_pretrained(out_dir)
        if self.ranker is not None:  # beside the refit world model: the ranker as refit
            from pathlib import Path

            self.ranker.save(Path(out_dir) / "world_model")


def _kept_sets(feats: dict, keep: torch.Tensor, keys: list[int], kept_seeds: torch.Tensor, real,
               keyframes: dict[int, Keyframe]) -> SiblingSets:
    """The kept candidates of each key (``keep [G, k]``) as sibling sets with their real re-executed outcomes."""
    g, k = keep.shape
    idx = keep.numpy()
    pick = lambda a: np.stack([a[i, idx[i]] for i in range(g)])  # noqa: E731
    sh = lambda a: np.asarray(a).reshape(g, k)  # noqa: E731
    kfs = [keyframes[kk] for kk in keys]
    return SiblingSets(
        keys=np.array(keys, np.int64), seeds=kept_seeds.numpy().astype(np.int64),
        episode_keys=np.array([kf.episode_key for kf in kfs], np.int64), chunk=np.array([kf.chunk for kf in kfs]),
        start_z=feats["start_z"], start_proprio=feats["start_proprio"],
        **{name: pick(feats[name]) for name in ("z", "proprio", "actions", "prob", "uncertainty", "valid", "score",
                                                "imagined_success")},
        real_success=sh(real.success_once.astype(bool)), real_dense=sh(real.dense.astype(np.float32)),
        real_steps=sh(real.length))
