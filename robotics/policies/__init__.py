"""Tiny VLA policies with flow-matching (SDE / learned-noise / ODE-SDE mix log-probs) and discrete-bin heads.

The names below are imported on first use (``robotics.policies.TinyVLA`` as before): importing a light submodule
(``robotics.policies.vla_config``, ``robotics.policies.lerobot.settings``) imports no torch, so ``grove config
show`` reads a robotics config without it (issue 64).
"""
from __future__ import annotations

from shared_rl.lazy import lazy_attributes

_LAZY = {
    **dict.fromkeys(["MODES", "FlowActionHead", "FlowSample", "sigma_schedule"], "flow_head"),
    "TinyVLA": "vla",
    **dict.fromkeys(["VLAConfig", "tokenize"], "vla_config"),
}

__all__ = ["MODES", "FlowActionHead", "FlowSample", "sigma_schedule", "TinyVLA", "VLAConfig", "tokenize"]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
