"""What the sampler needs from a stock diffusers flow-matching pipeline, behind one small interface.

An adapter wraps an *unmodified* pipeline object (``StableDiffusion3Pipeline``, ``FluxPipeline``, ``SanaPipeline``)
and re-does, step by step, exactly what that pipeline's ``__call__`` does: prompt encoding, latent preparation for
the same generator, the scheduler's sigmas/timesteps, the transformer call with the pipeline's timestep scaling and
guidance, and decoding. It calls the pipeline's own methods wherever they exist (``encode_prompt``,
``prepare_latents``, ``retrieve_timesteps``, ``image_processor.postprocess``) so a deterministic Euler chain over an
adapter reproduces ``pipe(..., output_type="latent")`` bit for bit in float32.

Differences from the pipelines, by design: latents are kept in float32 between steps (the step math must be float32;
a bf16 pipeline rounds its latents to bf16 after every step, so there it matches only to bf16 tolerance), and
pipeline extras outside the sampling core (IP-adapters, SD3 skip-layer guidance, SANA resolution binning, callbacks,
cache contexts) are not reproduced.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .cache import prompt_cache

__all__ = ["Conditioning", "FlowPipelineAdapter"]


@dataclass
class Conditioning:
    """Encoded prompts for a batch of samples (one row per sample, num_images_per_prompt already expanded).

    tensors: per-sample tensors (first dim = batch), e.g. ``prompt_embeds``, ``pooled_prompt_embeds`` and their
        ``negative_`` counterparts when CFG is on. Indexing a Conditioning indexes these.
    shared: batch-independent tensors (FLUX ``txt_ids``/``img_ids``).
    guidance_scale: CFG scale (SD3, SANA; FLUX true-CFG scale is ``true_cfg_scale``) or the FLUX guidance embedding.
    do_cfg: whether the velocity call runs the unconditional branch (counts as a second forward).
    height, width: image size in pixels (decoding and FLUX latent packing need it).
    options: small model-specific scalars (e.g. ``true_cfg_scale``).
    """

    tensors: dict[str, torch.Tensor]
    guidance_scale: float
    do_cfg: bool
    height: int
    width: int
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(next(iter(self.tensors.values())).shape[0])

    def __getitem__(self, idx: Any) -> "Conditioning":
        if isinstance(idx, torch.Tensor):
            idx = idx.to(next(iter(self.tensors.values())).device)
        return Conditioning(
            tensors={k: v[idx] for k, v in self.tensors.items()},
            guidance_scale=self.guidance_scale,
            do_cfg=self.do_cfg,
            height=self.height,
            width=self.width,
            shared=self.shared,
            options=self.options,
        )

    @staticmethod
    def cat(parts: list["Conditioning"]) -> "Conditioning":
        first = parts[0]
        return Conditioning(
            tensors={k: torch.cat([p.tensors[k] for p in parts]) for k in first.tensors},
            guidance_scale=first.guidance_scale,
            do_cfg=first.do_cfg,
            height=first.height,
            width=first.width,
            shared=first.shared,
            options=first.options,
        )


class FlowPipelineAdapter:
    """Base class; subclasses implement the model-specific pieces. All inputs/outputs are batched.

    Prompt encoding goes through :meth:`encode_prompts`, which serves each prompt's embedding rows from the
    pipeline's text-embedding cache (``visgen.pipelines.cache``) and calls the subclass's :meth:`_encode` only for
    the prompts it has not seen with the same options. Video adapters (``is_video``) decode to ``[B, F, 3, H, W]``.
    """

    family: ClassVar[str] = ""
    pipeline_class_names: ClassVar[tuple[str, ...]] = ()
    is_video: ClassVar[bool] = False

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    # ---------------------------------------------------------------- generic helpers

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        """Where sampling runs: the pipeline's execution device, or the transformer's when a CPU-offloaded text
        encoder makes the pipeline report the CPU (``visgen.memory.offload_text_encoders``)."""
        device = self.pipe._execution_device
        if device.type == "cpu":
            param = next(iter(self.transformer.parameters()), None)
            if param is not None and param.device.type != "cpu":
                return param.device
        return device

    def call_default(self, name: str) -> Any:
        """The default of an argument of the pipeline's ``__call__`` (so the adapter's defaults follow diffusers)."""
        return inspect.signature(type(self.pipe).__call__).parameters[name].default

    def default_size(self) -> tuple[int, int]:
        size = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        return size, size

    def size_multiple(self) -> int:
        """Height/width must be multiples of this (VAE downsampling x transformer patch size)."""
        patch = getattr(self.transformer.config, "patch_size", 1) or 1
        patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
        return int(getattr(self.pipe, "vae_scale_factor", 8)) * int(patch)

    def text_modules(self) -> list[torch.nn.Module]:
        """The frozen prompt-side modules (text encoders, connectors): what the embedding cache fingerprints and
        what ``offload_text_encoders`` moves."""
        skip = {"transformer", "transformer_2", "vae", "audio_vae", "vocoder", "scheduler"}
        return [m for name, m in self.pipe.components.items()
                if name not in skip and isinstance(m, torch.nn.Module)]

    def latent_output(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """What the stock pipeline returns for ``output_type="latent"`` given the final sampler latents (most
        pipelines return them as they are; FLUX.2 un-patchifies and de-normalises them first)."""
        return latents

    def forwards_per_step(self, cond: Conditioning) -> int:
        """Model evaluations per sample per denoising step (CFG counts 2)."""
        return 2 if cond.do_cfg else 1

    def scheduler_copy(self):
        """A private copy of the pipeline's own scheduler (setting timesteps must not disturb the pipeline)."""
        scheduler = copy.deepcopy(self.pipe.scheduler)
        is_flow = type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" or getattr(
            scheduler.config, "use_flow_sigmas", False
        )
        if not is_flow:
            raise ValueError(
                f"{type(scheduler).__name__} is not a flow-matching scheduler; the flow kernels need "
                "FlowMatchEulerDiscreteScheduler (or a scheduler with use_flow_sigmas=True)"
            )
        if getattr(scheduler.config, "invert_sigmas", False):
            raise ValueError("schedulers with invert_sigmas=True are not supported (sigma must run from 1 to 0)")
        return scheduler

    @staticmethod
    def _finish_schedule(scheduler, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        sigmas = scheduler.sigmas.to(device=device, dtype=torch.float32)
        timesteps = scheduler.timesteps.to(device=device)
        if not torch.is_floating_point(timesteps):
            # DPM-Solver style flow schedulers hand the model integer timesteps; the values are kept as they are
            timesteps = timesteps.to(torch.float32)
        if sigmas.shape[0] != timesteps.shape[0] + 1:
            raise ValueError(f"scheduler gave {sigmas.shape[0]} sigmas for {timesteps.shape[0]} timesteps")
        return sigmas, timesteps

    # ---------------------------------------------------------------- prompt encoding (cached)

    def encode_prompts(self, prompts: list[str], num_images_per_prompt: int = 1, **options: Any) -> Conditioning:
        """Encode prompts (no grad) as the pipeline does; row order matches the pipeline's batch order
        (each prompt's rows repeated ``num_images_per_prompt`` times in a row).

        Served from the text-embedding cache when it is on and the text encoders are frozen and unchanged; the
        result equals an uncached call (tested bit for bit). ``options``: the subclass's ``_encode`` keywords.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        cache = prompt_cache(self.pipe)
        if not cache.usable(self, options):
            return self._encode_now(prompts, num_images_per_prompt, options)
        return cache.encode(self, prompts, num_images_per_prompt, options)

    def _encode_now(self, prompts: list[str], num_images_per_prompt: int, options: dict) -> Conditioning:
        """:meth:`_encode`, with offloaded text encoders visiting the device for the call (``visgen.memory``)."""
        from .memory import text_encoder_offload

        with text_encoder_offload(self):
            return self._encode(prompts, num_images_per_prompt=num_images_per_prompt, **options)

    def _split_rows(self, cond: Conditioning) -> list[Conditioning]:
        """One Conditioning per row (what the cache stores per prompt)."""
        return [cond[i:i + 1] for i in range(len(cond))]

    def _cat_rows(self, rows: list[Conditioning]) -> Conditioning:
        """The inverse of :meth:`_split_rows` for any selection of rows (variable-length encoders re-pad here)."""
        return Conditioning.cat(rows)

    # ---------------------------------------------------------------- model-specific interface

    def _encode(
        self,
        prompts: list[str],
        num_images_per_prompt: int = 1,
        guidance_scale: float | None = None,
        negative_prompt: str | list[str] | None = None,
        max_sequence_length: int | None = None,
        height: int | None = None,
        width: int | None = None,
        **kwargs: Any,
    ) -> Conditioning:
        """Encode prompts (no grad) exactly as the pipeline does (no cache)."""
        raise NotImplementedError

    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        """Initial noise in the model's latent layout, drawn exactly as the pipeline draws it; float32."""
        raise NotImplementedError

    def schedule(
        self, num_steps: int, cond: Conditioning, sigmas: list[float] | None = None, mu: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas [T+1] float32 ending in 0, timesteps [T])`` from the pipeline's own scheduler."""
        raise NotImplementedError

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Guided velocity ``v`` (float32, shape of ``latents``) for per-sample scheduler ``timesteps`` ``[B]``.

        Runs with grad when grad is enabled (training recomputation); CFG runs both branches in one batch like the
        pipeline does.
        """
        raise NotImplementedError

    def decode(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` (video: ``[B, F, 3, H, W]``) in [0, 1] (float32), decoded like the pipeline
        (no grad)."""
        raise NotImplementedError

    def encode_images(self, images: torch.Tensor, cond: Conditioning, generator: Any = None) -> torch.Tensor:
        """Clean latents of images in [0, 1] (offline DPO); families without it say so in one line."""
        from shared_rl.config import ConfigError

        raise ConfigError(f"{type(self).__name__} cannot encode stored images yet (offline DPO needs it: the SD3 family "
                          "can)")

    def decode_differentiable(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``decode`` with the graph to ``latents`` kept (DiffusionOPSD); families without one say so in one line."""
        from shared_rl.config import ConfigError

        raise ConfigError(f"{type(self).__name__} has no differentiable VAE decode yet (DiffusionOPSD needs one: "
                          "the SD3 family has it)")
