"""grove from Python: the same runs as the CLI, with objects you already hold.

    from shared_rl.api import train
    trainer = train("configs/toy.yaml", overrides={"iterations": 20}, run_dir="runs/toy")
    print(trainer.history[-1])

``train`` validates exactly as ``grove train`` does (the config loader and the preflight: one ``ConfigError`` line
for any mistake, nothing written), builds a ``Trainer`` and runs it; ``objects`` are handed to the domain instead
of the paths its config names (``RunContext.objects``: the llm domain reads ``model`` and ``tokenizer``). For text
models there is a TRL-shaped front door, ``shared_rl.llm.api.GRPOTrainer(model=..., reward_funcs=...,
train_dataset=..., args=...)``.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from .config import TrainConfig, apply_overrides, load_train_config, load_yaml
from .trainer import Trainer


def merge(base: dict, over: Mapping[str, Any]) -> dict:
    """``base`` with ``over`` merged in section by section (nested mappings merge, other values replace)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


@contextlib.contextmanager
def removed_if_refused(folder: str | Path | None) -> Iterator[None]:
    """Undo what the block created at ``folder`` when it raises: the API front doors write the rows or prompts they
    were handed into ``RUN/<folder>`` before the config check reads them, and a refused config must leave the file
    system as it was (as ``grove train`` does). Only folders that did not exist before the block are removed: the
    outermost missing ancestor of ``folder`` (``RUN`` itself when it was new)."""
    if folder is None:
        yield
        return
    outer = None
    for candidate in (Path(folder).absolute(), *Path(folder).absolute().parents):
        if candidate.exists():
            break
        outer = candidate
    try:
        yield
    except BaseException:
        if outer is not None:
            shutil.rmtree(outer, ignore_errors=True)
        raise


def _nested(overrides: Mapping[str, Any]) -> dict:
    """``{"llm.model": x}`` as ``{"llm": {"model": x}}``: a dotted key, the CLI's spelling, names the same setting
    (it used to be refused as an unknown top-level key)."""
    out: dict = {}
    for key, value in overrides.items():
        *parents, leaf = str(key).split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = merge(node[leaf], value) if isinstance(value, Mapping) and isinstance(node.get(leaf), dict) \
            else value
    return out


def load_config(config: str | Path | Mapping[str, Any] | TrainConfig,
                overrides: Mapping[str, Any] | Sequence[str] = (), paths: bool = False) -> TrainConfig:
    """A validated ``TrainConfig`` from a YAML path, a mapping of sections or a ``TrainConfig``, with overrides:
    a mapping of sections (``{"optim": {"lr": 1e-3}}``, or dotted keys as the CLI writes them, ``{"optim.lr": 1e-3}``)
    or CLI-style strings (``["optim.lr=1e-3"]``). ``paths``:
    first the CLI's path checks (``shared_rl.prechecks.precheck_paths``: a typo'd path or an uncached hub id with no
    network is one line at once, not a minute of the loader's retries) — for a config whose paths name what loads,
    not labels of objects the caller holds."""
    if isinstance(config, TrainConfig):
        if overrides:
            raise ValueError("overrides apply to a YAML path or a mapping; change the TrainConfig's fields instead")
        return config
    data = load_yaml(config) if isinstance(config, (str, Path)) else dict(config)
    if isinstance(overrides, Mapping):
        data = merge(data, _nested(overrides))
    else:
        data = apply_overrides(data, list(overrides))
    if paths:
        from .prechecks import precheck_paths

        precheck_paths(data)
    return load_train_config(data)


def train(config: str | Path | Mapping[str, Any] | TrainConfig, overrides: Mapping[str, Any] | Sequence[str] = (),
          run_dir: str | Path | None = None, objects: Mapping[str, Any] | None = None, log=print) -> Trainer:
    """Validate ``config`` (+ ``overrides``), build the trainer (handing it ``objects``) and run every iteration;
    returns the ``Trainer`` (``.history`` the metric records, ``.domain`` the trained policy). With ``run_dir`` the
    run writes its metrics, checkpoints, plots and export there, as ``grove train --out`` does."""
    with removed_if_refused(run_dir):  # a config or input refused while the trainer is built leaves no run_dir
        # without objects the config's paths are what loads: the CLI's path checks first (issue 64: an uncached hub
        # id from Python was a minute of retries and a traceback)
        trainer = Trainer(load_config(config, overrides, paths=not objects), Path(run_dir) if run_dir else None,
                          log=log, objects=dict(objects or {}))
    trainer.fit()
    return trainer
