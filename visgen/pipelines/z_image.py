"""Adapter for the stock ``ZImagePipeline`` (Z-Image, Tongyi-MAI / Alibaba 2025), diffusers 0.42.

What is particular to Z-Image, and reproduced:

- **Text**: Qwen3 hidden states (second-to-last layer) of the chat-templated prompt, each prompt cut to its own
  tokens (the transformer takes *lists* of variable-length embeddings); stored here zero-padded with a mask and cut
  back per row before the call.
- **Model convention**: the transformer takes the *reversed* time ``(1000 - t) / 1000`` and predicts the negated
  velocity; latents go in as a list of ``[C, 1, h, w]`` items; sigmas ``linspace(1, 1/T, T)`` with the
  resolution-dependent ``mu``.
- **CFG** (``guidance_scale > 0``: Z-Image's convention, ``pred = pos + g (pos - neg)``): conditional and
  unconditional items in one transformer call, ``cfg_normalization`` (cap the guided norm at that multiple of the
  conditional one) and ``cfg_truncation`` (no guidance on steps whose normalised time exceeds it) per row.
- **Decode**: ``z / scaling_factor + shift_factor``, ``AutoencoderKL``.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.z_image import pipeline_z_image as z_module

from .base import Conditioning, FlowPipelineAdapter
from .qwen_image import cat_variable_rows, split_variable_rows


def _pad(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(int(e.shape[0]) for e in items)
    embeds = torch.stack([torch.cat([e, e.new_zeros(longest - e.shape[0], *e.shape[1:])]) for e in items])
    mask = torch.stack([torch.arange(longest, device=embeds.device) < e.shape[0] for e in items]).long()
    return embeds, mask


class ZImageAdapter(FlowPipelineAdapter):
    family = "z_image"
    pipeline_class_names = ("ZImagePipeline",)

    def default_size(self) -> tuple[int, int]:
        return 1024, 1024  # ZImagePipeline's default

    def size_multiple(self) -> int:
        return 2 * int(self.pipe.vae_scale_factor)

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor
        return 2 * (int(height) // (f * 2)), 2 * (int(width) // (f * 2))

    def forwards_per_step(self, cond: Conditioning) -> int:
        return 2 if cond.do_cfg else 1

    def _encode(self, prompts, num_images_per_prompt=1, guidance_scale=None, negative_prompt=None,
                max_sequence_length=None, height=None, width=None, cfg_normalization=False, cfg_truncation=1.0,
                **kwargs: Any) -> Conditioning:
        if kwargs:
            raise TypeError(f"Z-Image adapter got unexpected options {sorted(kwargs)}")
        guidance_scale = self.call_default("guidance_scale") if guidance_scale is None else guidance_scale
        max_sequence_length = max_sequence_length or self.call_default("max_sequence_length")
        default_h, default_w = self.default_size()
        height, width = int(height or default_h), int(width or default_w)
        do_cfg = guidance_scale > 0  # the pipeline's do_classifier_free_guidance
        if isinstance(negative_prompt, (list, tuple)):
            negative_prompt = list(negative_prompt)  # the pipeline templates the lists it gets in place
        with torch.no_grad():
            pos, neg = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                               do_classifier_free_guidance=do_cfg, negative_prompt=negative_prompt,
                                               max_sequence_length=max_sequence_length)
        embeds, mask = _pad(pos)
        tensors = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if do_cfg:
            tensors["negative_prompt_embeds"], tensors["negative_prompt_embeds_mask"] = _pad(neg)
        cond = Conditioning(tensors, float(guidance_scale), do_cfg, height, width,
                            options={"cfg_normalization": float(cfg_normalization or 0.0),
                                     "cfg_truncation": None if cfg_truncation is None else float(cfg_truncation)})
        if num_images_per_prompt > 1:
            cond = cond[torch.arange(len(prompts)).repeat_interleave(num_images_per_prompt)]
        return cond

    def _split_rows(self, cond):
        return split_variable_rows(cond)

    def _cat_rows(self, rows):
        return cat_variable_rows(rows)

    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        return self.pipe.prepare_latents(batch_size, self.transformer.in_channels, cond.height, cond.width,
                                         torch.float32, self.device, generator)

    def schedule(self, num_steps, cond, sigmas=None, mu=None):
        scheduler = self.scheduler_copy()
        if mu is None:
            lh, lw = self.latent_size(cond.height, cond.width)
            mu = z_module.calculate_shift(
                (lh // 2) * (lw // 2), scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096), scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.15))
        if sigmas is None:
            sigmas = z_module.get_default_z_image_sigmas(num_steps)
        z_module.retrieve_timesteps(scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        return self._finish_schedule(scheduler, self.device)

    @staticmethod
    def _items(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        return [e[m.bool()] for e, m in zip(embeds, mask)]

    def _guidance(self, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Per row: the guidance scale of the pipeline at timestep ``t`` (0 where cfg_truncation switches it off)."""
        g = torch.full((t.shape[0],), cond.guidance_scale)
        trunc = cond.options.get("cfg_truncation")
        if trunc is not None and trunc <= 1:
            norms = ((1000 - t.float()) / 1000).tolist()
            for i, value in enumerate(norms):
                if value > trunc:
                    g[i] = 0.0
        return g

    def _run(self, latents, t, cond, scale: float) -> torch.Tensor:
        transformer = self.transformer
        n = latents.shape[0]
        timestep = (1000 - t) / 1000
        pos = self._items(cond.tensors["prompt_embeds"], cond.tensors["prompt_embeds_mask"])
        x = latents.to(transformer.dtype)
        apply_cfg = cond.do_cfg and scale > 0
        if apply_cfg:
            neg = self._items(cond.tensors["negative_prompt_embeds"], cond.tensors["negative_prompt_embeds_mask"])
            x, embeds, timestep = x.repeat(2, 1, 1, 1), pos + neg, timestep.repeat(2)
        else:
            embeds = pos
        items = list(x.unsqueeze(2).unbind(dim=0))
        out = transformer(items, timestep, embeds, joint_attention_kwargs=None, return_dict=False)[0]
        if apply_cfg:
            preds = []
            norm_cap = cond.options.get("cfg_normalization", 0.0)
            for j in range(n):
                p, q = out[j].float(), out[n + j].float()
                pred = p + scale * (p - q)
                if norm_cap and norm_cap > 0.0:
                    ori, new = torch.linalg.vector_norm(p), torch.linalg.vector_norm(pred)
                    cap = ori * norm_cap
                    if new > cap:
                        pred = pred * (cap / new)
                preds.append(pred)
            noise = torch.stack(preds, dim=0)
        else:
            noise = torch.stack([o.float() for o in out], dim=0)
        return -noise.squeeze(2)

    def velocity(self, latents, timesteps, cond):
        t = timesteps.to(latents.device)
        scales = self._guidance(t, cond)
        if bool((scales == scales[0]).all()):
            return self._run(latents, t, cond, float(scales[0])).float()
        out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
        for value in torch.unique(scales).tolist():
            rows = torch.nonzero(scales == value).flatten()
            out[rows.to(latents.device)] = self._run(latents[rows], t[rows], cond[rows], value).float()
        return out

    def decode(self, latents, cond):
        vae = self.pipe.vae
        with torch.no_grad():
            z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
            image = vae.decode(z, return_dict=False)[0]
            return self.pipe.image_processor.postprocess(image, output_type="pt").float()
