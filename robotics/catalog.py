"""The robotics domain's names for ``grove list`` (registered as ``shared_rl.registry.CATALOGS["robotics"]``).

Written as text: reading them from the config and the environments imports MuJoCo and Meta-World (seconds), and
``grove list`` should answer at once; ``tests/core/test_docs_match.py`` checks each list against its source
(``RoboticsConfig.head_mode``, ``robotics.envs.vector.DEFAULT_TASKS``, ``metaworld_env.known_tasks()``,
``libero_tasks.SUITES``).
"""
from __future__ import annotations

HEAD_MODES = ("flow_sde", "flow_noise", "sde_one_step", "fpo", "discrete")
DEFAULT_TASKS = ("reach-v3", "push-v3", "door-open-v3", "button-press-topdown-v3", "drawer-close-v3")
METAWORLD_V3_TASKS = (
    "assembly-v3", "basketball-v3", "bin-picking-v3", "box-close-v3", "button-press-topdown-v3",
    "button-press-topdown-wall-v3", "button-press-v3", "button-press-wall-v3", "coffee-button-v3", "coffee-pull-v3",
    "coffee-push-v3", "dial-turn-v3", "disassemble-v3", "door-close-v3", "door-lock-v3", "door-open-v3",
    "door-unlock-v3", "drawer-close-v3", "drawer-open-v3", "faucet-close-v3", "faucet-open-v3", "hammer-v3",
    "hand-insert-v3", "handle-press-side-v3", "handle-press-v3", "handle-pull-side-v3", "handle-pull-v3",
    "lever-pull-v3", "peg-insert-side-v3", "peg-unplug-side-v3", "pick-out-of-hole-v3", "pick-place-v3",
    "pick-place-wall-v3", "plate-slide-back-side-v3", "plate-slide-back-v3", "plate-slide-side-v3", "plate-slide-v3",
    "push-back-v3", "push-v3", "push-wall-v3", "reach-v3", "reach-wall-v3", "shelf-place-v3", "soccer-v3",
    "stick-pull-v3", "stick-push-v3", "sweep-into-v3", "sweep-v3", "window-close-v3", "window-open-v3")
TOOLS = ("collect", "from-lerobot", "to-lerobot")
# LIBERO's suites (``robotics.envs.libero_tasks.SUITES``) as grove names their tasks, SUITE/INDEX
LIBERO_TASKS = ("libero_spatial/0..9", "libero_object/0..9", "libero_goal/0..9", "libero_10/0..9", "libero_90/0..89")


def catalog() -> dict[str, list[str]]:
    return {
        "exploration modes (robotics.head_mode)": list(HEAD_MODES),
        "default tasks (robotics.env.tasks; the BC asset's)": list(DEFAULT_TASKS),
        "all Meta-World v3 tasks (robotics.env.tasks)": list(METAWORLD_V3_TASKS),
        "LIBERO tasks (robotics.env.tasks with robotics.env.kind: libero; SUITE/<LIBERO task name> also works)":
            list(LIBERO_TASKS),
        "tools (grove robotics TOOL)": list(TOOLS),
    }
