"""Adapter for the stock ``SanaPipeline`` (SANA, Xie et al. 2024), diffusers 0.42."""
from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.sana import pipeline_sana as sana_module

from .base import Conditioning, FlowPipelineAdapter


class SanaAdapter(FlowPipelineAdapter):
    """SANA: Gemma text encoder with attention masks, CFG as one batch ``[negative; positive]``, model timestep
    ``t * transformer.config.timestep_scale``, DC-AE decoding.

    Scheduler: SANA checkpoints ship a ``DPMSolverMultistepScheduler`` with ``use_flow_sigmas``. The flow kernels are
    Euler-type steps, so with such a scheduler the adapter takes its sigma/timestep grid and integrates it with Euler
    (not DPM-Solver++); the ODE sampler then matches a ``SanaPipeline`` whose scheduler is a
    ``FlowMatchEulerDiscreteScheduler`` (bit for bit), not the multistep solver. Resolution binning is not applied:
    pass a height/width the model supports.
    """

    family = "sana"
    pipeline_class_names = ("SanaPipeline",)

    def default_size(self) -> tuple[int, int]:
        size = self.transformer.config.sample_size * self.pipe.vae_scale_factor
        return size, size

    def _encode(
        self,
        prompts: list[str],
        num_images_per_prompt: int = 1,
        guidance_scale: float | None = None,
        negative_prompt: str | list[str] | None = None,
        max_sequence_length: int | None = None,
        height: int | None = None,
        width: int | None = None,
        complex_human_instruction: list[str] | None | str = "default",
        clean_caption: bool = False,
        **kwargs: Any,
    ) -> Conditioning:
        if kwargs:
            raise TypeError(f"SANA adapter got unexpected options {sorted(kwargs)}")
        guidance_scale = self.call_default("guidance_scale") if guidance_scale is None else guidance_scale
        max_sequence_length = max_sequence_length or self.call_default("max_sequence_length")
        if isinstance(complex_human_instruction, str) and complex_human_instruction == "default":
            complex_human_instruction = self.call_default("complex_human_instruction")
        if negative_prompt is None:
            negative_prompt = self.call_default("negative_prompt")
        default_h, default_w = self.default_size()
        do_cfg = guidance_scale > 1.0
        with torch.no_grad():
            embeds, mask, neg_embeds, neg_mask = self.pipe.encode_prompt(
                prompts,
                do_cfg,
                negative_prompt=negative_prompt,
                num_images_per_prompt=num_images_per_prompt,
                device=self.device,
                clean_caption=clean_caption,
                max_sequence_length=max_sequence_length,
                complex_human_instruction=complex_human_instruction,
            )
        tensors = {"prompt_embeds": embeds, "prompt_attention_mask": mask}
        if do_cfg:
            tensors["negative_prompt_embeds"] = neg_embeds
            tensors["negative_prompt_attention_mask"] = neg_mask
        return Conditioning(tensors, float(guidance_scale), do_cfg, height or default_h, width or default_w)

    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        return self.pipe.prepare_latents(
            batch_size,
            self.transformer.config.in_channels,
            cond.height,
            cond.width,
            torch.float32,  # SanaPipeline always draws float32 latents
            self.device,
            generator,
        )

    def schedule(self, num_steps, cond, sigmas=None, mu=None):
        scheduler = self.scheduler_copy()
        kwargs = {} if mu is None else {"mu": mu}
        sana_module.retrieve_timesteps(scheduler, num_steps, self.device, None, sigmas, **kwargs)
        return self._finish_schedule(scheduler, self.device)

    def velocity(self, latents, timesteps, cond):
        transformer = self.transformer
        x = latents
        t = timesteps.to(latents.device)
        embeds = cond.tensors["prompt_embeds"]
        mask = cond.tensors["prompt_attention_mask"]
        if cond.do_cfg:
            x = torch.cat([x, x])
            t = torch.cat([t, t])
            embeds = torch.cat([cond.tensors["negative_prompt_embeds"], embeds])
            mask = torch.cat([cond.tensors["negative_prompt_attention_mask"], mask])
        t = t * transformer.config.timestep_scale
        out = transformer(
            x.to(dtype=transformer.dtype),
            encoder_hidden_states=embeds.to(dtype=transformer.dtype),
            encoder_attention_mask=mask,
            timestep=t,
            return_dict=False,
        )[0].float()
        if cond.do_cfg:
            uncond, text = out.chunk(2)
            out = uncond + cond.guidance_scale * (text - uncond)
        if transformer.config.out_channels // 2 == transformer.config.in_channels:
            out = out.chunk(2, dim=1)[0]  # learned-sigma checkpoints: keep the velocity half
        return out

    def decode(self, latents, cond):
        vae = self.pipe.vae
        with torch.no_grad():
            image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
            return self.pipe.image_processor.postprocess(image, output_type="pt").float()
