"""A tiny synthetic reaching env with the same batched API as the Meta-World vector envs.

A point starts near the centre of the unit square and must come within ``radius`` of a goal; actions are 4-d
like Meta-World's (the first two move the point by ``0.1·a``; the rest are ignored). Frames are 64x64 drawn
with numpy (agent white, goal red), proprio is (x, y, goal_x, goal_y). Goals of all reset states lie in the
upper-right quadrant, so a randomly initialised policy succeeds sometimes and RL can find the direction within
a few iterations: it exists for fast learning tests of the whole domain (rollout → log-probs → trainer) without
a physics engine, and as a template for plugging in another env.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .metaworld_env import decode_key
from .results import ChunkResult

POINT_TASK = "point-reach"


@dataclass
class PointState:
    task: str
    pos: np.ndarray
    goal: np.ndarray
    steps: int
    success_once: bool
    last_success: bool
    done: bool


class PointReachVec:
    def __init__(self, cfg):
        self.cfg = cfg
        self.size = cfg.image_size
        self.radius = 0.15
        self.pos = np.zeros((0, 2))
        self.goal = np.zeros((0, 2))

    def _reset_one(self, key: int) -> tuple[np.ndarray, np.ndarray]:
        _, split, index = decode_key(key)
        rng = np.random.default_rng([index, {"train": 0, "eval": 1}[split], 7])
        pos = 0.5 + rng.uniform(-0.05, 0.05, 2)
        goal = np.array([0.72, 0.72]) + rng.uniform(-0.05, 0.05, 2)
        return pos, goal

    def _frame(self, i: int) -> np.ndarray:
        s = self.size
        img = np.zeros((s, s, 3 * len(self.cfg.cameras)), np.uint8)
        for p, colour in ((self.goal[i], (255, 0, 0)), (self.pos[i], (255, 255, 255))):
            y, x = (np.clip(p, 0, 1) * (s - 4)).astype(int)
            img[s - 4 - y : s - y, x : x + 4, :3] = colour
        return img

    def _proprio(self, i: int) -> np.ndarray:
        p = np.concatenate([self.pos[i], self.goal[i]]).astype(np.float32)
        return p if self.cfg.include_goal else np.concatenate([self.pos[i], [0.0, 0.0]]).astype(np.float32)

    def _obs(self, idx, render_mask):
        imgs = np.stack([self._frame(i) if render_mask[i] else np.zeros((self.size, self.size, 3 * len(self.cfg.cameras)), np.uint8) for i in idx])
        pro = np.stack([self._proprio(i) for i in idx])
        state = np.zeros((len(idx), 39), np.float32)
        state[:, :2], state[:, 36:38] = self.pos[idx], self.goal[idx]
        return imgs, pro, state

    def reset(self, keys: list[int]) -> dict[str, np.ndarray]:
        pg = [self._reset_one(k) for k in keys]
        self.pos = np.array([p for p, _ in pg])
        self.goal = np.array([g for _, g in pg])
        self.steps = np.zeros(len(keys), int)
        self.success_once = np.zeros(len(keys), bool)
        self.last_success = np.zeros(len(keys), bool)
        self.done = np.zeros(len(keys), bool)
        imgs, pro, state = self._obs(range(len(keys)), np.ones(len(keys), bool))
        return {"image": imgs, "proprio": pro, "state": state}

    def step_chunk(self, actions: np.ndarray, active: np.ndarray | None = None):
        b, k = actions.shape[:2]
        active = np.ones(b, bool) if active is None else np.asarray(active, bool)
        reward = np.zeros((b, k), np.float32)
        success = np.zeros((b, k), bool)
        executed = np.zeros((b, k), bool)
        for i in range(b):
            if not active[i] or self.done[i]:
                continue
            for j in range(k):
                self.pos[i] = np.clip(self.pos[i] + 0.1 * np.clip(actions[i, j, :2], -1, 1), 0, 1)
                self.steps[i] += 1
                dist = float(np.linalg.norm(self.pos[i] - self.goal[i]))
                ok = dist < self.radius
                reward[i, j], success[i, j], executed[i, j] = 10.0 * (1 - min(dist, 1.0)), ok, True
                self.success_once[i] |= ok
                self.last_success[i] = ok
                if self.steps[i] >= self.cfg.horizon or (ok and self.cfg.success_mode == "once"):
                    self.done[i] = True
                    break
        imgs, pro, state = self._obs(range(b), active & ~self.done)
        return ChunkResult(image=imgs, proprio=pro, state=state, reward=reward, success=success, executed=executed,
                           done=self.done.copy(), success_once=self.success_once.copy(), success_end=self.last_success.copy())

    def get_states(self, idx: list[int]) -> list[PointState]:
        return [PointState(POINT_TASK, self.pos[i].copy(), self.goal[i].copy(), int(self.steps[i]),
                           bool(self.success_once[i]), bool(self.last_success[i]), bool(self.done[i])) for i in idx]

    def set_states(self, idx: list[int], states: list[PointState]) -> None:
        for i, s in zip(idx, states):
            self.pos[i], self.goal[i], self.steps[i] = s.pos.copy(), s.goal.copy(), s.steps
            self.success_once[i], self.last_success[i], self.done[i] = s.success_once, s.last_success, s.done

    def render(self, idx: list[int]) -> np.ndarray:
        return np.stack([self._frame(i) for i in idx])

    def close(self) -> None:
        pass
