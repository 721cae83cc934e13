"""The world model as a simulator: the batched env interface of ``envs.vector`` over imagined latents.

``WorldModelEnv`` has the simulator's API — ``reset(keys)``, ``step_chunk(actions[B, K, A], active)`` returning
a ``ChunkResult``, ``get_states`` / ``set_states``, ``render`` — so the unchanged episode runner
(``episodes.run_episodes``) and the branching runner (``robotics.branching``) drive it exactly as they drive
MuJoCo. A key names a **keyframe** (WoVR, "keyframe-initialised rollouts"): a real observation recorded along a
real trajectory (frame, the frame before it as history, proprio, and the simulator state there for the audit).
Imagination starts from the real frame, so the error depth is the imagined horizon, not the episode length.

Per chunk, every live slot takes one batched model step: the mean ensemble prediction becomes the next latent,
its decoding the next frame the VLA sees; the success model (or VLA-RFT reference similarity) scores it. An
imagined episode ends at the imagined horizon, at an imagined success (``success_mode: once``) or, when
``uncertainty_threshold > 0``, when the ensemble disagreement exceeds ``uncertainty_threshold`` times the
model's calibrated reference (``WorldModelConfig.uncertainty_ref``: the 95th percentile on held-out real
transitions): that rollout is *truncated* and flagged, so the learner can drop or discount it.

State save/restore copies the latent (current and history latents, proprio, counters and the slot's trace), so
branching in imagination is a ``get_states`` + ``set_states`` as in MuJoCo; the model is deterministic, so a
restored slot continues bit-identically.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..envs.results import ChunkResult
from .model import WorldModel
from .reward import ReferenceSimilarity, SuccessModel


@dataclass
class Keyframe:
    """A real chunk boundary an imagined rollout can start from."""

    key: int  # the keyframe's own key (decodes to its task index, split "train")
    task: str
    frame: np.ndarray  # [H, W, C] uint8
    prev_frame: np.ndarray  # the boundary before (= frame at an episode start)
    proprio: np.ndarray  # [P]
    sim_state: Any = None  # the simulator's get_states entry at this boundary (audit replays start here)
    episode_key: int = -1  # the real reset state the trajectory came from
    chunk: int = 0  # boundary index in that trajectory
    source: str = "policy"


@dataclass
class LatentState:
    """Everything one imagined slot needs to continue identically (``get_states`` / ``set_states``)."""

    key: int
    z: torch.Tensor
    z_prev: torch.Tensor
    proprio: torch.Tensor
    frame: np.ndarray
    steps: int
    done: bool
    success_once: bool
    last_success: bool
    truncated: bool
    trace: dict[str, list] = field(default_factory=dict)


class WorldModelEnv:
    """Imagined batched env over ``keyframes`` (see the module docstring)."""

    def __init__(self, wm: WorldModel, keyframes: dict[int, Keyframe], horizon: int,
                 success: SuccessModel | None = None, reference: ReferenceSimilarity | None = None,
                 success_mode: str = "once", uncertainty_threshold: float = 0.0, tasks: list[str] | None = None,
                 pessimistic: bool = False):
        if success is None and reference is None:
            raise ValueError("WorldModelEnv needs a success model or a reference-similarity reward")
        self.wm, self.keyframes, self.horizon = wm.eval(), keyframes, int(horizon)
        self.success, self.reference = success, reference
        self.success_mode, self.uncertainty_threshold = success_mode, float(uncertainty_threshold)
        self.tasks, self.pessimistic = tasks, pessimistic
        self.slots: list[LatentState] = []
        self.model_steps = 0  # batched model steps x rows, for throughput accounting

    def task_of_key(self, key: int) -> str:
        return self.keyframes[key].task

    # -- API
    @torch.no_grad()
    def reset(self, keys: list[int]) -> dict[str, np.ndarray]:
        missing = [k for k in keys if k not in self.keyframes]
        if missing:
            raise KeyError(f"no keyframe for keys {missing[:5]}")
        kfs = [self.keyframes[k] for k in keys]
        frames = np.stack([kf.frame for kf in kfs])
        z = self.wm.encode(torch.from_numpy(frames))
        z_prev = self.wm.encode(torch.from_numpy(np.stack([kf.prev_frame for kf in kfs])))
        pro = torch.from_numpy(np.stack([kf.proprio for kf in kfs]).astype(np.float32))
        self.slots = [LatentState(key=int(k), z=z[i], z_prev=z_prev[i], proprio=pro[i], frame=frames[i], steps=0,
                                  done=False, success_once=False, last_success=False, truncated=False,
                                  trace={"actions": [], "frames": [], "proprio": [], "prob": [], "uncertainty": [], "z": []})
                      for i, k in enumerate(keys)]
        return {"image": frames, "proprio": pro.numpy().copy(), "state": np.zeros((len(keys), 39), np.float32)}

    def _prob(self, pred, keys: list[int]) -> torch.Tensor:
        """P(success) of the predicted boundary; ``pessimistic``: the minimum over the ensemble heads (a success
        only counts when every head's prediction looks successful — MOPO-style pessimism against exploits)."""
        score = (lambda z, p: self.reference.prob(z, keys)) if self.reference is not None else self.success.prob
        if not self.pessimistic:
            return score(pred.z, pred.proprio)
        return torch.stack([score(z, p) for z, p in zip(pred.z_heads, pred.proprio_heads)]).min(0).values

    def _threshold(self) -> float:
        return self.reference.threshold if self.reference is not None else self.success.cfg.threshold

    @torch.no_grad()
    def step_chunk(self, actions: np.ndarray, active: np.ndarray | None = None) -> ChunkResult:
        b, k = actions.shape[:2]
        if b != len(self.slots):
            raise ValueError(f"step_chunk got actions for {b} slots, the batch has {len(self.slots)}")
        active = np.ones(b, bool) if active is None else np.asarray(active, bool)
        live = [i for i in range(b) if active[i] and not self.slots[i].done]
        reward = np.zeros((b, k), np.float32)
        success = np.zeros((b, k), bool)
        executed = np.zeros((b, k), bool)
        if live:
            s = [self.slots[i] for i in live]
            acts = torch.from_numpy(np.clip(actions[live], -1, 1).astype(np.float32))
            pred = self.wm.step(torch.stack([x.z for x in s]), torch.stack([x.z_prev for x in s]),
                                torch.stack([x.proprio for x in s]), acts)
            self.model_steps += len(live)
            frames = self.wm.decode(pred.z).numpy()
            prob = self._prob(pred, [x.key for x in s]).numpy()
            unc = (pred.uncertainty / max(self.wm.cfg.uncertainty_ref, 1e-12)).numpy()
            thr = self._threshold()
            for j, i in enumerate(live):
                st = self.slots[i]
                st.z_prev, st.z, st.proprio, st.frame = st.z, pred.z[j], pred.proprio[j], frames[j]
                st.steps += k
                ok = bool(prob[j] > thr)
                st.success_once |= ok
                st.last_success = ok
                st.trace["actions"].append(np.asarray(actions[i], np.float32).copy())
                st.trace["frames"].append(frames[j])
                st.trace["proprio"].append(pred.proprio[j].numpy().copy())
                st.trace["prob"].append(float(prob[j]))
                st.trace["uncertainty"].append(float(unc[j]))
                st.trace["z"].append(pred.z[j])  # the imagined latent (the sibling ranker reads it)
                executed[i] = True
                reward[i] = 10.0 * prob[j]
                success[i, k - 1] = ok
                if self.uncertainty_threshold > 0 and unc[j] > self.uncertainty_threshold and not ok:
                    st.truncated = True
                    st.done = True
                if st.steps >= self.horizon or (ok and self.success_mode == "once"):
                    st.done = True
        img = np.stack([self.slots[i].frame if (i in live and not self.slots[i].done) else
                        np.zeros_like(self.slots[i].frame) for i in range(b)])
        return ChunkResult(
            image=img, proprio=np.stack([x.proprio.numpy() for x in self.slots]),
            state=np.zeros((b, 39), np.float32), reward=reward, success=success, executed=executed,
            done=np.array([x.done for x in self.slots]), success_once=np.array([x.success_once for x in self.slots]),
            success_end=np.array([x.last_success for x in self.slots]))

    def get_states(self, idx: list[int]) -> list[LatentState]:
        out = []
        for i in idx:
            s = self.slots[i]
            out.append(LatentState(key=s.key, z=s.z.clone(), z_prev=s.z_prev.clone(), proprio=s.proprio.clone(),
                                   frame=s.frame.copy(), steps=s.steps, done=s.done, success_once=s.success_once,
                                   last_success=s.last_success, truncated=s.truncated,
                                   trace={k: list(v) for k, v in s.trace.items()}))
        return out

    def set_states(self, idx: list[int], states: list[LatentState]) -> None:
        for i, s in zip(idx, states):
            self.slots[i] = copy.copy(s)
            self.slots[i].z, self.slots[i].z_prev, self.slots[i].proprio = s.z.clone(), s.z_prev.clone(), s.proprio.clone()
            self.slots[i].trace = {k: list(v) for k, v in s.trace.items()}

    def render(self, idx: list[int]) -> np.ndarray:
        return np.stack([self.slots[i].frame for i in idx])

    def close(self) -> None:
        pass


def sample_keyframes(episodes, task_index: dict[str, int], stride: int = 2, max_chunk: int | None = None,
                     min_chunk: int = 0,
                     include_start: bool = True, need_state: bool = True, first_id: int = 0,
                     rng: np.random.Generator | None = None, limit: int | None = None) -> dict[int, Keyframe]:
    """WoVR keyframes along real trajectories: every ``stride``-th boundary (from ``min_chunk``; boundary 0 only
    when ``include_start``) up to ``max_chunk``, never at or after the first success (the task is already done
    there) nor at the final boundary, and only where a simulator state was recorded when ``need_state``
    (audits replay from it). ``limit`` keeps a random subset. Keys are ``make_key(task, "train", id)``.

    An episode that starts mid-trajectory (``start_steps`` > 0: re-executed from a keyframe by the verified
    rollout) is placed on the same grid by its absolute boundary index (start_steps / chunk + c), and its boundary 0
    (the keyframe it started from, whose history frame it lacks) is skipped."""
    from ..envs.metaworld_env import make_key

    cands = []
    for ep in episodes:
        if ep.task not in task_index:
            continue
        off = ep.start_steps // ep.actions.shape[1] if ep.num_chunks else 0
        first_success = int(np.argmax(ep.success)) + 1 if ep.succeeded else ep.num_chunks
        last = min(first_success, ep.num_chunks) - 1
        if max_chunk is not None:
            last = min(last, max_chunk - off)
        if off == 0:
            first = min_chunk if (include_start or min_chunk > 0) else stride
        else:  # the first absolute boundary after the start on the grid min_chunk + j * stride, made local
            a0 = max(min_chunk, off + 1)
            first = a0 + (min_chunk - a0) % stride - off
        for c in range(first, last + 1, stride):
            if need_state and (ep.states is None or ep.states[c] is None):
                continue
            cands.append((ep, c, off))
    if limit is not None and len(cands) > limit:
        rng = rng or np.random.default_rng(0)
        pick = np.sort(rng.choice(len(cands), limit, replace=False))
        cands = [cands[i] for i in pick]
    out: dict[int, Keyframe] = {}
    for n, (ep, c, off) in enumerate(cands):
        key = make_key(task_index[ep.task], "train", first_id + n)
        out[key] = Keyframe(key=key, task=ep.task, frame=ep.frames[c], prev_frame=ep.frames[max(c - 1, 0)],
                            proprio=ep.proprio[c], sim_state=ep.states[c] if ep.states is not None else None,
                            episode_key=ep.key, chunk=off + c, source=ep.source)
    return out
