"""Domains, supervised entry points, benchmarks and CLI command groups, found by name.

Strings (``"module:attr"``) keep the static layering clean: ``shared_rl`` never imports ``visgen`` or
``robotics``; they are imported only when a config or a command line names them. Third-party packages add
entries through the ``grove.domains`` / ``grove.supervised`` / ``grove.benchmarks`` / ``grove.commands`` /
``grove.catalogs`` entry-point groups (a built-in name wins over an entry point of the same name).
"""
from __future__ import annotations

import difflib
import importlib
import re
from importlib.metadata import entry_points
from typing import Any

from .errors import ConfigError

DOMAINS: dict[str, str] = {
    "toy": "shared_rl.toy:ToyDomain",
    "llm": "shared_rl.llm.domain:LLMDomain",
    "visgen": "visgen.domain:VisgenDomain",
    "robotics": "robotics.domain:RoboticsDomain",
}

# Each built-in domain's settings class (its ``config_class``), importable without the domain's module, which
# imports torch and the domain's packages: a config is read and checked (grove config show, the CLI's checks)
# without them. tests/core/test_part_index.py checks each is the domain's config_class. Entry-point domains are
# read through their domain class.
DOMAIN_CONFIGS: dict[str, str] = {
    "toy": "shared_rl.toy_config:ToyConfig",
    "llm": "shared_rl.llm.config:LLMConfig",
    "visgen": "visgen.config:VisgenConfig",
    "robotics": "robotics.config:RoboticsConfig",
}

SUPERVISED: dict[str, str] = {
    "llm": "shared_rl.llm.pretrain:run",
    "visgen": "visgen.pretrain:run",
    "robotics": "robotics.bc:run",
    "robotics-wm": "robotics.world_model.train:run",
}

# ``grove pretrain --dry-run``: where each built-in supervised job's settings are checked without running it, as
# (a dataclass for ``shared_rl.config.from_dict`` or a function ``settings -> resolved``, the name its errors use)
SUPERVISED_SETTINGS: dict[str, tuple[str, str]] = {
    "llm": ("shared_rl.llm.pretrain:SFTConfig", "sft"),
    "visgen": ("visgen.pretrain:load_config", "pretrain"),
    "robotics": ("robotics.bc:BCConfig", "robotics-bc"),
    "robotics-wm": ("robotics.world_model.train:WorldModelTrainConfig", "robotics-wm"),
}

BENCHMARKS: dict[str, str] = {
    "llm": "bench.llm_vs_trl:run",
    "robotics-sim": "bench.robotics_sim:run",
    "robotics-libero": "bench.robotics_libero:run",
    "robotics-libero-rl": "bench.robotics_libero_rl:run",
    "robotics-demos": "bench.robotics_demos:run",
    "robotics-world-model": "bench.robotics_world_model:run",
    "robotics-wm-probe": "bench.robotics_wm_probe:run",
    "visgen-trees": "bench.visgen_trees:run",
    "visgen-video": "bench.visgen_video:run",
    "visgen-rewards": "bench.visgen_rewards:run",
    "visgen-methods": "bench.visgen_methods:run",
    "visgen-two-stage": "bench.visgen_two_stage:run",
    "gpu-two-stage": "bench.gpu_two_stage:run",
    "gpu": "bench.gpu:run",
    "scale": "bench.scale:run",
    "cold-start": "bench.cold_start:run",
}

# ``grove NAME args...`` hands ``args`` to ``main(argv) -> exit code`` of the command group's module.
COMMANDS: dict[str, str] = {
    "robotics": "robotics.cli:main",
    "rewards": "visgen.cli:rewards_main",
    "reward-server": "visgen.cli:reward_server_main",
}

# ``grove list``: a domain's own registries, ``catalog() -> {"what (config key)": [names]}`` (methods, rewards,
# tasks), imported only when listed.
CATALOGS: dict[str, str] = {
    "llm": "shared_rl.llm.rewards:catalog",
    "visgen": "visgen.catalog:catalog",
    "robotics": "robotics.catalog:catalog",
}

_GROUPS = {"domains": (DOMAINS, "grove.domains"), "supervised": (SUPERVISED, "grove.supervised"),
           "benchmarks": (BENCHMARKS, "grove.benchmarks"), "commands": (COMMANDS, "grove.commands"),
           "catalogs": (CATALOGS, "grove.catalogs")}


def _table(name: str) -> dict[str, str]:
    builtin, group = _GROUPS[name]
    table = dict(builtin)
    try:
        for ep in entry_points(group=group):
            table.setdefault(ep.name, ep.value)
    except Exception:  # broken third-party metadata must not break grove
        pass
    return table


def _load(target: str, what: str, name: str) -> Any:
    module, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing != module and missing.split(".")[0] == module.split(".")[0]:
            raise  # the package imports a module of its own that is missing: a bug, keep the traceback
        raise ConfigError(f"{what} {name!r} needs module {module!r}, which cannot be imported ({e})") from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ConfigError(f"{what} {name!r}: {module} has no {attr!r}") from None


_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_OBJECT_SPEC = re.compile(rf"({_DOTTED}):({_DOTTED})")


def import_object(spec: str, where: str) -> Any:
    """The object a user names as ``module:attribute`` (a reward function, an engine class, a reward model's entry):
    ``module`` a dotted module path on the Python path, ``attribute`` a (dotted) name in it. Anything else — a file
    path, a relative module (``..x``), an empty side — and a module that does not import or lacks the attribute is
    one ``ConfigError`` line naming ``where``, never a traceback from the import machinery."""
    match = _OBJECT_SPEC.fullmatch(str(spec)) if isinstance(spec, str) else None
    if match is None:
        raise ConfigError(f"{where}: {spec!r} is not 'module:attribute' (a dotted module path on the Python path and "
                          f"a name in it, e.g. my_rewards:score); file paths and relative modules are not imported")
    module, attr = match.groups()
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{where}: {spec!r}: module {module!r} does not import ({e}); put it on the Python path "
                          f"(PYTHONPATH) or fix the name") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: {spec!r}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def did_you_mean(name: str, choices) -> str:
    """`` (did you mean 'grpo'?)`` when ``name`` is close to one of ``choices``, else "": every error about a name
    chosen from a list says it (estimators, losses, rewards, methods, domains, benchmarks, tasks...)."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _resolve(table: dict[str, str], what: str, name: str) -> Any:
    if name not in table:
        raise ConfigError(f"unknown {what} {name!r}{did_you_mean(name, table)}; known: {', '.join(sorted(table))}")
    return _load(table[name], what, name)


def resolve_domain(name: str) -> type:
    cls = _resolve(_table("domains"), "domain", name)
    if getattr(cls, "config_class", None) is None:
        raise ConfigError(f"domain {name!r} ({cls.__name__}) defines no config_class")
    return cls


def resolve_domain_config(name: str) -> type:
    """The settings class of domain ``name``: a built-in domain's from ``DOMAIN_CONFIGS`` (its domain module, which
    imports torch, is not imported), any other's ``config_class`` (its domain class is imported)."""
    if name in DOMAIN_CONFIGS and _table("domains").get(name) == DOMAINS.get(name):
        return _load(DOMAIN_CONFIGS[name], "domain", name)
    return resolve_domain(name).config_class


def resolve_supervised(name: str) -> Any:
    return _resolve(_table("supervised"), "supervised job for domain", name)


def domain_names() -> list[str]:
    return sorted(_table("domains"))


def supervised_names() -> list[str]:
    return sorted(_table("supervised"))


def resolve_catalog(name: str) -> Any:
    """``catalog() -> {what: [names]}`` of domain ``name`` (``grove list``)."""
    return _resolve(_table("catalogs"), "catalog of domain", name)


def catalog_names() -> list[str]:
    return sorted(_table("catalogs"))


def resolve_benchmark(name: str) -> Any:
    return _resolve(_table("benchmarks"), "benchmark", name)


def benchmark_names() -> list[str]:
    return sorted(_table("benchmarks"))


def resolve_command(name: str) -> Any:
    """The ``main(argv) -> int`` of command group ``name`` (``grove robotics collect ...``)."""
    return _resolve(_table("commands"), "command group", name)


def command_names() -> list[str]:
    return sorted(_table("commands"))


def resolve_supervised_settings(name: str) -> tuple[Any, str] | None:
    """(the settings class or resolving function of supervised job ``name``, the name its errors use), or None
    for a job that declares none (a third-party entry point); ``shared_rl.config.check_supervised`` applies it."""
    if name not in SUPERVISED_SETTINGS:
        return None
    target, where = SUPERVISED_SETTINGS[name]
    return _load(target, "supervised job for domain", name), where
