"""``task: file``: prompts from ``visgen.train_prompts`` / ``eval_prompts`` (``.txt``, one a line, or ``.jsonl``,
objects with a ``prompt`` field and the metadata the rewards read)."""
from __future__ import annotations

import json
from pathlib import Path

from shared_rl.config import ConfigError

from .base import Prompts, Task, register_task

REPO_ROOT = Path(__file__).resolve().parents[2]


def read_prompt_file(path: str) -> tuple[list[str], list[dict]]:
    """Prompts and per-prompt metadata from ``.txt`` (one a line) or ``.jsonl`` (objects with a ``prompt`` field)."""
    p = Path(path).expanduser()
    found = [c for c in ([p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]) if c.is_file()]
    if not found:
        raise ConfigError(f"prompt file {path!r} does not exist (relative paths: the working directory, then the repo)")
    file = found[0]
    prompts, metas = [], []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if file.suffix == ".jsonl":
            try:
                item = json.loads(line)
                prompts.append(str(item["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{file}:{n}: expected a JSON object with a 'prompt' field") from None
            metas.append(item)
        else:
            prompts.append(line)
            metas.append({})
    if not prompts:
        raise ConfigError(f"prompt file {file} holds no prompts")
    return prompts, metas


@register_task
class PromptFileTask(Task):
    """Any prompts: a training file and optionally a held-out one (none: no evaluation)."""

    name = "file"

    def check(self, cfg, where: str) -> None:
        if not cfg.train_prompts:
            raise ConfigError(f"{where}.train_prompts must name a prompt file when task is 'file'")

    def prompt_files(self, cfg) -> list[tuple[str, str]]:
        return [("train_prompts", cfg.train_prompts)] + ([("eval_prompts", cfg.eval_prompts)] if cfg.eval_prompts else [])

    def prompts(self, cfg, settings: dict) -> Prompts:
        train, train_meta = read_prompt_file(cfg.train_prompts)
        held_out, held_out_meta = read_prompt_file(cfg.eval_prompts) if cfg.eval_prompts else ([], [])
        return Prompts(train, train_meta, held_out, held_out_meta)
