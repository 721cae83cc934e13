"""What ``grove train`` checks about a visgen config before it loads a pipeline (``shared_rl.preflight``).

Loading even the tiny SD3 and running the held-out evaluation takes a while; a prompt file the configured reward
cannot score, a reward argument its factory does not take, or an ``advantage.weights`` name no reward emits used to
surface only after both. Everything here reads small files and builds no model:

- ``reward_names``: the outputs the configured rewards emit (``shapes`` emits ``shapes`` and ``shapes_strict``;
  a reward whose factory takes a ``name`` emits that, by default its registry name), or None when some reward's
  outputs cannot be known before it runs (a remote scorer): then the first rollout checks the names;
- ``preflight``: the model location exists (local paths; a hub id in the local cache or the Hub reachable), the
  prompt files read, ``train_subset`` indexes them, each reward's keyword arguments fit its factory (the cheap
  analytic rewards are built), and every prompt is one the shapes-family rewards can score.

``visgen.domain``'s config hooks call these with the domain module's own loaders (``read_prompt_file``, the
reward-module import), so the checks read exactly what the domain will load, and this module never imports
``visgen.domain`` (which imports it). The model location is ``shared_rl.prechecks.check_visgen_model``: torch-free,
run by the CLI before the typed validation too, and the resolver ``visgen.pipelines.load.load_pipeline`` loads with.
"""
from __future__ import annotations

import ast
import functools
import inspect
import sys
import typing
from pathlib import Path

from shared_rl.errors import ConfigError
# HELD_PREFIX (re-exported for visgen.api): the name of a pipeline the caller holds, a label with nothing to look up
from shared_rl.prechecks import HELD_PREFIX, check_prompt_file, check_visgen_model  # noqa: F401

# rewards whose factories build nothing heavy: built once here, so a bad argument value fails now
CHEAP_REWARDS = ("shapes", "shapes_soft", "jpeg_compressibility", "jpeg_incompressibility")
# rewards that score a prompt through the shapes-task grammar (or PromptSpec metadata)
SHAPES_GRAMMAR_REWARDS = ("shapes", "shapes_soft")
# rewards whose outputs are fixed names; the others are named by their factory's ``name`` argument
FIXED_OUTPUTS = {"shapes": ["shapes", "shapes_strict"], "shapes_soft": ["shapes_soft"], "shapes_colour": ["shapes_colour"],
                 "jpeg_compressibility": ["jpeg_compressibility"], "jpeg_incompressibility": ["jpeg_incompressibility"]}


REWARDS_DIR = Path(__file__).resolve().parent / "rewards"


@functools.lru_cache(maxsize=1)
def reward_source_index() -> dict[str, dict]:
    """What the config checks ask of each built-in reward, read from the reward modules' source (``ast``: nothing is
    imported, so a config's rewards are checked without torch): ``{reward: {"name": the factory's ``name`` default
    (its output's name) or None (it has none: its outputs are unknowable before it runs), "differentiable": its
    RewardInfo's flag}}``. A reward whose factory is not a plain function with literal defaults (a class, a computed
    default) is left out: its questions go to the live registry. tests/core/test_part_index.py checks the index
    answers as the live registry does."""
    index: dict[str, dict] = {}
    for path in sorted(REWARDS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            for deco in node.decorator_list:
                if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name) and deco.func.id == "register"
                        and deco.args and isinstance(deco.args[0], ast.Constant)):
                    continue
                entry = _source_entry(node, deco)
                if entry is not None:
                    index[deco.args[0].value] = entry
    return index


def _source_entry(node, deco) -> dict | None:
    if not isinstance(node, ast.FunctionDef):
        return None
    info = deco.args[1] if len(deco.args) > 1 else next((k.value for k in deco.keywords if k.arg == "info"), None)
    differentiable = False
    if info is not None:
        if not (isinstance(info, ast.Call) and isinstance(info.func, ast.Name) and info.func.id == "RewardInfo"):
            return None
        flag = next((k.value for k in info.keywords if k.arg == "differentiable"), None)
        if flag is not None and not (isinstance(flag, ast.Constant) and isinstance(flag.value, bool)):
            return None
        differentiable = bool(flag.value) if flag is not None else False
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = dict(zip([x.arg for x in positional][len(positional) - len(a.defaults):], a.defaults))
    defaults.update({x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    default = defaults.get("name")
    if default is not None and not (isinstance(default, ast.Constant) and isinstance(default.value, str)):
        return None  # a computed (or None) default: the live signature says what it is
    # no ``name`` argument, or one without a default: the outputs are unknowable before the reward runs
    return {"name": default.value if default is not None else None, "differentiable": differentiable}


def _indexed(name: str) -> dict | None:
    """``reward_source_index()[name]`` while ``visgen.rewards`` is not imported (afterwards: None, the live registry
    answers, with what a caller registered)."""
    return None if "visgen.rewards" in sys.modules else reward_source_index().get(name)


def needs_live_registry(names) -> bool:
    """Whether the questions about rewards ``names`` need the reward modules imported."""
    return any(n not in FIXED_OUTPUTS and _indexed(n) is None for n in names)


def reward_differentiable(name: str) -> bool:
    """``visgen.rewards.reward_info(name).differentiable``, from the source index while the rewards are not imported
    (the caller imports them first when ``needs_live_registry``)."""
    entry = _indexed(name)
    if entry is not None:
        return entry["differentiable"]
    from .rewards import reward_info

    return reward_info(name).differentiable


def reward_outputs(name: str, kwargs: dict) -> list[str] | None:
    """The output names the reward ``name`` built with ``kwargs`` returns, or None when they cannot be known."""
    if name in FIXED_OUTPUTS:  # known without the reward modules (torch): the config check of a shapes recipe
        return list(FIXED_OUTPUTS[name])
    entry = _indexed(name)
    if entry is not None:
        return None if entry["name"] is None else [str(kwargs.get("name", entry["name"]))]
    from .rewards.base import _REGISTRY

    factory = _REGISTRY.get(name)
    param = inspect.signature(factory).parameters.get("name") if factory is not None else None
    if param is not None and param.default is not inspect.Parameter.empty:
        return [str(kwargs.get("name", param.default))]
    return None


def reward_names(cfg, import_rewards) -> list[str] | None:
    if needs_live_registry(spec.name for spec in cfg.rewards):
        import_rewards()  # a reward the source index cannot answer for: the live registry
    outputs = [reward_outputs(spec.name, spec.kwargs) for spec in cfg.rewards]
    return None if any(o is None for o in outputs) else [name for names in outputs for name in names]


def _check_reward_arguments(where: str, name: str, kwargs: dict) -> None:
    from .rewards.base import _REGISTRY

    factory = _REGISTRY[name]
    signature = inspect.signature(factory)
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        # ``build_x(**kwargs) -> X`` hands everything to the class it returns: check against that class instead
        try:
            returned = typing.get_type_hints(factory).get("return")
        except Exception:  # noqa: BLE001 — an annotation that does not resolve: nothing to check against
            returned = None
        signature = inspect.signature(returned) if inspect.isclass(returned) else None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as e:
            raise ConfigError(f"{where}: reward {name!r} kwargs {kwargs}: {e}") from None
    if name in CHEAP_REWARDS:
        try:
            factory(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: reward {name!r} kwargs {kwargs}: {e}") from None


def _unscorable(prompts: list[str], metas: list[dict]) -> tuple[int, str] | None:
    """(index, reason) of the first prompt the shapes-task grammar cannot score, else None."""
    from .rewards.shapes import _spec

    for i, (prompt, meta) in enumerate(zip(prompts, metas)):
        try:
            _spec(prompt, meta)
        except ValueError as e:
            return i, str(e)
    return None


def check_image_size(cfg, model_dir: Path) -> None:
    """The image size against what the model's own files allow, before the pipeline loads: a transformer with a
    fixed positional table (SD3's ``pos_embed_max_size``) takes at most pos_embed_max_size · patch_size latent
    pixels per side, i.e. that times the VAE's downsampling (2^(blocks − 1)) image pixels; and the size must be a
    multiple of the VAE's downsampling times the patch size. One line naming the largest size that fits."""
    import json

    def read(name):
        path = model_dir / name / "config.json"
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except (ValueError, UnicodeDecodeError):
            return {}  # a damaged file is the loader's to name

    size = cfg.resolution
    if size is None:
        try:
            size = json.loads((model_dir / "grove.json").read_text()).get("resolution")
        except (OSError, ValueError, AttributeError):
            size = None
    transformer, vae = read("transformer"), read("vae")
    blocks = vae.get("block_out_channels")
    patch, table = transformer.get("patch_size"), transformer.get("pos_embed_max_size")
    if not size or not isinstance(blocks, list) or not isinstance(patch, int):
        return
    scale = 2 ** (len(blocks) - 1)
    multiple = scale * patch
    if size % multiple:
        raise ConfigError(f"visgen.resolution {size} must be a multiple of {multiple} for {cfg.model} (VAE "
                          f"downsampling {scale} x transformer patch size {patch})")
    if isinstance(table, int) and size > table * multiple:
        raise ConfigError(f"visgen.resolution {size} is more than {cfg.model} takes: its transformer's positional "
                          f"table (pos_embed_max_size {table}) fits at most {table * multiple} x {table * multiple} "
                          f"pixels; use visgen.resolution <= {table * multiple}")


def check_teacher(cfg, student: Path) -> None:
    """An objective's frozen teacher (on-policy distillation, ``visgen.objective.teacher``) against the student's
    pipeline, from their files, before either loads: the same pipeline family (``model_index.json``'s class) and the
    same scheduler config, the comparison ``FlowPolicy._enable_teacher`` makes when the weights load, with its
    message, so ``--dry-run`` refuses what the run would. A teacher that is no local directory yet (a recipe names
    the run that makes it; a hub id) is left to the load."""
    import json

    teacher = getattr(cfg.training_objective().settings, "teacher", None)
    if not teacher:
        return
    p = Path(str(teacher)).expanduser()
    here = next((c for c in ([p] if p.is_absolute() else [Path.cwd() / p, Path(__file__).resolve().parents[1] / p])
                 if (c / "model_index.json").is_file()), None)
    if here is None or not (student / "model_index.json").is_file():
        return
    try:
        mine, theirs = (json.loads((d / "model_index.json").read_text()) for d in (student, here))
    except (OSError, ValueError):
        return  # a damaged file is the loader's to name
    if mine.get("_class_name") != theirs.get("_class_name"):
        raise ConfigError(f"the teacher {teacher!r} is a {theirs.get('_class_name')}, the student a "
                          f"{mine.get('_class_name')}: on-policy distillation needs a teacher of the student's "
                          "pipeline family")
    import diffusers

    from .policy import _scheduler_config

    configs = []
    for d, index in ((student, mine), (here, theirs)):
        try:
            cls = getattr(diffusers, index["scheduler"][1])
            scheduler = cls.from_pretrained(str(d), subfolder="scheduler")
        except Exception:  # noqa: BLE001 - no scheduler, an unknown class, a damaged config: the load names it
            return
        configs.append({**_scheduler_config(scheduler), "class": type(scheduler).__name__})
    diff = sorted(k for k in set(configs[0]) | set(configs[1]) if configs[0].get(k) != configs[1].get(k))
    if diff:
        raise ConfigError(f"the teacher {teacher!r} has another scheduler than the student (differs in {diff}): it "
                          "must replay the student's states on the same noise schedule")


def preflight(cfg, train_cfg, read_prompt_file, import_rewards) -> None:
    """The checks of the module docstring for ``VisgenConfig`` ``cfg``; raises ConfigError."""
    if train_cfg.distributed.strategy == "fsdp2":  # what FSDP2 refuses from the config alone, as the real run
        from .fsdp import refuse_config

        refuse_config(cfg)
    # the location, and a hub id cached or the Hub reachable: the function the CLI already ran before torch
    location, local = check_visgen_model(cfg.model)
    if local:
        check_image_size(cfg, Path(location))
        check_teacher(cfg, Path(location))
    import_rewards()
    for i, spec in enumerate(cfg.rewards):
        _check_reward_arguments(f"visgen.rewards[{i}]", spec.name, spec.kwargs)
    from .tasks import get_task

    for key, path in get_task(cfg.task).prompt_files(cfg):  # an embedded task's own prompts are its grammar's
        check_prompt_file(path)  # a missing file, with the nearest one beside it: the line the CLI gave before torch
        prompts, metas = read_prompt_file(path)
        if key == "train_prompts" and cfg.train_subset is not None:
            bad = [i for i in cfg.train_subset if not 0 <= i < len(prompts)]
            if bad or not cfg.train_subset:
                raise ConfigError(f"visgen.train_subset must list prompt indices in 0..{len(prompts) - 1}, "
                                  f"got {cfg.train_subset}")
        for spec in cfg.rewards:
            if spec.name in SHAPES_GRAMMAR_REWARDS:
                found = _unscorable(prompts, metas)
                if found:
                    n, reason = found
                    raise ConfigError(f"visgen.{key} {path!r} prompt {n + 1} cannot be scored by reward "
                                      f"{spec.name!r}: {' '.join(reason.split())}; use shapes-task prompts (or "
                                      f"PromptSpec metadata in a .jsonl) or a reward that scores any prompt")
