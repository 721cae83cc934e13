"""The visgen domain's names for ``grove list`` (registered as ``shared_rl.registry.CATALOGS["visgen"]``)."""
from __future__ import annotations


def catalog() -> dict[str, list[str]]:
    from .domain import _import_optional_rewards
    from .methods import METHODS
    from .pipelines import ADAPTERS
    from .rewards import available_rewards

    _import_optional_rewards()
    return {
        "rollout methods (visgen.method.name)": sorted(METHODS),
        "rewards (visgen.rewards[].name)": available_rewards(),
        "SDE kernels (visgen.kernel)": ["cps", "dance", "sde"],
        "pipeline families (visgen.model: a diffusers pipeline of one of these)": sorted(ADAPTERS),
    }
