"""Adapter for the stock ``HunyuanVideo15Pipeline`` (HunyuanVideo 1.5 text-to-video, Tencent Hunyuan 2025),
diffusers 0.42.

- **Text**: two encoders — Qwen2.5-VL hidden states (the layer ``num_hidden_layers_to_skip + 1`` from the end) of
  the chat-templated prompt with its system-message prefix cropped, and ByT5 embeddings of quoted glyph text (zeros
  when the prompt quotes none); both with masks, padded to fixed lengths, cast to the transformer dtype.
- **Latents**: 5-D ``[B, C, F', H', W']`` in the transformer dtype; the model input is ``[latents, zero condition
  latents, zero mask]`` along channels (text-to-video) plus zero image embeddings; model timestep ``t``; sigmas
  ``linspace(1, 0, T + 1)[:-1]`` shifted by the scheduler's ``shift``.
- **Guidance** through the pipeline's ``guider`` component (``ClassifierFreeGuidance``: scale, rescale, original
  formulation, start/stop window): conditional and unconditional transformer calls, combined by the guider itself;
  the step index the guider's window needs comes from the schedule (``schedule`` records the grid on the
  conditioning). ``guidance_scale`` overrides the guider's scale (a copy; the pipeline's guider is untouched).
- **Decode**: ``z / scaling_factor``, ``AutoencoderKLHunyuanVideo15``, ``postprocess_video``: ``[B, F, 3, H, W]``,
  one video per VAE call (the 0.42 VAE fails on batches > 1).

Known diffusers 0.42 limits this adapter does not share: the stock pipeline fails for ``num_videos_per_prompt > 1``
(its zero image embeddings have one row per prompt) and decoding batches > 1; the adapter builds per-row image
embeddings and decodes per video, so RL groups of any size work.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.hunyuan_video1_5 import pipeline_hunyuan_video1_5 as hy_module

from .base import Conditioning, FlowPipelineAdapter

TEXT_KEYS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")


class HunyuanVideo15Adapter(FlowPipelineAdapter):
    family = "hunyuan_video15"
    pipeline_class_names = ("HunyuanVideo15Pipeline",)
    is_video = True

    def default_size(self) -> tuple[int, int]:
        p = self.pipe
        h, w = p.video_processor.calculate_default_height_width(p.default_aspect_ratio[1], p.default_aspect_ratio[0],
                                                                 p.target_size)
        return int(h), int(w)

    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor_spatial) * int(self.transformer.config.patch_size)

    def _guider(self, guidance_scale: float | None):
        guider = self.pipe.guider
        if guidance_scale is not None and guidance_scale != guider.guidance_scale:
            guider = copy.deepcopy(guider)
            guider.guidance_scale = float(guidance_scale)
        return guider

    @staticmethod
    def _cfg_possible(guider) -> bool:
        if not guider._enabled:
            return False
        target = 0.0 if guider.use_original_formulation else 1.0
        return not math.isclose(guider.guidance_scale, target)

    def _encode(self, prompts, num_images_per_prompt=1, guidance_scale=None, negative_prompt=None,
                max_sequence_length=None, height=None, width=None, num_frames=None, **kwargs: Any) -> Conditioning:
        if kwargs:
            raise TypeError(f"HunyuanVideo 1.5 adapter got unexpected options {sorted(kwargs)}")
        if max_sequence_length is not None:
            raise TypeError("HunyuanVideo 1.5 pads its prompts to pipe.tokenizer_max_length; max_sequence_length "
                            "does not apply")
        guider = self._guider(guidance_scale)
        default_h, default_w = self.default_size()
        height, width = int(height or default_h), int(width or default_w)
        num_frames = int(self.call_default("num_frames") if num_frames is None else num_frames)
        dtype = self.transformer.dtype
        do_cfg = self._cfg_possible(guider)
        with torch.no_grad():
            pos = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, dtype=dtype,
                                          batch_size=len(prompts), num_videos_per_prompt=num_images_per_prompt)
            tensors = dict(zip(TEXT_KEYS, pos))
            if do_cfg:
                neg_prompt = list(negative_prompt) if isinstance(negative_prompt, (list, tuple)) else negative_prompt
                neg = self.pipe.encode_prompt(prompt=neg_prompt, device=self.device, dtype=dtype,
                                              batch_size=len(prompts), num_videos_per_prompt=num_images_per_prompt)
                tensors.update({f"negative_{k}": v for k, v in zip(TEXT_KEYS, neg)})
        return Conditioning(tensors, float(guider.guidance_scale), do_cfg, height, width,
                            options={"num_frames": num_frames, "guider": guider})

    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        latents = self.pipe.prepare_latents(batch_size, self.pipe.num_channels_latents, cond.height, cond.width,
                                            cond.options["num_frames"], self.transformer.dtype, self.device, generator)
        return latents.float()

    def schedule(self, num_steps, cond, sigmas=None, mu=None):
        scheduler = self.scheduler_copy()
        if sigmas is None:
            sigmas = np.linspace(1.0, 0.0, num_steps + 1)[:-1]
        kwargs = {} if mu is None else {"mu": mu}
        hy_module.retrieve_timesteps(scheduler, num_steps, self.device, sigmas=sigmas, **kwargs)
        sig, ts = self._finish_schedule(scheduler, self.device)
        cond.options["timesteps"] = ts.detach().cpu().tolist()  # the guider's step window needs the step index
        return sig, ts

    def _step_index(self, t: float, cond: Conditioning) -> tuple[int, int]:
        grid = cond.options.get("timesteps")
        if not grid:
            return 0, 1
        i = min(range(len(grid)), key=lambda k: abs(grid[k] - t))
        return i, len(grid)

    def forwards_per_step(self, cond: Conditioning) -> int:
        return 2 if cond.do_cfg else 1

    def _call(self, x, t, cond: Conditioning, prefix: str) -> torch.Tensor:
        transformer = self.transformer
        n = x.shape[0]
        zeros = torch.zeros_like(x)
        model_in = torch.cat([x, zeros, zeros[:, :1]], dim=1)
        image_embeds = torch.zeros(n, self.pipe.vision_num_semantic_tokens, self.pipe.vision_states_dim,
                                   dtype=transformer.dtype, device=x.device)
        return transformer(hidden_states=model_in, image_embeds=image_embeds, timestep=t.to(model_in.dtype),
                           attention_kwargs=None, return_dict=False,
                           encoder_hidden_states=cond.tensors[f"{prefix}prompt_embeds"],
                           encoder_attention_mask=cond.tensors[f"{prefix}prompt_embeds_mask"],
                           encoder_hidden_states_2=cond.tensors[f"{prefix}prompt_embeds_2"],
                           encoder_attention_mask_2=cond.tensors[f"{prefix}prompt_embeds_mask_2"])[0]

    def _guided(self, x, t, cond, step: int, total: int) -> torch.Tensor:
        guider = cond.options["guider"]
        guider.set_state(step=step, num_inference_steps=total, timestep=t[0])
        pred_cond = self._call(x, t, cond, "")
        if cond.do_cfg and guider.num_conditions > 1:
            pred_uncond = self._call(x, t, cond, "negative_")
            return guider.forward(pred_cond, pred_uncond).pred
        return guider.forward(pred_cond, None).pred

    def velocity(self, latents, timesteps, cond):
        x = latents.to(self.transformer.dtype)
        t = timesteps.to(latents.device)
        steps = [self._step_index(float(v), cond) for v in t.tolist()]
        if len(set(steps)) == 1:
            return self._guided(x, t, cond, *steps[0]).float()
        out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
        for key in sorted(set(steps)):
            rows = torch.tensor([i for i, s in enumerate(steps) if s == key], device=latents.device)
            out[rows] = self._guided(x[rows], t[rows], cond[rows], *key).float()
        return out

    def decode(self, latents, cond):
        vae = self.pipe.vae
        with torch.no_grad():
            z = latents.to(vae.dtype) / vae.config.scaling_factor
            # one sample per call: diffusers 0.42's AutoencoderKLHunyuanVideo15 mid-block attention mask breaks
            # on batches > 1 (the stock pipeline cannot decode two videos either)
            videos = [vae.decode(z[i:i + 1], return_dict=False)[0] for i in range(z.shape[0])]
            return torch.cat([self.pipe.video_processor.postprocess_video(v, output_type="pt").float()
                              for v in videos])
