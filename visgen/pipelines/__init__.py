"""Per-model adapters over stock diffusers flow-matching pipelines (see ``base.FlowPipelineAdapter``)."""
from __future__ import annotations

from typing import Any

from .base import Conditioning, FlowPipelineAdapter
from .flux import FluxAdapter
from .flux2 import Flux2Adapter, Flux2KleinAdapter
from .hunyuan_video import HunyuanVideo15Adapter
from .ltx2 import LTX2Adapter
from .qwen_image import QwenImageAdapter
from .sana import SanaAdapter
from .sd3 import SD3Adapter
from .wan import WanAdapter
from .z_image import ZImageAdapter

ADAPTERS: dict[str, type[FlowPipelineAdapter]] = {a.family: a for a in (
    SD3Adapter, FluxAdapter, SanaAdapter, WanAdapter, QwenImageAdapter, Flux2Adapter, Flux2KleinAdapter, ZImageAdapter,
    HunyuanVideo15Adapter, LTX2Adapter)}

__all__ = ["ADAPTERS", "Conditioning", "FlowPipelineAdapter", "Flux2Adapter", "Flux2KleinAdapter", "FluxAdapter",
           "HunyuanVideo15Adapter", "LTX2Adapter", "QwenImageAdapter", "SanaAdapter", "SD3Adapter", "WanAdapter",
           "ZImageAdapter", "as_adapter"]


def as_adapter(pipe_or_adapter: Any) -> FlowPipelineAdapter:
    """The adapter for a pipeline object (matched by its class or a base class name); adapters pass through."""
    if isinstance(pipe_or_adapter, FlowPipelineAdapter):
        return pipe_or_adapter
    names = {cls.__name__ for cls in type(pipe_or_adapter).__mro__}
    for adapter in ADAPTERS.values():
        if names & set(adapter.pipeline_class_names):
            return adapter(pipe_or_adapter)
    supported = sorted(n for a in ADAPTERS.values() for n in a.pipeline_class_names)
    raise TypeError(f"no visgen adapter for {type(pipe_or_adapter).__name__}; supported pipelines: {supported}")
