"""Simulated environments for robotics RL: Meta-World v3 tasks (gymnasium, batched, multi-process).

The MuJoCo/OpenGL backend defaults are set in ``robotics/__init__.py``, which Python runs before this package.
"""
from .metaworld_env import (
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
from .results import ChunkResult
from .vector import DEFAULT_TASKS, BatchedMetaWorld, EnvConfig, SubprocMetaWorld, make_vector_env

__all__ = [
    "TASK_INSTRUCTIONS", "EnvState", "MetaWorldTaskEnv", "RenderSettings", "TaskRenderer", "decode_key",
    "instruction_for", "make_key", "proprio_from_obs", "reset_seed", "DEFAULT_TASKS", "BatchedMetaWorld",
    "ChunkResult", "EnvConfig", "SubprocMetaWorld", "make_vector_env",
]
