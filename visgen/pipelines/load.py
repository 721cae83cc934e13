"""Loading a stock diffusers pipeline (the policy's and, for on-policy distillation, the teacher's), in a module of
its own so the domain and the policy both import it without importing each other."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shared_rl.config import ConfigError
from shared_rl.prechecks import resolve_visgen_model as resolve_model_location


TRANSFORMERS = ("transformer", "transformer_2")  # the denoisers FSDP2 shards (visgen.fsdp); Wan 2.2 has two


def load_pipeline(model: str, dtype: torch.dtype, meta_transformers: bool = False):
    """A stock diffusers pipeline from a local directory or the hub, progress bars off. ``meta_transformers``
    (processes > 0 of an FSDP2 run, ``shared_rl.sharding.loads_on_meta``): the transformer(s) are built on the meta
    device from their ``config.json`` (no weight file read, nothing allocated) and the other components load as
    usual (they stay whole on every process); ``setup_fsdp`` then fills the shards from process 0's weights."""
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
    source, view = location, None
    try:
        if meta_transformers:
            kwargs.update(_meta_transformers(location, local, dtype))
            source = view = _view_without(location, local, [n for n in TRANSFORMERS if n in kwargs])
        pipe = DiffusionPipeline.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        where = "directory" if local else "Hugging Face hub id"
        raise ConfigError(f"could not load the diffusers pipeline from {where} {model!r}: {str(exc).splitlines()[0]}") from None
    finally:
        if view is not None:
            import shutil

            shutil.rmtree(view, ignore_errors=True)  # symbolic links only; the components are loaded by now
    if view is not None:
        pipe.register_to_config(_name_or_path=location)  # where it was loaded from, not the temporary view
    pipe.set_progress_bar_config(disable=True)
    return pipe, location, local


def _view_without(location: str, local: bool, names: list[str]) -> str:
    """A temporary directory of symbolic links to the pipeline's folders with ``names`` marked null in its
    ``model_index.json``, so that ``from_pretrained`` reads no file of those components and takes the objects
    passed for them instead (diffusers loads an optional component, such as Wan's ``transformer`` /
    ``transformer_2``, from its folder even when one is passed). A hub id: its cached snapshot (downloaded as
    every process's ``from_pretrained`` would; only files are fetched, nothing is read into memory here)."""
    import os
    import tempfile

    from diffusers import DiffusionPipeline

    folder = Path(location if local else DiffusionPipeline.download(location))
    index = json.loads((folder / "model_index.json").read_text())
    view = Path(tempfile.mkdtemp(prefix="grove-pipeline-view-"))
    for entry in folder.iterdir():
        if entry.name not in names and entry.name != "model_index.json":
            os.symlink(entry.resolve(), view / entry.name)
    index.update({n: [None, None] for n in names})
    (view / "model_index.json").write_text(json.dumps(index))
    return str(view)


def _meta_transformers(location: str, local: bool, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The pipeline's transformer(s) on the meta device, as ``from_pretrained(..., dtype=dtype)`` lays them out: the
    class named in ``model_index.json``, built from its subfolder's config, parameters and buffers in ``dtype``
    except the class's ``_keep_in_fp32_modules`` (diffusers keeps those in float32). ``shard_from_rank0`` checks
    that names, shapes and dtypes equal process 0's."""
    import importlib

    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(location, local_files_only=local)
    out: dict[str, torch.nn.Module] = {}
    for name in TRANSFORMERS:
        entry = index.get(name)
        if not isinstance(entry, (list, tuple)) or None in entry:
            continue
        library, class_name = entry
        cls = getattr(importlib.import_module(library), class_name)
        config = cls.load_config(location, subfolder=name, local_files_only=local)
        with torch.device("meta"):
            model = cls.from_config(config)
        keep = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
        for pname, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and not any(k in pname.split(".") for k in keep):
                t.data = t.data.to(dtype)
        out[name] = model.eval()
    return out
