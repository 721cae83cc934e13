"""``grove train --dry-run``'s memory estimate for visgen (``VisgenConfig.parameter_groups``): every model component
of the diffusers pipeline (``model_index.json``: the transformer, the text encoders, the VAE) built on the meta
device from its ``config.json``, so no weight is read, and split as ``visgen.policy.FlowPolicy`` holds it:

- ``train_mode: lora``: the LoRA adapters, ``rank x (in + out)`` per ``nn.Linear`` of the transformer that
  ``lora.target_modules`` names (peft's suffix match), trained in float32 (FlowPolicy keeps float32 master
  weights); the transformer frozen in ``visgen.dtype``;
- ``train_mode: full``: the transformer trained in float32, its frozen copy with ``full_reference``;
- ``ema.enabled``: a copy of the trained weights (of their shards under fsdp2);
- every other component frozen in ``visgen.dtype``, replicated under fsdp2 (``visgen.fsdp`` shards the transformer,
  its reference copy and Wan 2.2's second expert);
- an objective's frozen teacher (on-policy distillation, ``visgen.objective.teacher``): the teacher pipeline's
  transformer, built on the meta device from its own ``transformer/config.json`` (its other components are dropped
  when it loads, ``FlowPolicy._enable_teacher``), frozen in ``visgen.dtype`` and replicated under fsdp2; a teacher
  that is not readable here yet (a recipe names the run that makes it, an uncached hub id) is counted at the
  student transformer's size, and its group's name says so.

Not counted: the old-policy and snapshot copies some objectives keep (DiffusionNFT, CRD, DPO's ``ref_adapter``) and
the reward models. A
hub id is counted from its local Hugging Face cache, or not at all (None) when it is not cached.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from shared_rl.memory_estimate import DTYPE_BYTES, ParameterGroup

if TYPE_CHECKING:
    import torch

SHARDED = ("transformer", "transformer_2")  # the components visgen.fsdp.fsdp_units shards


def pipeline_directory(model: str) -> Path | None:
    """The local directory of ``visgen.model``: the pipeline directory itself, or a hub id's snapshot in the local
    cache (nothing is downloaded); None when neither."""
    from shared_rl.prechecks import resolve_visgen_model

    location, local = resolve_visgen_model(model)
    if local:
        return Path(location)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(location, local_files_only=True))
    except Exception:  # noqa: BLE001 — not cached (or no hub client): no estimate
        return None


def meta_components(directory: Path, only: tuple[str, ...] | None = None) -> dict[str, "torch.nn.Module"]:
    """The pipeline's model components (``torch.nn.Module`` classes of diffusers or transformers named in
    ``model_index.json``; those named in ``only`` when given), each built on the meta device from its folder's
    ``config.json``."""
    import importlib

    import torch

    index = json.loads((directory / "model_index.json").read_text())
    built = {}
    for name, spec in index.items():
        if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in ("diffusers", "transformers")):
            continue
        if only is not None and name not in only:
            continue
        folder = directory / name
        if not (folder / "config.json").is_file():
            continue
        cls = getattr(importlib.import_module(spec[0]), spec[1], None)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            continue  # schedulers, tokenizers: no parameters
        with torch.device("meta"):
            if spec[0] == "diffusers":
                built[name] = cls.from_config(cls.load_config(folder))
            else:
                from transformers import AutoConfig

                built[name] = cls._from_config(AutoConfig.from_pretrained(folder, local_files_only=True))
    return built


def lora_parameters(transformer: "torch.nn.Module", rank: int, targets: list[str]) -> int:
    """Parameters of rank-``rank`` LoRA adapters on the ``nn.Linear`` layers whose name is a target or ends with
    ``.target`` (peft's match): ``rank x (in_features + out_features)`` each."""
    import torch

    return sum(rank * (m.in_features + m.out_features) for n, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith(f".{t}") for t in targets))


def teacher_transformer_parameters(teacher: str) -> int | None:
    """Parameters of the transformer of the teacher pipeline ``teacher`` (a directory, as given or relative to the
    working directory or the repository, or a cached hub id), built on the meta device; None when it cannot be read
    here."""
    from shared_rl.errors import ConfigError

    try:
        directory = pipeline_directory(teacher)
    except ConfigError:  # a local path that does not exist yet: the run that makes it comes first
        return None
    if directory is None or not (directory / "model_index.json").is_file():
        return None
    try:
        built = meta_components(directory, only=("transformer",))
    except (OSError, ValueError):  # a damaged config is the loader's to name
        return None
    return sum(p.numel() for p in built["transformer"].parameters()) if "transformer" in built else None


def parameter_groups(cfg) -> list[ParameterGroup] | None:
    """The groups of ``cfg`` (a ``VisgenConfig``); None when the pipeline cannot be read here."""
    directory = pipeline_directory(cfg.model)
    if directory is None or not (directory / "model_index.json").is_file():
        return None
    components = meta_components(directory)
    if "transformer" not in components:
        return None
    size = DTYPE_BYTES[cfg.dtype]
    count = {name: sum(p.numel() for p in module.parameters()) for name, module in components.items()}
    n = count["transformer"]
    if cfg.train_mode == "lora":
        trained = lora_parameters(components["transformer"], cfg.lora.rank, list(cfg.lora.target_modules))
        groups = [ParameterGroup("LoRA adapters", trained, True, DTYPE_BYTES["float32"]),
                  ParameterGroup("transformer (frozen)", n, False, size)]
    else:
        trained = n
        groups = [ParameterGroup("transformer", n, True, DTYPE_BYTES["float32"])]
        if cfg.full_reference:
            groups.append(ParameterGroup("transformer reference copy", n, False, size))
    if cfg.ema.enabled:
        groups.append(ParameterGroup("EMA of the trained weights", trained, False, DTYPE_BYTES["float32"]))
    for name in sorted(set(components) - {"transformer"}):
        groups.append(ParameterGroup(name, count[name], False, size, sharded=name in SHARDED))
    teacher = getattr(cfg.training_objective().settings, "teacher", None)
    if teacher:
        t = teacher_transformer_parameters(str(teacher))
        label = "teacher transformer (frozen)" if t is not None else \
            "teacher transformer (frozen; not readable here: counted at the student's size)"
        groups.append(ParameterGroup(label, n if t is None else t, False, size, sharded=False))
    return groups
