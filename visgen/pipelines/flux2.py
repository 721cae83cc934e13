"""Adapters for the stock ``Flux2Pipeline`` (FLUX.2 [dev]) and ``Flux2KleinPipeline`` (FLUX.2 [klein]), Black Forest
Labs 2025, diffusers 0.42.

Both: the latent image is 2x2-patchified (4C channels) and flattened to tokens ``[B, (h/2)(w/2), 4C]`` with 4-axis
position ids (t, h, w, layer); model timestep ``t / 1000``; sigmas ``linspace(1, 1/T, T)`` shifted by the
*empirical* ``mu`` of ``compute_empirical_mu(image_seq_len, num_steps)`` (it depends on the step count too).
Decoding un-flattens by the ids, undoes the VAE's batch-norm statistics and un-patchifies before
``AutoencoderKLFlux2.decode``. Text: hidden states of fixed decoder layers stacked along features
(``text_encoder_out_layers``).

- **FLUX.2 [dev]** (``Flux2Pipeline``): Mistral-Small-3.1 text encoder with a system prompt; guidance-distilled:
  ``guidance_scale`` is the guidance *embedding* (one forward per step). Prompt upsampling
  (``caption_upsample_temperature``) is not reproduced.
- **FLUX.2 [klein]** (``Flux2KleinPipeline``): Qwen3 text encoder; real CFG with the empty negative prompt when
  ``guidance_scale > 1`` and the checkpoint is not step-distilled (``is_distilled``): two forwards,
  ``neg + g (cond - neg)``. Its ``output_type="latent"`` returns the de-normalised, un-patchified latents
  (:meth:`latent_output` does the same).

Reference-image conditioning (``image=``) is not reproduced. LoRA: the single-stream blocks fuse their QKV and MLP
input projections into ``to_qkv_mlp_proj``; list it in ``lora.target_modules`` to adapt them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers.pipelines.flux2 import pipeline_flux2 as flux2_module

from .base import Conditioning, FlowPipelineAdapter


class Flux2Adapter(FlowPipelineAdapter):
    family = "flux2"
    pipeline_class_names = ("Flux2Pipeline",)

    def size_multiple(self) -> int:
        return 2 * int(self.pipe.vae_scale_factor)

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor
        return 2 * (int(height) // (f * 2)), 2 * (int(width) // (f * 2))

    def _cfg(self, guidance_scale: float) -> bool:
        return False  # FLUX.2 [dev] is guidance-distilled

    def _encode(self, prompts, num_images_per_prompt=1, guidance_scale=None, negative_prompt=None,
                max_sequence_length=None, height=None, width=None, text_encoder_out_layers=None,
                **kwargs: Any) -> Conditioning:
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unexpected options {sorted(kwargs)}")
        guidance_scale = self.call_default("guidance_scale") if guidance_scale is None else guidance_scale
        max_sequence_length = max_sequence_length or self.call_default("max_sequence_length")
        layers = tuple(text_encoder_out_layers or self.call_default("text_encoder_out_layers"))
        default_h, default_w = self.default_size()
        height, width = int(height or default_h), int(width or default_w)
        do_cfg = self._cfg(float(guidance_scale))
        with torch.no_grad():
            embeds, text_ids = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                                       num_images_per_prompt=num_images_per_prompt,
                                                       max_sequence_length=max_sequence_length,
                                                       text_encoder_out_layers=layers)
            tensors = {"prompt_embeds": embeds, "txt_ids": text_ids}
            if do_cfg:
                neg = negative_prompt if negative_prompt is not None else ""
                if isinstance(neg, str):
                    neg = [neg] * len(prompts)
                neg_embeds, neg_ids = self.pipe.encode_prompt(prompt=neg, device=self.device,
                                                              num_images_per_prompt=num_images_per_prompt,
                                                              max_sequence_length=max_sequence_length,
                                                              text_encoder_out_layers=layers)
                tensors.update(negative_prompt_embeds=neg_embeds, negative_txt_ids=neg_ids)
        lh, lw = self.latent_size(height, width)
        probe = torch.zeros(1, 1, lh // 2, lw // 2)
        shared = {"img_ids": self.pipe._prepare_latent_ids(probe).to(self.device)}  # [1, L, 4]
        return Conditioning(tensors, float(guidance_scale), do_cfg, height, width, shared)

    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        latents, _ = self.pipe.prepare_latents(batch_size, self.transformer.config.in_channels // 4, cond.height,
                                               cond.width, cond.tensors["prompt_embeds"].dtype, self.device, generator)
        return latents.float()

    def schedule(self, num_steps, cond, sigmas=None, mu=None):
        scheduler = self.scheduler_copy()
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if getattr(scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        if mu is None:
            lh, lw = self.latent_size(cond.height, cond.width)
            mu = flux2_module.compute_empirical_mu(image_seq_len=(lh // 2) * (lw // 2), num_steps=num_steps)
        flux2_module.retrieve_timesteps(scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        return self._finish_schedule(scheduler, self.device)

    def _guidance(self, n: int, cond: Conditioning, device) -> torch.Tensor | None:
        if not self.transformer.config.guidance_embeds:
            return None
        return torch.full([1], cond.guidance_scale, device=device, dtype=torch.float32).expand(n)

    def velocity(self, latents, timesteps, cond):
        transformer = self.transformer
        n = latents.shape[0]
        x = latents.to(transformer.dtype)
        t = timesteps.to(device=x.device, dtype=latents.dtype)
        img_ids = cond.shared["img_ids"].expand(n, -1, -1)
        guidance = self._guidance(n, cond, x.device)
        out = transformer(hidden_states=x, timestep=t / 1000, guidance=guidance,
                          encoder_hidden_states=cond.tensors["prompt_embeds"], txt_ids=cond.tensors["txt_ids"],
                          img_ids=img_ids, joint_attention_kwargs=None, return_dict=False)[0][:, :latents.size(1)]
        if cond.do_cfg:
            neg = transformer(hidden_states=x, timestep=t / 1000, guidance=guidance,
                              encoder_hidden_states=cond.tensors["negative_prompt_embeds"],
                              txt_ids=cond.tensors["negative_txt_ids"], img_ids=img_ids, joint_attention_kwargs=None,
                              return_dict=False)[0][:, :latents.size(1)]
            out = neg + cond.guidance_scale * (out - neg)
        return out.float()

    def vae_latents(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Tokens -> the de-normalised, un-patchified latent image ``[B, C, h, w]`` the VAE decodes."""
        pipe = self.pipe
        lh, lw = self.latent_size(cond.height, cond.width)
        ids = cond.shared["img_ids"].expand(latents.shape[0], -1, -1)
        z = pipe._unpack_latents_with_ids(latents, ids, lh // 2, lw // 2) if self._unpack_with_size else \
            pipe._unpack_latents_with_ids(latents, ids)
        bn_mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        bn_std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps).to(
            z.device, z.dtype)
        return pipe._unpatchify_latents(z * bn_std + bn_mean)

    _unpack_with_size = False

    def decode(self, latents, cond):
        with torch.no_grad():
            z = self.vae_latents(latents, cond)
            image = self.pipe.vae.decode(z, return_dict=False)[0]
            return self.pipe.image_processor.postprocess(image, output_type="pt").float()


class Flux2KleinAdapter(Flux2Adapter):
    family = "flux2_klein"
    pipeline_class_names = ("Flux2KleinPipeline",)
    _unpack_with_size = True

    def _cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1 and not self.pipe.config.is_distilled

    def _guidance(self, n, cond, device):
        return None  # klein has no guidance embedding (guidance=None in the pipeline)

    def latent_output(self, latents, cond):
        return self.vae_latents(latents, cond)
