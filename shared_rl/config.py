"""Typed configs from YAML, validated up front (TRL-style dataclasses).

``from_dict(cls, data)`` builds a (nested) dataclass and rejects unknown keys, wrong types and bad values with
one line that says what to change. ``apply_overrides(data, ["optim.lr=1e-4", ...])`` applies dotted
command-line overrides before validation. ``TrainConfig.validate()`` checks batch arithmetic.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

# re-exported: ``from shared_rl.config import ConfigError`` keeps working (the classes live in errors.py)
from .errors import ConfigError, ResourceError  # noqa: F401


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


class Choice:
    """A registered part chosen by name, with its own settings (verl ``core_algos`` style): written in YAML as the
    name alone (``policy_loss: sapo``: the part's default settings) or as a mapping with ``name`` and the part's
    settings (``policy_loss: {name: sapo, tau_pos: 1.0}``). ``settings`` is an instance of the registered part's
    settings dataclass (an empty one for a part without settings). Subclasses name their registry in ``entries()``,
    whose values carry ``settings_class``; ``kind`` is the config path used in messages."""

    kind = "choice"

    def __init__(self, name: str, settings: Any = None) -> None:
        self.name = name
        self.settings = settings if settings is not None else self.settings_class_of(name)()

    @staticmethod
    def entries(needs: str | None = None) -> dict[str, Any]:
        """name -> entry with ``settings_class`` (the registry; ``needs``: the one name the caller looks up, so a
        torch-free index of the built-in entries may answer: ``shared_rl.part_index``)."""
        raise NotImplementedError

    @classmethod
    def settings_class_of(cls, name: str) -> type:
        known = cls.entries(str(name))
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{cls.kind} {name!r} is unknown{hint}; choose one of {sorted(known)}")
        return known[name].settings_class

    @classmethod
    def parse(cls, value: Any, where: str) -> "Choice":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(cls._checked_name(value, where))
        if isinstance(value, dict) and "name" in value:
            name = cls._checked_name(value["name"], where)
            rest = {k: v for k, v in value.items() if k != "name"}
            return cls(name, from_dict(cls.settings_class_of(name), rest, f"{where}"))
        raise ConfigError(f"{where}: expected a name or a mapping {{name: ..., <its settings>}}, got {value!r}")

    @classmethod
    def _checked_name(cls, name: Any, where: str) -> str:
        if not isinstance(name, str):
            raise ConfigError(f"{where}.name: expected a string, got {type(name).__name__} {name!r}")
        known = cls.entries(name)
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where} {name!r} is unknown{hint}; choose one of {sorted(known)}")
        return name

    def to_config(self) -> Any:
        """The YAML form: the name alone when the part has no settings, else ``{name, **settings}``."""
        fields_ = to_dict(self.settings) if dataclasses.is_dataclass(self.settings) else {}
        return {"name": self.name, **fields_} if fields_ else self.name

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and (other.name, other.settings) == (self.name, self.settings)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_config()!r})"


class PolicyLossChoice(Choice):
    """``loss.policy_loss``: a ``shared_rl.losses.POLICY_LOSSES`` entry and its settings."""

    kind = "loss.policy_loss"

    @staticmethod
    def entries(needs: str | None = None) -> dict[str, Any]:
        from .part_index import policy_losses

        return policy_losses(needs)


class EstimatorChoice(Choice):
    """``advantage.estimator``: a ``shared_rl.advantages.ESTIMATORS`` entry and its settings."""

    kind = "advantage.estimator"

    @staticmethod
    def entries(needs: str | None = None) -> dict[str, Any]:
        from .part_index import estimators

        return estimators(needs)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, Choice):
        return tp.parse(value, where)
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
        number = None
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):  # YAML reads "1e-4" as a string
            try:
                number = float(value)
            except (ValueError, OverflowError):  # an integer past float range is reported as not finite below
                number = math.inf if isinstance(value, int) else None
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(number):  # nan/inf (also "1e309", which overflows) would start a run that cannot learn
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"{where}: expected a path, got {type(value).__name__} {value!r}")
    return value


# TRL ``GRPOConfig`` field names a TRL user types at the top of a config -> grove's key for the same setting
TRL_KEYS = {
    "learning_rate": "optim.lr", "num_generations": "rollout.group_size", "max_steps": "iterations",
    "num_iterations": "optim.inner_epochs", "beta": "loss.kl_coef", "epsilon": "loss.clip_low",
    "epsilon_high": "loss.clip_high", "max_grad_norm": "optim.grad_clip", "max_completion_length": "llm.max_new_tokens",
    "temperature": "llm.temperature", "weight_decay": "optim.weight_decay", "output_dir": "--out DIR",
    "per_device_train_batch_size": "rollout.groups_per_iteration x rollout.group_size (prompts x completions)",
    "scale_rewards": "advantage.estimator (grpo / dr_grpo / batch_std)", "loss_type": "loss.aggregation",
    "lr_scheduler_type": "optim.schedule", "warmup_ratio": "optim.warmup_steps",
    "entropy_coef": "loss.entropy.coef", "entropy_target": "loss.entropy.target (adaptive)",
    "top_entropy_quantile": "loss.entropy.top_quantile", "delta": "loss.dual_clip",
    "off_policy_mask_threshold": "loss.off_policy_mask",
}


def _top_level_keys(fields: list[str], key: str, data: dict) -> tuple[list[str], str]:
    """The top-level keys a user writes (the domain's own section by its name, e.g. ``visgen:``, never the
    attribute ``domain_config``), and a hint when ``key`` is, or is close to, another domain's section name."""
    from .registry import domain_names

    domain = str(data.get("domain", "toy"))
    known = [k for k in fields if k != "domain_config"] + [domain]
    others = [d for d in domain_names() if d != domain]
    close = difflib.get_close_matches(key, known, n=1) or difflib.get_close_matches(key, others, n=1)
    section = close[0] if close else None
    if key == "domain_config":
        return known, f"; the domain's own settings go under its name: {domain}: (this config's domain)"
    if section in others and key == section:
        return known, (f"; this config's domain is {domain!r}, so its own settings go under {domain}: (a "
                       f"{section}: section needs domain: {section})")
    if section in others:
        return known, (f"; did you mean {section!r}? (a {section!r} section needs domain: {section}; this "
                       f"config's domain is {domain!r}, its settings go under {domain}:)")
    return known, ""


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
        top_level_attribute = not where and key == "domain_config" and cls.__name__ == "TrainConfig"
        if key not in fields or top_level_attribute:
            moved = getattr(cls, "moved_keys", {}).get(key)  # a class may say what replaced a key of earlier configs
            if moved:
                raise ConfigError(f"config key {path!r} was replaced: {moved}")
            if not where and key in TRL_KEYS and cls.__name__ == "TrainConfig":
                raise ConfigError(f"unknown config key {path!r}: that is TRL's GRPOConfig name; grove's is "
                                  f"{TRL_KEYS[key]}")
            known = list(fields)
            if not where and cls.__name__ == "TrainConfig":
                known, hint = _top_level_keys(known, str(key), data)
                if hint:
                    raise ConfigError(f"unknown config key {path!r}{hint}")
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
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
    if isinstance(obj, Choice):
        return obj.to_config()
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def describe(obj: Any, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """``(dotted path, value, default, help)`` for every setting of dataclass ``obj``, for ``grove config show``.

    Nested dataclass values are walked (their fields appear as ``section.field``, the section itself not), so a
    domain section held in an ``Any`` field is described too. The help text is the field's ``metadata["help"]``
    ("" when it has none), so it is written once, next to the field it documents; ``default`` is
    ``dataclasses.MISSING`` for a required field.
    """
    rows: list[tuple[str, Any, Any, str]] = []
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            rows += describe(value, f"{path}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if isinstance(value, Choice):  # the part's name, then its own settings: path.name, path.<setting> (YAML form)
            has_settings = dataclasses.is_dataclass(value.settings) and bool(dataclasses.fields(value.settings))
            rows.append((f"{path}.name" if has_settings else path, value.name,
                         default.name if isinstance(default, Choice) else default, f.metadata.get("help", "")))
            if has_settings:
                rows += describe(value.settings, f"{path}.")
            continue
        rows.append((path, value, default, f.metadata.get("help", "")))
    return rows


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
            if isinstance(nxt, str) and p in node:  # a registered part given by name: loss.policy_loss.tau_pos=2
                nxt = node[p] = {"name": nxt}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    from .preflight import check_config_file  # bytes, encoding and nesting before YAML reads them

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    check_config_file(path)
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
    groups_per_iteration: int = field(
        default=8, metadata={"help": "group keys (prompts / reset states) drawn per iteration; refills keep this many"})
    group_size: int = field(
        default=8, metadata={"help": "samples per group (G), >= 2; tree and multi-group domains may read it their way"})
    groups_per_call: int = field(default=0, metadata={
        "help": "keys per Domain.rollout call (spread over processes; fix it for layout-independent results); "
                "0 = an even share per process"})

    def check(self, where: str) -> None:
        _positive(f"{where}.", "groups_per_iteration", self.groups_per_iteration)
        _positive(f"{where}.", "groups_per_call", self.groups_per_call, allow_zero=True)
        if self.group_size < 2:
            raise ConfigError(f"{where}.group_size must be >= 2 for group-relative advantages, got {self.group_size}")


_CRITIC_MOVED = "the critic's settings belong to its estimator: advantage.estimator: {name: gae, gamma: .., lam: .., " \
                "normalize: .., value_coef: .., value_clip: .., warmup: .., lr: ..}"


@dataclass
class AdvantageConfig:
    estimator: EstimatorChoice = field(default_factory=lambda: EstimatorChoice("grpo"), metadata={
        "help": "a shared_rl.advantages.ESTIMATORS entry, by name or {name: .., <its settings>}: flat grpo | batch_std "
                "| dr_grpo | rloo | mc_median; tree rollouts depth_zscore | sibling | leaf_global | treerl | "
                "tree_leaf_zscore; with a critic (PPO; the domain supplies values) {name: gae, gamma, lam, normalize, "
                "value_coef, value_clip, warmup, lr}"})
    clip: Optional[float] = field(default=5.0, metadata={"help": "clip advantages to [-clip, clip]; null = no clip"})
    multi_reward: Literal["normalize_then_sum", "sum_then_normalize"] = field(default="sum_then_normalize", metadata={
        "help": "several rewards: sum_then_normalize (weighted sum, one estimator) | normalize_then_sum (GDPO)"})
    weights: dict[str, float] = field(default_factory=dict, metadata={
        "help": "reward name -> weight (missing names weigh 1.0; 0 = logged only)"})
    eps: float = field(default=1e-6, metadata={
        "help": "added to the std in z-score estimators; also a soft std floor: a group whose rewards differ by much "
                "less than eps (e.g. all-success groups told apart only by a dense term) gets advantages scaled by "
                "std / (std + eps) instead of unit size"})

    moved_keys: typing.ClassVar[dict[str, str]] = {"gamma": _CRITIC_MOVED, "lam": _CRITIC_MOVED,
                                                    "normalize": _CRITIC_MOVED}

    def check(self, where: str) -> None:
        if self.clip is not None:
            _positive(f"{where}.", "clip", self.clip)

    @property
    def kind(self) -> str:
        """flat | tree | step: what the estimator reads (group ids, the parent array, or a critic's values)."""
        return EstimatorChoice.entries(self.estimator.name)[self.estimator.name].kind


@dataclass
class EntropyConfig:
    """``loss.entropy``: the entropy bonus and the high-entropy token mask (the domain's per-step entropy ``H``).

    The bonus subtracts ``coef · Σ_{i,t} m·e·H / N_steps`` from the loss (the mean per-step entropy of the step's
    trained steps, whatever ``loss.aggregation`` is: TRL's ``entropy_coef``, verl's ``entropy_coeff``); ``e`` is the
    high-entropy mask below (1 everywhere at ``top_quantile: 1``). With ``target`` set the coefficient is adaptive
    (Skywork-OR1, arXiv 2505.22312, as TRL runs it): after each optimizer step it rises by ``coef_step`` when the
    step's mean entropy over ``m·e`` is at or below ``target`` and falls by it otherwise (within ``[coef_min,
    coef_max]``), and it is applied only while the previous step's entropy was at or below ``target``; the
    coefficient and that entropy are saved with each checkpoint."""

    coef: float = field(default=0.0, metadata={
        "help": "weight of the entropy bonus (loss - coef * mean entropy); 0 = none; the start value when adaptive"})
    target: Optional[float] = field(default=None, metadata={
        "help": "adaptive coefficient (Skywork-OR1): the target mean per-step entropy (nats); null = coef is fixed"})
    coef_step: float = field(default=0.005, metadata={"help": "adaptive: the coefficient's change per optimizer step"})
    coef_min: float = field(default=0.0, metadata={"help": "adaptive: the coefficient's lower bound"})
    coef_max: float = field(default=1.0, metadata={"help": "adaptive: the coefficient's upper bound"})
    top_quantile: float = field(default=1.0, metadata={
        "help": "Beyond the 80/20 Rule (arXiv 2506.01939): the policy loss (and the bonus) only on the steps whose "
                "entropy is in the top fraction rho of each micro-batch's trained steps (0.2 there); 1 = all"})

    @property
    def enabled(self) -> bool:
        """Whether the bonus is part of the loss (an adaptive coefficient may sit at 0 and rise again)."""
        return self.coef != 0 or self.target is not None

    def check(self, where: str) -> None:
        _positive(f"{where}.", "coef", self.coef, allow_zero=True)
        _positive(f"{where}.", "coef_step", self.coef_step, allow_zero=True)
        if not 0 <= self.coef_min <= self.coef_max:
            raise ConfigError(f"{where}: need 0 <= coef_min <= coef_max, got {self.coef_min} and {self.coef_max}")
        if self.target is not None:
            _positive(f"{where}.", "target", self.target, allow_zero=True)
        if not 0 <= self.top_quantile <= 1:
            raise ConfigError(f"{where}.top_quantile must be in [0, 1] (1 = every step), got {self.top_quantile}")


@dataclass
class LossConfig:
    policy_loss: Optional[PolicyLossChoice] = field(default=None, metadata={
        "help": "a shared_rl.losses.POLICY_LOSSES entry, by name or {name: .., <its settings>}: clipped (PPO/GRPO/"
                "DAPO) | gspo (sequence ratio) | cispo (clipped IS weight) | {name: sapo, tau_pos, tau_neg} (soft "
                "gate) | {name: guard, scale, center, step_weight} (GRPO-Guard); null = the loss the domain's method implies "
                "(visgen objective nft / awm), else clipped"})
    policy_coef: float = field(default=1.0, metadata={
        "help": "weight of the policy-gradient term; 0 = none: each optimizer step trains the domain's auxiliary "
                "losses alone (filtered BC / ReST-EM: robotics.replay.source successes, the run's own successes)"})
    clip_low: float = field(default=0.2, metadata={"help": "ratio clip below: 1 - clip_low (clipped, gspo, cispo)"})
    clip_high: Optional[float] = field(default=None, metadata={
        "help": "ratio clip above: 1 + clip_high; null = clip_low, larger = DAPO clip-higher"})
    dual_clip: Optional[float] = field(default=None, metadata={
        "help": "dual clip constant c > 1 bounding the loss of negative advantages (clipped, gspo); null = off"})
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = field(
        default="token-mean", metadata={"help": "token-mean (DAPO) | seq-mean-token-mean (GRPO) | "
                                                "seq-mean-token-sum-norm (Dr. GRPO)"})
    max_steps_norm: Optional[int] = field(default=None, metadata={
        "help": "the constant length of seq-mean-token-sum-norm; null = T, the rollout's step count"})
    kl_coef: float = field(default=0.0, metadata={"help": "weight of the KL(policy || reference) term; 0 = no KL"})
    kl_estimator: str = field(default="domain", metadata={
        "help": "shared_rl.losses.KL_ESTIMATORS entry: domain (the domain's own KL, else k3) | k1 | k3"})
    off_policy_mask: Optional[float] = field(default=None, metadata={
        "help": "DeepSeek-V3.2's off-policy sequence mask: drop a negative-advantage sequence whose mean KL(behaviour "
                "|| policy) exceeds this (0.5 say; TRL's off_policy_mask_threshold); null = off"})
    entropy: EntropyConfig = field(default_factory=EntropyConfig, metadata={
        "help": "entropy bonus {coef, target (adaptive), coef_step, coef_min, coef_max} and top_quantile (80/20 mask)"})

    moved_keys: typing.ClassVar[dict[str, str]] = {
        "sapo_tau_pos": "policy_loss: {name: sapo, tau_pos: .., tau_neg: ..}",
        "sapo_tau_neg": "policy_loss: {name: sapo, tau_pos: .., tau_neg: ..}",
        "guard_center": "policy_loss: {name: guard, center: .., step_weight: ..}",
        "guard_reweight": "policy_loss: {name: guard, center: .., step_weight: ..}",
        "objective_adv_max": "the nft loss's own setting (visgen.objective: {name: nft, adv_max: ..})",
        "value_coef": _CRITIC_MOVED, "value_clip": _CRITIC_MOVED, "critic_warmup": _CRITIC_MOVED,
        "replay_coef": "the domain's own replay settings (robotics.replay: {coef: .., data: ..})",
    }

    def check(self, where: str) -> None:
        from .part_index import kl_estimator_names
        if self.policy_coef < 0:
            raise ConfigError(f"{where}.policy_coef must be >= 0 (0 = no policy-gradient term), got {self.policy_coef}")

        KL_ESTIMATORS = kl_estimator_names()  # noqa: N806 — read from the source while torch is not imported
        if self.kl_estimator not in KL_ESTIMATORS:
            close = difflib.get_close_matches(self.kl_estimator, sorted(KL_ESTIMATORS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}.kl_estimator {self.kl_estimator!r} is unknown{hint}; choose one of "
                              f"{sorted(KL_ESTIMATORS)}")
        _positive(f"{where}.", "clip_low", self.clip_low)
        if self.clip_high is not None:
            _positive(f"{where}.", "clip_high", self.clip_high)
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"{where}.dual_clip must be > 1 (e.g. 3.0), got {self.dual_clip}")
        _positive(f"{where}.", "kl_coef", self.kl_coef, allow_zero=True)
        if self.off_policy_mask is not None:
            _positive(f"{where}.", "off_policy_mask", self.off_policy_mask, allow_zero=True)
        if self.max_steps_norm is not None:
            _positive(f"{where}.", "max_steps_norm", self.max_steps_norm)


@dataclass
class OptimConfig:
    lr: float = field(default=1e-4, metadata={"help": "AdamW peak learning rate (after warm-up)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata={"help": "AdamW [beta1, beta2]"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    grad_clip: Optional[float] = field(default=1.0, metadata={"help": "max global gradient norm; null = no clipping"})
    warmup_steps: int = field(default=0, metadata={"help": "optimizer steps of linear warm-up to lr; 0 = none"})
    schedule: Literal["constant", "cosine", "linear"] = field(
        default="constant", metadata={"help": "lr after warm-up: constant | cosine | linear (decay to 0 at the end)"})
    ema_decay: float = field(default=0.0, metadata={
        "help": "weight averaging (Polyak): an EMA of the trained weights, decay min(ema_decay, (1+t)/(10+t)) at "
                "optimizer step t, is what evaluation and the exported model use; rollouts and updates use the live "
                "weights. 0 = off"})
    inner_epochs: int = field(default=1, metadata={"help": "passes over each iteration's rollouts (PPO epochs)"})
    minibatches_per_epoch: int = field(default=1, metadata={"help": "optimizer steps per inner epoch"})
    backward_steps: int = field(default=0, metadata={
        "help": "trained step columns per forward + backward within a micro-batch: 1 keeps one denoising step's graph "
                "alive at a time (the official Flow-GRPO trainer's memory), the same gradient; 0 = all of them in one "
                "backward (fewer calls, one graph per trained step held at once). Needs a domain that computes step "
                "subsets (visgen; DomainBase.supports_step_subsets)"})
    micro_batch_size: int = field(
        default=0, metadata={"help": "sequences per forward/backward (gradient accumulation); 0 = the whole minibatch"})

    moved_keys: typing.ClassVar[dict[str, str]] = {"critic_lr": _CRITIC_MOVED}

    def check(self, where: str) -> None:
        _positive(f"{where}.", "lr", self.lr)
        _positive(f"{where}.", "inner_epochs", self.inner_epochs)
        _positive(f"{where}.", "minibatches_per_epoch", self.minibatches_per_epoch)
        _positive(f"{where}.", "micro_batch_size", self.micro_batch_size, allow_zero=True)
        _positive(f"{where}.", "backward_steps", self.backward_steps, allow_zero=True)
        _positive(f"{where}.", "weight_decay", self.weight_decay, allow_zero=True)
        _positive(f"{where}.", "eps", self.eps)
        _positive(f"{where}.", "warmup_steps", self.warmup_steps, allow_zero=True)
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"{where}.ema_decay must be in [0, 1) (0 = off; 0.98 averages ~50 optimizer steps), "
                              f"got {self.ema_decay}")
        if self.grad_clip is not None:
            _positive(f"{where}.", "grad_clip", self.grad_clip)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{where}.betas must be two numbers in [0, 1) like [0.9, 0.999], got {self.betas}")


@dataclass
class SelectionConfig:
    filter: Literal["none", "zero_std", "band"] = field(
        default="none", metadata={"help": "group filter: none | zero_std (drop equal-reward groups) | band"})
    band: list[float] = field(default_factory=lambda: [0.1, 0.9],
                              metadata={"help": "[lo, hi] mean success a group needs to be kept (filter: band)"})
    band_reward: Optional[str] = field(
        default=None, metadata={"help": "reward name for the success band; null = the first reward"})
    max_refill_rounds: int = field(
        default=0, metadata={"help": "extra rollout rounds to replace filtered-out groups; 0 = none"})
    sampler: Literal["uniform", "vade", "history"] = field(
        default="uniform", metadata={"help": "key sampler: uniform | vade (Beta posterior) | history (skip solved)"})
    vade_prior: list[float] = field(default_factory=lambda: [1.0, 1.0],
                                    metadata={"help": "VADE Beta prior [alpha0, beta0] of each key's success"})
    vade_decay_fast: float = field(default=0.7, metadata={"help": "VADE fast pseudo-count decay per update, (0, 1]"})
    vade_decay_slow: float = field(default=0.95, metadata={"help": "VADE slow pseudo-count decay per update, (0, 1]"})
    vade_fast_weight: float = field(default=0.5, metadata={"help": "VADE weight of the fast posterior, in [0, 1]"})
    history_window: int = field(
        default=2, metadata={"help": "history: skip a key after this many all-success or all-fail groups"})
    history_readmit_after: int = field(default=5, metadata={"help": "history: iterations until a skipped key returns"})

    moved_keys: typing.ClassVar[dict[str, str]] = {
        k: "per-stratum key balance is the domain's own setting (robotics.balance: {enabled: .., by: .., need_decay: "
           "..., need_floor: ..})" for k in ("balance", "balance_by", "need_decay", "need_floor")}

    def check(self, where: str) -> None:
        lo, hi = (self.band + [None, None])[:2]
        if len(self.band) != 2 or not (0 <= lo < hi <= 1):
            raise ConfigError(f"{where}.band must be [lo, hi] with 0 <= lo < hi <= 1, got {self.band}")
        _positive(f"{where}.", "max_refill_rounds", self.max_refill_rounds, allow_zero=True)
        for name in ("vade_decay_fast", "vade_decay_slow"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ConfigError(f"{where}.{name} must be in (0, 1], got {v}")
        if not 0 <= self.vade_fast_weight <= 1:
            raise ConfigError(f"{where}.vade_fast_weight must be in [0, 1], got {self.vade_fast_weight}")
        if len(self.vade_prior) != 2 or not all(v > 0 for v in self.vade_prior):
            raise ConfigError(f"{where}.vade_prior must be two positive numbers [alpha0, beta0], got {self.vade_prior}")
        _positive(f"{where}.", "history_window", self.history_window)
        _positive(f"{where}.", "history_readmit_after", self.history_readmit_after, allow_zero=True)


@dataclass
class CheckpointConfig:
    every: int = field(default=0, metadata={"help": "iterations between checkpoints; 0 = only at the end"})
    keep_last: int = field(default=2, metadata={"help": "newest checkpoints kept on disk (older ones are deleted)"})

    def check(self, where: str) -> None:
        _positive(f"{where}.", "every", self.every, allow_zero=True)
        _positive(f"{where}.", "keep_last", self.keep_last)


@dataclass
class ResumeConfig:
    allow_inexact: bool = field(default=False, metadata={
        "help": "resume from a checkpoint that lacks some part's state (an older checkpoint): warn, record the gap in "
                "metrics.jsonl (resume/inexact) and continue, instead of refusing with exit 2"})


@dataclass
class EvalConfig:
    every: int = field(default=0, metadata={"help": "iterations between evaluations; 0 = at the start and end only"})
    at_start: bool = field(default=True, metadata={"help": "evaluate once before the first update"})

    def check(self, where: str) -> None:
        _positive(f"{where}.", "every", self.every, allow_zero=True)


@dataclass
class LoggingConfig:
    progress: bool = field(default=True, metadata={"help": "show a progress bar on the terminal"})
    tensorboard: bool = field(default=False, metadata={"help": "also write TensorBoard events to RUN_DIR/tensorboard"})
    wandb: bool = field(default=False, metadata={"help": "also log to Weights & Biases (needs wandb installed)"})
    wandb_project: str = field(default="grove", metadata={"help": "Weights & Biases project name"})
    step_clip_frac: bool = field(default=False, metadata={"help": "also log clip_frac/step<j>: the clipped fraction "
                                                                  "of each step column (GRPO-Guard's measurement)"})
    grad_noise_scale: bool = field(default=False, metadata={
        "help": "also log the gradient noise scale of the updates (McCandlish et al. 2018, 'An Empirical Model of "
                "Large-Batch Training'): each optimizer step's minibatch is split into two halves, the gradient "
                "snapshotted between them (no extra forward), and grad/noise_scale = tr(Σ)/|G|² is the number of "
                "sequences per update at which its noise equals its signal; grad/half_cosine is the cosine of the "
                "two halves' gradients (0: the update is noise). Replicate only (not fsdp2)"})


@dataclass
class DistributedConfig:
    """How several processes share the policy (docs/scaling.md).

    strategy: ``replicate`` keeps a full copy of the policy on every process and sums the trainable gradients
        (``Dist.sum_gradients``); ``fsdp2`` shards the modules the domain lists in ``fsdp_modules()`` with
        ``torch.distributed.fsdp.fully_shard`` (parameters, gradients and optimizer state split over processes,
        gradients still *summed*). With one process both are the same.
    reshard_after_forward: fsdp2 only; free the gathered parameters after each training forward (saves memory,
        costs one more all-gather per block in backward).
    checkpoint / mixed_precision / cpu_offload / replicate: the checkpoint layout and FSDP2's policies and mesh
        (docs/scaling.md).
    """

    strategy: Literal["replicate", "fsdp2"] = field(
        default="replicate", metadata={"help": "replicate (full copy per process) | fsdp2 (shard the policy)"})
    reshard_after_forward: bool = field(
        default=True, metadata={"help": "fsdp2: free gathered parameters after each forward (less memory)"})
    checkpoint: Literal["auto", "full", "sharded"] = field(
        default="auto", metadata={"help": "checkpoint layout: full (one model.safetensors + optimizer.pt, gathered "
                                          "to process 0) | sharded (torch.distributed.checkpoint: each process "
                                          "writes its own shards) | auto (sharded under fsdp2 with several "
                                          "processes, else full)"})
    mixed_precision: Literal["none", "bf16"] = field(
        default="none", metadata={"help": "fsdp2: bf16 = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): "
                                          "forwards/backwards in bf16, fp32 shards, gradients and reductions"})
    cpu_offload: bool = field(
        default=False, metadata={"help": "fsdp2: CPUOffloadPolicy: shards, gradients and optimizer state live in "
                                         "CPU memory, copied to the GPU per block (needs a GPU device)"})
    replicate: int = field(
        default=1, metadata={"help": "fsdp2: HSDP, a 2-D mesh of `replicate` groups x (processes / replicate) "
                                     "shards (e.g. nodes x GPUs per node); 1 = shard over every process"})


DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


@dataclass
class TrainConfig:
    """Everything the shared trainer needs; the domain's own section is ``domain_config``."""

    domain: str = field(default="toy", metadata={
        "help": "domain name (shared_rl.registry): toy | visgen | llm | robotics | an entry point; its settings are "
                "the section of that name"})
    kind: Literal["rl", "supervised"] = field(default="rl", metadata={
        "help": "rl (this trainer) | supervised (the domain's pretraining entry, grove pretrain)"})
    seed: int = field(default=0, metadata={"help": "seed of every random draw (iterations reseed from it)"})
    iterations: int = field(default=10, metadata={"help": "training iterations (rollout + updates each)"})
    device: str = field(default="auto", metadata={
        "help": "torch device: auto (the first GPU if torch sees one, else cpu) | cpu | cuda | cuda:N | mps"})
    max_nonfinite_steps: int = field(default=3, metadata={
        "help": "stop with a clear message after this many skipped non-finite optimizer steps in a row"})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "what one iteration samples"})
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig, metadata={
        "help": "rewards -> per-sequence advantages"})
    loss: LossConfig = field(default_factory=LossConfig, metadata={"help": "policy loss, aggregation and KL"})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "AdamW, schedule and batching"})
    selection: SelectionConfig = field(default_factory=SelectionConfig, metadata={
        "help": "group filters and key samplers"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "checkpoint cadence"})
    resume: ResumeConfig = field(default_factory=ResumeConfig, metadata={
        "help": "what --resume accepts"})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "evaluation cadence"})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "progress bar and loggers"})
    distributed: DistributedConfig = field(default_factory=DistributedConfig, metadata={
        "help": "how several processes share the policy"})
    domain_config: Any = field(default=None, metadata={
        "help": "the domain's own settings (the YAML section named after the domain), set by load_train_config"})

    def check(self, where: str) -> None:
        _positive("", "iterations", self.iterations, allow_zero=True)
        _positive("", "max_nonfinite_steps", self.max_nonfinite_steps)
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"device {self.device!r} is not a device grove runs on; use auto, cpu, cuda, cuda:N "
                              f"(N = GPU index) or mps")
        mb = self.optim.micro_batch_size
        if mb and self.rollout.group_size * self.rollout.groups_per_iteration % self.optim.minibatches_per_epoch:
            raise ConfigError(
                f"optim.minibatches_per_epoch={self.optim.minibatches_per_epoch} must divide the "
                f"{self.rollout.groups_per_iteration}x{self.rollout.group_size} sequences per iteration"
            )

    def policy_loss_choice(self) -> PolicyLossChoice:
        """The policy loss this run trains with: ``loss.policy_loss`` when set, else the one the domain's method
        implies (its config's ``policy_loss`` hook: visgen's likelihood-free objectives), else ``clipped``. Read,
        never stored: the config stays as the user wrote it."""
        if self.loss.policy_loss is not None:
            return self.loss.policy_loss
        implied = self.domain_config.policy_loss(self) if self.domain_config is not None else None
        return implied if implied is not None else PolicyLossChoice("clipped")


def check_supervised(name: str, settings: dict) -> Any:
    """The resolved settings of supervised job ``name`` (every key and value checked as its run checks them:
    ConfigError otherwise), or None for a job that declares no settings class (a third-party entry point)."""
    from .registry import resolve_supervised_settings

    found = resolve_supervised_settings(name)
    if found is None:
        return None
    obj, where = found
    if isinstance(obj, type):
        return from_dict(obj, settings, where)
    resolved = obj(settings)
    return resolved[-1] if isinstance(resolved, tuple) else resolved  # visgen: (task, its settings)


def load_train_config(data: dict) -> TrainConfig:
    """Validate a full YAML dict: trainer sections plus the domain section (``data[domain]``).

    Cross-checks with the domain (its config's hooks, ``shared_rl.domain.DomainConfig``): the advantage estimator's
    kind against ``rollout_structure(train_cfg)`` (a tree estimator needs tree rollouts, a critic's needs flat
    ones); then the config's own ``check_with(train_cfg)``; then reward names. Nothing here changes the config."""
    from .domain_config import DomainConfig
    from .part_index import estimator_names
    from .registry import resolve_domain_config

    data = dict(data)
    domain = data.get("domain", "toy")
    if not isinstance(domain, str):
        raise ConfigError(f"domain must be a name like 'visgen', got {domain!r}")
    config_class = resolve_domain_config(domain)  # the built-ins' without importing the domain (torch)
    if not (isinstance(config_class, type) and issubclass(config_class, DomainConfig)):
        raise TypeError(f"domain {domain!r}: its config_class must subclass shared_rl.domain.DomainConfig")
    domain_section = data.pop(domain, None)
    cfg = from_dict(TrainConfig, data)
    cfg.domain_config = from_dict(config_class, domain_section or {}, domain)
    structure = cfg.domain_config.rollout_structure(cfg)
    if structure not in ("flat", "tree"):
        raise ConfigError(f"{type(cfg.domain_config).__name__}.rollout_structure returned {structure!r}; it must "
                          f"return 'flat' or 'tree'")
    est, kind = cfg.advantage.estimator.name, cfg.advantage.kind
    if structure == "flat" and kind == "tree":
        raise ConfigError(f"advantage.estimator {est!r} needs tree rollouts; this config's {domain} rollouts are "
                          f"flat: use a flat estimator ({', '.join(estimator_names('flat'))}), or configure tree "
                          f"rollouts in the {domain!r} section if the domain has them")
    sequences = cfg.rollout.groups_per_iteration * cfg.rollout.group_size
    if structure == "flat" and cfg.optim.minibatches_per_epoch > sequences:
        raise ConfigError(f"optim.minibatches_per_epoch={cfg.optim.minibatches_per_epoch} is more than the "
                          f"{cfg.rollout.groups_per_iteration}x{cfg.rollout.group_size}={sequences} sequences an "
                          f"iteration samples (each optimizer step needs one); use at most {sequences}")
    if kind == "step" and structure != "flat":
        raise ConfigError(f"advantage.estimator {est!r} needs flat rollouts (sequences of decisions); this config's "
                          f"{domain} rollouts are trees: use a tree estimator ({', '.join(estimator_names('tree'))})")
    if cfg.logging.grad_noise_scale and cfg.distributed.strategy == "fsdp2":
        raise ConfigError("logging.grad_noise_scale snapshots whole gradients, which distributed.strategy: fsdp2 "
                          "keeps sharded; set logging.grad_noise_scale: false or use replicate")
    cfg.domain_config.check_with(cfg)
    _check_reward_names(cfg)
    return cfg


def _check_reward_names(cfg: TrainConfig) -> None:
    """Names that must be reward outputs (``advantage.weights`` keys, ``selection.band_reward``), checked against
    the domain config's optional hook ``reward_names(train_cfg) -> list[str] | None`` before any model loads (a
    domain without the hook, or whose hook returns None because a reward's outputs are only known when it runs, is
    checked at its first rollout)."""
    names = cfg.domain_config.reward_names(cfg)
    if names is None:
        return
    names = list(names)
    unknown = sorted(set(cfg.advantage.weights) - set(names))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"advantage.weights names {unknown}, which this config's {cfg.domain} rewards do not "
                          f"emit{hint}; its rewards are {names}")
    band = cfg.selection.band_reward
    if band is not None and band not in names:
        raise ConfigError(f"selection.band_reward {band!r} is not a reward of this config; its rewards are {names}")


def dump_train_config(cfg: TrainConfig) -> dict:
    out = to_dict(cfg)
    out[cfg.domain] = out.pop("domain_config")
    return out
