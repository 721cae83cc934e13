"""Text embeddings cached by prompt, automatically (DanceGRPO precomputes them offline; grove caches them online).

RL re-encodes the same prompts every iteration (a training set of a few hundred or thousand prompts, drawn again and
again) through text encoders that never train: UMT5-XXL (Wan, 5.7B parameters), Qwen2.5-VL-7B (Qwen-Image,
HunyuanVideo 1.5), Mistral-Small-3.1-24B (FLUX.2-dev). :class:`PromptCache` keeps each prompt's embedding rows
(``Conditioning`` rows with one sample) the first time the adapter encodes it and serves them afterwards.

- **Key**: the prompt and every encoding option (negative prompt, guidance scale, sequence length, size, frames,
  model-specific flags), so a different call never gets a stale row.
- **Validity**: the cache holds only while the text-side modules (``adapter.text_modules()``) are frozen and
  unchanged: it is bypassed when any of their parameters requires grad, and cleared when their parameter
  fingerprint (ids, in-place version counters, devices, dtypes) changes — a ``load_state_dict`` or an optimizer step
  on a text encoder invalidates it.
- **Exactness**: rows are re-assembled in the requested order and repeated ``num_images_per_prompt`` times like the
  pipelines do; the result equals an uncached call (tests compare bit for bit). Missing prompts are encoded one per
  call (duplicates once), so a prompt's rows never depend on the prompts that came with it: a resumed run, whose
  cache starts empty, gets the rows the uninterrupted run had.
- **Memory**: rows are stored on ``device`` (default: the CPU when the pipeline runs on an accelerator, so the cache
  costs no accelerator memory; it moves a hit's rows back, a few MB even for Wan's 512x4096 UMT5 rows), at most
  ``max_prompts`` prompts, least recently used evicted first.

``prompt_cache(pipe)`` returns the pipeline's cache (one per pipeline object, shared by every adapter over it);
``configure_prompt_cache(pipe, enabled=..., max_prompts=..., device=...)`` changes it. ``stats()`` counts hits and
misses per prompt.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["PromptCache", "prompt_cache", "configure_prompt_cache"]

_CACHES: "weakref.WeakKeyDictionary[Any, PromptCache]" = weakref.WeakKeyDictionary()


def _freeze(value: Any) -> Any:
    """A hashable, order-independent form of an option value (lists, dicts, tensors by content)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), tuple(value.detach().cpu().flatten().tolist()))
    if isinstance(value, float) and value != value:  # NaN
        return ("nan",)
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


class PromptCache:
    """Per-prompt embedding rows of one pipeline (see the module docstring)."""

    def __init__(self, enabled: bool = True, max_prompts: int = 4096, device: str | torch.device | None = None):
        self.enabled = bool(enabled)
        self.max_prompts = int(max_prompts)
        self.device = None if device is None else torch.device(device)
        self._rows: "OrderedDict[tuple, Any]" = OrderedDict()
        self._meta: dict[tuple, dict] = {}
        self._fingerprint: tuple | None = None
        self.hits = 0
        self.misses = 0
        self.bypassed = 0

    # --------------------------------------------------------------------------------------------------- state
    def clear(self) -> None:
        self._rows.clear()
        self._meta.clear()

    def __len__(self) -> int:
        return len(self._rows)

    def stats(self) -> dict[str, float]:
        asked = self.hits + self.misses
        return {"hits": float(self.hits), "misses": float(self.misses), "bypassed": float(self.bypassed),
                "hit_rate": self.hits / asked if asked else 0.0, "prompts": float(len(self._rows))}

    def reset_stats(self) -> None:
        self.hits = self.misses = self.bypassed = 0

    @staticmethod
    def fingerprint(adapter) -> tuple:
        parts = []
        for module in adapter.text_modules():
            for p in module.parameters():
                parts.append((id(p), p._version, str(p.device), str(p.dtype)))
        return tuple(parts)

    def usable(self, adapter, options: dict) -> bool:
        if not self.enabled or self.max_prompts < 1:
            return False
        modules = adapter.text_modules()
        if any(p.requires_grad for m in modules for p in m.parameters()):
            self.bypassed += 1
            return False
        return True

    # --------------------------------------------------------------------------------------------------- lookup
    def _store_device(self, cond_device: torch.device) -> torch.device:
        if self.device is not None:
            return self.device
        return torch.device("cpu") if cond_device.type != "cpu" else cond_device

    def encode(self, adapter, prompts: list[str], num_images_per_prompt: int, options: dict):
        fp = self.fingerprint(adapter)
        if fp != self._fingerprint:
            self.clear()
            self._fingerprint = fp
        opt_key = (type(adapter).__name__, _freeze(options))
        unique = list(dict.fromkeys(prompts))
        missing = [p for p in unique if (p, opt_key) not in self._rows]
        self.misses += len(missing)
        self.hits += len(unique) - len(missing)
        if missing:
            # one prompt per encoder call: a batch's matmuls round in the last bit by batch size (CLIP on the CPU), so
            # rows encoded together would depend on which prompts first came along — and a resumed run, whose cache
            # starts empty, would meet them in other company than the uninterrupted run did (issue 65). Each prompt
            # is encoded once per run, so the extra calls cost little.
            conds = [adapter._encode_now([prompt], 1, options) for prompt in missing]
            cond = conds[0]
            store = self._store_device(next(iter(cond.tensors.values())).device)
            self._meta[opt_key] = {"guidance_scale": cond.guidance_scale, "do_cfg": cond.do_cfg,
                                   "height": cond.height, "width": cond.width, "shared": cond.shared,
                                   "options": cond.options, "device": next(iter(cond.tensors.values())).device}
            for prompt, one in zip(missing, conds):
                row = adapter._split_rows(one)[0]
                row.tensors = {k: v.to(store) for k, v in row.tensors.items()}
                self._rows[(prompt, opt_key)] = row
        for p in unique:
            self._rows.move_to_end((p, opt_key))
        meta = self._meta[opt_key]
        rows = [self._rows[(p, opt_key)] for p in prompts]
        cond = adapter._cat_rows(rows)
        cond.tensors = {k: v.to(meta["device"]) for k, v in cond.tensors.items()}
        cond.guidance_scale, cond.do_cfg = meta["guidance_scale"], meta["do_cfg"]
        cond.height, cond.width, cond.shared = meta["height"], meta["width"], meta["shared"]
        cond.options = dict(meta["options"])  # a schedule may record its grid here (HunyuanVideo 1.5)
        if num_images_per_prompt > 1:
            cond = cond[torch.arange(len(prompts)).repeat_interleave(num_images_per_prompt)]
        while len(self._rows) > self.max_prompts:
            self._rows.popitem(last=False)
        return cond


def prompt_cache(pipe) -> PromptCache:
    """The text-embedding cache of ``pipe`` (created on first use, enabled)."""
    try:
        return _CACHES[pipe]
    except KeyError:
        cache = _CACHES[pipe] = PromptCache()
        return cache
    except TypeError:  # an object that cannot be weakly referenced: a private, disabled cache
        return PromptCache(enabled=False)


def configure_prompt_cache(pipe, enabled: bool | None = None, max_prompts: int | None = None,
                           device: str | torch.device | None = None, clear: bool = False) -> PromptCache:
    cache = prompt_cache(pipe)
    if enabled is not None:
        cache.enabled = bool(enabled)
    if max_prompts is not None:
        cache.max_prompts = int(max_prompts)
    if device is not None:
        cache.device = torch.device(device)
    if clear or enabled is False:
        cache.clear()
    return cache
