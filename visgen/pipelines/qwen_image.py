"""Adapter for the stock ``QwenImagePipeline`` (Qwen-Image, Qwen Team 2025, "Qwen-Image Technical Report"),
diffusers 0.42.

- **Text**: Qwen2.5-VL hidden states of the prompt in the pipeline's chat template, its fixed prefix dropped; each
  prompt keeps only its own tokens and the batch is zero-padded to its longest prompt with a mask (``None`` when no
  row is padded, as the pipeline passes it). The embedding cache stores each prompt's rows unpadded and re-pads a
  batch exactly like the pipeline.
- **Latents**: 2x2-packed tokens ``[B, (h/2)(w/2), 4C]`` of a one-frame video latent; model timestep ``t / 1000``;
  sigmas ``linspace(1, 1/T, T)`` with the resolution-dependent ``mu`` (dynamic shifting).
- **Guidance**: "true CFG" with a negative prompt (``true_cfg_scale > 1`` and ``negative_prompt`` given; two
  forwards), combined as ``neg + s (cond - neg)`` and rescaled per token to the conditional prediction's norm, as
  the pipeline does; the guidance embedding when the transformer is guidance-distilled (``guidance_scale``).
- **Decode**: unpack to ``[B, C, 1, H, W]``, ``z * latents_std + latents_mean``, ``AutoencoderKLQwenImage``, first
  frame.

Deliberate difference: diffusers 0.42's ``encode_prompt`` repeats the text mask tiled but the embeddings per prompt
for ``num_images_per_prompt > 1``, so with prompts of different lengths its rows get another prompt's mask; the
adapter encodes each prompt once and repeats both per prompt (parity is tested with one image per prompt, and with
equal-length prompts for several).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage as qwen_module

from .base import Conditioning, FlowPipelineAdapter

# (embeddings, mask) pairs of variable length: trimmed per prompt in the cache, re-padded per batch
VARIABLE = (("prompt_embeds", "prompt_embeds_mask"), ("negative_prompt_embeds", "negative_prompt_embeds_mask"))


def split_variable_rows(cond: Conditioning, pairs=VARIABLE) -> list[Conditioning]:
    """Rows of ``cond`` with each (embeds, mask) pair cut to the row's own valid length."""
    rows = []
    for i in range(len(cond)):
        row = cond[i:i + 1]
        for emb, mask in pairs:
            if emb in row.tensors:
                n = int(row.tensors[mask].sum())
                row.tensors[emb] = row.tensors[emb][:, :n]
                row.tensors[mask] = row.tensors[mask][:, :n]
        rows.append(row)
    return rows


def cat_variable_rows(rows: list[Conditioning], pairs=VARIABLE) -> Conditioning:
    """The inverse of :func:`split_variable_rows`: zero-pad every pair to the longest row, like the pipeline."""
    padded = []
    for row in rows:
        tensors = dict(row.tensors)
        for emb, mask in pairs:
            if emb in tensors:
                longest = max(r.tensors[emb].shape[1] for r in rows)
                e, m = tensors[emb], tensors[mask]
                extra = longest - e.shape[1]
                if extra:
                    tensors[emb] = torch.cat([e, e.new_zeros(e.shape[0], extra, *e.shape[2:])], 1)
                    tensors[mask] = torch.cat([m, m.new_zeros(m.shape[0], extra)], 1)
        padded.append(Conditioning(tensors, row.guidance_scale, row.do_cfg, row.height, row.width, row.shared,
                                   row.options))
    return Conditioning.cat(padded)


class QwenImageAdapter(FlowPipelineAdapter):
    family = "qwen_image"
    pipeline_class_names = ("QwenImagePipeline",)

    def size_multiple(self) -> int:
        return 2 * int(self.pipe.vae_scale_factor)  # 2x2 packing of the latent

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor
        return 2 * (int(height) // (f * 2)), 2 * (int(width) // (f * 2))

    def _encode(self, prompts, num_images_per_prompt=1, guidance_scale=None, negative_prompt=None,
                max_sequence_length=None, height=None, width=None, true_cfg_scale=None, **kwargs: Any) -> Conditioning:
        if kwargs:
            raise TypeError(f"Qwen-Image adapter got unexpected options {sorted(kwargs)}")
        max_sequence_length = max_sequence_length or self.call_default("max_sequence_length")
        true_cfg_scale = self.call_default("true_cfg_scale") if true_cfg_scale is None else true_cfg_scale
        default_h, default_w = self.default_size()
        height, width = int(height or default_h), int(width or default_w)
        do_true_cfg = true_cfg_scale > 1 and negative_prompt is not None
        if self.transformer.config.guidance_embeds and guidance_scale is None:
            raise ValueError("this Qwen-Image transformer is guidance-distilled: give guidance_scale")
        # encoded once per prompt and repeated here: diffusers 0.42's encode_prompt repeats the *mask* tiled
        # ([p0, p1, p0, p1]) but the embeddings per prompt ([p0, p0, p1, p1]) when num_images_per_prompt > 1, which
        # gives rows the wrong prompt's mask when prompt lengths differ
        with torch.no_grad():
            embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device, num_images_per_prompt=1,
                                                   max_sequence_length=max_sequence_length)
            tensors = {"prompt_embeds": embeds, "prompt_embeds_mask": self._mask(embeds, mask)}
            if do_true_cfg:
                if isinstance(negative_prompt, str):
                    negative_prompt = [negative_prompt] * len(prompts)
                neg, neg_mask = self.pipe.encode_prompt(prompt=negative_prompt, device=self.device,
                                                        num_images_per_prompt=1,
                                                        max_sequence_length=max_sequence_length)
                tensors["negative_prompt_embeds"] = neg
                tensors["negative_prompt_embeds_mask"] = self._mask(neg, neg_mask)
        g = 1.0 if guidance_scale is None else float(guidance_scale)
        cond = Conditioning(tensors, g, do_true_cfg, height, width, options={"true_cfg_scale": float(true_cfg_scale)})
        if num_images_per_prompt > 1:
            cond = cond[torch.arange(len(prompts)).repeat_interleave(num_images_per_prompt)]
        return cond

    @staticmethod
    def _mask(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:  # the pipeline drops an all-ones mask; keep it explicit per row
            return torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return mask

    def _split_rows(self, cond):
        return split_variable_rows(cond)

    def _cat_rows(self, rows):
        return cat_variable_rows(rows)

    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        dtype = cond.tensors["prompt_embeds"].dtype
        latents = self.pipe.prepare_latents(batch_size, self.transformer.config.in_channels // 4, cond.height,
                                            cond.width, dtype, self.device, generator)
        return latents.float()

    def schedule(self, num_steps, cond, sigmas=None, mu=None):
        scheduler = self.scheduler_copy()
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if mu is None:
            lh, lw = self.latent_size(cond.height, cond.width)
            mu = qwen_module.calculate_shift(
                (lh // 2) * (lw // 2),
                scheduler.config.get("base_image_seq_len", 256), scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5), scheduler.config.get("max_shift", 1.15))
        qwen_module.retrieve_timesteps(scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        return self._finish_schedule(scheduler, self.device)

    def _forward(self, x, t, embeds, mask, cond, guidance):
        f = self.pipe.vae_scale_factor
        img_shapes = [[(1, cond.height // f // 2, cond.width // f // 2)]] * x.shape[0]
        return self.transformer(hidden_states=x, timestep=t / 1000, guidance=guidance,
                                encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                                encoder_hidden_states=embeds, img_shapes=img_shapes, attention_kwargs={},
                                return_dict=False)[0]

    def velocity(self, latents, timesteps, cond):
        x = latents.to(self.transformer.dtype)
        t = timesteps.to(device=x.device, dtype=x.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([x.shape[0]], cond.guidance_scale, device=x.device, dtype=torch.float32)
        out = self._forward(x, t, cond.tensors["prompt_embeds"], cond.tensors["prompt_embeds_mask"], cond, guidance)
        if cond.do_cfg:
            neg = self._forward(x, t, cond.tensors["negative_prompt_embeds"],
                                cond.tensors["negative_prompt_embeds_mask"], cond, guidance)
            comb = neg + cond.options["true_cfg_scale"] * (out - neg)
            cond_norm = torch.norm(out, dim=-1, keepdim=True)
            noise_norm = torch.norm(comb, dim=-1, keepdim=True)
            out = comb * (cond_norm / noise_norm)
        return out.float()

    def forwards_per_step(self, cond: Conditioning) -> int:
        return 2 if cond.do_cfg else 1

    def decode(self, latents, cond):
        vae = self.pipe.vae
        with torch.no_grad():
            z = self.pipe._unpack_latents(latents, cond.height, cond.width, self.pipe.vae_scale_factor).to(vae.dtype)
            mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
            inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device,
                                                                                                       z.dtype)
            z = z / inv_std + mean
            image = vae.decode(z, return_dict=False)[0][:, :, 0]
            return self.pipe.image_processor.postprocess(image, output_type="pt").float()
