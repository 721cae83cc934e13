"""Use a trained visgen run outside grove: the stock diffusers pipeline, the exported weights, the training settings.

A run's ``final/`` holds the LoRA in the diffusers layout (``pytorch_lora_weights.safetensors``, or
``transformer/`` after full fine-tuning) and ``grove_export.json``: the base pipeline's location and the sampling
settings the policy was trained and evaluated with. Two things stop a bare ``from_pretrained`` + ``load_lora_weights``
from reproducing the run: pipelines saved without some components (the tiny SD3 has no T5, recorded as ``null``
in ``model_index.json``) must be loaded with those components passed as ``None``, and the image size, text length,
step count and guidance scale must be the training ones. ``load_trained_pipeline`` does both::

    from visgen.export import load_trained_pipeline

    pipe, settings = load_trained_pipeline("runs/shapes_grpo-20250101-120000/final")
    image = pipe("a red circle on the left", generator=torch.Generator().manual_seed(0), **settings).images[0]

``settings`` holds ``num_inference_steps``, ``guidance_scale``, ``height``/``width`` and ``max_sequence_length``
(those the run recorded); the pipeline's own Euler sampler is the deterministic ODE grove evaluates with (bit for
bit, ``tests/visgen/test_sampling.py``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
EXPORT_INFO = "grove_export.json"


def export_info(final_dir: str | Path) -> dict[str, Any]:
    """The ``grove_export.json`` of an exported run directory (``RUN/final``)."""
    path = Path(final_dir) / EXPORT_INFO
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: give the final/ directory of a visgen run")
    return json.loads(path.read_text())


def sampling_settings(info: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``pipe(prompt, ...)`` that match training: steps, guidance, image size, text length."""
    out: dict[str, Any] = {}
    for key in ("num_inference_steps", "guidance_scale", "max_sequence_length"):
        if info.get(key) is not None:
            out[key] = info[key]
    if info.get("resolution"):
        out["height"] = out["width"] = int(info["resolution"])
    return out


def checkout_relative(location: str) -> str | None:
    """``location`` relative to this checkout when it is a folder inside it (the project's assets), else None."""
    try:
        return str(Path(location).resolve().relative_to(REPO_ROOT))
    except (ValueError, OSError):
        return None


def resolve_base(base: str, in_checkout: str | None = None) -> str:
    """A local base pipeline (absolute, or relative to the working directory, then to this checkout: exports of
    older runs stored the path as configured; then ``in_checkout``, the base's place inside the checkout that wrote
    the export, under this one: a run moved with its checkout to another machine), else the hub id as given."""
    p = Path(base).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]
    candidates += [REPO_ROOT / in_checkout] if in_checkout else []
    for candidate in candidates:
        if (candidate / "model_index.json").is_file():
            return str(candidate)
    return base


def load_base_pipeline(location: str, **kwargs: Any):
    """``DiffusionPipeline.from_pretrained`` that also loads pipelines saved without some components (``null``
    entries in ``model_index.json``, e.g. SD3 without T5): those are passed as ``None``, as diffusers requires."""
    from diffusers import DiffusionPipeline

    index_path = Path(location) / "model_index.json"
    if index_path.is_file():
        for name, value in json.loads(index_path.read_text()).items():
            if not name.startswith("_") and (value is None or value == [None, None]):
                kwargs.setdefault(name, None)
    return DiffusionPipeline.from_pretrained(location, **kwargs)


def load_trained_pipeline(final_dir: str | Path, base: str | None = None, device: str = "cpu", dtype=None):
    """(the base pipeline with the run's trained weights, the sampling settings of training).

    ``base`` overrides the recorded base pipeline (a moved checkout, a local copy of a hub model)."""
    import torch

    final_dir = Path(final_dir)
    info = export_info(final_dir)
    location = resolve_base(base or str(info["base_model"]), None if base else info.get("base_model_in_checkout"))
    pipe = load_base_pipeline(location, dtype=dtype or torch.float32)  # torch_dtype is deprecated in diffusers
    if (final_dir / "transformer").is_dir():  # full fine-tuning
        pipe.transformer = type(pipe.transformer).from_pretrained(final_dir / "transformer",
                                                                  dtype=dtype or torch.float32)
    else:
        pipe.load_lora_weights(str(final_dir))
    pipe.to(device)
    return pipe, sampling_settings(info)
