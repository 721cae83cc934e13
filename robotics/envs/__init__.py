"""Simulated environments for robotics RL: Meta-World v3 tasks (gymnasium, batched, multi-process).

The MuJoCo/OpenGL backend defaults are set in ``robotics/__init__.py``, which Python runs before this package.
The names below are imported on first use (``robotics.envs.EnvConfig`` as before): importing a light submodule
(``robotics.envs.settings``, the ``env`` section; ``robotics.envs.libero_tasks``' task table) imports no
simulator, so ``grove config show`` reads a robotics config without MuJoCo or torch (issue 64).
"""
from __future__ import annotations

from shared_rl.lazy import lazy_attributes

_LAZY = {
    **dict.fromkeys(["EnvState", "MetaWorldTaskEnv", "RenderSettings", "TaskRenderer", "decode_key",
                     "instruction_for", "make_key", "proprio_from_obs", "reset_seed"], "metaworld_env"),
    "TASK_INSTRUCTIONS": "settings",
    "DEFAULT_TASKS": "settings",
    "EnvConfig": "settings",
    "ChunkResult": "results",
    **dict.fromkeys(["BatchedMetaWorld", "SubprocMetaWorld", "make_vector_env"], "vector"),
}

__all__ = [
    "TASK_INSTRUCTIONS", "EnvState", "MetaWorldTaskEnv", "RenderSettings", "TaskRenderer", "decode_key",
    "instruction_for", "make_key", "proprio_from_obs", "reset_seed", "DEFAULT_TASKS", "BatchedMetaWorld",
    "ChunkResult", "EnvConfig", "SubprocMetaWorld", "make_vector_env",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
