"""The core registries' built-in entries (advantage estimators, policy losses, KL estimators) as a config needs them
— name, kind, settings class — without importing torch, so ``grove config show`` and the CLI's checks answer in
the time the interpreter takes to start (issue 64).

The registries themselves live beside their tensor code (``shared_rl.advantages.ESTIMATORS``,
``shared_rl.losses.POLICY_LOSSES`` / ``KL_ESTIMATORS``). Here their built-in entries are read from the registering
decorators in the modules' source (``registered_names``, ``ast``: nothing is imported); a settings class named there
is taken from this module or ``shared_rl.loss_settings`` when it lives there (``NoSettings``, ``GAESettings``, the
losses' settings: the same class objects the registries hold, which import them from there), and any other name
— a settings class defined beside its torch code, an entry the source does not show — makes the lookup import the
live registry, so the answer is always the live one. Once a registry's module is imported (a Python caller that
registered its own entry, a training run), the live registry is used directly. tests/core/test_part_index.py
checks the index equals the live registries.
"""
from __future__ import annotations

import ast
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

HERE = Path(__file__).resolve().parent


@dataclass
class NoSettings:
    """The settings of an estimator or a loss that has none of its own."""


@dataclass
class GAESettings:
    """The critic's settings, all in one place: how its values become advantages and how it is trained."""

    gamma: float = field(default=1.0, metadata={"help": "discount per decision (action chunk), in (0, 1]"})
    lam: float = field(default=0.95, metadata={"help": "lambda in [0, 1] (1 = Monte-Carlo return - value)"})
    normalize: str = field(default="none", metadata={
        "help": "none | batch (z-score the advantages over the iteration's taken decisions of every process, as PPO)"})
    value_coef: float = field(default=0.0, metadata={
        "help": "weight of the critic's value loss (losses.value_loss); 0 = the critic is not trained"})
    value_clip: float | None = field(default=None, metadata={
        "help": "clip the new value to V_old +- value_clip in the value loss (PPO2 / RL4VLA); null = no clip"})
    warmup: int = field(default=0, metadata={
        "help": "first iterations that train only the critic (policy loss and auxiliary losses weigh 0); needs "
                "value_coef > 0"})
    lr: float | None = field(default=None, metadata={
        "help": "learning rate of the domain's critic_parameters() (a second AdamW group); null = optim.lr"})

    def check(self, where: str) -> None:
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"{where}.gamma must be in (0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"{where}.lam must be in [0, 1], got {self.lam}")
        if self.normalize not in ("none", "batch"):
            raise ConfigError(f"{where}.normalize must be none or batch, got {self.normalize!r}")
        if self.value_coef < 0:
            raise ConfigError(f"{where}.value_coef must be >= 0, got {self.value_coef}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ConfigError(f"{where}.value_clip must be > 0 (null = no clip), got {self.value_clip}")
        if self.warmup < 0:
            raise ConfigError(f"{where}.warmup must be >= 0, got {self.warmup}")
        if self.warmup and self.value_coef <= 0:
            raise ConfigError(f"{where}.warmup={self.warmup} trains only the critic, but value_coef is 0; set "
                              f"{where}.value_coef > 0 (e.g. 0.5)")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"{where}.lr must be > 0 (null = optim.lr), got {self.lr}")


def registered_names(source: Path, decorator: str, refs: bool = False) -> dict[str, dict]:
    """The names a module registers with ``@decorator("name", key=value, ...)`` on its functions or classes, or with
    a bare ``@decorator`` on a class that sets ``name = "..."`` in its body, read from its source with ``ast``
    (nothing is imported), each with the keyword arguments written as literals (``refs``: also those written as a
    bare name, ``settings=GAESettings``, as the name's text).

    The core's tensor registries (``shared_rl.advantages.ESTIMATORS``, ``shared_rl.losses.POLICY_LOSSES`` and
    ``KL_ESTIMATORS``) and visgen's rewards import torch, seconds on a loaded 2-core machine, so `grove list` and
    the config loader read their built-in names from the registering decorators instead; a new entry registered the
    same way is found without touching this module, and tests/core/test_cli_list.py checks the result equals the
    live registries. Entries a Python caller registers live only in its own process (which then uses the live
    registry: its module is imported)."""

    def class_name(node) -> str | None:
        for stmt in node.body:
            if (isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "name" for t in stmt.targets)
                    and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
                return stmt.value.value
        return None

    def literal(value):
        if isinstance(value, ast.Constant):
            return True, value.value
        if refs and isinstance(value, ast.Name):
            return True, value.id
        return False, None

    found: dict[str, dict] = {}
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"), str(source))):
        for deco in getattr(node, "decorator_list", ()):
            if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name) and deco.func.id == decorator
                    and deco.args and isinstance(deco.args[0], ast.Constant) and isinstance(deco.args[0].value, str)):
                kwargs = {}
                for k in deco.keywords:
                    ok, value = literal(k.value)
                    if k.arg and ok:
                        kwargs[k.arg] = value
                found[deco.args[0].value] = kwargs
            elif (isinstance(deco, ast.Name) and deco.id == decorator and isinstance(node, ast.ClassDef)
                  and (name := class_name(node)) is not None):
                found[name] = {}
    return found


@dataclass(frozen=True)
class IndexedPart:
    """A built-in registry entry as the config loader reads it: its name, kind and settings class."""

    name: str
    kind: str
    settings_class: type


class _Unindexed(Exception):
    """The source names something the index cannot answer without the live module."""


def _indexed(source: str, decorator: str) -> dict[str, IndexedPart]:
    from . import loss_settings

    here = {**vars(loss_settings), **globals()}
    parts = {}
    for name, kwargs in registered_names(HERE / source, decorator, refs=True).items():
        settings = kwargs.get("settings", "NoSettings")
        cls = here.get(settings)
        if not isinstance(cls, type):
            raise _Unindexed(settings)
        parts[name] = IndexedPart(name, kwargs.get("kind", "flat"), cls)
    return parts


def _registry(module: str, attr: str, source: str, decorator: str, needs: str | None) -> dict[str, Any]:
    """The live registry ``module.attr`` when ``module`` is imported, or when the index cannot answer for ``needs``
    (a name, None: every entry) without it; else the index read from ``source``."""
    mod = sys.modules.get(module)
    if mod is None:
        try:
            index = _indexed(source, decorator)
        except _Unindexed:
            index = None
        else:
            if needs is None or needs in index:
                return index
        mod = importlib.import_module(module)
    return getattr(mod, attr)


def estimators(needs: str | None = None) -> dict[str, Any]:
    """``shared_rl.advantages.ESTIMATORS``, or its built-in entries (``IndexedPart``) while it is not imported
    and holds ``needs``."""
    return _registry("shared_rl.advantages", "ESTIMATORS", "advantages.py", "register", needs)


def policy_losses(needs: str | None = None) -> dict[str, Any]:
    """``shared_rl.losses.POLICY_LOSSES``, or its built-in entries while it is not imported and holds ``needs``."""
    return _registry("shared_rl.losses", "POLICY_LOSSES", "losses.py", "register_policy_loss", needs)


def kl_estimator_names() -> list[str]:
    """The names of ``shared_rl.losses.KL_ESTIMATORS`` (read from the source while the module is not imported)."""
    mod = sys.modules.get("shared_rl.losses")
    names = mod.KL_ESTIMATORS if mod is not None else registered_names(HERE / "losses.py", "register_kl_estimator")
    return sorted(names)


def estimator_names(kind: str) -> list[str]:
    """The registered estimators of one kind, sorted (``shared_rl.advantages.estimator_names`` without torch)."""
    return sorted(n for n, e in estimators().items() if e.kind == kind)


def selector_names() -> list[str]:
    """The names of ``shared_rl.two_stage.SELECTORS`` (the two-stage rollouts' candidate selectors), sorted: the live
    registry when the module is imported, else the keys of its ``SELECTORS = {...}`` literal read from the source
    (``ast``: nothing is imported), so a config's ``selector`` is checked without torch."""
    mod = sys.modules.get("shared_rl.two_stage")
    if mod is not None:
        return sorted(mod.SELECTORS)
    tree = ast.parse((HERE / "two_stage.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SELECTORS" for t in node.targets)
                and isinstance(node.value, ast.Dict)
                and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.value.keys)):
            return sorted(k.value for k in node.value.keys)
    return sorted(importlib.import_module("shared_rl.two_stage").SELECTORS)  # not a literal: the live registry
