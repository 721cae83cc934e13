"""The visgen domain's names for ``grove list`` (registered as ``shared_rl.registry.CATALOGS["visgen"]``).

The method and pipeline registries import diffusers (seconds), so their names come from the torch-free specs
(``visgen.method_settings.METHOD_SPECS``, ``visgen.objective_settings.OBJECTIVE_SPECS``), are written here as text or
read from the registering source, and ``grove list`` imports neither diffusers nor torch; ``tests/core/test_docs_match.py``
checks each list against its registry (``visgen.methods.METHODS``, ``visgen.objectives.OBJECTIVES``,
``visgen.tasks.TASKS``, ``visgen.pipelines.ADAPTERS``, ``VisgenConfig.kernel``).
The rewards are read from their modules' ``@register("name", ...)`` lines (``shared_rl.part_index.registered_names``):
registering them imports no model library but does import torch (seconds), which ``grove list`` must not wait for;
``tests/core/test_cli_list.py`` checks ``reward_names()`` against ``register_rewards()``.
"""
from __future__ import annotations

from pathlib import Path

from shared_rl.part_index import registered_names

from .method_settings import METHOD_SPECS
from .objective_settings import OBJECTIVE_SPECS

_HERE = Path(__file__).resolve().parent


def _read(sources, decorator: str) -> tuple[str, ...]:
    """The names ``@decorator`` registers in ``sources`` (``shared_rl.part_index.registered_names``: read, not
    imported)."""
    return tuple(sorted({name for path in sources for name in registered_names(path, decorator)}))


# the built-in methods and objectives: their torch-free specs (each live entry subclasses its spec)
METHODS = tuple(sorted(METHOD_SPECS))
OBJECTIVES = tuple(sorted(OBJECTIVE_SPECS))
# tasks are classes registered with a bare decorator and a literal `name`: read from the source, so a new one is
# listed without an edit here (a few milliseconds of parsing)
TASKS = _read(sorted((_HERE / "tasks").glob("*.py")), "register_task")
KERNELS = ("cps", "dance", "sde")
PIPELINE_FAMILIES = ("flux", "flux2", "flux2_klein", "hunyuan_video15", "ltx2", "qwen_image", "sana", "sd3", "wan",
                     "z_image")


def register_rewards() -> list[str]:
    """Every built-in image and video reward registered (the set ``visgen.domain`` checks names against); their
    names."""
    from .rewards import available_rewards, hps, pickscore, shapes_soft, video  # noqa: F401  (they register)

    return available_rewards()


def reward_names() -> list[str]:
    """The built-in rewards, sorted, from the source of ``visgen/rewards/`` (nothing imported)."""
    return list(_read(sorted((_HERE / "rewards").glob("*.py")), "register"))


def catalog() -> dict[str, list[str]]:
    return {
        "rollout methods (visgen.method.name)": list(METHODS),
        "training objectives (visgen.objective.name)": list(OBJECTIVES),
        "tasks (visgen.task)": list(TASKS),
        "rewards (visgen.rewards[].name; grove rewards describes each)": reward_names(),
        "SDE kernels (visgen.kernel)": list(KERNELS),
        "pipeline families (visgen.model: a diffusers pipeline of one of these)": list(PIPELINE_FAMILIES),
    }
