"""Meta-World 3.x tasks with reset-state keys, fast 64x64 rendering, chunked stepping and state save/restore.

Reset states. A *reset-state key* is an int that names (task, split, index). The env seed is derived from all
three with ``numpy.random.SeedSequence``, and the Meta-World env draws its object/goal positions from a
``np_random`` seeded with it (``_freeze_rand_vec=False, seeded_rand_vec=True``). Train keys use split 0 and eval
keys split 1, so the two sets are disjoint by construction (different keys, different seeds; the test also
checks that no eval object/goal vector equals a training one). We never write ``env._last_rand_vec`` by hand:
``reach-v3`` re-draws its goal in a ``while`` loop until goal and hand are 15 cm apart, and a frozen vector that
violates that makes the reset loop forever.

Rendering (measured, DESIGN.md §5/§7): the default scene renders ~16 frames/s on 2 busy cores; one
``mujoco.Renderer`` per task with shadows, reflections and skybox off and ``model.vis.quality.offsamples = 0``
set *before* the renderer (its framebuffer) is made renders ~150-250 frames/s at 64x64. A renderer is re-used
by every env of the same task in the process via ``update_scene(env.data)``: geometry and colours come from the
model, positions from ``data`` (per-reset model edits such as the door body position reach ``data`` through
``mj_forward``). The ``corner`` camera has its y axis pointing down (``xyaxes`` in Meta-World's
``xyz_base.xml``), so its image is rotated by 180 degrees; we rotate it back (a vertical flip alone would
mirror the scene).
"""
from __future__ import annotations

import atexit
import copy
import os
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

import mujoco  # the headless backend (MUJOCO_GL) is chosen in robotics/__init__.py, which runs first
import numpy as np

# the task table and proprio sizes import no simulator (grove config show); re-exported here
from .settings import TASK_INSTRUCTIONS, RenderSettings, proprio_dim  # noqa: F401


SPLITS = {"train": 0, "eval": 1}
# key = task_index * TASK_STRIDE + split * SPLIT_STRIDE + index, index < SPLIT_STRIDE
TASK_STRIDE = 1_000_000
SPLIT_STRIDE = 500_000

CAMERAS_ROTATED_180 = frozenset({"corner"})
_MJ_STATE = mujoco.mjtState.mjSTATE_INTEGRATION


def instruction_for(task: str) -> str:
    if task in TASK_INSTRUCTIONS:
        return TASK_INSTRUCTIONS[task]
    from . import libero_tasks  # no simulator import: the task table only

    if libero_tasks.is_libero_task(task):
        return libero_tasks.language(task)
    return task.removesuffix("-v3").replace("-", " ")


def make_key(task_index: int, split: str, index: int) -> int:
    """The reset-state key of reset ``index`` of task ``task_index`` in ``split`` ("train" or "eval")."""
    if not 0 <= index < SPLIT_STRIDE:
        raise ValueError(f"reset-state index must be in [0, {SPLIT_STRIDE}), got {index}")
    return task_index * TASK_STRIDE + SPLITS[split] * SPLIT_STRIDE + index


def decode_key(key: int) -> tuple[int, str, int]:
    """Inverse of :func:`make_key`: (task_index, split, index)."""
    task_index, rest = divmod(int(key), TASK_STRIDE)
    split_id, index = divmod(rest, SPLIT_STRIDE)
    return task_index, ("train", "eval")[split_id], index


def reset_seed(task: str, split: str, index: int) -> int:
    """The env seed of a reset state; depends on the task *name* so adding tasks never shifts other seeds."""
    entropy = [zlib.crc32(task.encode()), SPLITS[split], index, 0x6772_6F76]  # "grov"
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


# -------------------------------------------------------------------------------------------------------------
# Rendering


_LIVE_RENDERERS: weakref.WeakSet = weakref.WeakSet()  # TaskRenderer / LiberoRenderer


_ATEXIT_REGISTERED = False


def _close_live_renderers() -> None:
    # EGL contexts freed by the garbage collector after mujoco.egl has terminated the display raise noisy
    # EGLErrors at exit. atexit runs LIFO, so this is registered after the first renderer exists (mujoco.egl
    # registers its own handler when it is first imported, i.e. when that renderer is made).
    for r in list(_LIVE_RENDERERS):
        r.close()


def _register_renderer(renderer) -> None:
    """Close ``renderer`` (anything with ``close()``) at exit unless it was closed before; call after it made its
    GL context."""
    global _ATEXIT_REGISTERED
    _LIVE_RENDERERS.add(renderer)
    if not _ATEXIT_REGISTERED:
        atexit.register(_close_live_renderers)
        _ATEXIT_REGISTERED = True


_LLVM_GUARDED = False


def _load_triton_llvm_first() -> None:
    """Load triton's native library before Mesa's EGL driver, once per process.

    Mesa llvmpipe (the CPU EGL renderer) and triton each bring an LLVM. If the EGL context exists first, the
    later ``import triton`` (pulled in lazily by torch: ``torch.optim.AdamW`` imports ``torch._dynamo``)
    segfaults; in the other order both work (measured on torch 2.14 / triton 3.8 / Mesa llvmpipe).
    """
    global _LLVM_GUARDED
    if _LLVM_GUARDED:
        return
    _LLVM_GUARDED = True
    if os.environ.get("MUJOCO_GL", "egl") != "egl":
        return
    import importlib.util

    try:
        if importlib.util.find_spec("triton") is not None:
            import triton._C.libtriton  # noqa: F401
    except Exception:  # a broken triton install must not stop rendering
        pass


class TaskRenderer:
    """One ``mujoco.Renderer`` for all envs of one task in this process (see module docstring for why)."""

    def __init__(self, model: mujoco.MjModel, settings: RenderSettings):
        self.settings = settings
        _load_triton_llvm_first()
        if settings.tuned:
            # offsamples sizes the multisample framebuffer, which is made with the renderer: set it first.
            model.vis.quality.offsamples = 0
        self.renderer = mujoco.Renderer(model, settings.size, settings.size)
        _register_renderer(self)
        if settings.tuned:
            flags = self.renderer.scene.flags
            flags[mujoco.mjtRndFlag.mjRND_SHADOW] = False
            flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = False
            flags[mujoco.mjtRndFlag.mjRND_SKYBOX] = False

    def render(self, data: mujoco.MjData) -> np.ndarray:
        """``[H, W, 3 * len(cameras)]`` uint8, cameras stacked on the channel axis, upright."""
        frames = []
        for cam in self.settings.cameras:
            self.renderer.update_scene(data, camera=cam)
            img = self.renderer.render()
            if cam in CAMERAS_ROTATED_180:
                img = img[::-1, ::-1]
            frames.append(img)
        return np.ascontiguousarray(np.concatenate(frames, axis=-1))

    def close(self) -> None:
        if self.renderer is not None:
            try:
                self.renderer.close()
            except Exception:  # the GL context may already be gone at interpreter exit
                pass
            self.renderer = None


# -------------------------------------------------------------------------------------------------------------
# One env


@dataclass
class EnvState:
    """Everything needed to continue an episode bit-identically in another env instance of the same task."""

    task: str
    key: int
    physics: np.ndarray  # mj_getState(mjSTATE_INTEGRATION)
    body_pos: np.ndarray  # Meta-World moves bodies/sites in the *model* at reset (door, drawer, goal site)
    body_quat: np.ndarray
    site_pos: np.ndarray
    attrs: dict[str, Any]  # the env's own Python fields (targets, path length, previous obs, its rng)
    steps: int
    success_once: bool
    last_obs: np.ndarray


# Fields of a Meta-World env that are structure, not state (or are rebuilt lazily).
_STRUCTURE_FIELDS = frozenset(
    {
        "model", "data", "mujoco_renderer", "observation_space", "action_space", "_random_reset_space",
        "goal_space", "init_config", "_ezpickle_args", "_ezpickle_kwargs", "sawyer_observation_space",
        "fullpath", "spec", "np_random",
    }
)


class MetaWorldTaskEnv:
    """A Meta-World v3 task with goal-observable 39-d state, seeded resets and episode bookkeeping.

    The episode bookkeeping (``steps``, ``success_once``) lives here, not in Meta-World, so the horizon is ours
    (Meta-World raises after its own ``max_path_length``, which we lift out of the way).
    """

    def __init__(self, task: str):
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE

        name = f"{task}-goal-observable"
        if name not in ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE:
            known = sorted(k.removesuffix("-goal-observable") for k in ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE)
            raise ValueError(f"unknown Meta-World task {task!r}; known v3 tasks: {', '.join(known)}")
        self.task = task
        self.env = ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE[name]()
        self.env._freeze_rand_vec = False
        self.env.seeded_rand_vec = True
        self.env.max_path_length = 10**9
        self.key: int | None = None
        self.steps = 0
        self.success_once = False
        self.last_obs = np.zeros(39)

    @property
    def model(self) -> mujoco.MjModel:
        return self.env.model

    @property
    def data(self) -> mujoco.MjData:
        return self.env.data

    def reset(self, key: int) -> np.ndarray:
        """Reset to reset state ``key`` (same key -> same state, whatever this env did before). Returns 39-d obs."""
        _, split, index = decode_key(key)
        self.env.seed(reset_seed(self.task, split, index))
        obs, _ = self.env.reset()
        # Meta-World's reset leaves some derived quantities (site positions) from before the reset, which shows
        # in the rendered frame; recompute them so a reset state renders identically in every env instance.
        mujoco.mj_forward(self.env.model, self.env.data)
        self.key = int(key)
        self.steps = 0
        self.success_once = False
        self.last_obs = np.asarray(obs, dtype=np.float64)
        return self.last_obs

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool]:
        """One control step (clipped to [-1, 1]). Returns (obs, dense Meta-World reward, success now)."""
        obs, reward, _, _, info = self.env.step(np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0))
        self.steps += 1
        success = bool(info.get("success", 0.0) > 0.5)
        self.success_once |= success
        self.last_obs = np.asarray(obs, dtype=np.float64)
        return self.last_obs, float(reward), success

    def get_state(self) -> EnvState:
        env = self.env
        physics = np.empty(mujoco.mj_stateSize(env.model, _MJ_STATE))
        mujoco.mj_getState(env.model, env.data, physics, _MJ_STATE)
        attrs: dict[str, Any] = {}
        for name, value in env.__dict__.items():
            if name in _STRUCTURE_FIELDS:
                continue
            if isinstance(value, np.ndarray):
                attrs[name] = value.copy()
            elif isinstance(value, (bool, int, float, str, type(None), np.generic)):
                attrs[name] = value
            elif isinstance(value, np.random.Generator):
                attrs[name] = copy.deepcopy(value)
        return EnvState(
            task=self.task,
            key=int(self.key if self.key is not None else -1),
            physics=physics,
            body_pos=env.model.body_pos.copy(),
            body_quat=env.model.body_quat.copy(),
            site_pos=env.model.site_pos.copy(),
            attrs=attrs,
            steps=self.steps,
            success_once=self.success_once,
            last_obs=self.last_obs.copy(),
        )

    def set_state(self, state: EnvState) -> None:
        if state.task != self.task:
            raise ValueError(f"cannot restore a {state.task!r} state into a {self.task!r} env")
        env = self.env
        for name, value in state.attrs.items():
            setattr(env, name, value.copy() if isinstance(value, np.ndarray) else copy.deepcopy(value))
        env.model.body_pos[:] = state.body_pos
        env.model.body_quat[:] = state.body_quat
        env.model.site_pos[:] = state.site_pos
        mujoco.mj_setState(env.model, env.data, state.physics, _MJ_STATE)
        # mj_forward recomputes positions, contacts and sensors (what observations and rendering read) but also
        # overwrites qacc_warmstart; set the state again so the next solver call warm-starts exactly as it
        # would have in the original episode (otherwise continuations drift at the 1e-14 level).
        mujoco.mj_forward(env.model, env.data)
        mujoco.mj_setState(env.model, env.data, state.physics, _MJ_STATE)
        self.key = state.key
        self.steps = state.steps
        self.success_once = state.success_once
        self.last_obs = state.last_obs.copy()

    def rand_vec(self) -> np.ndarray:
        """The object/goal vector drawn at the last reset (what makes reset states differ)."""
        return np.asarray(self.env._last_rand_vec, dtype=np.float64).copy()


# fields of Meta-World's 39-d state vector
HAND_AND_GRIPPER = slice(0, 4)  # hand xyz, gripper opening
OBJECT_XYZ = slice(4, 7)  # the first object: push's puck, the door / drawer handle, the button
GOAL_XYZ = slice(36, 39)


def proprio_from_obs(obs: np.ndarray, include_goal: bool = False, include_object: bool = False) -> np.ndarray:
    """Robot proprioception from the 39-d Meta-World state: hand xyz (0:3) and gripper opening (3).

    ``include_object`` appends the first object's xyz (4:7: the puck, the door or drawer handle, the button), as a
    pose estimator would give it; ``include_goal`` then appends the goal xyz (36:39). At 64x64 the reach goal and
    push's puck are 1-2 pixels, and a frozen tiny encoder places the puck to only ~3 cm.
    """
    parts = [obs[..., HAND_AND_GRIPPER]]
    if include_object:
        parts.append(obs[..., OBJECT_XYZ])
    if include_goal:
        parts.append(obs[..., GOAL_XYZ])
    return np.concatenate(parts, axis=-1).astype(np.float32)


SuccessMode = Literal["once", "end"]


def known_tasks() -> list[str]:
    """Meta-World v3 task names (``reach-v3``, ...)."""
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE

    return sorted(k.removesuffix("-goal-observable") for k in ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE)
