"""The robotics domain's names for ``grove list`` (registered as ``shared_rl.registry.CATALOGS["robotics"]``)."""
from __future__ import annotations


def catalog() -> dict[str, list[str]]:
    import typing

    from .domain import RoboticsConfig
    from .envs.metaworld_env import known_tasks
    from .envs.vector import DEFAULT_TASKS

    head_modes = [str(m) for m in typing.get_args(typing.get_type_hints(RoboticsConfig)["head_mode"])]
    return {
        "exploration modes (robotics.head_mode)": head_modes,
        "default tasks (robotics.env.tasks; the BC asset's)": list(DEFAULT_TASKS),
        "all Meta-World v3 tasks (robotics.env.tasks)": known_tasks(),
        "tools (grove robotics TOOL)": ["collect", "from-lerobot", "to-lerobot"],
    }
