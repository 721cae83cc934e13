"""Verifiable rewards with TRL's reward-function signature, so TRL reward functions work unchanged.

A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., **columns, **extras)`` and
returns one ``float | None`` per completion; ``None`` becomes NaN, which the trainer masks and counts (a failed
check is never a silent zero). ``columns`` are the dataset columns (``answer``, ...); extras are
``trainer_state`` (with ``global_step``), ``log_metric``, ``log_extra`` (as TRL passes them) and, from grove,
``max_completion_length`` and ``truncated`` (no EOS within the length cap). Functions that take ``**kwargs``
ignore what they do not use.

Built-ins (``llm.rewards[*].name``): ``exact_match``, ``numeric_match``, ``format``, ``length_penalty``,
``overlong`` (DAPO soft overlong punishment). Any other name is imported as ``module:function``; with ``args``
it is called once as a factory that returns the reward function.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError

RewardFunction = Callable[..., list]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def completion_text(completion: Any) -> str:
    """A completion as text: a string, or TRL's conversational form (a list of messages; the last one's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    raise TypeError(f"cannot read a completion of type {type(completion).__name__}")


def parse_number(text: str, prefer_marker: bool = True) -> float | None:
    """The answer number in ``text``: after a GSM8K ``####`` marker when present, else the last number."""
    if prefer_marker and "####" in text:
        text = text.rsplit("####", 1)[1]
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def exact_match(column: str = "answer", strip: bool = True) -> RewardFunction:
    """1 if the completion equals the reference column (whitespace-stripped), else 0."""
    def exact_match_reward(prompts, completions, **kwargs) -> list[float | None]:
        refs = kwargs[column]
        out = []
        for c, ref in zip(completions, refs):
            text = completion_text(c)
            out.append(float((text.strip() if strip else text) == (str(ref).strip() if strip else str(ref))))
        return out
    exact_match_reward.__name__ = "exact_match"
    return exact_match_reward


def numeric_match(column: str = "answer", tolerance: float = 1e-6) -> RewardFunction:
    """1 if the completion's answer number equals the reference's (GSM8K ``####`` aware), 0 if it differs or the
    completion has no number, None (masked) if the reference itself has no number."""
    def numeric_match_reward(prompts, completions, **kwargs) -> list[float | None]:
        out: list[float | None] = []
        for c, ref in zip(completions, kwargs[column]):
            target = parse_number(str(ref))
            if target is None:
                out.append(None)
                continue
            got = parse_number(completion_text(c), prefer_marker=True)
            out.append(float(got is not None and math.isclose(got, target, abs_tol=tolerance)))
        return out
    numeric_match_reward.__name__ = "numeric_match"
    return numeric_match_reward


def format_check(pattern: str = r"\s*-?\d+\s*", require_eos: bool = True) -> RewardFunction:
    """1 if the whole completion matches ``pattern`` (and it ended with EOS, when ``require_eos``), else 0."""
    regex = re.compile(pattern, re.DOTALL)

    def format_reward(prompts, completions, **kwargs) -> list[float | None]:
        truncated = kwargs.get("truncated") or [False] * len(completions)
        return [float(bool(regex.fullmatch(completion_text(c))) and not (require_eos and t))
                for c, t in zip(completions, truncated)]
    format_reward.__name__ = "format"
    return format_reward


def length_penalty(coef: float = 0.01, unit: str = "tokens") -> RewardFunction:
    """``-coef * length`` (tokens via ``completion_ids`` when given, else characters)."""
    def length_penalty_reward(prompts, completions, **kwargs) -> list[float | None]:
        ids = kwargs.get("completion_ids")
        if unit == "tokens" and ids is not None:
            return [-coef * len(x) for x in ids]
        return [-coef * len(completion_text(c)) for c in completions]
    length_penalty_reward.__name__ = "length_penalty"
    return length_penalty_reward


def overlong(max_length: int | None = None, buffer: int = 4) -> RewardFunction:
    """DAPO soft overlong punishment (Yu et al., "DAPO"): with L = max_length, C = buffer and length |y|,
    0 if |y| <= L - C; (L - C - |y|) / C if L - C < |y| <= L; -1 beyond L. ``max_length`` defaults to the
    generation cap (``max_completion_length``)."""
    def overlong_reward(prompts, completions, **kwargs) -> list[float | None]:
        limit = max_length or kwargs.get("max_completion_length")
        if limit is None:
            raise ValueError("overlong reward needs max_length (or max_completion_length from the caller)")
        ids = kwargs.get("completion_ids")
        lengths = [len(x) for x in ids] if ids is not None else [len(completion_text(c)) for c in completions]
        out = []
        for n in lengths:
            if n <= limit - buffer:
                out.append(0.0)
            elif n <= limit:
                out.append((limit - buffer - n) / buffer)
            else:
                out.append(-1.0)
        return out
    overlong_reward.__name__ = "overlong"
    return overlong_reward


def required_columns(spec: LLMRewardSpec) -> list[str]:
    """Dataset columns a built-in reward reads (``exact_match``/``numeric_match``: their ``column``, default
    ``answer``); a ``module:function`` reward declares none, so only built-ins are checked before loading."""
    if spec.name in ("exact_match", "numeric_match"):
        return [str(spec.args.get("column", "answer"))]
    return []


BUILTIN_REWARDS: dict[str, Callable[..., RewardFunction]] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "format": format_check,
    "length_penalty": length_penalty,
    "overlong": overlong,
}


@dataclass
class LLMRewardSpec:
    """One reward term of ``llm.rewards``: ``name`` (built-in or ``module:function``), its ``weight`` in the total,
    factory ``args``, and ``label`` (the metric name ``reward/<label>/mean``; defaults to the name).
    ``LLM``-prefixed: the image domain has reward specs of its own."""

    name: str = field(default="numeric_match", metadata={"help": "built-in reward or 'module:function'"})
    weight: float = field(default=1.0, metadata={"help": "weight of this term in the total reward"})
    args: dict[str, Any] = field(default_factory=dict, metadata={"help": "keyword arguments of the reward factory"})
    label: str = field(default="", metadata={"help": "metric name reward/<label>/mean; '' = the reward's name"})


def _import_reward(name: str) -> Any:
    """The object ``module:function`` names; a module that does not import or lacks the attribute is a config
    mistake (a typo, a file not on the Python path), reported before any model loads."""
    from ..registry import import_object

    return import_object(name, "llm.rewards")


def build_reward(spec: LLMRewardSpec) -> tuple[str, RewardFunction]:
    if spec.name in BUILTIN_REWARDS:
        try:
            fn = BUILTIN_REWARDS[spec.name](**spec.args)
        except TypeError as e:  # an argument the factory does not take
            raise ConfigError(f"llm.rewards: {spec.name} args {spec.args}: {e}") from None
    elif ":" in spec.name:
        obj = _import_reward(spec.name)
        fn = obj(**spec.args) if spec.args else obj
    else:
        from ..registry import did_you_mean

        raise ConfigError(f"unknown reward {spec.name!r}{did_you_mean(spec.name, BUILTIN_REWARDS)}: use one of "
                          f"{sorted(BUILTIN_REWARDS)} or 'module:function'")
    label = spec.label or (spec.name if spec.name in BUILTIN_REWARDS else getattr(fn, "__name__", spec.name))
    return label, fn


def call_reward(fn: RewardFunction, label: str, prompts: list, completions: list, completion_ids: list[list[int]],
                columns: dict[str, list], extras: dict[str, Any]) -> list[float]:
    """Call a TRL-style reward function; None -> NaN; a wrong-length answer is a clear error."""
    values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extras)
    values = list(values)
    if len(values) != len(completions):
        raise ValueError(f"reward {label!r} returned {len(values)} values for {len(completions)} completions")
    return [math.nan if v is None else float(v) for v in values]


def catalog() -> dict[str, list[str]]:
    """The LLM domain's names for ``grove list`` (``shared_rl.registry.CATALOGS``)."""
    return {"rewards (llm.rewards[].name; or module:function)": sorted(BUILTIN_REWARDS),
            "rollout engines (llm.engine; or module:Class)": ["auto", "fast", "torch"]}
