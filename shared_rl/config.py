"""Typed configs from YAML, validated up front (TRL-style dataclasses).

``from_dict(cls, data)`` builds a (nested) dataclass and rejects unknown keys, wrong types and bad values with
one line that says what to change. ``apply_overrides(data, ["optim.lr=1e-4", ...])`` applies dotted
command-line overrides before validation. ``TrainConfig.validate()`` checks batch arithmetic.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A config problem; its message is one actionable line (the CLI prints it and exits with code 2)."""


class ResourceError(RuntimeError):
    """The run cannot continue for lack of a resource (out of memory); the message says what to change."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} settings, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_coerce(k, kt, where): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"{where}: expected a path, got {type(value).__name__} {value!r}")
    return value


def from_dict(cls: type, data: dict | None, where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, checking keys and types; nested dataclasses recurse."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"unknown config key {path!r}{hint}")
        kwargs[key] = _coerce(value, hints[key], path)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where or cls.__name__}: {e}") from None
    check = getattr(obj, "check", None)
    if callable(check):
        check(where)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict (Paths as strings), for writing the resolved config."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict, returning a new dict."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{at}") from None
    if data is None:
        raise ConfigError(f"config file {str(path)!r} is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must be a mapping of settings, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------------------------
# The trainer's config. Domain settings live in a section named after the domain and are validated by the
# domain's own ``config_class``.


def _positive(where: str, name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{where}{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass
class RolloutConfig:
    groups_per_iteration: int = 8
    group_size: int = 8
    # groups per Domain.rollout call (a rollout micro-batch, spread over processes); fix it to get identical
    # results for any number of processes; 0 = all of this process's groups in one call
    groups_per_call: int = 0

    def check(self, where: str) -> None:
        _positive(f"{where}.", "groups_per_iteration", self.groups_per_iteration)
        _positive(f"{where}.", "groups_per_call", self.groups_per_call, allow_zero=True)
        if self.group_size < 2:
            raise ConfigError(f"{where}.group_size must be >= 2 for group-relative advantages, got {self.group_size}")


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"
    clip: Optional[float] = 5.0
    multi_reward: Literal["normalize_then_sum", "sum_then_normalize"] = "sum_then_normalize"
    weights: dict[str, float] = field(default_factory=dict)
    eps: float = 1e-6

    def check(self, where: str) -> None:
        from .advantages import ESTIMATORS, TREE_ESTIMATORS

        known = sorted(ESTIMATORS) + sorted(TREE_ESTIMATORS)
        if self.estimator not in known:
            close = difflib.get_close_matches(self.estimator, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}.estimator {self.estimator!r} is unknown{hint}; choose one of {known}")
        if self.clip is not None:
            _positive(f"{where}.", "clip", self.clip)


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: Optional[float] = None  # None = same as clip_low; larger = DAPO clip-higher
    dual_clip: Optional[float] = None  # Ye et al. dual clip constant c > 1 for negative advantages
    ratio_level: Literal["step", "sequence"] = "step"  # sequence = GSPO
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    max_steps_norm: Optional[int] = None  # the constant for seq-mean-token-sum-norm (default: T)
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3", "domain"] = "domain"

    def check(self, where: str) -> None:
        _positive(f"{where}.", "clip_low", self.clip_low)
        if self.clip_high is not None:
            _positive(f"{where}.", "clip_high", self.clip_high)
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"{where}.dual_clip must be > 1 (e.g. 3.0), got {self.dual_clip}")
        _positive(f"{where}.", "kl_coef", self.kl_coef, allow_zero=True)


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: Optional[float] = 1.0
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    inner_epochs: int = 1
    minibatches_per_epoch: int = 1  # optimizer steps per inner epoch
    micro_batch_size: int = 0  # sequences per forward/backward; 0 = the whole minibatch

    def check(self, where: str) -> None:
        _positive(f"{where}.", "lr", self.lr)
        _positive(f"{where}.", "inner_epochs", self.inner_epochs)
        _positive(f"{where}.", "minibatches_per_epoch", self.minibatches_per_epoch)
        _positive(f"{where}.", "micro_batch_size", self.micro_batch_size, allow_zero=True)
        if len(self.betas) != 2:
            raise ConfigError(f"{where}.betas must be two numbers like [0.9, 0.999], got {self.betas}")


@dataclass
class SelectionConfig:
    filter: Literal["none", "zero_std", "band"] = "none"
    band: list[float] = field(default_factory=lambda: [0.1, 0.9])
    band_reward: Optional[str] = None  # reward name for the success band (default: the first reward)
    max_refill_rounds: int = 0
    sampler: Literal["uniform", "vade", "history"] = "uniform"
    vade_prior: list[float] = field(default_factory=lambda: [1.0, 1.0])
    vade_decay_fast: float = 0.7
    vade_decay_slow: float = 0.95
    vade_fast_weight: float = 0.5
    history_window: int = 2
    history_readmit_after: int = 5

    def check(self, where: str) -> None:
        lo, hi = (self.band + [None, None])[:2]
        if len(self.band) != 2 or not (0 <= lo < hi <= 1):
            raise ConfigError(f"{where}.band must be [lo, hi] with 0 <= lo < hi <= 1, got {self.band}")
        _positive(f"{where}.", "max_refill_rounds", self.max_refill_rounds, allow_zero=True)
        for name in ("vade_decay_fast", "vade_decay_slow"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ConfigError(f"{where}.{name} must be in (0, 1], got {v}")


@dataclass
class CheckpointConfig:
    every: int = 0  # iterations between checkpoints; 0 = only at the end
    keep_last: int = 2

    def check(self, where: str) -> None:
        _positive(f"{where}.", "every", self.every, allow_zero=True)
        _positive(f"{where}.", "keep_last", self.keep_last)


@dataclass
class EvalConfig:
    every: int = 0  # iterations between evaluations; 0 = before the first update and at the end only
    at_start: bool = True


@dataclass
class LoggingConfig:
    progress: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "grove"


@dataclass
class DistributedConfig:
    """How several processes share the policy (docs/scaling.md).

    strategy: ``replicate`` keeps a full copy of the policy on every process and sums the trainable gradients
        (``Dist.sum_gradients``); ``fsdp2`` shards the modules the domain lists in ``fsdp_modules()`` with
        ``torch.distributed.fsdp.fully_shard`` (parameters, gradients and optimizer state split over processes,
        gradients still *summed*). With one process both are the same.
    reshard_after_forward: fsdp2 only; free the gathered parameters after each training forward (saves memory,
        costs one more all-gather per block in backward).
    """

    strategy: Literal["replicate", "fsdp2"] = "replicate"
    reshard_after_forward: bool = True


@dataclass
class TrainConfig:
    """Everything the shared trainer needs; the domain's own section is ``domain_config``."""

    domain: str = "toy"
    kind: Literal["rl", "supervised"] = "rl"
    seed: int = 0
    iterations: int = 10
    device: str = "auto"
    max_nonfinite_steps: int = 3  # stop with a clear message after this many skipped non-finite steps
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    domain_config: Any = None

    def check(self, where: str) -> None:
        _positive("", "iterations", self.iterations, allow_zero=True)
        mb = self.optim.micro_batch_size
        if mb and self.rollout.group_size * self.rollout.groups_per_iteration % self.optim.minibatches_per_epoch:
            raise ConfigError(
                f"optim.minibatches_per_epoch={self.optim.minibatches_per_epoch} must divide the "
                f"{self.rollout.groups_per_iteration}x{self.rollout.group_size} sequences per iteration"
            )
        if self.selection.sampler == "vade" and self.selection.filter == "none":
            pass  # VADE alone is fine: it steers which keys are drawn


def load_train_config(data: dict) -> TrainConfig:
    """Validate a full YAML dict: trainer sections plus the domain section (``data[domain]``)."""
    from .registry import resolve_domain

    data = dict(data)
    domain = data.get("domain", "toy")
    if not isinstance(domain, str):
        raise ConfigError(f"domain must be a name like 'visgen', got {domain!r}")
    domain_cls = resolve_domain(domain)
    domain_section = data.pop(domain, None)
    cfg = from_dict(TrainConfig, data)
    cfg.domain_config = from_dict(domain_cls.config_class, domain_section or {}, domain)
    check_domain = getattr(cfg.domain_config, "check_with", None)
    if callable(check_domain):
        check_domain(cfg)
    return cfg


def dump_train_config(cfg: TrainConfig) -> dict:
    out = to_dict(cfg)
    out[cfg.domain] = out.pop("domain_config")
    return out
