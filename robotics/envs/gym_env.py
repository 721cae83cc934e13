"""A Meta-World task behind the standard ``gymnasium.Env`` interface (for users and third-party tools).

Observation: ``{"image": uint8 [H, W, 3*cams], "proprio": float32 [P], "state": float32 [39]}``; the
instruction text is ``env.instruction``. ``reset(options={"key": k})`` picks a reset state by key;
``reset(seed=s)`` picks training reset state ``s`` of this task. Reward is the success flag (0/1) plus
``dense_weight`` times Meta-World's shaped reward / 10. ``terminated`` is True at the first success when
``success_mode="once"``; ``truncated`` at the horizon. ``info`` carries ``success`` (this step),
``success_once`` and ``success_end`` explicitly. ``step_chunk`` runs K actions and renders once.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from .metaworld_env import (
    EnvState,
    MetaWorldTaskEnv,
    RenderSettings,
    TaskRenderer,
    decode_key,
    instruction_for,
    make_key,
    proprio_dim,
    proprio_from_obs,
)


class MetaWorldGymEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(
        self,
        task: str = "reach-v3",
        task_index: int = 0,
        horizon: int = 150,
        success_mode: str = "once",
        image_size: int = 64,
        cameras: tuple[str, ...] = ("corner",),
        include_goal: bool = False,
        include_object: bool = False,
        dense_weight: float = 0.0,
        render_tuned: bool = True,
    ):
        if success_mode not in ("once", "end"):
            raise ValueError(f"success_mode must be 'once' or 'end', got {success_mode!r}")
        self.task, self.task_index = task, task_index
        self.instruction = instruction_for(task)
        self.horizon, self.success_mode = horizon, success_mode
        self.include_goal, self.include_object, self.dense_weight = include_goal, include_object, dense_weight
        self._env = MetaWorldTaskEnv(task)
        self._renderer = TaskRenderer(self._env.model, RenderSettings(image_size, list(cameras), render_tuned))
        self.render_mode = "rgb_array"
        c = 3 * len(cameras)
        self.observation_space = gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (image_size, image_size, c), np.uint8),
                "proprio": gym.spaces.Box(-np.inf, np.inf, (proprio_dim(include_goal, include_object),), np.float32),
                "state": gym.spaces.Box(-np.inf, np.inf, (39,), np.float32),
            }
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)

    def _obs(self) -> dict[str, np.ndarray]:
        return {
            "image": self._renderer.render(self._env.data),
            "proprio": proprio_from_obs(self._env.last_obs, self.include_goal, self.include_object),
            "state": self._env.last_obs.astype(np.float32),
        }

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if "key" in options:
            key = int(options["key"])
            if decode_key(key)[0] != self.task_index:
                raise ValueError(f"key {key} belongs to task index {decode_key(key)[0]}, this env is {self.task_index}")
        else:
            key = make_key(self.task_index, options.get("split", "train"), int(options.get("index", seed or 0)))
        self._env.reset(key)
        self._last_success = False
        return self._obs(), {"key": key, "instruction": self.instruction}

    def _step_no_render(self, action: np.ndarray) -> tuple[float, bool, bool, dict]:
        _, dense, success = self._env.step(action)
        self._last_success = success
        reward = float(success) + self.dense_weight * dense / 10.0
        terminated = success and self.success_mode == "once"
        truncated = self._env.steps >= self.horizon and not terminated
        info = {"success": success, "success_once": self._env.success_once, "success_end": success,
                "dense_reward": dense}
        return reward, terminated, truncated, info

    def step(self, action):
        reward, terminated, truncated, info = self._step_no_render(action)
        return self._obs(), reward, terminated, truncated, info

    def step_chunk(self, actions: np.ndarray):
        """Execute up to K actions (stops at episode end); render once. Returns per-step rewards in info."""
        rewards, info, terminated, truncated = [], {}, False, False
        for a in actions:
            r, terminated, truncated, info = self._step_no_render(a)
            rewards.append(r)
            if terminated or truncated:
                break
        info = dict(info, rewards=np.array(rewards, np.float32), steps_executed=len(rewards))
        return self._obs(), float(sum(rewards)), terminated, truncated, info

    def render(self) -> np.ndarray:
        return self._renderer.render(self._env.data)[..., :3]

    def get_state(self) -> EnvState:
        return self._env.get_state()

    def set_state(self, state: EnvState) -> None:
        self._env.set_state(state)

    def close(self) -> None:
        self._renderer.close()
