"""Importing LeRobot's policy modules under grove's pinned stack (torch 2.14, transformers 5, lerobot 0.4.4 --no-deps).

Two things stand between ``import lerobot.policies.smolvla.modeling_smolvla`` and a working module here:

1. LeRobot's pure-Python needs (draccus, einops, pyserial, deepdiff < 9, num2words) that ``pip install --no-deps
   lerobot`` leaves out: the project's robotics extra and ``constraints.txt`` install them.
2. ``lerobot/policies/__init__.py`` imports every policy family's package, and ``lerobot.policies.groot`` imports
   ``groot_n1.py``, whose ``GR00TN15Config`` dataclass (a subclass of transformers' ``PretrainedConfig``) fails
   under transformers 5 with ``TypeError: non-default argument 'backbone_cfg' follows default argument``
   (transformers 5 made ``PretrainedConfig`` a dataclass with defaulted fields). The package ``__init__`` only needs
   GR00T's *configuration* module, which imports fine. So before anything imports ``lerobot.policies`` we register
   ``lerobot.policies.groot`` as a bare package object that points at GR00T's real folder: ``from
   .groot.configuration_groot import GrootConfig`` then loads that one file, and ``groot/__init__.py`` (the import of
   ``modeling_groot`` / ``groot_n1``) never runs. Nothing of LeRobot is copied or edited; only GR00T's model class
   stays unimportable, as it is under transformers 5 anyway.

Every grove module that touches ``lerobot.policies`` calls :func:`import_policies` first. A user script that imports
LeRobot's policies itself calls it too (``from robotics.policies.lerobot import import_policies``).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

from shared_rl.errors import ConfigError

GROOT = "lerobot.policies.groot"
# the families grove drives: the LeRobot policy ``name`` (config.json's "type") -> modeling module and class
FAMILIES = {
    "smolvla": ("lerobot.policies.smolvla.modeling_smolvla", "SmolVLAPolicy"),
    "pi0": ("lerobot.policies.pi0.modeling_pi0", "PI0Policy"),
    "pi05": ("lerobot.policies.pi05.modeling_pi05", "PI05Policy"),
}


def _skip_groot_package() -> None:
    """Register ``lerobot.policies.groot`` as a package whose ``__init__`` is not run (see the module docstring)."""
    if GROOT in sys.modules:
        return
    spec = importlib.util.find_spec("lerobot")
    if spec is None or spec.origin is None:
        raise ConfigError("robotics.policy.type: lerobot needs LeRobot: pip install --no-deps -c constraints.txt "
                          "lerobot==0.4.4 (make does this)")
    package = types.ModuleType(GROOT)
    package.__path__ = [str(Path(spec.origin).parent / "policies" / "groot")]
    package.__package__ = GROOT
    sys.modules[GROOT] = package


def import_policies() -> types.ModuleType:
    """``lerobot.policies``, importable under transformers 5 (GR00T's package init skipped)."""
    _skip_groot_package()
    try:
        return importlib.import_module("lerobot.policies")
    except ModuleNotFoundError as e:
        raise ConfigError(f"robotics.policy.type: lerobot: LeRobot's policy modules need {e.name!r}; install the "
                          f"robotics extra: pip install -c constraints.txt -e '.[robotics]'") from None


def policy_class(family: str) -> type:
    """The ``PreTrainedPolicy`` subclass of a LeRobot policy family (``smolvla``, ``pi0``, ``pi05``)."""
    if family not in FAMILIES:
        raise ConfigError(f"robotics.policy: LeRobot policy type {family!r} is not supported; grove drives "
                          f"{', '.join(FAMILIES)}")
    import_policies()
    module, name = FAMILIES[family]
    return getattr(importlib.import_module(module), name)
