"""Simulated environments for robotics RL: Meta-World v3 tasks (gymnasium, batched, multi-process)."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

from .metaworld_env import (  # noqa: E402
    TASK_INSTRUCTIONS,
    EnvState,
    MetaWorldTaskEnv,
    RenderSettings,
    TaskRenderer,
    decode_key,
    instruction_for,
    make_key,
    proprio_from_obs,
    reset_seed,
)
from .vector import DEFAULT_TASKS, BatchedMetaWorld, ChunkResult, EnvConfig, SubprocMetaWorld, make_vector_env  # noqa: E402

__all__ = [
    "TASK_INSTRUCTIONS", "EnvState", "MetaWorldTaskEnv", "RenderSettings", "TaskRenderer", "decode_key",
    "instruction_for", "make_key", "proprio_from_obs", "reset_seed", "DEFAULT_TASKS", "BatchedMetaWorld",
    "ChunkResult", "EnvConfig", "SubprocMetaWorld", "make_vector_env",
]
