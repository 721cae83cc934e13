"""Adapter for the stock ``LTX2Pipeline`` (LTX-2, Lightricks 2025: a joint audio-video DiT), diffusers 0.42.

LTX-2 denoises a video and its soundtrack *together*: two token streams (packed video latents ``[B, Nv, Cv]``, packed
audio-mel latents ``[B, Na, Ca]``) through one transformer with cross-modal attention, on two schedulers with the
same sigma grid. The adapter's latent is both streams flattened and concatenated, ``[B, Nv*Cv + Na*Ca]``: the flow
kernels act per element, so one Euler/SDE step on it is exactly the two schedulers' steps (the log-prob is the
mean over the elements of both). What the pipeline does, reproduced:

- **Text**: Gemma-3 hidden states of every layer (left-padded to ``max_sequence_length``) through the pipeline's
  ``connectors`` (video and audio text streams), run on the ``[negative; positive]`` batch when guiding, as the
  pipeline does.
- **Schedule**: ``linspace(1, 1/T, T)`` shifted by ``mu`` of the video token count (base 1024 / max 4096,
  shifts 0.95 / 2.05); model timestep ``t`` (also given as ``sigma``).
- **Guidance in x0 space**, per modality: the velocity is turned into ``x0 = x - sigma v``; CFG adds
  ``(g - 1)(x0_cond - x0_uncond)`` (one batched call ``[uncond; cond]``), spatio-temporal guidance (STG) adds
  ``stg (x0_cond - x0_perturbed)`` from a call with the ``spatio_temporal_guidance_blocks`` perturbed, modality
  isolation adds ``(m - 1)(x0_cond - x0_isolated)``; then ``guidance_rescale``, and back to a velocity
  ``(x - x0) / sigma``. All four knobs have separate audio values (default: the video ones).
- **Decode**: the video stream is unpacked, de-normalised and decoded by ``AutoencoderKLLTX2Video`` (``[B, F, 3, H,
  W]``); :meth:`decode_audio` decodes the audio stream to a waveform (audio VAE + vocoder).

Deliberate differences: prompts are encoded once and their rows repeated per sample (diffusers 0.42 repeats the
Gemma attention *mask* tiled but the embeddings per prompt for ``num_videos_per_prompt > 1``); prompt enhancement,
the duration head, image/keyframe conditioning and decode-time noise (``decode_timestep > 0``) are not reproduced.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers.pipelines.ltx2 import pipeline_ltx2 as ltx_module

from .base import Conditioning, FlowPipelineAdapter

TEXT = ("video_embeds", "audio_embeds", "text_mask")


class LTX2Adapter(FlowPipelineAdapter):
    family = "ltx2"
    pipeline_class_names = ("LTX2Pipeline",)
    is_video = True

    def default_size(self) -> tuple[int, int]:
        return int(self.call_default("height")), int(self.call_default("width"))

    def size_multiple(self) -> int:
        return int(self.pipe.vae_spatial_compression_ratio) * int(self.pipe.transformer_spatial_patch_size)

    def text_modules(self) -> list[torch.nn.Module]:
        return [m for m in (self.pipe.text_encoder, self.pipe.connectors) if isinstance(m, torch.nn.Module)]

    # ------------------------------------------------------------------------------------------------ prompts
    def _encode(self, prompts, num_images_per_prompt=1, guidance_scale=None, negative_prompt=None,
                max_sequence_length=None, height=None, width=None, num_frames=None, frame_rate=None,
                motion_speed=None, stg_scale=None, modality_scale=None, guidance_rescale=None,
                audio_guidance_scale=None, audio_stg_scale=None, audio_modality_scale=None,
                audio_guidance_rescale=None, spatio_temporal_guidance_blocks="default", use_cross_timestep=None,
                **kwargs: Any) -> Conditioning:
        if kwargs:
            raise TypeError(f"LTX-2 adapter got unexpected options {sorted(kwargs)}")
        d = self.call_default
        g = d("guidance_scale") if guidance_scale is None else guidance_scale
        stg = d("stg_scale") if stg_scale is None else stg_scale
        mod = d("modality_scale") if modality_scale is None else modality_scale
        rescale = d("guidance_rescale") if guidance_rescale is None else guidance_rescale
        # the pipeline's `x or video_value` fall-backs (0 / None mean "the video value")
        a_g = (d("audio_guidance_scale") if audio_guidance_scale is None else audio_guidance_scale) or g
        a_stg = (d("audio_stg_scale") if audio_stg_scale is None else audio_stg_scale) or stg
        a_mod = (d("audio_modality_scale") if audio_modality_scale is None else audio_modality_scale) or mod
        a_rescale = (d("audio_guidance_rescale") if audio_guidance_rescale is None
                     else audio_guidance_rescale) or rescale
        blocks = d("spatio_temporal_guidance_blocks") if spatio_temporal_guidance_blocks == "default" \
            else spatio_temporal_guidance_blocks
        do_cfg = g > 1.0 or a_g > 1.0
        do_stg = stg > 0.0 or a_stg > 0.0
        do_mod = mod > 1.0 or a_mod > 1.0
        if do_stg and not blocks:
            raise ValueError("LTX-2 spatio-temporal guidance (stg_scale > 0) needs spatio_temporal_guidance_blocks")
        max_sequence_length = max_sequence_length or d("max_sequence_length")
        default_h, default_w = self.default_size()
        height, width = int(height or default_h), int(width or default_w)
        frames = int(num_frames or 121)
        frame_rate = float(d("frame_rate") if frame_rate is None else frame_rate)
        speed = float(d("motion_speed") if motion_speed is None else motion_speed)
        pipe = self.pipe
        with torch.no_grad():
            pos, pos_mask, neg, neg_mask = pipe.encode_prompt(
                prompt=list(prompts), negative_prompt=negative_prompt, do_classifier_free_guidance=do_cfg,
                num_videos_per_prompt=1, max_sequence_length=max_sequence_length, device=self.device)
            embeds = torch.cat([neg, pos]) if do_cfg else pos
            mask = torch.cat([neg_mask, pos_mask]) if do_cfg else pos_mask
            side = getattr(pipe.tokenizer, "padding_side", "left") if getattr(pipe, "tokenizer", None) else "left"
            video_emb, audio_emb, conn_mask = pipe.connectors(embeds, mask, padding_side=side)
        n = len(prompts)
        tensors = {"video_embeds": video_emb[-n:], "audio_embeds": audio_emb[-n:], "text_mask": conn_mask[-n:]}
        if do_cfg:
            tensors.update(negative_video_embeds=video_emb[:n], negative_audio_embeds=audio_emb[:n],
                           negative_text_mask=conn_mask[:n])
        lat_f = (frames - 1) // pipe.vae_temporal_compression_ratio + 1
        lat_h, lat_w = height // pipe.vae_spatial_compression_ratio, width // pipe.vae_spatial_compression_ratio
        audio_per_s = (pipe.audio_sampling_rate / pipe.audio_hop_length
                       / float(pipe.audio_vae_temporal_compression_ratio))
        audio_frames = round(frames / frame_rate * audio_per_s)
        options = {"num_frames": frames, "latent": (lat_f, lat_h, lat_w), "audio_frames": audio_frames,
                   "fps": ltx_module.get_conditioning_frame_rate(frame_rate, speed), "cfg": (float(g), float(a_g)),
                   "stg": (float(stg), float(a_stg)), "modality": (float(mod), float(a_mod)),
                   "rescale": (float(rescale), float(a_rescale)), "do_stg": do_stg, "do_modality": do_mod,
                   "blocks": None if blocks is None else list(blocks),
                   "use_cross_timestep": bool(d("use_cross_timestep") if use_cross_timestep is None
                                              else use_cross_timestep)}
        cond = Conditioning(tensors, float(g), do_cfg, height, width, options=options)
        if num_images_per_prompt > 1:
            cond = cond[torch.arange(n).repeat_interleave(num_images_per_prompt)]
        return cond

    def forwards_per_step(self, cond: Conditioning) -> int:
        return (2 if cond.do_cfg else 1) + int(cond.options["do_stg"]) + int(cond.options["do_modality"])

    # ------------------------------------------------------------------------------------------------ latents
    def _sizes(self, cond) -> tuple[tuple[int, int], tuple[int, int]]:
        pipe = self.pipe
        f, h, w = cond.options["latent"]
        p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        nv = (f // pt) * (h // p) * (w // p)
        cv = self.transformer.config.in_channels * p * p * pt
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        ca = pipe.audio_vae.config.latent_channels * mel
        return (nv, cv), (cond.options["audio_frames"], ca)

    def split(self, latents: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint latent ``[B, D]`` -> (packed video tokens ``[B, Nv, Cv]``, packed audio tokens ``[B, Na, Ca]``)."""
        (nv, cv), (na, ca) = self._sizes(cond)
        b = latents.shape[0]
        return latents[:, :nv * cv].reshape(b, nv, cv), latents[:, nv * cv:].reshape(b, na, ca)

    @staticmethod
    def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        return torch.cat([video.flatten(1), audio.flatten(1)], 1)

    def prepare_latents(self, batch_size: int, cond: Conditioning, generator: Any) -> torch.Tensor:
        pipe = self.pipe
        video = pipe.prepare_latents(batch_size, self.transformer.config.in_channels, cond.height, cond.width,
                                     cond.options["num_frames"], 0.0, torch.float32, self.device, generator)
        audio = pipe.prepare_audio_latents(batch_size, num_channels_latents=pipe.audio_vae.config.latent_channels,
                                           audio_latent_length=cond.options["audio_frames"],
                                           num_mel_bins=pipe.audio_vae.config.mel_bins, noise_scale=0.0,
                                           dtype=torch.float32, device=self.device, generator=generator)
        return self.join(video, audio)

    def schedule(self, num_steps, cond, sigmas=None, mu=None):
        scheduler = self.scheduler_copy()
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if mu is None:
            (nv, _), _ = self._sizes(cond)
            mu = ltx_module.calculate_shift(nv, scheduler.config.get("base_image_seq_len", 1024),
                                            scheduler.config.get("max_image_seq_len", 4096),
                                            scheduler.config.get("base_shift", 0.95),
                                            scheduler.config.get("max_shift", 2.05))
        ltx_module.retrieve_timesteps(scheduler, num_steps, self.device, None, sigmas=sigmas, mu=mu)
        sig, ts = self._finish_schedule(scheduler, self.device)
        cond.options["grid"] = (ts.detach().cpu().tolist(), sig.detach().cpu().tolist())  # x0 <-> v needs sigma
        return sig, ts

    def _sigma(self, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        grid = cond.options.get("grid")
        if grid is None:
            raise RuntimeError("LTX-2 adapter: call schedule(...) with this conditioning before velocity(...)")
        ts, sig = grid
        idx = [min(range(len(ts)), key=lambda k: abs(ts[k] - float(v))) for v in t.tolist()]
        return torch.tensor([sig[i] for i in idx], dtype=torch.float32, device=t.device)

    # ------------------------------------------------------------------------------------------------ velocity
    def _call(self, video, audio, t, emb_v, emb_a, mask, cond, isolate=False, blocks=None):
        o = cond.options
        f, h, w = o["latent"]
        n = video.shape[0]
        coords_v = self.transformer.rope.prepare_video_coords(n, f, h, w, video.device, fps=o["fps"])
        coords_a = self.transformer.audio_rope.prepare_audio_coords(n, o["audio_frames"], audio.device)
        dtype = emb_v.dtype
        out_v, out_a = self.transformer(
            hidden_states=video.to(dtype), audio_hidden_states=audio.to(dtype), encoder_hidden_states=emb_v,
            audio_encoder_hidden_states=emb_a, timestep=t, sigma=t, encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask, num_frames=f, height=h, width=w, fps=o["fps"],
            audio_num_frames=o["audio_frames"], video_coords=coords_v, audio_coords=coords_a,
            isolate_modalities=isolate, spatio_temporal_guidance_blocks=blocks, perturbation_mask=None,
            use_cross_timestep=o["use_cross_timestep"], attention_kwargs=None, return_dict=False)
        return out_v.float(), out_a.float()

    def velocity(self, latents, timesteps, cond):
        o = cond.options
        video, audio = self.split(latents, cond)
        t = timesteps.to(latents.device)
        sigma = self._sigma(t, cond).view(-1, 1, 1)
        pos = (cond.tensors["video_embeds"], cond.tensors["audio_embeds"], cond.tensors["text_mask"])
        (g, a_g), (stg, a_stg), (mod, a_mod), (resc, a_resc) = o["cfg"], o["stg"], o["modality"], o["rescale"]
        if cond.do_cfg:
            neg = (cond.tensors["negative_video_embeds"], cond.tensors["negative_audio_embeds"],
                   cond.tensors["negative_text_mask"])
            v2, a2 = self._call(torch.cat([video, video]), torch.cat([audio, audio]), torch.cat([t, t]),
                                torch.cat([neg[0], pos[0]]), torch.cat([neg[1], pos[1]]), torch.cat([neg[2], pos[2]]),
                                cond)
            v_unc, v_c = v2.chunk(2)
            a_unc, a_c = a2.chunk(2)
            x0_v, x0_a = video - v_c * sigma, audio - a_c * sigma
            delta_v = (g - 1) * (x0_v - (video - v_unc * sigma))
            delta_a = (a_g - 1) * (x0_a - (audio - a_unc * sigma))
        else:
            v_c, a_c = self._call(video, audio, t, *pos, cond)
            x0_v, x0_a = video - v_c * sigma, audio - a_c * sigma
            delta_v = delta_a = 0
        stg_v = stg_a = mod_v = mod_a = 0
        if o["do_stg"]:
            sv, sa = self._call(video, audio, t, *pos, cond, blocks=o["blocks"])
            stg_v = stg * (x0_v - (video - sv * sigma))
            stg_a = a_stg * (x0_a - (audio - sa * sigma))
        if o["do_modality"]:
            mv, ma = self._call(video, audio, t, *pos, cond, isolate=True)
            mod_v = (mod - 1) * (x0_v - (video - mv * sigma))
            mod_a = (a_mod - 1) * (x0_a - (audio - ma * sigma))
        g_v = x0_v + delta_v + stg_v + mod_v
        g_a = x0_a + delta_a + stg_a + mod_a
        x0_v = ltx_module.rescale_noise_cfg(g_v, x0_v, guidance_rescale=resc) if resc > 0 else g_v
        x0_a = ltx_module.rescale_noise_cfg(g_a, x0_a, guidance_rescale=a_resc) if a_resc > 0 else g_a
        return self.join((video - x0_v) / sigma, (audio - x0_a) / sigma)

    # ------------------------------------------------------------------------------------------------ decoding
    def _video_latents(self, latents, cond) -> torch.Tensor:
        pipe = self.pipe
        video, _ = self.split(latents, cond)
        f, h, w = cond.options["latent"]
        return pipe._unpack_latents(video, f, h, w, pipe.transformer_spatial_patch_size,
                                    pipe.transformer_temporal_patch_size)

    def _audio_latents(self, latents, cond) -> torch.Tensor:
        pipe = self.pipe
        _, audio = self.split(latents, cond)
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return pipe._unpack_audio_latents(audio, cond.options["audio_frames"], num_mel_bins=mel)

    def latent_output(self, latents, cond):
        """The video latents the pipeline returns for ``output_type="latent"`` (``audio_latent_output``: audio)."""
        pipe = self.pipe
        return pipe._denormalize_latents(self._video_latents(latents, cond), pipe.vae.latents_mean,
                                         pipe.vae.latents_std, pipe.vae.config.scaling_factor)

    def audio_latent_output(self, latents, cond):
        return self._audio_latents(latents, cond)

    def decode(self, latents, cond):
        pipe = self.pipe
        vae = pipe.vae
        with torch.no_grad():
            z = self._video_latents(latents, cond).to(cond.tensors["video_embeds"].dtype)
            timestep = None
            if vae.config.timestep_conditioning:  # decode_timestep 0 (the default): no decode-time noise
                timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
            z = pipe._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            video = vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0]
            return pipe.video_processor.postprocess_video(video, output_type="pt").float()

    def decode_audio(self, latents, cond) -> torch.Tensor:
        """The soundtrack as the pipeline's vocoder waveform ``[B, channels, samples]``."""
        pipe = self.pipe
        with torch.no_grad():
            mel = pipe.audio_vae.decode(self._audio_latents(latents, cond).to(pipe.audio_vae.dtype),
                                        return_dict=False)[0]
            return pipe.vocoder(mel).float()
