"""Checks that need the machine, not just the config: run before any model loads and before anything is written.

``load_train_config`` validates what the YAML says (types, ranges, names, batch arithmetic). ``preflight`` checks
whether *this machine and these inputs* can run it, so that a mistake costs seconds instead of a model load and a
held-out evaluation:

- the device exists (``device: cuda`` without a GPU, ``cuda:3`` on a one-GPU machine, ``mps`` off Apple);
- the optional loggers asked for are installed (``logging.wandb``, ``logging.tensorboard``);
- the domain's own input checks: the domain config's optional hook ``preflight(train_cfg)`` reads its small
  inputs (prompt files, datasets, ``module:function`` rewards) and checks that the configured rewards can score
  them (``shared_rl.domain`` documents the hook).

Every failure is a ``ConfigError`` whose one line says what to change.
"""
from __future__ import annotations

import importlib.util

from .errors import ConfigError


def resolve_device(name: str):
    """``torch.device`` for a config's ``device`` (``auto`` = the first GPU if torch sees one, else the CPU);
    a device this machine does not have is a ConfigError, never a silent fall-back."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ConfigError("device 'mps' is not available on this machine (torch.backends.mps.is_available() is "
                              "False); use device=cpu or device=auto")
        return torch.device("mps")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} is not available: torch sees no CUDA GPU here "
                              f"(torch.cuda.is_available() is False); use device=cpu or device=auto")
        index = int(name.split(":", 1)[1]) if ":" in name else 0
        count = torch.cuda.device_count()
        if index >= count:
            raise ConfigError(f"device {name!r} is not available: torch sees {count} GPU(s), cuda:0..cuda:{count - 1}")
        return torch.device(name)
    raise ConfigError(f"device {name!r} is not a device grove runs on; use auto, cpu, cuda, cuda:N or mps")


def _need_package(flag: str, package: str, install: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{flag}: true needs the {package} package, which is not installed: {install} (or set "
                          f"{flag}=false)")


def preflight(cfg) -> None:
    """Everything ``grove train`` can check about a validated ``TrainConfig`` before loading a model."""
    resolve_device(cfg.device)
    if cfg.logging.wandb:
        _need_package("logging.wandb", "wandb", "pip install wandb")
    if cfg.logging.tensorboard:
        _need_package("logging.tensorboard", "tensorboard", "pip install tensorboard")
    cfg.domain_config.preflight(cfg)
