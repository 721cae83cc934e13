"""Tiny VLA policies with flow-matching (SDE / learned-noise / ODE-SDE mix log-probs) and discrete-bin heads.

The names below are imported on first use (``robotics.policies.TinyVLA`` as before): importing a light submodule
(``robotics.policies.vla_config``, ``robotics.policies.lerobot.settings``) imports no torch, so ``grove config
show`` reads a robotics config without it (issue 64).
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    **dict.fromkeys(["MODES", "FlowActionHead", "FlowSample", "sigma_schedule"], "flow_head"),
    "TinyVLA": "vla",
    **dict.fromkeys(["VLAConfig", "tokenize"], "vla_config"),
}

__all__ = ["MODES", "FlowActionHead", "FlowSample", "sigma_schedule", "TinyVLA", "VLAConfig", "tokenize"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
