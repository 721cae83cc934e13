"""Supervised pretraining of the tiny Wan pipeline on the moving-shapes video task (the video RL demo's start).

``grove pretrain configs/visgen/video_pretrain.yaml --out DIR`` (``visgen.pretrain.run`` hands ``task:
video_shapes`` configs here) or ``python -m visgen.pretrain configs/visgen/video_pretrain.yaml --out
assets/video-wan-tiny``. Two seeded stages, like the image asset (``visgen.pretrain``):

1. VAE (``AutoencoderKLWan``) on rendered clips: pixel MSE plus a small KL term. Then ``latents_mean`` /
   ``latents_std`` are set per latent channel from the posterior means, so the transformer sees unit-variance
   latents (``WanPipeline`` decodes ``z * std + mean``).
2. ``WanTransformer3DModel`` and the UMT5 text encoder jointly, by rectified flow (Liu et al., "Flow Straight and
   Fast", 2022): ``x_t = (1 - t) x0 + t eps`` with logit-normal ``t``, the model predicts ``v = eps - x0`` at
   timestep ``1000 t``; 10% empty prompts so classifier-free guidance works. An EMA of the weights is what gets
   evaluated and saved.

Evaluation samples the held-out prompts with the *stock* ``WanPipeline`` (Euler ODE) and scores the clips with the
analytic checker (``visgen.tasks.video``): ``eval/heldout_g<g>/score`` and ``.../strict``. Snapshots of the EMA
pipeline are saved at every evaluation (``run_dir/step_<k>``), so the asset can be taken at the knee of the curve.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from shared_rl.config import ConfigError, from_dict

from . import video as vtask

GROVE_JSON = "grove.json"


@dataclass
class VideoVaeStage:
    steps: int = field(default=600, metadata={"help": "VAE optimizer steps"})
    batch_size: int = field(default=16, metadata={"help": "clips per VAE step"})
    lr: float = field(default=2e-3, metadata={"help": "VAE learning rate (AdamW, 50-step warm-up, cosine to 10%)"})
    kl_weight: float = field(default=1e-6, metadata={"help": "weight of the posterior KL per pixel"})


@dataclass
class VideoTransformerStage:
    steps: int = field(default=3000, metadata={"help": "transformer + text-encoder optimizer steps"})
    batch_size: int = field(default=64, metadata={"help": "clips per step"})
    lr: float = field(default=1e-3, metadata={"help": "learning rate (AdamW, constant after warm-up)"})
    warmup_steps: int = field(default=100, metadata={"help": "linear warm-up steps"})
    empty_prompt_prob: float = field(default=0.1, metadata={"help": "prompts replaced by '' (for CFG)"})
    logit_normal_std: float = field(default=1.0, metadata={"help": "std of the logit-normal t distribution"})
    ema_decay: float = field(default=0.999, metadata={"help": "EMA decay of the evaluated/saved weights"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clip"})


@dataclass
class VideoPretrainEval:
    every: int = field(default=500, metadata={"help": "evaluate (and snapshot) every this many transformer steps"})
    samples_per_prompt: int = field(default=4, metadata={"help": "clips per held-out prompt"})
    num_inference_steps: int = field(default=10, metadata={"help": "Euler ODE steps of the stock pipeline"})
    guidance_scales: list = field(default_factory=lambda: [1.0, 3.0], metadata={"help": "CFG scales evaluated"})
    batch_size: int = field(default=64, metadata={"help": "clips per sampling call"})
    save_snapshots: bool = field(default=True, metadata={"help": "save the EMA pipeline at every evaluation"})


@dataclass
class VideoPretrainConfig:
    task: str = field(default="video_shapes", metadata={"help": "video_shapes (this module)"})
    seed: int = field(default=0, metadata={"help": "seed of data, init and training"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    split_seed: int = field(default=0, metadata={"help": "train/held-out prompt split seed"})
    dataset_size: int = field(default=4096, metadata={"help": "pre-rendered ground-truth clips of training prompts"})
    caption_noise: float = field(default=0.0, metadata={
        "help": "fraction of clips moving another direction than their prompt says (weakly aligned captions)"})
    frames: int = field(default=vtask.FRAMES, metadata={"help": "frames per clip (4k+1 for the Wan VAE)"})
    size: int = field(default=vtask.SIZE, metadata={"help": "clip side in pixels (multiple of 8)"})
    max_sequence_length: int = field(default=10, metadata={"help": "text tokens (the longest prompt is 9)"})
    model: dict = field(default_factory=dict,
                        metadata={"help": "keyword arguments of visgen.tasks.video.build_tiny_wan"})
    output_dir: str | None = field(default=None, metadata={"help": "where the final pipeline is saved"})
    log_every: int = field(default=50, metadata={"help": "metrics.jsonl row every this many steps"})
    vae: VideoVaeStage = field(default_factory=VideoVaeStage, metadata={"help": "VAE stage"})
    transformer: VideoTransformerStage = field(default_factory=VideoTransformerStage,
                                               metadata={"help": "transformer stage"})
    eval: VideoPretrainEval = field(default_factory=VideoPretrainEval, metadata={"help": "evaluation"})


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def render_dataset(specs: list, n: int, seed: int, frames: int, size: int, caption_noise: float = 0.0
                   ) -> tuple[torch.Tensor, list[str]]:
    """``n`` clips ``[n, 3, F, H, W]`` in [-1, 1] (the VAE layout) of prompts drawn from ``specs``, and the prompts.

    ``caption_noise``: the fraction of clips whose object moves in a random *other* direction than its prompt says
    (weakly aligned captions, as in web video data), so the pretrained model follows the prompted direction only
    part of the time and RL has something to align."""
    rng = np.random.default_rng(seed)
    chosen = [specs[i] for i in rng.integers(len(specs), size=n)]
    directions = list(vtask.DIRECTIONS)
    rendered = []
    for s in chosen:
        if caption_noise > 0 and rng.random() < caption_noise:
            other = [d for d in directions if d != s.direction]
            s = vtask.ClipSpec(s.color, s.shape, other[int(rng.integers(len(other)))])
        rendered.append(vtask.render_clip(s, rng, frames, size))
    clips = np.stack(rendered)  # [n, F, 3, H, W]
    return torch.from_numpy(clips).permute(0, 2, 1, 3, 4).mul(2).sub(1).contiguous(), [s.prompt for s in chosen]


class _Metrics:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def write(self, step: int, values: dict[str, float]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, **{k: float(v) for k, v in values.items()}}) + "\n")


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLWan._decode`` without its final clamp to [-1, 1]: the clamp has zero gradient outside the
    range, so a decoder whose outputs start below -1 (the black background) never learns the objects."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=(i == 0)))
    vae.clear_cache()
    out = torch.cat(frames, 2)
    if vae.config.patch_size is not None:  # the Wan 2.2 layout decodes 2x2-patchified pixels
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = unpatchify(out, patch_size=vae.config.patch_size)
    return out


def train_vae(vae, clips: torch.Tensor, cfg: VideoVaeStage, generator: torch.Generator, metrics: _Metrics,
              log: Callable) -> float:
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.lr, weight_decay=0.0)
    recent: list[float] = []
    for step in range(cfg.steps):
        warm = min(1.0, (step + 1) / 50)
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, cfg.steps)))
        for g in opt.param_groups:
            g["lr"] = cfg.lr * warm * cosine
        x = clips[torch.randint(len(clips), (cfg.batch_size,), generator=generator)]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = decode_unclamped(vae, z)
        mse = F.mse_loss(recon, x)
        kl = posterior.kl().mean() / x[0].numel()
        opt.zero_grad(set_to_none=True)
        (mse + cfg.kl_weight * kl).backward()
        opt.step()
        recent.append(mse.item())
        if (step + 1) % 50 == 0:
            metrics.write(step + 1, {"vae/mse": float(np.mean(recent[-50:])), "vae/kl": kl.item()})
            log(f"vae step {step + 1}: mse {np.mean(recent[-50:]):.4f}")
    vae.eval()
    return float(np.mean(recent[-100:]))


@torch.no_grad()
def encode_dataset(vae, clips: torch.Tensor, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    means, stds = [], []
    for start in range(0, len(clips), batch_size):
        dist = vae.encode(clips[start:start + batch_size]).latent_dist
        means.append(dist.mean)
        stds.append(dist.std)
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def sample_clips(pipe, prompts: list[str], guidance: float, steps: int, seed: int, batch_size: int, frames: int,
                 size: int, max_sequence_length: int) -> torch.Tensor:
    """Stock-pipeline ODE clips ``[N, F, 3, H, W]`` in [0, 1]; chunk j uses the generator seeded ``seed + j``."""
    out = []
    for j, start in enumerate(range(0, len(prompts), batch_size)):
        video = pipe(prompts[start:start + batch_size], height=size, width=size, num_frames=frames,
                     num_inference_steps=steps, guidance_scale=guidance, output_type="pt",
                     generator=torch.Generator().manual_seed(seed + j), max_sequence_length=max_sequence_length).frames
        out.append(video.float().cpu())
    return torch.cat(out)


def evaluate(pipe, specs: list, conf: VideoPretrainConfig, seed: int, prefix: str = "heldout") -> dict[str, float]:
    ev = conf.eval
    prompts = [s.prompt for s in specs for _ in range(ev.samples_per_prompt)]
    expanded = [s for s in specs for _ in range(ev.samples_per_prompt)]
    results = {}
    for g in ev.guidance_scales:
        clips = sample_clips(pipe, prompts, float(g), ev.num_inference_steps, seed, ev.batch_size, conf.frames,
                             conf.size, conf.max_sequence_length)
        score, strict = vtask.score_batch(clips.numpy(), expanded)
        results[f"eval/{prefix}_g{g:g}/score"] = float(np.nanmean(score))
        results[f"eval/{prefix}_g{g:g}/strict"] = float(np.nanmean(strict))
    return results


def save_pipeline(pipe, directory: Path, conf: VideoPretrainConfig, extra: dict | None = None) -> Path:
    """``save_pretrained`` plus the ``grove.json`` the RL domain reads (frames, resolution, text length, fps)."""
    directory = Path(directory)
    pipe.save_pretrained(directory, safe_serialization=True)
    settings = {"task": "video_shapes", "num_frames": conf.frames, "resolution": conf.size, "fps": vtask.FPS,
                "max_sequence_length": conf.max_sequence_length, "split_seed": conf.split_seed}
    settings.update(extra or {})
    (directory / GROVE_JSON).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return directory


def run(cfg: dict, run_dir: Path, log: Callable[[str], Any] = print) -> dict[str, float]:
    """Pretrain the tiny Wan (VAE, then transformer + text encoder), evaluate, save; returns the final metrics."""
    conf: VideoPretrainConfig = from_dict(VideoPretrainConfig, dict(cfg), where="pretrain")
    if conf.task != "video_shapes":
        raise ConfigError(f"pretrain.task: this module trains 'video_shapes', got {conf.task!r}")
    if (conf.frames - 1) % 4 or conf.size % 8:
        raise ConfigError(f"pretrain.frames must be 4k+1 and size a multiple of 8 (the Wan VAE), got "
                          f"{conf.frames} frames at {conf.size} px")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out_dir = Path(conf.output_dir) if conf.output_dir else run_dir / "pipeline"
    torch.set_num_threads(conf.threads)
    torch.set_flush_denormal(True)
    _seed(conf.seed)
    generator = torch.Generator().manual_seed(conf.seed)
    metrics = _Metrics(run_dir / "metrics.jsonl")
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(conf), indent=2) + "\n")
    started = time.time()

    train_specs, eval_specs = vtask.split_prompts(conf.split_seed)
    log(f"video_shapes: {len(train_specs)} train prompts, {len(eval_specs)} held-out")
    if not 0.0 <= conf.caption_noise < 1.0:
        raise ConfigError(f"pretrain.caption_noise must be in [0, 1), got {conf.caption_noise}")
    clips, prompts = render_dataset(train_specs, conf.dataset_size, conf.seed, conf.frames, conf.size,
                                    conf.caption_noise)
    pipe = vtask.build_tiny_wan(seed=conf.seed, **conf.model)
    vae_mse = train_vae(pipe.vae, clips, conf.vae, generator, metrics, log)
    pipe.vae.requires_grad_(False)
    lat_mean, lat_std = encode_dataset(pipe.vae, clips)
    channel_mean = lat_mean.mean(dim=(0, 2, 3, 4))
    channel_std = (lat_mean - channel_mean.view(1, -1, 1, 1, 1)).std(dim=(0, 2, 3, 4))
    pipe.vae.register_to_config(latents_mean=channel_mean.tolist(), latents_std=channel_std.tolist())
    log(f"vae: mse {vae_mse:.4f}; latent channel std {channel_std.numpy().round(3).tolist()} "
        f"({time.time() - started:.0f}s)")

    tc = conf.transformer
    modules = [pipe.transformer, pipe.text_encoder]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train()
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=0.0)
    ema_modules = [copy.deepcopy(m).eval().requires_grad_(False) for m in modules]
    ema_pipe = copy.copy(pipe)
    ema_pipe.transformer, ema_pipe.text_encoder = ema_modules
    ema_pipe.scheduler = copy.deepcopy(pipe.scheduler)
    mean = channel_mean.view(1, -1, 1, 1, 1)
    std = channel_std.view(1, -1, 1, 1, 1)
    result: dict[str, float] = {"vae/mse": vae_mse}

    def run_eval(step: int) -> dict[str, float]:
        t0 = time.time()
        values = evaluate(ema_pipe, eval_specs, conf, conf.seed + 10_000)
        values["time/eval"] = time.time() - t0
        metrics.write(step, values)
        log(f"step {step}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in values.items()
                                         if k.startswith("eval/")))
        return values

    losses: list[float] = []
    for step in range(tc.steps):
        lr = tc.lr * min(1.0, (step + 1) / max(1, tc.warmup_steps))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(len(clips), (tc.batch_size,), generator=generator)
        z = lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=generator)
        x0 = (z - mean) / std
        drop = torch.rand(tc.batch_size, generator=generator) < tc.empty_prompt_prob
        batch_prompts = ["" if d else prompts[i] for d, i in zip(drop.tolist(), idx.tolist())]
        embeds, _ = pipe.encode_prompt(batch_prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=conf.max_sequence_length, device=torch.device("cpu"))
        t = torch.sigmoid(tc.logit_normal_std * torch.randn(tc.batch_size, generator=generator))
        noise = torch.randn(x0.shape, generator=generator)
        tb = t.view(-1, 1, 1, 1, 1)
        x_t = (1 - tb) * x0 + tb * noise
        pred = pipe.transformer(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=embeds,
                                return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        with torch.no_grad():
            decay = min(tc.ema_decay, (1 + step) / (10 + step))
            for live, ema in zip(modules, ema_modules):
                for p_ema, p in zip(ema.parameters(), live.parameters()):
                    p_ema.lerp_(p, 1 - decay)
        losses.append(loss.item())
        if (step + 1) % conf.log_every == 0:
            metrics.write(step + 1, {"loss/flow": float(np.mean(losses[-conf.log_every:])),
                                     "grad_norm": float(grad_norm), "lr": lr, "time/elapsed": time.time() - started})
        if conf.eval.every and (step + 1) % conf.eval.every == 0 and step + 1 < tc.steps:
            log(f"step {step + 1}: flow loss {np.mean(losses[-conf.log_every:]):.4f} ({time.time() - started:.0f}s)")
            values = run_eval(step + 1)
            if conf.eval.save_snapshots:
                save_pipeline(ema_pipe, run_dir / f"step_{step + 1:06d}", conf,
                              {"step": step + 1, "measured": {k: round(v, 4) for k, v in values.items()}})

    result["loss/flow"] = float(np.mean(losses[-200:])) if losses else float("nan")
    result["time/train"] = time.time() - started
    result.update(run_eval(tc.steps))
    for live, ema in zip(modules, ema_modules):
        live.load_state_dict(ema.state_dict())
        live.eval()
    save_pipeline(pipe, out_dir, conf, {"step": tc.steps, "measured": {k: round(v, 4) for k, v in result.items()}})
    clips_out = sample_clips(pipe, [s.prompt for s in eval_specs], 1.0, conf.eval.num_inference_steps,
                             conf.seed + 30_000, 64, conf.frames, conf.size, conf.max_sequence_length)
    vtask.write_video(vtask.clip_grid(list(clips_out), 4), run_dir / "samples.gif")
    log(f"saved pipeline to {out_dir} ({result['time/train']:.0f}s)")
    (run_dir / "final.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result
