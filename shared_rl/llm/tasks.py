"""Text tasks: the embedded arithmetic task and datasets loaded from JSONL / CSV files or ``datasets``.

An example is a dict with a ``prompt`` (a string, or a list of chat messages as in TRL's conversational format)
and any other columns (``answer``, ...), which reward functions receive as keyword arguments, exactly as TRL's
``GRPOTrainer`` passes dataset columns.
"""
from __future__ import annotations

import csv
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ConfigError

if TYPE_CHECKING:  # transformers is imported where a tokenizer is loaded
    from transformers import PreTrainedTokenizerBase


@dataclass
class DatasetSettings:
    """Where prompts come from.

    source: ``arith`` (embedded: ``a+b=`` with operands below ``10**digits``), ``jsonl``, ``csv``, ``json`` or
        ``hf`` (``datasets``: a directory saved with ``save_to_disk``, or a name for ``load_dataset``).
    path / name / split / eval_split / eval_path: where the rows are; without an eval split, a deterministic
        ``eval_fraction`` of rows (chosen by a hash of the row index and ``seed``) is held out.
    prompt_column / answer_column: renamed to ``prompt`` / ``answer`` (what the built-in rewards read).
    prompt_template: ``str.format`` template applied to string prompts (``{prompt}`` and any column).
    system_prompt: prepended as a system message when a chat template is used.
    num_train / num_eval: caps (0 = all); for ``arith`` the number of problems drawn.
    max_prompt_tokens / long_prompts: the longest prompt the model takes and what a longer one is (an error before
        the run starts, or cut to its last tokens, logged).
    """

    source: str = field(default="arith", metadata={"help": "arith (embedded) | jsonl | csv | json | hf (datasets)"})
    digits: int = field(default=3, metadata={"help": "arith: operands below 10**digits"})
    path: str = field(default="", metadata={"help": "file, saved-dataset directory or hub name of the rows"})
    name: str | None = field(default=None, metadata={"help": "hf: dataset config name"})
    split: str = field(default="train", metadata={"help": "training split"})
    eval_split: str | None = field(default=None, metadata={
        "help": "evaluation split; null = hold out eval_fraction of the rows"})
    eval_path: str = field(default="", metadata={"help": "separate evaluation file; '' = from path"})
    prompt_column: str = field(default="prompt", metadata={"help": "column renamed to prompt"})
    answer_column: str = field(default="answer", metadata={"help": "column renamed to answer (built-in rewards read it)"})
    prompt_template: str = field(default="{prompt}", metadata={
        "help": "str.format template for string prompts ({prompt} and any column)"})
    system_prompt: str | None = field(default=None, metadata={"help": "system message when a chat template is used"})
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "extra keyword arguments of the tokenizer's apply_chat_template (e.g. enable_thinking: false)"})
    eval_fraction: float = field(default=0.05, metadata={"help": "rows held out for evaluation without an eval split"})
    num_train: int = field(default=20000, metadata={"help": "training examples at most; 0 = all"})
    num_eval: int = field(default=500, metadata={"help": "evaluation examples at most; 0 = all"})
    seed: int = field(default=0, metadata={"help": "seed of the arith draw and the held-out hash"})
    max_prompt_tokens: int = field(default=0, metadata={
        "help": "longest prompt in tokens (after the chat template); 0 = the model's context (max_position_embeddings) "
                "minus llm.max_new_tokens"})
    long_prompts: Literal["error", "truncate"] = field(default="error", metadata={
        "help": "a longer prompt: error = a bad input found before the run starts | truncate = keep its last "
                "max_prompt_tokens tokens (TRL's max_prompt_length side) and say how many were cut"})

    def check(self, where: str) -> None:
        """The embedded ``arith`` task reads no rows: a path or dataset name given with it would be ignored."""
        if self.source == "arith":
            given = [f"{where}.{k}={getattr(self, k)!r}" for k in ("path", "eval_path", "name") if getattr(self, k)]
            if given:
                raise ConfigError(f"{', '.join(given)} is ignored by {where}.source: arith (the embedded a+b= task, "
                                  f"which reads no rows); set {where}.source to jsonl, csv, json or hf to read it, "
                                  f"or drop it")


@dataclass
class TaskData:
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)


def _stable_hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def is_eval_pair(a: int, b: int) -> bool:
    """The arithmetic eval partition: 5% of all (a, b) pairs, fixed forever (independent of seeds and sizes), so
    no SFT or RL run ever trains on an eval problem."""
    return _stable_hash("arith", a, b) % 20 == 0


def arith_example(a: int, b: int) -> dict[str, Any]:
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def arith_problems(split: str, count: int, digits: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` distinct addition problems from the ``train`` or ``eval`` partition, deterministic in ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    limit = 10 ** digits
    want_eval = split == "eval"
    capacity = limit * limit * (0.05 if want_eval else 0.95)
    if count > 0.5 * capacity:
        raise ConfigError(f"llm.dataset: asked for {count} {split} problems with {digits} digits; at most "
                          f"{int(0.5 * capacity)} (lower num_train/num_eval or raise digits)")
    rng = random.Random(_stable_hash("arith-draw", split, seed, digits))
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < count:
        a, b = rng.randrange(limit), rng.randrange(limit)
        if (a, b) in seen or is_eval_pair(a, b) != want_eval:
            continue
        seen.add((a, b))
        out.append(arith_example(a, b))
    return out


def _read_rows(path: str, fmt: str, where: str = "llm.dataset.path") -> list[dict[str, Any]]:
    from ..prechecks import check_llm_dataset  # the line the CLI's early pass gives, with the nearest data file

    p = Path(path)
    check_llm_dataset(path, fmt, where)
    if fmt == "jsonl":
        from ..readers import read_jsonl

        return read_jsonl(p)
    if fmt == "json":
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            return data["data"]
        if not isinstance(data, list):
            raise ConfigError(f"{p}: expected a JSON list of rows (or an object with a 'data' list)")
        return data
    if fmt == "csv":
        with p.open(newline="") as f:
            return list(csv.DictReader(f))
    raise ConfigError(f"unknown dataset file format {fmt!r}; use jsonl, json or csv")


def _read_hf(settings: DatasetSettings, split: str) -> list[dict[str, Any]]:
    import datasets

    if Path(settings.path).exists():
        ds = datasets.load_from_disk(settings.path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(settings.path, settings.name, split=split)
    return [dict(row) for row in ds]


def _check_prompt(prompt: Any, where: str, column: str) -> None:
    """A prompt is a non-empty string or a conversation: a non-empty list of {role, content} messages with string
    fields (TRL's two dataset formats); anything else is a bad row, named."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError(f"{where}: the {column!r} column is empty; every row needs a prompt")
        return
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return
    shown = repr(prompt)[:60]
    raise ConfigError(f"{where}: the {column!r} column holds {type(prompt).__name__} {shown}; a prompt is a string or "
                      f"a list of {{role, content}} messages")


def _normalise(rows: list[dict[str, Any]], s: DatasetSettings, where: str) -> list[dict[str, Any]]:
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: row {i} is a {type(row).__name__}, not an object with named columns")
        row = dict(row)
        if s.prompt_column not in row:
            raise ConfigError(f"{where}: row {i} has no prompt column {s.prompt_column!r} (columns: {sorted(row)}); "
                           f"set llm.dataset.prompt_column")
        prompt = row.pop(s.prompt_column)
        _check_prompt(prompt, f"{where} row {i}", s.prompt_column)
        if isinstance(prompt, str):
            try:
                prompt = s.prompt_template.format(prompt=prompt, **row)
            except (KeyError, IndexError) as e:
                raise ConfigError(f"llm.dataset.prompt_template {s.prompt_template!r} names {e}, which {where} row "
                                  f"{i} lacks (columns: {sorted(row)})") from None
        row["prompt"] = prompt
        if s.answer_column != "answer" and s.answer_column in row:
            row["answer"] = row.pop(s.answer_column)
        out.append(row)
    return out


def load_task(s: DatasetSettings) -> TaskData:
    """Deterministic, disjoint train / eval example lists."""
    if s.source == "arith":
        return TaskData(arith_problems("train", s.num_train, s.digits, s.seed),
                        arith_problems("eval", s.num_eval, s.digits, s.seed))
    if s.source in ("jsonl", "csv", "json"):
        rows = _read_rows(s.path, s.source)
        eval_rows = _read_rows(s.eval_path, s.source, "llm.dataset.eval_path") if s.eval_path else None
    elif s.source == "hf":
        rows = _read_hf(s, s.split)
        eval_rows = _read_hf(s, s.eval_split) if s.eval_split else None
    else:
        raise ConfigError(f"llm.dataset.source must be arith, jsonl, csv, json or hf; got {s.source!r}")
    if eval_rows is None:
        held = [_stable_hash("holdout", s.seed, i) % 10_000 < s.eval_fraction * 10_000 for i in range(len(rows))]
        eval_rows = [r for r, h in zip(rows, held) if h]
        rows = [r for r, h in zip(rows, held) if not h]
    train = _normalise(rows, s, f"llm.dataset {s.path}: train")
    evaluation = _normalise(eval_rows, s, f"llm.dataset {s.eval_path or s.path}: eval")
    if s.num_train:
        train = train[:s.num_train]
    if s.num_eval:
        evaluation = evaluation[:s.num_eval]
    if not train:
        raise ConfigError(f"dataset {s.path!r} gave no training rows")
    return TaskData(train, evaluation)


def format_prompt(tokenizer, prompt: Any, system_prompt: str | None = None, use_chat_template: str = "auto",
                  chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a prompt: through the tokenizer's chat template when it has one (``auto``) or ``always``,
    else the raw string with the tokenizer's own special tokens (BOS from the post-processor)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    conversational = isinstance(prompt, list)
    if use_chat_template == "always" and not has_template:
        raise ConfigError("llm.chat_template is 'always' but the tokenizer has no chat template")
    if conversational or (has_template and use_chat_template != "never"):
        if not has_template:
            raise ConfigError("conversational prompts (lists of messages) need a tokenizer with a chat template")
        messages = list(prompt) if conversational else [{"role": "user", "content": prompt}]
        if system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **(chat_template_kwargs or {}))
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def prompt_token_limit(settings: DatasetSettings, context: int | None, max_new_tokens: int) -> int | None:
    """The longest prompt in tokens: ``max_prompt_tokens`` when set, else the model's context minus the completion
    cap (None when the context is unknown)."""
    if settings.max_prompt_tokens > 0:
        return settings.max_prompt_tokens
    if context is None:
        return None
    return max(context - max_new_tokens, 1)


def prompt_token_ids(task: TaskData, tokenizer, settings: DatasetSettings, chat_template: str,
                     limit: int | None, why: str) -> tuple[dict[tuple[str, int], list[int]], int]:
    """Every prompt's token ids as the run feeds them (template, BOS), keyed ``(split, row)``, checked against
    ``limit``: with ``long_prompts: error`` the first too-long row is a ConfigError (one line: split, row, length,
    limit and ``why`` the limit is what it is); with ``truncate`` it keeps its last ``limit`` tokens. Returns the ids
    and how many rows were cut."""
    ids, cut = {}, 0
    for split, rows in (("train", task.train), ("eval", task.eval)):
        for i, row in enumerate(rows):
            tokens = format_prompt(tokenizer, row["prompt"], settings.system_prompt, chat_template,
                                   settings.chat_template_kwargs)
            if limit is not None and len(tokens) > limit:
                if settings.long_prompts == "error":
                    raise ConfigError(f"llm.dataset: {split} row {i}'s prompt is {len(tokens):,} tokens, more than "
                                      f"{limit:,} ({why}); shorten it, set llm.dataset.max_prompt_tokens, or "
                                      f"llm.dataset.long_prompts: truncate")
                tokens, cut = tokens[-limit:], cut + 1
            ids[(split, i)] = tokens
    return ids, cut


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer at ``path`` (a local directory, relative to the repository or the working directory, or a hub
    id: ``prechecks.resolve_llm_model``), left-padded, EOS as pad when it has none."""
    from transformers import AutoTokenizer

    from ..prechecks import resolve_llm_model

    tok = AutoTokenizer.from_pretrained(resolve_llm_model(path))
    if tok.pad_token_id is None:
        # Some hub tokenizers have no pad token; EOS as pad is safe here because attention masks, not ids,
        # decide what is padding in every forward this package runs.
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok
