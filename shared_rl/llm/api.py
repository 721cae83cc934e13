"""A TRL-shaped front door for text-model GRPO: the model, reward functions and dataset you hold, grove's loop.

    from shared_rl.llm.api import GRPOTrainer

    def brevity(prompts, completions, **columns):          # TRL's reward-function signature
        return [-len(c) / 10 for c in completions]

    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[brevity, "numeric_match"],
                          train_dataset=[{"prompt": "12+30=", "answer": "42"}, ...],
                          args={"iterations": 50, "rollout": {"groups_per_iteration": 8, "group_size": 8}})
    trainer.train()                                           # trains `model` itself (through LoRA if asked)

What each argument becomes (everything else is the ordinary config, validated as ``grove train`` does):

- ``model``: a ``transformers`` causal LM object (trained in place; with ``llm.lora`` a peft adapter wraps it) or a
  path / hub id (``llm.model``). ``processing_class``: its tokenizer (default: loaded from the model's path).
- ``reward_funcs``: callables with TRL's signature ``f(prompts, completions, completion_ids, **columns) -> list``
  (a value per completion, None = missing), or names of built-in rewards (``numeric_match``, ``exact_match``,
  ``format``, ``length_penalty``, ``overlong``); ``reward_weights`` their weights (default 1 each). A callable's
  metric is ``reward/<its __name__>/mean``.
- ``train_dataset`` / ``eval_dataset``: a list of dicts (or anything iterable of dicts, e.g. a ``datasets.Dataset``)
  with a ``prompt`` column; other columns reach the reward functions by name. Written as JSONL beside the run (a
  temporary folder without ``run_dir``) and read through ``llm.dataset`` like any file.
- ``args``: a ``TrainConfig`` section mapping (``{"optim": {"lr": 1e-4}, "llm": {"max_new_tokens": 32}}``) or
  CLI-style strings; ``domain: llm`` is implied.
"""
from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..api import load_config, merge
from ..config import ConfigError, apply_overrides
from ..trainer import Trainer
from .rewards import BUILTIN_REWARDS

_registered: dict[str, Callable] = {}  # name in BUILTIN_REWARDS -> the caller's function it stands for
_counter = itertools.count()


def _register(fn: Callable) -> str:
    """The caller's reward function as a built-in reward name (the config names rewards; the name is unique per
    function object, so two functions both called ``reward`` do not collide)."""
    for name, known in _registered.items():
        if known is fn:
            return name
    name = f"python:{getattr(fn, '__name__', 'reward')}:{next(_counter)}"
    _registered[name] = fn
    BUILTIN_REWARDS[name] = lambda _fn=fn: _fn  # a factory without arguments returning the function itself
    return name


def _write_rows(rows: Iterable[Mapping[str, Any]], path: Path, what: str) -> Path:
    rows = [dict(r) for r in rows]
    if not rows:
        raise ConfigError(f"{what} is empty: give a list of dicts with a 'prompt' column")
    missing = next((i for i, r in enumerate(rows) if "prompt" not in r), None)
    if missing is not None:
        raise ConfigError(f"{what} row {missing} has no 'prompt' column (columns: {sorted(rows[missing])})")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


class GRPOTrainer:
    """``GRPOTrainer(model, reward_funcs, train_dataset, args, ...).train()`` — see the module docstring."""

    def __init__(self, model: Any, reward_funcs: Callable | str | Sequence[Callable | str],
                 train_dataset: Iterable[Mapping[str, Any]] | None = None, args: Mapping[str, Any] | Sequence[str] = (),
                 processing_class: Any = None, eval_dataset: Iterable[Mapping[str, Any]] | None = None,
                 reward_weights: Sequence[float] | None = None, run_dir: str | Path | None = None, log=print) -> None:
        funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
        if not funcs:
            raise ConfigError("reward_funcs is empty: give at least one reward function or built-in reward name")
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ConfigError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
        rewards = []
        for fn, w in zip(funcs, weights):
            if isinstance(fn, str):
                rewards.append({"name": fn, "weight": float(w)})
            else:
                rewards.append({"name": _register(fn), "weight": float(w), "label": getattr(fn, "__name__", "reward")})
        section: dict[str, Any] = {"rewards": rewards}
        held: dict[str, Any] = {}
        if isinstance(model, (str, Path)):
            section["model"] = str(model)
        else:  # an object: handed to the domain (RunContext.objects), its path only names it in logs
            held["model"] = model
            section["model"] = str(getattr(model, "name_or_path", "") or type(model).__name__)
        if processing_class is not None:
            held["tokenizer"] = processing_class
        self._tmp = None
        if train_dataset is not None:
            folder = Path(run_dir) / "datasets" if run_dir else Path(self._tmpdir())
            dataset = {"source": "jsonl", "path": str(_write_rows(train_dataset, folder / "train.jsonl", "train_dataset"))}
            if eval_dataset is not None:
                dataset["eval_path"] = str(_write_rows(eval_dataset, folder / "eval.jsonl", "eval_dataset"))
            section["dataset"] = dataset
        base = {"domain": "llm", "llm": section}
        data = merge(base, args) if isinstance(args, Mapping) else apply_overrides(base, list(args))
        self.config = load_config(data)
        self.run_dir = Path(run_dir) if run_dir else None
        self.trainer = Trainer(self.config, self.run_dir, log=log, objects=held)

    def _tmpdir(self) -> str:
        self._tmp = tempfile.TemporaryDirectory(prefix="grove-llm-")
        return self._tmp.name

    @property
    def model(self):
        """The policy being trained (the caller's object, wrapped by peft when LoRA is on)."""
        return self.trainer.domain.model

    def train(self) -> list[dict[str, Any]]:
        """Run every iteration (evaluation, checkpoints and export as configured); returns the metric records."""
        return self.trainer.fit()
