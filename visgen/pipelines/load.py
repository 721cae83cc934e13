"""Loading a stock diffusers pipeline (the policy's and, for on-policy distillation, the teacher's), in a module of
its own so the domain and the policy both import it without importing each other."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shared_rl.config import ConfigError
from shared_rl.prechecks import resolve_visgen_model as resolve_model_location


def load_pipeline(model: str, dtype: torch.dtype):
    """A stock diffusers pipeline from a local directory or the hub, progress bars off."""
    from diffusers import DiffusionPipeline

    location, local = resolve_model_location(model)
    kwargs: dict[str, Any] = {"dtype": dtype}  # torch_dtype is deprecated (diffusers 0.42, the pinned version)
    if local:
        kwargs["local_files_only"] = True
        index_path = Path(location) / "model_index.json"
        if not index_path.is_file():
            raise ConfigError(f"model path {location!r} is not a diffusers pipeline (no model_index.json)")
        index = json.loads(index_path.read_text())
        # components saved as null (SD3 without T5) must be passed as None or diffusers refuses to build the pipeline
        for name, value in index.items():
            if not name.startswith("_") and (value is None or value == [None, None]):
                kwargs[name] = None
    try:
        pipe = DiffusionPipeline.from_pretrained(location, **kwargs)
    except (OSError, ValueError) as exc:
        where = "directory" if local else "Hugging Face hub id"
        raise ConfigError(f"could not load the diffusers pipeline from {where} {model!r}: {str(exc).splitlines()[0]}") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe, location, local
