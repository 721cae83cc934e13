"""LeRobot policy directories that travel: the local folders a policy names, inside it, named relative to it.

A LeRobot policy can name other folders by path: SmolVLA's ``vlm_model_name`` (its VLM's config and processor) and
the tokenizer step's ``tokenizer_name`` in ``policy_preprocessor.json``. For hub models they are hub ids; for grove's
tiny policies (tests, the CPU recipes) they are local folders, recorded by LeRobot as absolute paths of the machine
that wrote them, so a moved or copied policy directory stopped loading. grove's exports copy such folders into the
policy directory (``vlm/``, ``tokenizer/``) and record them relative to it in ``grove_local_files.json``; grove's
loader reads them from there wherever the directory is. (LeRobot's own ``from_pretrained`` still reads the absolute
path in ``config.json``; on another machine pass ``--policy.vlm_model_name=<dir>/vlm`` to it.)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

LOCAL_FILES = "grove_local_files.json"
TOKENIZER_STEP = "tokenizer_processor"  # LeRobot's registry name of the tokenizer step


def _into(out: Path, src: Path, name: str) -> str:
    dst = out / name
    if src.resolve() != dst.resolve():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    return name


def bundle_local_files(out: str | Path, policy_config, preprocessor) -> dict[str, str]:
    """Copy the local folders ``policy_config`` and ``preprocessor`` name into ``out`` and record them relative to it
    (nothing for hub ids). Returns the record."""
    out = Path(out)
    record: dict[str, str] = {}
    vlm = getattr(policy_config, "vlm_model_name", None)
    if vlm and Path(vlm).is_dir():
        record["vlm_model_name"] = _into(out, Path(vlm), "vlm")
    for step in getattr(preprocessor, "steps", []):
        name = getattr(step, "tokenizer_name", None)
        if name and Path(name).is_dir():
            same_as_vlm = vlm and Path(vlm).is_dir() and Path(name).resolve() == Path(vlm).resolve()
            record["tokenizer_name"] = record["vlm_model_name"] if same_as_vlm else _into(out, Path(name), "tokenizer")
    if record:
        (out / LOCAL_FILES).write_text(json.dumps(record, indent=1) + "\n")
    return record


def local_files(path: str | Path) -> dict[str, str]:
    """The folders a policy directory carries, as absolute paths where it is now (field name -> path)."""
    p = Path(path)
    f = p / LOCAL_FILES
    if not f.is_file():
        return {}
    from shared_rl.readers import read_json

    record = read_json(f, "grove's record of the folders a policy directory carries")
    if not isinstance(record, dict):
        return {}
    return {k: str((p / v).resolve()) for k, v in record.items() if isinstance(v, str) and (p / v).is_dir()}


def policy_config_here(path: str | Path):
    """The policy's config with its carried VLM where the directory is now, or None when it carries none."""
    moved = local_files(path)
    if "vlm_model_name" not in moved:
        return None
    from lerobot.configs.policies import PreTrainedConfig

    config = PreTrainedConfig.from_pretrained(str(path), local_files_only=True)
    config.vlm_model_name = moved["vlm_model_name"]
    return config


def preprocessor_overrides_here(path: str | Path) -> dict:
    """``make_pre_post_processors``'s overrides that point the tokenizer step at the carried tokenizer."""
    moved = local_files(path)
    return {TOKENIZER_STEP: {"tokenizer_name": moved["tokenizer_name"]}} if "tokenizer_name" in moved else {}
