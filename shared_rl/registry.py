"""Domains, supervised entry points and benchmarks, found by name.

Strings (``"module:attr"``) keep the static layering clean: ``shared_rl`` never imports ``visgen`` or
``robotics``; they are imported only when a config names them. Third-party packages add entries through the
``grove.domains`` / ``grove.supervised`` / ``grove.benchmarks`` entry-point groups.
"""
from __future__ import annotations

import difflib
import importlib
from importlib.metadata import entry_points
from typing import Any

from .config import ConfigError

DOMAINS: dict[str, str] = {
    "toy": "shared_rl.toy:ToyDomain",
    "llm": "shared_rl.llm.domain:LLMDomain",
    "visgen": "visgen.domain:VisgenDomain",
    "robotics": "robotics.domain:RoboticsDomain",
}

SUPERVISED: dict[str, str] = {
    "llm": "shared_rl.llm.pretrain:run",
    "visgen": "visgen.pretrain:run",
    "robotics": "robotics.bc:run",
}

BENCHMARKS: dict[str, str] = {
    "llm": "bench.llm_vs_trl:run",
    "robotics-sim": "bench.robotics_sim:run",
    "visgen-trees": "bench.visgen_trees:run",
    "visgen-sampling": "bench.visgen_sampling:run",
    "scale": "bench.scale:run",
}


def _table(name: str, group: str) -> dict[str, str]:
    table = dict({"domains": DOMAINS, "supervised": SUPERVISED, "benchmarks": BENCHMARKS}[name])
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
        raise ConfigError(f"{what} {name!r} needs module {module!r}, which cannot be imported ({e})") from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ConfigError(f"{what} {name!r}: {module} has no {attr!r}") from None


def _resolve(table: dict[str, str], what: str, name: str) -> Any:
    if name not in table:
        close = difflib.get_close_matches(name, list(table), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown {what} {name!r}{hint}; known: {', '.join(sorted(table))}")
    return _load(table[name], what, name)


def resolve_domain(name: str) -> type:
    cls = _resolve(_table("domains", "grove.domains"), "domain", name)
    if getattr(cls, "config_class", None) is None:
        raise ConfigError(f"domain {name!r} ({cls.__name__}) defines no config_class")
    return cls


def resolve_supervised(name: str) -> Any:
    return _resolve(_table("supervised", "grove.supervised"), "supervised job for domain", name)


def resolve_benchmark(name: str) -> Any:
    return _resolve(_table("benchmarks", "grove.benchmarks"), "benchmark", name)


def benchmark_names() -> list[str]:
    return sorted(_table("benchmarks", "grove.benchmarks"))
