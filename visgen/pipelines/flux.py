"""Adapter for the stock ``FluxPipeline`` (FLUX.1 dev/schnell, Black Forest Labs 2024), diffusers 0.42."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers.pipelines.flux import pipeline_flux as flux_module

from .base import Conditioning, FlowPipelineAdapter


class FluxAdapter(FlowPipelineAdapter):
    """FLUX: 2x2-packed latent tokens, model timestep ``t / 1000``, guidance as an embedding (guidance-distilled
    FLUX.1-dev; one forward per step) and optional "true CFG" with a negative prompt (two separate forwards, as the
    pipeline does)."""

    family = "flux"
    pipeline_class_names = ("FluxPipeline",)

    def size_multiple(self) -> int:
        return 2 * super().size_multiple()  # FLUX packs 2x2 latent patches

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        """Unpacked latent height/width, as ``FluxPipeline.prepare_latents`` rounds them."""
        factor = self.pipe.vae_scale_factor
        return 2 * (int(height) // (factor * 2)), 2 * (int(width) // (factor * 2))

    def _encode(
        self,
        prompts: list[str],
        num_images_per_prompt: int = 1,
        guidance_scale: float | None = None,
        negative_prompt: str | list[str] | None = None,
        max_sequence_length: int | None = None,
        height: int | None = None,
        width: int | None = None,
        true_cfg_scale: float = 1.0,
        **kwargs: Any,
    ) -> Conditioning:
        if kwargs:
            raise TypeError(f"FLUX adapter got unexpected options {sorted(kwargs)}")
        guidance_scale = self.call_default("guidance_scale") if guidance_scale is None else guidance_scale
        max_sequence_length = max_sequence_length or self.call_default("max_sequence_length")
        default_h, default_w = self.default_size()
        height, width = height or default_h, width or default_w
        do_true_cfg = true_cfg_scale > 1 and negative_prompt is not None
        with torch.no_grad():
            embeds, pooled, text_ids = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                device=self.device,
                num_images_per_prompt=num_images_per_prompt,
                max_sequence_length=max_sequence_length,
            )
            tensors = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
            shared = {"txt_ids": text_ids}
            if do_true_cfg:
                if isinstance(negative_prompt, str):
                    negative_prompt = [negative_prompt] * len(prompts)
                neg_embeds, neg_pooled, neg_text_ids = self.pipe.encode_prompt(
                    prompt=negative_prompt,
                    prompt_2=None,
                    device=self.device,
                    num_images_per_prompt=num_images_per_prompt,
                    max_sequence_length=max_sequence_length,
                )
                tensors["negative_prompt_embeds"] = neg_embeds
                tensors["negative_pooled_prompt_embeds"] = neg_pooled
                shared["negative_txt_ids"] = neg_text_ids
        latent_h, latent_w = self.latent_size(height, width)
        shared["img_ids"] = self.pipe._prepare_latent_image_ids(
            1, latent_h // 2, latent_w // 2, self.device, embeds.dtype
        )
        options = {"true_cfg_scale": float(true_cfg_scale)}
        return Conditioning(tensors, float(guidance_scale), do_true_cfg, height, width, shared, options)

    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        latents, _ = self.pipe.prepare_latents(
            batch_size,
            self.transformer.config.in_channels // 4,
            cond.height,
            cond.width,
            cond.tensors["prompt_embeds"].dtype,
            self.device,
            generator,
        )
        return latents.float()

    def schedule(self, num_steps, cond, sigmas=None, mu=None):
        scheduler = self.scheduler_copy()
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if getattr(scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        if mu is None:
            latent_h, latent_w = self.latent_size(cond.height, cond.width)
            mu = flux_module.calculate_shift(
                (latent_h // 2) * (latent_w // 2),  # the packed sequence length
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.15),
            )
        flux_module.retrieve_timesteps(scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        return self._finish_schedule(scheduler, self.device)

    def velocity(self, latents, timesteps, cond):
        transformer = self.transformer
        x = latents.to(transformer.dtype)
        t = timesteps.to(device=latents.device, dtype=x.dtype) / 1000
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full([x.shape[0]], cond.guidance_scale, device=x.device, dtype=torch.float32)
        out = transformer(
            hidden_states=x,
            timestep=t,
            guidance=guidance,
            pooled_projections=cond.tensors["pooled_prompt_embeds"],
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            txt_ids=cond.shared["txt_ids"],
            img_ids=cond.shared["img_ids"],
            return_dict=False,
        )[0]
        if cond.do_cfg:
            negative = transformer(
                hidden_states=x,
                timestep=t,
                guidance=guidance,
                pooled_projections=cond.tensors["negative_pooled_prompt_embeds"],
                encoder_hidden_states=cond.tensors["negative_prompt_embeds"],
                txt_ids=cond.shared["negative_txt_ids"],
                img_ids=cond.shared["img_ids"],
                return_dict=False,
            )[0]
            out = negative + cond.options["true_cfg_scale"] * (out - negative)
        return out.float()

    def unpack(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Packed tokens ``[B, N, 4C]`` -> latent image ``[B, C, h, w]`` (the pipeline's ``_unpack_latents``)."""
        return self.pipe._unpack_latents(latents, cond.height, cond.width, self.pipe.vae_scale_factor)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """Latent image ``[B, C, h, w]`` -> packed tokens ``[B, h/2 * w/2, 4C]`` (the pipeline's ``_pack_latents``)."""
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)

    def decode(self, latents, cond):
        vae = self.pipe.vae
        with torch.no_grad():
            z = self.unpack(latents, cond)
            z = (z / vae.config.scaling_factor) + (vae.config.shift_factor or 0.0)
            image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
            return self.pipe.image_processor.postprocess(image, output_type="pt").float()
