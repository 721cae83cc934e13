"""Memory controls for video (and large image) rollouts: ``visgen.memory`` in a training YAML.

Video rollouts are memory-bound (users report out-of-memory on Wan-14B and hours per sampling round; DanceGRPO
trains video as single frames to escape it). Each control here is independent and measured by
``grove bench visgen-video`` (rollout frames/s and peak memory with and without it):

| setting | what it does | exact? |
|---|---|---|
| ``prompt_cache`` (on) | text embeddings cached by prompt (``visgen.pipelines.cache``) | yes (Qwen-Image: ~1e-7) |
| ``offload_text_encoders`` | frozen text encoders stay on the CPU; they visit the device for cache misses only | yes |
| ``offload_rewards`` | every reward's models stay on the CPU between reward calls | yes |
| ``vae_slicing`` | the VAE decodes one sample at a time | to float rounding |
| ``vae_tiling`` | the VAE decodes spatial tiles and blends them (diffusers' tiling) | no: seams blended |
| ``decode_frame_chunk`` | Wan: post-process ``k`` latent frames at a time into one preallocated video | yes (tested) |

(Qwen-Image's pipeline itself gives a prompt other last bits in another batch; CPU convolutions round per batch
size.)

The rollout micro-batch (``visgen.rollout_micro_batch``: samples per transformer forward while sampling and per
VAE decode call) is independent of the training micro-batch (``optim.micro_batch_size``); gradient checkpointing
is ``visgen.gradient_checkpointing``. Both are listed here for completeness; they have their own settings.

Context (sequence) parallelism of a transformer with a diffusers ``_cp_plan`` (Wan, Qwen-Image, FLUX.2, LTX-2, ...):
:func:`enable_context_parallel` splits the token sequence over the processes of the initialised process group
(Ulysses all-to-all; ring attention needs an attention backend that returns the log-sum-exp, i.e. a GPU one). All
processes of the group must then run the *same* batch — sampling and evaluation in a ``torchrun`` /
``accelerate launch`` of ``visgen.sample``. The trainer's processes are data-parallel (each rolls out its own
prompts), so it is not a training setting.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from shared_rl.errors import ConfigError

from ..part_settings import MemorySettings  # torch-free: the config reads it (memory.MemorySettings as before)

__all__ = ["MemorySettings", "apply_memory_settings", "enable_context_parallel", "text_encoder_offload"]

_TEXT_OFFLOAD: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def apply_memory_settings(pipe, adapter, settings: MemorySettings) -> dict[str, Any]:
    """Switch the controls of ``settings`` on for ``pipe`` / ``adapter``; returns what was applied (for logs)."""
    from .cache import configure_prompt_cache

    applied: dict[str, Any] = {}
    configure_prompt_cache(pipe, enabled=settings.prompt_cache, max_prompts=settings.prompt_cache_size)
    applied["prompt_cache"] = settings.prompt_cache
    vae = getattr(pipe, "vae", None)
    if settings.vae_slicing:
        if vae is None or not hasattr(vae, "enable_slicing"):
            raise ConfigError(f"visgen.memory.vae_slicing: {type(vae).__name__} has no enable_slicing")
        vae.enable_slicing()
        applied["vae_slicing"] = True
    if settings.vae_tiling:
        if vae is None or not hasattr(vae, "enable_tiling"):
            raise ConfigError(f"visgen.memory.vae_tiling: {type(vae).__name__} has no enable_tiling")
        kwargs = {}
        if settings.vae_tile_size:
            import inspect

            size, stride = int(settings.vae_tile_size), max(1, int(settings.vae_tile_size) * 3 // 4)
            wanted = {"tile_sample_min_height": size, "tile_sample_min_width": size,
                      "tile_sample_stride_height": stride, "tile_sample_stride_width": stride}
            params = inspect.signature(vae.enable_tiling).parameters
            kwargs = {k: v for k, v in wanted.items() if k in params}
            if not kwargs:
                raise ConfigError(f"visgen.memory.vae_tile_size: {type(vae).__name__}.enable_tiling takes no tile "
                                  "size; leave it 0")
        vae.enable_tiling(**kwargs)
        applied["vae_tiling"] = kwargs or True
    if settings.decode_frame_chunk:
        if not hasattr(adapter, "decode_frame_chunk"):
            raise ConfigError(f"visgen.memory.decode_frame_chunk is for Wan pipelines (causal frame-by-frame VAE); "
                              f"{type(pipe).__name__} decodes whole clips (use vae_slicing / vae_tiling)")
        adapter.decode_frame_chunk = int(settings.decode_frame_chunk)
        applied["decode_frame_chunk"] = adapter.decode_frame_chunk
    if settings.offload_text_encoders:
        _TEXT_OFFLOAD[pipe] = True
        for module in adapter.text_modules():
            module.to("cpu")
        applied["offload_text_encoders"] = True
    return applied


def text_encoder_offload(adapter) -> contextlib.AbstractContextManager:
    """While encoding: the offloaded text encoders visit the adapter's device and return to the CPU afterwards."""
    try:
        active = _TEXT_OFFLOAD.get(adapter.pipe, False)
    except TypeError:
        active = False
    if not active:
        return contextlib.nullcontext()
    from visgen.rewards.video import Offload

    class _Visit:
        def __enter__(self):
            self.offloads = [Offload(m, adapter.device) for m in adapter.text_modules()]
            for o in self.offloads:
                o.__enter__()

        def __exit__(self, *exc):
            for o in self.offloads:
                o.__exit__(*exc)

    return _Visit()


def enable_context_parallel(transformer, ulysses_degree: int = 1, ring_degree: int = 1) -> None:
    """diffusers context parallelism (``ModelMixin.enable_parallelism``) over the initialised process group: the
    token sequence is split over ``ulysses_degree x ring_degree`` processes along the transformer's ``_cp_plan``."""
    if getattr(type(transformer), "_cp_plan", None) is None:
        raise ConfigError(f"visgen.memory.context_parallel: {type(transformer).__name__} has no _cp_plan "
                          "(diffusers has no context-parallel plan for it)")
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise ConfigError("visgen.memory.context_parallel needs torch.distributed (launch with accelerate / torchrun)")
    from diffusers import ContextParallelConfig

    config = ContextParallelConfig(ulysses_degree=ulysses_degree if ulysses_degree > 1 else None,
                                   ring_degree=ring_degree if ring_degree > 1 else None)
    if torch.accelerator.device_count() > 0:
        transformer.enable_parallelism(config=config)
        return
    # CPU processes (gloo): diffusers 0.42 picks the device as rank % accelerator count (a division by zero without
    # an accelerator); resolve the config on a CPU device mesh instead, then let diffusers apply the plan as usual
    from diffusers.models._modeling_parallel import ParallelConfig

    def resolve_on_cpu(cfg):
        cfg = ParallelConfig(context_parallel_config=cfg) if isinstance(cfg, ContextParallelConfig) else cfg
        cp = cfg.context_parallel_config
        mesh = cp.mesh or torch.distributed.device_mesh.init_device_mesh(
            device_type="cpu", mesh_shape=cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
        cfg.setup(torch.distributed.get_rank(), torch.distributed.get_world_size(), torch.device("cpu"), mesh=mesh)
        transformer._parallel_config = cfg
        return cfg

    transformer._resolve_parallel_config = resolve_on_cpu
    try:
        transformer.enable_parallelism(config=config)
    finally:
        del transformer._resolve_parallel_config
