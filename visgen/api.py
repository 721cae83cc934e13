"""visgen from Python: the diffusers pipeline, reward functions and prompts you hold, grove's loop.

    from visgen.api import FlowGRPOTrainer

    def brightness(images, prompts, metadata):       # images [B, 3, H, W] in [0, 1]; a value per image
        return images.mean(dim=(1, 2, 3))

    trainer = FlowGRPOTrainer(pipeline=pipe, reward_funcs=[brightness], prompts=["a red circle", ...],
                              args={"iterations": 20, "visgen": {"num_inference_steps": 10, "lora": {"rank": 8}}})
    trainer.train()                                    # trains `pipe`'s transformer (LoRA by default)

- ``pipeline``: a stock diffusers pipeline object (SD3/3.5, FLUX, SANA, Wan, …; trained in place) or a path / hub
  id (``visgen.model``).
- ``reward_funcs``: callables ``f(images, prompts, metadata) -> [B]`` (a tensor, array or list; NaN = missing), or
  names of registered rewards (``grove list``); ``reward_weights`` their weights in ``advantage.weights`` (default
  1). A callable's metric is ``reward/<its __name__>/mean``.
- ``prompts`` / ``eval_prompts``: lists of strings (or dicts with a ``prompt`` key and metadata the rewards read);
  written as prompt files beside the run (a temporary folder without ``run_dir``), ``visgen.task: file``.
- ``args``: any part of the config (``{"optim": {"lr": 1e-4}, "visgen": {"resolution": 512}}``), validated as
  ``grove train`` does; ``domain: visgen`` is implied.
"""
from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from shared_rl.api import load_config, merge, removed_if_refused
from shared_rl.config import ConfigError, apply_overrides
from shared_rl.trainer import Trainer

from .preflight import HELD_PREFIX

_registered: dict[str, Callable] = {}
_counter = itertools.count()


def _register(fn: Callable) -> tuple[str, str]:
    """The caller's reward function as a registered reward (name, output label); one name per function object."""
    from .rewards.base import register

    label = getattr(fn, "__name__", "reward")
    for name, known in _registered.items():
        if known is fn:
            return name, label

    def factory(name: str = label):
        def reward(images, prompts, metadata=None):
            values = torch.as_tensor(fn(images, prompts, metadata), dtype=torch.float32).flatten()
            if values.numel() != len(prompts):
                raise ValueError(f"reward {label!r} returned {values.numel()} values for {len(prompts)} images")
            return {name: values.cpu()}

        return reward

    name = f"python:{label}:{next(_counter)}"
    register(name)(factory)
    _registered[name] = fn
    return name, label


def _write_prompts(prompts: Iterable[str | Mapping[str, Any]], path: Path, what: str) -> str:
    rows = [p if isinstance(p, str) else dict(p) for p in prompts]
    if not rows:
        raise ConfigError(f"{what} is empty: give a list of prompts")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, str) and "prompt" not in r), None)
    if bad is not None:
        raise ConfigError(f"{what} item {bad} is a mapping without a 'prompt' key (keys: {sorted(rows[bad])})")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r if isinstance(r, dict) else {"prompt": r}) + "\n")
    return str(path)


class FlowGRPOTrainer:
    """``FlowGRPOTrainer(pipeline, reward_funcs, prompts, args, ...).train()`` — see the module docstring. The method
    is whatever ``args`` configures (Flow-GRPO by default; any ``visgen.method`` / ``visgen.objective``)."""

    def __init__(self, pipeline: Any, reward_funcs: Callable | str | Sequence[Callable | str],
                 prompts: Iterable[str | Mapping[str, Any]], args: Mapping[str, Any] | Sequence[str] = (),
                 eval_prompts: Iterable[str | Mapping[str, Any]] | None = None,
                 reward_weights: Sequence[float] | None = None, run_dir: str | Path | None = None, log=print) -> None:
        funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
        if not funcs:
            raise ConfigError("reward_funcs is empty: give at least one reward function or registered reward name")
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ConfigError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
        rewards, advantage_weights = [], {}
        for fn, w in zip(funcs, weights):
            if isinstance(fn, str):
                if w != 1.0:  # a registered reward may emit several outputs: weigh them by name
                    raise ConfigError(f"reward_weights: {fn!r} is a registered reward; weigh its outputs with "
                                      f"args={{'advantage': {{'weights': {{<output>: w}}}}}}")
                rewards.append({"name": fn})
            else:
                name, label = _register(fn)
                rewards.append({"name": name})
                advantage_weights[label] = float(w)
        held: dict[str, Any] = {}
        section: dict[str, Any] = {"rewards": rewards, "task": "file"}
        if isinstance(pipeline, (str, Path)):
            section["model"] = str(pipeline)
        else:  # an object: handed to the domain (RunContext.objects); the name only labels it
            held["pipeline"] = pipeline
            section["model"] = f"{HELD_PREFIX}{type(pipeline).__name__}"
        self._tmp = None
        if run_dir:
            folder = Path(run_dir) / "prompts"
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="grove-visgen-")
            folder = Path(self._tmp.name)
        with removed_if_refused(folder if run_dir else None):  # a refused config leaves no RUN/prompts behind
            section["train_prompts"] = _write_prompts(prompts, folder / "train.jsonl", "prompts")
            if eval_prompts is not None:
                section["eval_prompts"] = _write_prompts(eval_prompts, folder / "eval.jsonl", "eval_prompts")
            base: dict[str, Any] = {"domain": "visgen", "visgen": section}
            if advantage_weights and any(w != 1.0 for w in advantage_weights.values()):
                base["advantage"] = {"weights": advantage_weights}
            data = merge(base, args) if isinstance(args, Mapping) else apply_overrides(base, list(args))
            self.config = load_config(data)
            self.run_dir = Path(run_dir) if run_dir else None
            self.trainer = Trainer(self.config, self.run_dir, log=log, objects=held)

    @property
    def pipeline(self):
        """The pipeline being trained (the caller's object when one was given)."""
        return self.trainer.domain.pipe

    def train(self) -> list[dict[str, Any]]:
        """Run every iteration (evaluation, checkpoints and export as configured); returns the metric records."""
        return self.trainer.fit()
