"""Batched Meta-World execution: in-process (one renderer per task, shared) or over worker processes.

Both classes have the same API and the same results for the same calls (the physics is deterministic), so the
domain picks one by ``num_workers`` alone:

- ``reset(keys)``: slot i is reset to reset state ``keys[i]`` (the batch size is ``len(keys)``).
- ``step_chunk(actions[B, K, 4], active[B])``: every active, unfinished slot executes its K actions (stopping
  early when its episode ends) and is rendered once at the end — rendering only when a new chunk is planned.
- ``get_states(idx)`` / ``set_states(idx, states)``: branch an episode at a chunk boundary.

An episode ends at the horizon, or (``success_mode="once"``) at the first success step. "Success once" = any
step succeeded; "success at end" = the last executed step succeeded (the episode then always runs the whole
horizon, as success can be lost again).
"""
from __future__ import annotations

import multiprocessing as mp
import signal
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from shared_rl.errors import WorkerDied

from .metaworld_env import (
    EnvState,
    MetaWorldTaskEnv,
    RenderSettings,
    TaskRenderer,
    decode_key,
    proprio_from_obs,
)
from .results import ChunkResult
# the env section and its constants import no simulator (grove config show); re-exported here
from .settings import (  # noqa: F401
    DEFAULT_TASKS,
    LIBERO_ACTION_DIM,
    LIBERO_CAMERAS,
    LIBERO_STATE_DIM,
    EnvConfig,
)


__all__ = ["DEFAULT_TASKS", "EnvConfig", "ChunkResult", "BatchedMetaWorld", "SubprocMetaWorld", "make_vector_env"]


def make_task_env(cfg: EnvConfig, task: str):
    """One task env of ``cfg.kind`` (Meta-World or LIBERO; both have reset / step / get_state / set_state)."""
    if cfg.kind == "libero":
        from .libero_env import LiberoTaskEnv

        return LiberoTaskEnv(task)
    return MetaWorldTaskEnv(task)


def make_renderer(cfg: EnvConfig, env):
    """The renderer for ``env``'s task (one per task and process; ``render(data)`` -> [H, W, 3 * cameras])."""
    if cfg.kind == "libero":
        from .libero_env import LiberoRenderer

        return LiberoRenderer(env.model, cfg.image_size, list(cfg.cameras), cfg.render_tuned)
    return TaskRenderer(env.model, cfg.render_settings())


def observed_vectors(cfg: EnvConfig, env) -> tuple[np.ndarray, np.ndarray]:
    """(proprio, state) of ``env`` now: Meta-World's proprio from its 39-d state; LIBERO's is LeRobot's 8-d
    ``observation.state`` for both."""
    if cfg.kind == "libero":
        state = env.state_vector()
        return state, state
    return proprio_from_obs(env.last_obs, cfg.include_goal, cfg.include_object), env.last_obs.astype(np.float32)


class BatchedMetaWorld:
    """In-process batch of Meta-World or LIBERO envs (kept alive and re-used: building one costs ~0.15 s for
    Meta-World, ~2 s for LIBERO)."""

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self.settings = cfg.render_settings()
        self._pool: dict[str, list[MetaWorldTaskEnv]] = {}
        self._renderers: dict[str, TaskRenderer] = {}
        self.slots: list[MetaWorldTaskEnv] = []
        self._last_success: list[bool] = []
        self._done: list[bool] = []

    # -- env bookkeeping
    def _acquire(self, task: str) -> MetaWorldTaskEnv:
        free = self._pool.setdefault(task, [])
        return free.pop() if free else make_task_env(self.cfg, task)

    def _release_all(self) -> None:
        for env in self.slots:
            self._pool.setdefault(env.task, []).append(env)
        self.slots = []

    def _renderer(self, env: MetaWorldTaskEnv) -> TaskRenderer:
        if env.task not in self._renderers:
            self._renderers[env.task] = make_renderer(self.cfg, env)
        return self._renderers[env.task]

    def task_of_key(self, key: int) -> str:
        return self.cfg.tasks[decode_key(key)[0]]

    # -- observations
    def _observe(self, i: int, render: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        env = self.slots[i]
        s = self.settings
        img = self._renderer(env).render(env.data) if render else np.zeros((s.size, s.size, 3 * len(s.cameras)), np.uint8)
        return (img, *observed_vectors(self.cfg, env))

    def render(self, idx: list[int]) -> np.ndarray:
        return np.stack([self._observe(i, True)[0] for i in idx])

    # -- API
    def reset(self, keys: list[int]) -> dict[str, np.ndarray]:
        self._release_all()
        for key in keys:
            env = self._acquire(self.task_of_key(key))
            env.reset(key)
            self.slots.append(env)
        self._last_success = [False] * len(keys)
        self._done = [False] * len(keys)
        obs = [self._observe(i, True) for i in range(len(keys))]
        return {"image": np.stack([o[0] for o in obs]), "proprio": np.stack([o[1] for o in obs]),
                "state": np.stack([o[2] for o in obs])}

    def step_chunk(self, actions: np.ndarray, active: np.ndarray | None = None) -> ChunkResult:
        b, k = actions.shape[:2]
        if b != len(self.slots):
            raise ValueError(f"step_chunk got actions for {b} envs, the batch has {len(self.slots)}")
        active = np.ones(b, bool) if active is None else np.asarray(active, bool)
        reward = np.zeros((b, k), np.float32)
        success = np.zeros((b, k), bool)
        executed = np.zeros((b, k), bool)
        images, proprios, states = [], [], []
        for i, env in enumerate(self.slots):
            if active[i] and not self._done[i]:
                for j in range(k):
                    _, r, ok = env.step(actions[i, j])
                    reward[i, j], success[i, j], executed[i, j] = r, ok, True
                    self._last_success[i] = ok
                    if env.steps >= self.cfg.horizon or (ok and self.cfg.success_mode == "once"):
                        self._done[i] = True
                        break
                img, pro, st = self._observe(i, render=not self._done[i])
            else:
                img, pro, st = self._observe(i, render=False)
            images.append(img), proprios.append(pro), states.append(st)
        return ChunkResult(
            image=np.stack(images), proprio=np.stack(proprios), state=np.stack(states), reward=reward,
            success=success, executed=executed, done=np.array(self._done), 
            success_once=np.array([e.success_once for e in self.slots]), success_end=np.array(self._last_success),
        )

    def get_states(self, idx: list[int]) -> list[tuple[EnvState, bool, bool]]:
        return [(self.slots[i].get_state(), self._last_success[i], self._done[i]) for i in idx]

    def set_states(self, idx: list[int], states: list[tuple[EnvState, bool, bool]]) -> None:
        for i, (state, last_success, done) in zip(idx, states):
            if self.slots[i].task != state.task:
                self._pool.setdefault(self.slots[i].task, []).append(self.slots[i])
                self.slots[i] = self._acquire(state.task)
            self.slots[i].set_state(state)
            self._last_success[i] = last_success
            self._done[i] = done

    def close(self) -> None:
        for r in self._renderers.values():
            r.close()
        self._renderers = {}

    def __del__(self):  # an un-closed EGL context raises noisily at interpreter exit
        try:
            self.close()
        except Exception:
            pass


# -------------------------------------------------------------------------------------------------------------
# Worker processes


def _worker(conn, cfg_dict: dict) -> None:
    env = BatchedMetaWorld(EnvConfig(**cfg_dict))
    try:
        while True:
            cmd, args = conn.recv()
            if cmd == "close":
                break
            try:
                conn.send(("ok", getattr(env, cmd)(*args)))
            except Exception as e:  # report, keep serving
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        env.close()
        conn.close()


class SubprocMetaWorld:
    """The batch split in contiguous slices over ``num_workers`` processes (spawned: safe with EGL and torch)."""

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for _ in range(cfg.num_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, asdict(cfg)), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._slices: list[tuple[int, int]] = []
        self._keys: list[int] = []  # the episodes of the last reset (a dead worker's message names their tasks)

    def _call(self, per_worker: list[tuple[int, str, tuple]]) -> list:
        for w, cmd, args in per_worker:
            try:
                self._conns[w].send((cmd, args))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                raise self._died(w, cmd) from None
        out = []
        for w, cmd, _ in per_worker:
            try:
                status, value = self._conns[w].recv()
            except (EOFError, ConnectionResetError, OSError):  # the worker is gone (killed, OOM-killed, crashed)
                raise self._died(w, cmd) from None
            if status != "ok":
                raise RuntimeError(f"Meta-World worker {w} failed in {cmd}: {value}")
            out.append(value)
        return out

    def _died(self, w: int, cmd: str) -> WorkerDied:
        """The one-line stop for a worker whose pipe closed: which worker, its tasks, how it ended."""
        proc = self._procs[w]
        proc.join(timeout=10)  # its pipe closed because it exited: reap it to read how (bounded, never a hang)
        code = proc.exitcode
        if code is None:
            how = "its pipe closed while the process still runs"
        elif code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
            how = f"killed by {name}" + (" (the kernel's out-of-memory killer sends it when memory runs out)"
                                         if -code == signal.SIGKILL else "")
        else:
            how = f"exited with code {code}"
        a, b = self._slices[w] if w < len(self._slices) else (0, 0)
        tasks = sorted({self.cfg.tasks[decode_key(k)[0]] for k in self._keys[a:b]}) or ["none yet"]
        kind = "LIBERO" if self.cfg.kind == "libero" else "Meta-World"
        return WorkerDied(f"{kind} env worker {w} (pid {proc.pid}, task {', '.join(tasks)}) died during {cmd}: {how}")

    def _split(self, n: int) -> list[tuple[int, int]]:
        w = min(len(self._conns), n)
        bounds = np.linspace(0, n, w + 1).round().astype(int)
        return [(int(bounds[i]), int(bounds[i + 1])) for i in range(w)]

    def reset(self, keys: list[int]) -> dict[str, np.ndarray]:
        self._slices = self._split(len(keys))
        self._keys = list(keys)
        parts = self._call([(w, "reset", (list(keys[a:b]),)) for w, (a, b) in enumerate(self._slices)])
        return {k: np.concatenate([p[k] for p in parts], 0) for k in parts[0]}

    def step_chunk(self, actions: np.ndarray, active: np.ndarray | None = None) -> ChunkResult:
        active = np.ones(len(actions), bool) if active is None else np.asarray(active, bool)
        parts = self._call([(w, "step_chunk", (actions[a:b], active[a:b])) for w, (a, b) in enumerate(self._slices)])
        return ChunkResult.cat(parts)

    def _route(self, idx: list[int]) -> dict[int, list[tuple[int, int]]]:
        routes: dict[int, list[tuple[int, int]]] = {}
        for pos, i in enumerate(idx):
            for w, (a, b) in enumerate(self._slices):
                if a <= i < b:
                    routes.setdefault(w, []).append((pos, i - a))
        return routes

    def get_states(self, idx: list[int]) -> list:
        routes = self._route(idx)
        parts = self._call([(w, "get_states", ([j for _, j in r],)) for w, r in routes.items()])
        out: list = [None] * len(idx)
        for (w, r), states in zip(routes.items(), parts):
            for (pos, _), s in zip(r, states):
                out[pos] = s
        return out

    def set_states(self, idx: list[int], states: list) -> None:
        routes = self._route(idx)
        self._call([(w, "set_states", ([j for _, j in r], [states[pos] for pos, _ in r])) for w, r in routes.items()])

    def render(self, idx: list[int]) -> np.ndarray:
        routes = self._route(idx)
        parts = self._call([(w, "render", ([j for _, j in r],)) for w, r in routes.items()])
        out = [None] * len(idx)
        for (w, r), imgs in zip(routes.items(), parts):
            for (pos, _), im in zip(r, imgs):
                out[pos] = im
        return np.stack(out)

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        self._conns, self._procs = [], []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def make_vector_env(cfg: EnvConfig):
    """The batched env for ``cfg``: Meta-World in-process or over workers, or the synthetic point env."""
    if cfg.kind == "point":
        from .point import PointReachVec

        return PointReachVec(cfg)
    return SubprocMetaWorld(cfg) if cfg.num_workers > 0 else BatchedMetaWorld(cfg)
