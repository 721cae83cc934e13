"""The path checks of the built-in domains, importable without torch, so the CLI can answer a typo'd path first.

A mistyped model or checkpoint path is the most common first mistake, and the typed validation that finds it
(``load_train_config`` builds the domains' config dataclasses, which import torch and the domain packages) costs
seconds of imports on a small machine before it gets there. The checks themselves are a few ``stat`` calls, so they
live here, in a module that imports only the standard library and grove's torch-free modules (``errors``,
``registry``, ``readers``, ``preflight``), and run twice through the same functions:

- early, by the CLI, on the raw YAML dict with its overrides applied (``precheck_paths``), before
  ``load_train_config`` and before anything imports torch;
- later, by each domain's own validation (``LLM``: ``shared_rl.llm.model.resolve_model_path``; ``visgen``:
  ``visgen.preflight``; ``robotics``: ``RoboticsConfig.preflight``), which calls the very functions below on its typed
  config, so the two cannot drift: one list of checks, one message each. (Two exceptions: a LeRobot
  ``policy.path`` is checked by ``robotics.policies.lerobot.load.read_policy_config``, which also parses the files;
  ``check_lerobot_policy`` is its stat-only part, line for line, and the test compares the two. And an LLM hub id
  is looked up in the local cache by the early pass alone, ``check_llm_model``: the LLM domain's validation
  resolves the location only, since the Python API also hands it the names of model objects it holds. The early
  pass runs in the CLI and in ``shared_rl.api.train`` of a config without held objects.)

Which keys are paths is declared once, in ``PATH_KEYS``: per domain, the dotted key in its section, the function that
checks it, and the other keys of the section the check reads (with their dataclass defaults, which
``tests/core/test_prechecks.py`` compares with the dataclasses'). The early pass checks only keys the YAML or the
overrides give as non-empty strings: a default, a wrong type or a misspelt key is left to the typed validation,
which names it. It is a subset of the full checks, never a stricter one: every line it prints is the line the run
would print later (the test feeds the bad-path corpus to both), or, for an LLM hub id, the failure the run's loader
would reach after its retries. Third-party domains are not listed and get the full validation only.

``shared_rl`` never imports ``visgen`` or ``robotics``: their checks are plain path logic kept here by name, and the
domains import them from here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError
from .preflight import HUB_ID  # "org/name", the pattern the hub-cache check uses

REPO_ROOT = Path(__file__).resolve().parents[1]  # where assets/ and configs/ live: relative paths also resolve here
# a path under held/ only labels an object the Python API caller holds (visgen.api, robotics.api): nothing to stat
HELD_PREFIX = "held/"


# ------------------------------------------------------------------------------------------------------ paths
def nearest_path(given: str, accept: Callable[[Path], bool]) -> str:
    """`` (did you mean 'a/b'?)`` for a path that does not exist: the entry beside it that ``accept`` takes (a file,
    a policy directory) whose name is closest to the one given, or, when its folder does not exist either, the folder
    beside that folder, holding an accepted entry of the same name, whose name is closest to the folder's
    (``assets/clone-bc/x.json`` -> ``assets/clone-bc5/x.json``); "" when none is close. Only the one name is compared:
    a long common prefix makes any two paths look alike. Looked for as given and relative to the repository, as the
    paths resolve."""
    import difflib

    p = Path(given)
    bases = [Path("/")] if p.is_absolute() else list(dict.fromkeys([Path.cwd(), REPO_ROOT]))
    in_folder = any((b / p.parent).is_dir() for b in bases)
    name = p.name if in_folder else p.parent.name
    near: dict[str, str] = {}  # the name compared -> the path suggested
    for base in bases:
        try:
            if in_folder and (base / p.parent).is_dir():
                near.update((c.name, str(p.parent / c.name)) for c in (base / p.parent).iterdir() if accept(c))
            elif not in_folder and p.parent != p.parent.parent and (base / p.parent.parent).is_dir():
                near.update((d.name, str(p.parent.parent / d.name / p.name)) for d in (base / p.parent.parent).iterdir()
                            if d.is_dir() and accept(d / p.name))
        except OSError:  # an unreadable folder: nothing to suggest from it
            continue
    close = difflib.get_close_matches(name, sorted(n for n in near if near[n] != given), n=1)
    return f" (did you mean {near[close[0]]!r}?)" if close else ""


# ------------------------------------------------------------------------------------------------------ llm
def resolve_llm_model(path: str) -> str:
    """A local path relative to the working directory or the repository root (where assets/ lives), else a hub id;
    a path meant locally (``readers.local_path_meant``) that does not exist is a ConfigError with the nearest
    sibling, answered before any Hub client retries."""
    from .readers import local_path_meant
    from .registry import did_you_mean

    p = Path(path)
    if p.exists():
        return str(p)
    if (REPO_ROOT / p).exists():
        return str(REPO_ROOT / p)
    # a hub id is "name" or "org/name"; anything else that does not exist is a missing local path (so is
    # "dir/name" whose "dir" is a local folder: assets/llm-arith-tiy)
    if local_path_meant(path, (REPO_ROOT,)):
        parent = next((b / p.parent for b in (Path.cwd(), REPO_ROOT) if (b / p.parent).is_dir()), None)
        siblings = [str(p.parent / c.name) for c in parent.iterdir()] if parent is not None else []
        raise ConfigError(f"model path {path!r} does not exist{did_you_mean(path, siblings)} (a local path, not a hub "
                          f"id like 'org/name')")
    return path


def check_llm_model(path: str, where: str = "llm.model") -> str:
    """``llm.model`` / ``llm.tokenizer`` as the CLI names it: the location (``resolve_llm_model``) and, for a hub id,
    that it is in the local cache or the Hub can be reached (``preflight.check_hub_model``), so a typo'd or uncached
    id with no network is one line at once instead of a minute of the loader's retries. Not part of
    ``resolve_llm_model``, which the domain also calls with the name of a model object the Python API caller holds
    (a class name, not a hub id)."""
    location = resolve_llm_model(path)
    if location == path and not Path(path).exists():  # a hub id
        from .preflight import check_hub_model

        check_hub_model(path, where)
    return location


def check_llm_tokenizer(path: str) -> str:
    return check_llm_model(path, "llm.tokenizer")


DATASET_SUFFIXES = (".jsonl", ".json", ".csv")


def check_llm_dataset(path: str, source: str = "arith", where: str = "llm.dataset.path") -> None:
    """``llm.dataset.path`` / ``eval_path`` of a file source (``jsonl`` / ``csv`` / ``json``; ``hf`` names a hub
    dataset or a saved one, read later, and ``arith`` reads none): the file exists (relative paths: the working
    directory, as ``shared_rl.llm.tasks`` reads it); else the line with the nearest data file beside it."""
    if source not in ("jsonl", "csv", "json") or not path or Path(path).exists():
        return
    near = nearest_path(path, lambda c: c.is_file() and c.suffix in DATASET_SUFFIXES)
    raise ConfigError(f"dataset file {path!r} not found ({where}){near}")


def check_llm_eval_dataset(path: str, source: str = "arith") -> None:
    check_llm_dataset(path, source, "llm.dataset.eval_path")


# ------------------------------------------------------------------------------------------------------ visgen
SHAPES_ASSET_HINT = ("build it with `python -m visgen.pretrain configs/visgen/shapes_pretrain.yaml --out "
                     "assets/shapes-sd3-tiny` (about 10 minutes on 2 CPU cores)")


def resolve_visgen_model(model: str) -> tuple[str, bool]:
    """``(path or hub id, is_local)`` of ``visgen.model``: a diffusers pipeline directory (as given, or relative to
    the working directory or the repository) or a hub id. A local-looking path that does not exist is a ConfigError
    naming the nearest pipeline directory beside it."""
    from .registry import did_you_mean

    p = Path(model).expanduser()
    bases = list(dict.fromkeys([Path.cwd(), REPO_ROOT]))  # run from the checkout: one place, named once
    candidates = [p] if p.is_absolute() else [b / p for b in bases]
    for c in candidates:
        if c.exists():
            return str(c), True
    hub_like = re.fullmatch(HUB_ID, model) is not None
    local_like = (not hub_like or p.is_absolute() or model.startswith((".", "~"))
                  or any((b / p.parts[0]).is_dir() for b in bases))
    if local_like:
        # the pipelines next to where the path points (assets/shapes-sd3-tny -> assets/shapes-sd3-tiny)
        parents = [b / p.parent for b in ([Path("/")] if p.is_absolute() else bases) if (b / p.parent).is_dir()]
        siblings = sorted({str(p.parent / c.name) for d in parents for c in d.iterdir()
                           if (c / "model_index.json").is_file()})
        near = did_you_mean(model, siblings)
        hint = SHAPES_ASSET_HINT if "shapes-sd3-tiny" in model else "give a diffusers pipeline directory or a hub id"
        raise ConfigError(f"model path {model!r} does not exist{near} (looked in {', '.join(str(b) for b in bases)}); "
                          f"{hint}")
    return model, False


def check_visgen_model(model: str) -> tuple[str, bool]:
    """``visgen.model`` before a pipeline loads: the location (``resolve_visgen_model``), and for a hub id, that it
    is in the local cache or the Hub can be reached (``preflight.check_hub_model``: a cache look-up and one short
    connection attempt, not the loader's minute of retries). A ``held/`` label is not looked up."""
    location, local = resolve_visgen_model(model)
    if not local and not model.startswith(HELD_PREFIX):
        from .preflight import check_hub_model

        check_hub_model(model, "visgen.model")
    return location, local


def check_prompt_file(path: str, task: str = "file") -> None:
    """``visgen.train_prompts`` / ``eval_prompts`` of ``task: file`` (other tasks read no prompt file): it exists as
    given, in the working directory or in the repository, as ``visgen.tasks.files.read_prompt_file`` looks; else the
    line with the nearest prompt file beside it. What is in it is the domain's check (``visgen.preflight``)."""
    if task != "file" or not path:
        return
    p = Path(path).expanduser()
    if any(c.is_file() for c in ([p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p])):
        return
    near = nearest_path(path, lambda c: c.is_file() and c.suffix in (".txt", ".jsonl"))
    raise ConfigError(f"prompt file {path!r} does not exist{near} (relative paths: the working directory, then the "
                      f"repo)")


# ------------------------------------------------------------------------------------------------------ robotics
def resolve_repo_path(path: str) -> Path:
    """A path as given if it exists (or is absolute), else relative to the repository (the assets)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    return REPO_ROOT / p


def missing_checkpoint_hint(path, env_kind: str) -> str:
    """What to do about a tiny-VLA checkpoint directory that is not there: the command that makes one for this env
    (LIBERO: ``libero_bc.yaml``, with ``export_dir`` set to the missing path), or the nearest existing name."""
    from .registry import did_you_mean

    path = Path(path)
    parent = path.parent
    names = sorted(p.name for p in parent.iterdir() if (p / "model.safetensors").is_file()) if parent.is_dir() else []
    near = did_you_mean(path.name, names) if names else ""
    recipe = "libero_bc.yaml" if env_kind == "libero" else "metaworld_bc.yaml"
    if near:
        return f"not a VLA directory (no model.safetensors + config.json){near}"
    return (f"not a VLA directory (no model.safetensors + config.json); make it with `grove train "
            f"configs/robotics/{recipe} export_dir={path}` or set robotics.checkpoint to '' for a fresh model")


def check_vla_checkpoint(checkpoint: str, env_kind: str, policy_type: str) -> Path | None:
    """``robotics.checkpoint`` of a tiny-VLA policy: its directory (resolved) when it holds ``model.safetensors``
    and ``config.json``, None when there is nothing to read (another policy type, ``''`` = a fresh model, a
    ``held/`` label); else a ConfigError with the hint for this env."""
    if policy_type != "tiny_vla" or not checkpoint or checkpoint.startswith(HELD_PREFIX):
        return None
    path = resolve_repo_path(checkpoint)
    if not (path / "model.safetensors").is_file() or not (path / "config.json").is_file():
        raise ConfigError(f"robotics.checkpoint {checkpoint}: {missing_checkpoint_hint(path, env_kind)}")
    return path


def lerobot_tiny_command(path: str, env_kind: str = "metaworld") -> str:
    """The command that makes a tiny LeRobot policy at ``path`` for this env (the family read off the name), as
    the hint of every missing LeRobot policy path."""
    name = Path(path).name
    family = "pi05" if "pi05" in name else "pi0" if "pi0" in name else ""
    args = [f"--env {env_kind}"] if env_kind == "libero" else []
    args += [f"--family {family}"] if family else []
    return " ".join(["python scripts/robotics_lerobot_tiny.py", *args, f"--out {path}"])


def check_lerobot_policy(path: str, env_kind: str, policy_type: str) -> None:
    """``robotics.policy.path`` of a LeRobot policy before torch or LeRobot is imported: a local path that does not
    exist, a directory without ``config.json``, or a hub id with no snapshot in the local cache (the loader reads the
    cache only: offline by design) is the line ``robotics.policies.lerobot.load.read_policy_config`` gives, which the
    domain's validation runs later (tests/core/test_prechecks.py compares the two). Resolved as the domain resolves
    it (a local folder, also relative to the repository, else a hub id); what only reading the files can find (a
    ``config.json`` that is not JSON, a cached id without one) is left to that full check."""
    if policy_type != "lerobot" or not path or path.startswith(HELD_PREFIX):
        return
    from .preflight import cached_hub_ids
    from .readers import local_path_meant

    resolved = resolve_repo_path(path)
    given = str(resolved) if resolved.exists() else path
    p = Path(given)
    if not p.is_dir() and local_path_meant(given):
        near = nearest_path(given, lambda c: (c / "config.json").is_file())
        raise ConfigError(f"robotics.policy.path: {given} does not exist{near} (a local path, not a hub id); make this "
                          f"recipe's tiny policy with `{lerobot_tiny_command(given, env_kind)}`, your own with "
                          f"LeRobot's `lerobot-train`")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"robotics.policy.path: {p} has no config.json; it must be a LeRobot policy directory "
                              f"(policy.save_pretrained(dir))")
        return
    if given not in cached_hub_ids("models"):
        raise ConfigError(f"robotics.policy.path: {given!r} is neither a LeRobot policy directory nor a hub id in "
                          f"the local cache (download it once with `hf download {given}`)")


def check_eval_baseline(path: str) -> None:
    """``robotics.eval_baseline``: a file of recorded evaluation episodes, when one is named."""
    if path and not resolve_repo_path(path).is_file():
        near = nearest_path(path, Path.is_file)
        raise ConfigError(f"robotics.eval_baseline {path}: no such file{near} (a BC clone's eval_episodes.json or a "
                          f"run's eval_episodes/it0000.json)")


# ------------------------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class PathKey:
    """A path-valued key of a domain's section: ``check(value, **context)`` raises ConfigError when it is wrong;
    ``context`` maps each further argument to ``(dotted key in the same section, the dataclass default)``."""

    key: str
    check: Callable[..., Any]
    context: dict[str, tuple[str, Any]] = field(default_factory=dict)


# Among themselves in the order the domains' own validation checks them, so a config with two bad paths gets the
# same first line from both passes (a path and another kind of mistake together: the early pass names the path).
PATH_KEYS: dict[str, tuple[PathKey, ...]] = {
    "llm": (PathKey("model", check_llm_model), PathKey("tokenizer", check_llm_tokenizer),
            PathKey("dataset.path", check_llm_dataset, {"source": ("dataset.source", "arith")}),
            PathKey("dataset.eval_path", check_llm_eval_dataset, {"source": ("dataset.source", "arith")})),
    "visgen": (PathKey("model", check_visgen_model),
               PathKey("train_prompts", check_prompt_file, {"task": ("task", "shapes")}),
               PathKey("eval_prompts", check_prompt_file, {"task": ("task", "shapes")})),
    "robotics": (
        PathKey("checkpoint", check_vla_checkpoint,
                {"env_kind": ("env.kind", "metaworld"), "policy_type": ("policy.type", "tiny_vla")}),
        PathKey("policy.path", check_lerobot_policy,
                {"env_kind": ("env.kind", "metaworld"), "policy_type": ("policy.type", "tiny_vla")}),
        PathKey("eval_baseline", check_eval_baseline),
    ),
}

_ABSENT = object()


def _lookup(section: dict, dotted: str, default: Any = _ABSENT) -> Any:
    """``section[a][b]`` for ``"a.b"``: ``default`` when a key is absent, ``_ABSENT`` when a level is not a mapping
    (a shape the typed validation will refuse: nothing to check early)."""
    node: Any = section
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return _ABSENT
        if part not in node:
            return default
        node = node[part]
    return node


def precheck_paths(data: dict) -> None:
    """The ``PATH_KEYS`` checks of the config dict ``data`` (YAML + overrides, not yet validated): ConfigError at
    the first wrong path. Imports no torch and nothing of the domain packages; see the module docstring for what
    it leaves to the typed validation."""
    domain = data.get("domain", "toy")
    section = data.get(domain) if isinstance(domain, str) else None
    if not isinstance(section, dict):
        return
    for entry in PATH_KEYS.get(domain, ()):
        value = _lookup(section, entry.key, None)
        if not isinstance(value, str) or not value:
            continue
        kwargs = {arg: _lookup(section, dotted, default) for arg, (dotted, default) in entry.context.items()}
        if any(not isinstance(v, str) for v in kwargs.values()):
            continue  # a context key of the wrong type or shape: the typed validation names it first
        entry.check(value, **kwargs)
