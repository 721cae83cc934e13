"""Per-model adapters over stock diffusers flow-matching pipelines (see ``base.FlowPipelineAdapter``).

The adapters are imported on first use (PEP 562 ``__getattr__``): each one imports its diffusers pipeline module,
~6 s together on a 2-core machine, which a config check or ``grove config show`` never needs."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import Conditioning, FlowPipelineAdapter

if TYPE_CHECKING:
    from .flux import FluxAdapter
    from .flux2 import Flux2Adapter, Flux2KleinAdapter
    from .hunyuan_video import HunyuanVideo15Adapter
    from .ltx2 import LTX2Adapter
    from .qwen_image import QwenImageAdapter
    from .sana import SanaAdapter
    from .sd3 import SD3Adapter
    from .wan import WanAdapter
    from .z_image import ZImageAdapter

# adapter class -> its module, in the order ``as_adapter`` tries them
_ADAPTER_MODULES = {"SD3Adapter": "sd3", "FluxAdapter": "flux", "SanaAdapter": "sana", "WanAdapter": "wan",
                    "QwenImageAdapter": "qwen_image", "Flux2Adapter": "flux2", "Flux2KleinAdapter": "flux2",
                    "ZImageAdapter": "z_image", "HunyuanVideo15Adapter": "hunyuan_video", "LTX2Adapter": "ltx2"}
_adapters: dict[str, type[FlowPipelineAdapter]] = {}

__all__ = ["ADAPTERS", "Conditioning", "FlowPipelineAdapter", "Flux2Adapter", "Flux2KleinAdapter", "FluxAdapter",
           "HunyuanVideo15Adapter", "LTX2Adapter", "QwenImageAdapter", "SanaAdapter", "SD3Adapter", "WanAdapter",
           "ZImageAdapter", "adapters", "as_adapter"]


def adapters() -> dict[str, type[FlowPipelineAdapter]]:
    """family -> adapter class, every built-in adapter (imports them all on the first call)."""
    if not _adapters:
        classes = [getattr(importlib.import_module(f".{mod}", __name__), name) for name, mod in _ADAPTER_MODULES.items()]
        _adapters.update({a.family: a for a in classes})
    return _adapters


def __getattr__(name: str) -> Any:
    if name == "ADAPTERS":
        return adapters()
    if name in _ADAPTER_MODULES:
        return getattr(importlib.import_module(f".{_ADAPTER_MODULES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def as_adapter(pipe_or_adapter: Any) -> FlowPipelineAdapter:
    """The adapter for a pipeline object (matched by its class or a base class name); adapters pass through."""
    if isinstance(pipe_or_adapter, FlowPipelineAdapter):
        return pipe_or_adapter
    names = {cls.__name__ for cls in type(pipe_or_adapter).__mro__}
    for adapter in adapters().values():
        if names & set(adapter.pipeline_class_names):
            return adapter(pipe_or_adapter)
    supported = sorted(n for a in adapters().values() for n in a.pipeline_class_names)
    raise TypeError(f"no visgen adapter for {type(pipe_or_adapter).__name__}; supported pipelines: {supported}")
