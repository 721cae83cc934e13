"""Lazy package attributes (PEP 562): a package names what it exports and the submodule each comes from, and
imports that submodule only on first use, so a light import (``grove config show``) never pulls torch or MuJoCo."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_attributes(package: str, table: dict[str, str], public: list[str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a name to its module (absolute, or relative to
    the package when it has no dot); the value is cached in the package's namespace after the first lookup."""
    import sys

    def __getattr__(name: str) -> Any:  # noqa: N807 — the module hook's name
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = table[name] if "." in table[name] else f"{package}.{table[name]}"
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
