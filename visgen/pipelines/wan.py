"""Adapter for the stock ``WanPipeline`` (Wan 2.1 / 2.2 text-to-video, Wan Team 2025), diffusers 0.42.

Latents are 5-D video latents ``[B, C, F', H', W']`` (``F' = (frames - 1) / 4 + 1``), the engine treats them like any
other latent. What the pipeline does, and so does this adapter:

- **Text**: UMT5 embeddings, each prompt trimmed to its tokens and zero-padded to ``max_sequence_length``; cast to
  the transformer dtype.
- **CFG** (``guidance_scale > 1``): two separate transformer calls per step, conditional first, then
  ``uncond + g (cond - uncond)``. Wan 2.2 A14B (``transformer_2`` + ``boundary_ratio``): rows whose timestep is
  ``>= boundary_ratio * num_train_timesteps`` use ``transformer`` with ``guidance_scale``, the others
  ``transformer_2`` with ``guidance_scale_2`` (default: ``guidance_scale``); a mixed batch is split by expert.
- **Wan 2.2 TI2V-5B** (``expand_timesteps``): the timestep is given per latent token (``[B, F' H'/2 W'/2]``).
- **Schedule**: the pipeline's scheduler is set with ``set_timesteps(num_inference_steps)`` (its ``shift`` /
  ``flow_shift``); hub checkpoints ship ``UniPCMultistepScheduler(use_flow_sigmas=True)``, whose sigma grid the
  Euler-type kernels integrate (like SANA's DPM-Solver grid), so the ODE then matches a WanPipeline whose scheduler is
  ``FlowMatchEulerDiscreteScheduler`` with the same shift, not the multistep solver.
- **Decode**: ``z * latents_std + latents_mean`` per channel, ``AutoencoderKLWan.decode``, ``postprocess_video``:
  ``[B, F, 3, H, W]`` in [0, 1]. With ``decode_frame_chunk = k`` (``visgen.memory.decode_frame_chunk``) the causal
  decoder runs latent frame by latent frame as the VAE does, carrying its causal cache, but each group of ``k``
  latent frames is clamped, post-processed and written into one preallocated output right away instead of being
  concatenated frame by frame (``torch.cat`` per frame copies the growing video ``F'`` times): equal to the full
  decode bit for bit (tested), with a lower peak (``grove bench visgen-video``).

Training adapts ``transformer`` (LoRA); with Wan 2.2 A14B the low-noise expert ``transformer_2`` stays frozen.
Under FSDP2 both experts are sharded, each on its own (``visgen.fsdp``), and every velocity call runs both (an
expert without rows on a weight-0 row), so the experts' collectives are paired across processes.
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Conditioning, FlowPipelineAdapter


class WanAdapter(FlowPipelineAdapter):
    family = "wan"
    pipeline_class_names = ("WanPipeline",)
    is_video = True
    decode_frame_chunk: int = 0  # 0: the VAE's own decode
    idle_expert_calls: int = 0  # FSDP2: expert forwards on a weight-0 row (``_velocity_both_experts``; tests)

    # ------------------------------------------------------------------------------------------------ sizes
    def _patch(self) -> tuple[int, int, int]:
        model = self.pipe.transformer if self.pipe.transformer is not None else self.pipe.transformer_2
        return tuple(model.config.patch_size)

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer if self.pipe.transformer is not None else self.pipe.transformer_2

    def default_size(self) -> tuple[int, int]:
        return int(self.call_default("height")), int(self.call_default("width"))

    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor_spatial) * int(self._patch()[-1])

    def num_frames(self, num_frames: int | None) -> int:
        """Frames as the pipeline rounds them (``4k + 1`` for the Wan VAE)."""
        n = int(self.call_default("num_frames") if num_frames is None else num_frames)
        t = self.pipe.vae_scale_factor_temporal
        if n % t != 1:
            n = n // t * t + 1
        return max(n, 1)

    # ------------------------------------------------------------------------------------------------ prompts
    def _encode(self, prompts, num_images_per_prompt=1, guidance_scale=None, negative_prompt=None,
                max_sequence_length=None, height=None, width=None, num_frames=None, guidance_scale_2=None,
                **kwargs: Any) -> Conditioning:
        if kwargs:
            raise TypeError(f"Wan adapter got unexpected options {sorted(kwargs)}")
        guidance_scale = self.call_default("guidance_scale") if guidance_scale is None else guidance_scale
        max_sequence_length = max_sequence_length or self.call_default("max_sequence_length")
        default_h, default_w = self.default_size()
        height, width = int(height or default_h), int(width or default_w)
        _, ph, pw = self._patch()
        mh, mw = self.pipe.vae_scale_factor_spatial * ph, self.pipe.vae_scale_factor_spatial * pw
        height, width = height // mh * mh, width // mw * mw  # the pipeline's patchification rounding
        boundary = self.pipe.config.boundary_ratio
        if boundary is None and guidance_scale_2 is not None:
            raise ValueError("guidance_scale_2 is only for Wan 2.2 pipelines with a boundary_ratio (two experts)")
        if boundary is not None and guidance_scale_2 is None:
            guidance_scale_2 = guidance_scale
        do_cfg = guidance_scale > 1.0  # the pipeline's do_classifier_free_guidance
        with torch.no_grad():
            embeds, negative = self.pipe.encode_prompt(
                prompt=prompts, negative_prompt=negative_prompt, do_classifier_free_guidance=do_cfg,
                num_videos_per_prompt=num_images_per_prompt, max_sequence_length=max_sequence_length,
                device=self.device)
        dtype = self.transformer.dtype
        tensors = {"prompt_embeds": embeds.to(dtype)}
        if do_cfg:
            tensors["negative_prompt_embeds"] = negative.to(dtype)
        options = {"num_frames": self.num_frames(num_frames),
                   "guidance_scale_2": None if guidance_scale_2 is None else float(guidance_scale_2)}
        return Conditioning(tensors, float(guidance_scale), do_cfg, height, width, options=options)

    # ------------------------------------------------------------------------------------------------ sampling
    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        return self.pipe.prepare_latents(batch_size, self.transformer.config.in_channels, cond.height, cond.width,
                                         cond.options["num_frames"], torch.float32, self.device, generator)

    def schedule(self, num_steps, cond, sigmas=None, mu=None):
        scheduler = self.scheduler_copy()
        kwargs: dict[str, Any] = {}
        if sigmas is not None:
            kwargs["sigmas"] = sigmas
        if mu is not None:
            kwargs["mu"] = mu
        if kwargs:
            scheduler.set_timesteps(None if sigmas is not None else num_steps, device=self.device, **kwargs)
        else:
            scheduler.set_timesteps(num_steps, device=self.device)  # exactly what WanPipeline does
        return self._finish_schedule(scheduler, self.device)

    def _boundary_timestep(self) -> float | None:
        ratio = self.pipe.config.boundary_ratio
        return None if ratio is None else ratio * self.pipe.scheduler.config.num_train_timesteps

    def _model_timestep(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if not self.pipe.config.expand_timesteps:
            return t
        # Wan 2.2 TI2V: one timestep per latent token, as the pipeline builds it from its all-ones mask
        ones = torch.ones(latents.shape[2:], dtype=torch.float32, device=latents.device)[:, ::2, ::2]
        return torch.stack([(ones * ti).flatten() for ti in t])

    def _guided(self, model, latents, t, cond, guidance) -> torch.Tensor:
        x = latents.to(model.dtype)
        timestep = self._model_timestep(latents, t)
        out = model(hidden_states=x, timestep=timestep, encoder_hidden_states=cond.tensors["prompt_embeds"],
                    return_dict=False)[0]
        if cond.do_cfg:
            uncond = model(hidden_states=x, timestep=timestep,
                           encoder_hidden_states=cond.tensors["negative_prompt_embeds"], return_dict=False)[0]
            out = uncond + guidance * (out - uncond)
        return out

    def velocity(self, latents, timesteps, cond):
        t = timesteps.to(latents.device)
        boundary = self._boundary_timestep()
        if boundary is None:
            return self._guided(self.pipe.transformer, latents, t, cond, cond.guidance_scale).float()
        high = t >= boundary
        if self._experts_paired():
            return self._velocity_both_experts(latents, t, cond, high)
        if bool(high.all()) or bool((~high).all()):
            if bool(high.all()):
                model, g = self.pipe.transformer, cond.guidance_scale
            else:
                model, g = self.pipe.transformer_2, cond.options["guidance_scale_2"]
            return self._guided(model, latents, t, cond, g).float()
        out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
        for mask, model, g in ((high, self.pipe.transformer, cond.guidance_scale),
                               (~high, self.pipe.transformer_2, cond.options["guidance_scale_2"])):
            rows = torch.nonzero(mask).flatten()
            out[rows] = self._guided(model, latents[rows], t[rows], cond[rows], g).float()
        return out

    def _experts_paired(self) -> bool:
        """FSDP2 with the experts sharded (``visgen.fsdp``), outside ``FSDPShards.gathered()``: each expert's forward
        is a collective (all-gather, and reduce-scatter in backward for the trained one), so every process must run
        each expert equally often, whichever rows it holds."""
        from shared_rl.distributed import is_dtensor, shards_gathered

        two = self.pipe.transformer_2
        return not shards_gathered() and is_dtensor(next(two.parameters(), None))

    def _velocity_both_experts(self, latents, t, cond, high) -> torch.Tensor:
        """The velocity with both experts run once per call (per CFG branch): an expert none of this call's rows go
        to runs on the first row, its output weighted 0 (the value is unchanged bit for bit, its gradient is
        exactly zero, and its backward still runs, so the trained expert's reduce-scatter is paired too)."""
        out = torch.zeros(latents.shape, dtype=torch.float32, device=latents.device)
        for mask, model, g in ((high, self.pipe.transformer, cond.guidance_scale),
                               (~high, self.pipe.transformer_2, cond.options["guidance_scale_2"])):
            rows = torch.nonzero(mask).flatten()
            if len(rows):
                out[rows] = self._guided(model, latents[rows], t[rows], cond[rows], g).float()
            else:
                idle = self._guided(model, latents[:1], t[:1], cond[:1], g).float()
                out = out + 0.0 * idle.sum()
                self.idle_expert_calls += 1
        return out

    # ------------------------------------------------------------------------------------------------ decoding
    def _vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return z / inv_std + mean  # the pipeline's exact operations

    def decode(self, latents, cond):
        with torch.no_grad():
            z = self._vae_latents(latents)
            chunk = int(self.decode_frame_chunk or 0)
            if chunk > 0 and self._can_chunk():
                return self._decode_chunked(z, chunk)
            video = self.pipe.vae.decode(z, return_dict=False)[0]
            return self.pipe.video_processor.postprocess_video(video, output_type="pt").float()

    def _can_chunk(self) -> bool:
        vae = self.pipe.vae
        return type(vae).__name__ == "AutoencoderKLWan" and not getattr(vae, "use_tiling", False) and all(
            hasattr(vae, a) for a in ("clear_cache", "_feat_map", "post_quant_conv", "decoder"))

    def _decode_chunked(self, z: torch.Tensor, chunk: int) -> torch.Tensor:
        """``AutoencoderKLWan._decode`` latent frame by latent frame with its causal cache, post-processing each
        ``chunk`` of latent frames into a preallocated ``[B, F, 3, H, W]`` output (VAE slicing still applies)."""
        vae = self.pipe.vae
        if getattr(vae, "use_slicing", False) and z.shape[0] > 1:
            return torch.cat([self._decode_chunked(z[i:i + 1], chunk) for i in range(z.shape[0])])
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        processor = self.pipe.video_processor
        vae.clear_cache()
        x = vae.post_quant_conv(z)
        out = None
        pos = 0
        pending = []
        num = x.shape[2]
        for i in range(num):
            vae._conv_idx = [0]
            frame = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                first_chunk=(i == 0))
            pending.append(frame)
            if len(pending) == chunk or i == num - 1:
                block = pending[0] if len(pending) == 1 else torch.cat(pending, 2)
                pending = []
                if vae.config.patch_size is not None:
                    block = unpatchify(block, patch_size=vae.config.patch_size)
                block = torch.clamp(block, min=-1.0, max=1.0)
                frames = processor.postprocess_video(block, output_type="pt").float()  # [B, f, 3, H, W]
                if out is None:
                    total = 1 + (num - 1) * self.pipe.vae_scale_factor_temporal
                    out = torch.empty((frames.shape[0], total, *frames.shape[2:]), dtype=torch.float32,
                                      device=frames.device)
                out[:, pos:pos + frames.shape[1]] = frames
                pos += frames.shape[1]
                del block, frames
        vae.clear_cache()
        return out[:, :pos]
