"""Real interaction as world-model data: chunk-level episodes recorded from the unchanged episode runner.

``RecordingEnv`` wraps any batched env (Meta-World or the point env) and records, per slot, what the world model
and the audit need at every chunk boundary: the frame (also the final frame of a finished episode, which the
simulator itself does not render), the proprio, the executed action chunk, whether the chunk succeeded, and —
with ``record_states`` — the simulator state (``get_states``), so any chunk boundary can be restored later as an
imagination start (a WoVR keyframe) or an audit replay start. Policy rollouts are collected by running the usual
``episodes.run_episodes`` on a ``RecordingEnv``; scripted demonstrations (``collect.collect_demos``) are cut into
chunks by ``episodes_from_demos``. Failures are kept: the world model must learn what failing looks like.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class ChunkEpisode:
    """One real episode at chunk resolution: ``C`` chunks between ``C+1`` observed boundaries."""

    task: str
    key: int
    frames: np.ndarray  # [C+1, H, W, Ch] uint8, boundary observations (frame 0 = the start)
    proprio: np.ndarray  # [C+1, P] float32
    actions: np.ndarray  # [C, K, A] float32 executed chunks (rows after an early end within a chunk are unused)
    success: np.ndarray  # [C] bool, a step of chunk c succeeded
    executed: np.ndarray  # [C] int, env steps executed in chunk c
    states: list[Any] | None = None  # [C+1] simulator states at the boundaries (None for demos)
    source: str = "policy"  # "policy" | "demo"
    start_steps: int = 0  # env steps before frame 0 (non-zero for an episode replayed from a keyframe)

    @property
    def num_chunks(self) -> int:
        return int(self.actions.shape[0])

    @property
    def env_steps(self) -> int:
        return int(self.executed.sum())

    @property
    def succeeded(self) -> bool:
        return bool(self.success.any())


class RecordingEnv:
    """A batched env that records every slot's chunk-level episode (see the module docstring)."""

    def __init__(self, venv, record_states: bool = False, state_max_chunk: int | None = None):
        # state_max_chunk: record simulator states only at boundaries 0..n (None = all). A LIBERO state is ~37 KB of
        # JSON (robosuite's controller, gripper and observable buffers beside MuJoCo's), and keyframes are drawn from
        # the first boundaries only, so the later ones would be stored for nothing
        self.venv, self.record_states, self.state_max_chunk = venv, record_states, state_max_chunk
        self._rec: list[dict] = []
        self._done = np.zeros(0, bool)
        self.cfg = getattr(venv, "cfg", None)

    def reset(self, keys: list[int]) -> dict[str, np.ndarray]:
        obs = self.venv.reset(keys)
        n = len(keys)
        states = self.venv.get_states(list(range(n))) if self.record_states else [None] * n
        task_of = getattr(self.venv, "task_of_key", None)
        self._rec = [{"key": int(k), "task": task_of(k) if task_of else "point-reach", "frames": [obs["image"][i]],
                      "proprio": [obs["proprio"][i]], "actions": [], "success": [], "executed": [],
                      "states": [states[i]]} for i, k in enumerate(keys)]
        self._done = np.zeros(n, bool)
        return obs

    def step_chunk(self, actions: np.ndarray, active: np.ndarray | None = None):
        b = len(self._rec)
        active = np.ones(b, bool) if active is None else np.asarray(active, bool)
        live = active & ~self._done
        res = self.venv.step_chunk(actions, active)
        idx = np.nonzero(live)[0].tolist()
        ended = [i for i in idx if res.done[i]]
        finals = dict(zip(ended, self.venv.render(ended))) if ended else {}
        want = [i for i in idx if self.state_max_chunk is None or len(self._rec[i]["actions"]) < self.state_max_chunk] \
            if self.record_states else []
        states = dict(zip(want, self.venv.get_states(want))) if want else {}
        for i in idx:
            r = self._rec[i]
            r["frames"].append(finals[i] if i in finals else res.image[i])
            r["proprio"].append(res.proprio[i])
            r["actions"].append(np.asarray(actions[i], np.float32))
            r["success"].append(bool(res.success[i].any()))
            r["executed"].append(int(res.executed[i].sum()))
            r["states"].append(states.get(i))
        self._done = np.asarray(res.done, bool).copy()
        return res

    def get_states(self, idx):
        return self.venv.get_states(idx)

    def set_states(self, idx, states):
        self.venv.set_states(idx, states)

    def render(self, idx):
        return self.venv.render(idx)

    def episodes(self, source: str = "policy") -> list[ChunkEpisode]:
        out = []
        for r in self._rec:
            c = len(r["actions"])
            out.append(ChunkEpisode(
                task=r["task"], key=r["key"], frames=np.stack(r["frames"]), proprio=np.stack(r["proprio"]).astype(np.float32),
                actions=np.stack(r["actions"]) if c else np.zeros((0, 1, 4), np.float32),
                success=np.array(r["success"], bool), executed=np.array(r["executed"], np.int64),
                states=list(r["states"]) if self.record_states else None, source=source))
        return out

    def close(self) -> None:
        pass


def episodes_from_demos(demos, chunk: int) -> list[ChunkEpisode]:
    """Cut per-step demonstrations (``robotics.data.Episode``: the frame *before* each action) into chunks.

    A demo's frame after its last action is not stored, so its last (partial) chunk is dropped: demonstrations
    feed the dynamics; the success frames the reward model learns from come from recorded policy rollouts."""
    out = []
    for d in demos:
        n = (len(d) - 1) // chunk  # chunks whose end frame exists
        if n < 1:
            continue
        steps = np.arange(n + 1) * chunk
        acts = d.actions[: n * chunk].reshape(n, chunk, -1).astype(np.float32)
        succ = d.success[: n * chunk].reshape(n, chunk).any(1)
        out.append(ChunkEpisode(task=d.task, key=int(d.key), frames=d.images[steps], proprio=d.proprio[steps].astype(np.float32),
                                actions=acts, success=succ, executed=np.full(n, chunk, np.int64), states=None,
                                source="demo"))
    return out


def save_chunk_episodes(episodes: list[ChunkEpisode], path: str | Path) -> Path:
    """One compressed ``.npz`` without pickle: the episodes' arrays concatenated, their fields and simulator
    states as JSON (``envs.state_codec``: arrays bit for bit, only known state classes rebuilt)."""
    from ..envs.state_codec import encode

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = [{"task": e.task, "key": int(e.key), "source": e.source, "start_steps": int(e.start_steps),
             "chunks": e.num_chunks, "states": encode(list(e.states)) if e.states is not None else None}
            for e in episodes]
    arrays = {"frames": np.concatenate([e.frames for e in episodes]),
              "proprio": np.concatenate([e.proprio for e in episodes]),
              "actions": np.concatenate([e.actions for e in episodes]),
              "success": np.concatenate([e.success for e in episodes]),
              "executed": np.concatenate([e.executed for e in episodes]),
              "meta": np.array(json.dumps(meta))}
    np.savez_compressed(path, **arrays)
    return path


def load_chunk_episodes(path: str | Path) -> list[ChunkEpisode]:
    from shared_rl.errors import ConfigError

    from ..envs.state_codec import decode

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"world-model data {p} does not exist; `grove train configs/robotics/world_model.yaml` makes it")
    try:
        z = np.load(p, allow_pickle=False)
        meta = json.loads(str(z["meta"]))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{p} is not a world-model data file ({e})") from None
    out, f0, c0 = [], 0, 0
    frames, proprio, actions, success, executed = (z[k] for k in ("frames", "proprio", "actions", "success", "executed"))
    for m in meta:
        n = m["chunks"]
        out.append(ChunkEpisode(task=m["task"], key=m["key"], frames=frames[f0:f0 + n + 1], proprio=proprio[f0:f0 + n + 1],
                                actions=actions[c0:c0 + n], success=success[c0:c0 + n], executed=executed[c0:c0 + n],
                                states=decode(m["states"]) if m["states"] is not None else None, source=m["source"],
                                start_steps=m["start_steps"]))
        f0, c0 = f0 + n + 1, c0 + n
    return out


@dataclass
class WindowBatch:
    frames: Any  # torch uint8 [B, L+1, H, W, C]
    proprio: Any  # [B, L+1, P]
    actions: Any  # [B, L, K, A]
    valid: Any  # [B, L] bool (chunk executed in full)


@dataclass
class WindowSampler:
    """Random training windows of ``length`` chunks: boundary ``s-1`` (history), ``s`` (start) ... ``s+length-1``.

    Windows start at any boundary; one that runs past an episode's end is padded and the padded chunks are marked
    invalid (the loss stops there), so short successful episodes and their final frames are used too."""

    episodes: list[ChunkEpisode]
    length: int = 3
    _index: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._index = [(e, s) for e, ep in enumerate(self.episodes) for s in range(ep.num_chunks)]
        if not self._index:
            from shared_rl.errors import ConfigError

            raise ConfigError("world-model data has no chunk to train on")

    def __len__(self) -> int:
        return len(self._index)

    def sample(self, n: int, rng: np.random.Generator) -> WindowBatch:
        import torch

        picks = rng.integers(0, len(self._index), n)
        ep0 = self.episodes[0]
        L = self.length
        frames = np.zeros((n, L + 1, *ep0.frames.shape[1:]), np.uint8)
        pro = np.zeros((n, L + 1, ep0.proprio.shape[1]), np.float32)
        acts = np.zeros((n, L, *ep0.actions.shape[1:]), np.float32)
        valid = np.zeros((n, L), bool)
        for row, p in enumerate(picks):
            e, s = self._index[p]
            ep = self.episodes[e]
            # boundary b of the window maps to episode boundary s - 1 + b (clamped at 0 for the history frame)
            for b in range(L + 1):
                t = min(max(s - 1 + b, 0), ep.num_chunks)
                frames[row, b], pro[row, b] = ep.frames[t], ep.proprio[t]
            for j in range(L):
                c = s - 1 + j  # chunk between window boundaries j and j+1
                if 0 <= c < ep.num_chunks:
                    acts[row, j] = ep.actions[c]
                    valid[row, j] = ep.executed[c] == ep.actions.shape[1] or (c == ep.num_chunks - 1)
                elif c < 0:
                    valid[row, j] = True  # the history step before the start: frame 0 repeated, never trained
        return WindowBatch(torch.from_numpy(frames), torch.from_numpy(pro), torch.from_numpy(acts), torch.from_numpy(valid))
