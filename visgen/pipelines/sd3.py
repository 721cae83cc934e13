"""Adapter for the stock ``StableDiffusion3Pipeline`` (SD3 / SD3.5, Esser et al. 2024), diffusers 0.42."""
from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.stable_diffusion_3 import pipeline_stable_diffusion_3 as sd3_module

from .base import Conditioning, FlowPipelineAdapter


class SD3Adapter(FlowPipelineAdapter):
    """SD3: two CLIP encoders (+ optional T5), CFG as one batch ``[negative; positive]``, model timestep = ``t``."""

    family = "sd3"
    pipeline_class_names = ("StableDiffusion3Pipeline",)

    def _encode(
        self,
        prompts: list[str],
        num_images_per_prompt: int = 1,
        guidance_scale: float | None = None,
        negative_prompt: str | list[str] | None = None,
        max_sequence_length: int | None = None,
        height: int | None = None,
        width: int | None = None,
        clip_skip: int | None = None,
        **kwargs: Any,
    ) -> Conditioning:
        if kwargs:
            raise TypeError(f"SD3 adapter got unexpected options {sorted(kwargs)}")
        guidance_scale = self.call_default("guidance_scale") if guidance_scale is None else guidance_scale
        max_sequence_length = max_sequence_length or self.call_default("max_sequence_length")
        default_h, default_w = self.default_size()
        do_cfg = guidance_scale > 1  # the pipeline's do_classifier_free_guidance
        with torch.no_grad():
            prompt_embeds, negative_embeds, pooled, negative_pooled = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                prompt_3=None,
                negative_prompt=negative_prompt,
                do_classifier_free_guidance=do_cfg,
                device=self.device,
                clip_skip=clip_skip,
                num_images_per_prompt=num_images_per_prompt,
                max_sequence_length=max_sequence_length,
            )
        tensors = {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
        if do_cfg:
            tensors["negative_prompt_embeds"] = negative_embeds
            tensors["negative_pooled_prompt_embeds"] = negative_pooled
        return Conditioning(tensors, float(guidance_scale), do_cfg, height or default_h, width or default_w)

    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        latents = self.pipe.prepare_latents(
            batch_size,
            self.transformer.config.in_channels,
            cond.height,
            cond.width,
            cond.tensors["prompt_embeds"].dtype,
            self.device,
            generator,
        )
        return latents.float()

    def schedule(self, num_steps, cond, sigmas=None, mu=None):
        scheduler = self.scheduler_copy()
        scheduler_kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None) and mu is None:
            patch = self.transformer.config.patch_size
            latent_h = int(cond.height) // self.pipe.vae_scale_factor
            latent_w = int(cond.width) // self.pipe.vae_scale_factor
            mu = sd3_module.calculate_shift(
                (latent_h // patch) * (latent_w // patch),
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        if mu is not None:
            scheduler_kwargs["mu"] = mu
        sd3_module.retrieve_timesteps(scheduler, num_steps, self.device, sigmas=sigmas, **scheduler_kwargs)
        return self._finish_schedule(scheduler, self.device)

    def velocity(self, latents, timesteps, cond):
        transformer = self.transformer
        x = latents.to(transformer.dtype)
        t = timesteps.to(latents.device)
        embeds = cond.tensors["prompt_embeds"]
        pooled = cond.tensors["pooled_prompt_embeds"]
        if cond.do_cfg:
            x = torch.cat([x, x])
            t = torch.cat([t, t])
            embeds = torch.cat([cond.tensors["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond.tensors["negative_pooled_prompt_embeds"], pooled])
        out = transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False
        )[0]
        if cond.do_cfg:
            uncond, text = out.chunk(2)
            out = uncond + cond.guidance_scale * (text - uncond)
        return out.float()

    def decode(self, latents, cond):
        vae = self.pipe.vae
        with torch.no_grad():
            # the pipeline adds shift_factor unconditionally (None would fail there); 0 is what None means
            z = (latents / vae.config.scaling_factor) + (vae.config.shift_factor or 0.0)
            image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
            return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    def encode_images(self, images, cond, generator=None):
        """Clean latents of images ``[B, 3, H, W]`` in [0, 1] (offline DPO's stored pairs): the VAE posterior sampled
        with ``generator`` (the Diffusion-DPO training script's ``latent_dist.sample()``), shifted and scaled as the
        pipeline's decode undoes it; float32."""
        vae = self.pipe.vae
        with torch.no_grad():
            dist = vae.encode((images * 2 - 1).to(vae.device, vae.dtype)).latent_dist
            z = dist.sample(generator if generator is None or generator.device == dist.mean.device else None)
            return ((z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor).float()

    def decode_differentiable(self, latents, cond):
        """``decode`` with the graph to ``latents`` kept (DiffusionOPSD's reward gradient through the VAE):
        ``(vae.decode(z) / 2 + 1/2).clamp(0, 1)``, the pipeline's post-processing in torch."""
        vae = self.pipe.vae
        z = (latents / vae.config.scaling_factor) + (vae.config.shift_factor or 0.0)
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
