"""Supervised pretraining of an embedded task's tiny pipeline (the RL demos' starting points): one loop for the
image tasks (``shapes``, ``words``: the tiny SD3 of ``visgen.tiny``) and the video task (``video_shapes``: the tiny
Wan of ``visgen.tasks.video``). The config's ``task`` (``visgen.tasks``) brings the data, the pipeline, the scoring
and its own settings; the model family below (:data:`MODELS`) brings what differs between SD3 and Wan.

Two stages, both seeded:

1. VAE on rendered ground truth: pixel MSE plus a small KL term. Afterwards the latents are normalised from the
   posterior means so the transformer sees roughly unit-variance latents (SD3: one ``shift_factor`` /
   ``scaling_factor``; Wan: ``latents_mean`` / ``latents_std`` per channel).
2. Transformer and text encoder(s) jointly, by rectified flow (Liu et al., "Flow Straight and Fast", 2022; the SD3
   recipe of Esser et al., 2024): x_t = (1-t)·x0 + t·ε with logit-normal t, the model predicts v = ε - x0 at
   timestep 1000·t, MSE loss; 10% of prompts are replaced by "" so classifier-free guidance (Ho & Salimans, 2022)
   works at sampling time. An EMA of the weights is what gets evaluated and saved.

Periodic evaluation samples held-out prompts (and ``eval.train_prompts`` training prompts) with the *stock*
pipeline (Euler ODE) at each guidance scale and scores them with the task: ``eval/<split>_g<g>/<metric>`` — shapes
``score`` / ``strict`` / ``strict_<kind>`` (the analytic checker), words ``ocr`` / ``exact`` (the OCR reward; plus
``vae/ocr``, the VAE's reconstructions of held-out renders read back), video ``score`` / ``strict``. The EMA
pipeline is saved at every periodic evaluation (``run_dir/step_<k>``), so an asset can be taken at the knee of the
curve; its ``grove.json`` records what sampling and RL reuse (split, resolution, text length, frames).

Entry points: ``run(cfg, run_dir, log)`` (``grove pretrain``) and
``python -m visgen.pretrain configs/visgen/shapes_pretrain.yaml --out assets/shapes-sd3-tiny``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from shared_rl.config import ConfigError, from_dict
from visgen.tasks import TASKS, PretrainConfig, Task, get_task

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------- model families
class TinySD3:
    """The image pieces: the tiny ``StableDiffusion3Pipeline`` (``visgen.tiny``), samples ``[N, 3, H, W]``."""

    text_encoders = ("text_encoder", "text_encoder_2")
    encode_batch = 512

    def vae_input(self, samples: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(samples) * 2.0 - 1.0

    def vae_lr(self, step: int, stage) -> float:
        return stage.lr * _lr_factor(step, 50, stage.steps)  # 50-step warm-up, then cosine to 10%

    def vae_decode(self, vae, z: torch.Tensor) -> torch.Tensor:
        return vae.decode(z).sample

    def normalise(self, vae, lat_mean: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
        shift = float(lat_mean.mean())
        scale = float(1.0 / (lat_mean - shift).std())
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
        return (lambda z: (z - shift) * scale), f"shift_factor {shift:.4f}, scaling_factor {scale:.4f}"

    def condition(self, pipe, prompts: list[str], conf) -> dict[str, torch.Tensor]:
        from visgen import tiny

        embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=CPU,
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=tiny.MAX_SEQUENCE_LENGTH)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    @torch.no_grad()
    def sample(self, pipe, prompts: list[str], guidance: float, steps: int, seed: int, batch_size: int,
               conf) -> torch.Tensor:
        """Stock-pipeline ODE images in [0, 1]; sample i uses the generator seeded ``seed + (i // B) * B``."""
        from visgen import tiny

        out = []
        for start in range(0, len(prompts), batch_size):
            out.append(pipe(prompts[start:start + batch_size], num_inference_steps=steps, guidance_scale=guidance,
                            max_sequence_length=tiny.MAX_SEQUENCE_LENGTH, output_type="pt",
                            generator=torch.Generator().manual_seed(seed + start)).images.float().cpu())
        return torch.cat(out)

    def save_samples(self, pipe, specs: list, run_dir: Path, conf, seed: int) -> None:
        """``samples.png``: one row per (prompt, guidance) for 8 held-out prompts, 4 samples each, upscaled 4x."""
        from torchvision.utils import save_image

        ev = conf.eval
        rows, captions = [], []
        for spec in specs[::max(1, len(specs) // 8)][:8]:
            for g in ev.guidance_scales:
                rows.append(self.sample(pipe, [spec.prompt] * 4, float(g), ev.num_inference_steps, seed, 4, conf))
                captions.append(f"g={g:g}: {spec.prompt}")
        path = run_dir / "samples.png"
        save_image(F.interpolate(torch.cat(rows), scale_factor=4, mode="nearest"), path, nrow=4, padding=2,
                   pad_value=0.5)
        path.with_suffix(".txt").write_text("\n".join(captions) + "\n")

    def asset_settings(self, pipe, conf) -> dict:
        from visgen import tiny

        return {"max_sequence_length": tiny.MAX_SEQUENCE_LENGTH,
                "resolution": int(pipe.transformer.config.sample_size * pipe.vae_scale_factor)}

    def asset_config(self, settings: dict) -> dict:
        """Pretraining settings recovered from a saved asset's grove.json (to evaluate it)."""
        return {"eval_fraction": settings.get("eval_fraction", 0.2)}

    def load(self, directory):
        from visgen import tiny

        return tiny.load_shapes_asset(directory)


class TinyWan:
    """The video pieces: the tiny ``WanPipeline`` (``visgen.tasks.video.build_tiny_wan``), clips ``[N, F, 3, H, W]``
    (the VAE takes ``[N, 3, F, H, W]``)."""

    text_encoders = ("text_encoder",)
    encode_batch = 64

    def vae_input(self, samples: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(samples).permute(0, 2, 1, 3, 4).mul(2).sub(1).contiguous()

    def vae_lr(self, step: int, stage) -> float:
        # the video recipe's schedule (warm-up times a cosine from step 0), kept so its asset rebuilds bit for bit
        warm = min(1.0, (step + 1) / 50)
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, stage.steps)))
        return stage.lr * warm * cosine

    def vae_decode(self, vae, z: torch.Tensor) -> torch.Tensor:
        return decode_unclamped(vae, z)

    def normalise(self, vae, lat_mean: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
        channel_mean = lat_mean.mean(dim=(0, 2, 3, 4))
        channel_std = (lat_mean - channel_mean.view(1, -1, 1, 1, 1)).std(dim=(0, 2, 3, 4))
        vae.register_to_config(latents_mean=channel_mean.tolist(), latents_std=channel_std.tolist())
        mean, std = channel_mean.view(1, -1, 1, 1, 1), channel_std.view(1, -1, 1, 1, 1)
        return (lambda z: (z - mean) / std), f"channel std {channel_std.numpy().round(3).tolist()}"

    def condition(self, pipe, prompts: list[str], conf) -> dict[str, torch.Tensor]:
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=conf.max_sequence_length, device=CPU)
        return {"encoder_hidden_states": embeds}

    @torch.no_grad()
    def sample(self, pipe, prompts: list[str], guidance: float, steps: int, seed: int, batch_size: int,
               conf) -> torch.Tensor:
        """Stock-pipeline ODE clips in [0, 1]; chunk j uses the generator seeded ``seed + j``."""
        out = []
        for j, start in enumerate(range(0, len(prompts), batch_size)):
            out.append(pipe(prompts[start:start + batch_size], height=conf.size, width=conf.size,
                            num_frames=conf.frames, num_inference_steps=steps, guidance_scale=guidance,
                            output_type="pt", generator=torch.Generator().manual_seed(seed + j),
                            max_sequence_length=conf.max_sequence_length).frames.float().cpu())
        return torch.cat(out)

    def save_samples(self, pipe, specs: list, run_dir: Path, conf, seed: int) -> None:
        """``samples.gif``: one clip per held-out prompt (guidance 1), four a row."""
        from visgen.tasks import video as vtask

        clips = self.sample(pipe, [s.prompt for s in specs], 1.0, conf.eval.num_inference_steps, seed, 64, conf)
        vtask.write_video(vtask.clip_grid(list(clips), 4), run_dir / "samples.gif")

    def asset_settings(self, pipe, conf) -> dict:
        from visgen.tasks import video as vtask

        return {"num_frames": conf.frames, "resolution": conf.size, "fps": vtask.FPS,
                "max_sequence_length": conf.max_sequence_length}

    def asset_config(self, settings: dict) -> dict:
        return {"frames": settings["num_frames"], "size": settings["resolution"],
                "max_sequence_length": settings["max_sequence_length"]}

    def load(self, directory):
        from diffusers import WanPipeline

        pipe = WanPipeline.from_pretrained(directory, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        return pipe


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


# the tiny model family each task pretrains (``Task.model``)
MODELS = {"tiny_sd3": TinySD3(), "tiny_wan": TinyWan()}


# ------------------------------------------------------------------------------------------------------ config
def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def load_config(cfg: dict) -> tuple[Task, PretrainConfig]:
    """The task and its pretraining settings (the task's defaults under the YAML); ConfigError in one line."""
    data = dict(cfg)
    name = data.get("task", "shapes")
    task = get_task(name, "pretrain.task")
    if task.pretrain_config is None:
        raise ConfigError(f"pretrain.task: the {name} task has no embedded model to pretrain; choose one of "
                          f"{sorted(n for n, t in TASKS.items() if t.pretrain_config is not None)}")
    for key in sorted(set(data) - _fields(task.pretrain_config)):
        owners = [n for n, t in TASKS.items() if t.pretrain_config is not None and key in _fields(t.pretrain_config)]
        if owners:
            raise ConfigError(f"pretrain.{key} is a setting of task {' / '.join(owners)}, not of task {name}")
    return task, from_dict(task.pretrain_config, _merge(task.pretrain_defaults, data), "pretrain")


# ------------------------------------------------------------------------------------------------------ pieces
def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _lr_factor(step: int, warmup: int, total: int, schedule: str = "cosine") -> float:
    """Linear warm-up, then constant or cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


class _Metrics:
    """metrics.jsonl rows; ``started`` is the run's start (``time/elapsed``)."""

    def __init__(self, path: Path):
        self.path, self.started = path, time.time()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def write(self, step: int, values: dict[str, float]) -> None:
        row = {"step": step, **{k: float(v) for k, v in values.items()}}
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


def render_dataset(task: Task, family, specs: list, conf) -> tuple[torch.Tensor, list[str]]:
    """``conf.dataset_size`` ground-truth samples (the VAE's layout, in [-1, 1]) of prompts drawn from ``specs``,
    and those prompts; one generator seeded ``conf.seed`` draws the prompts and each render's randomness."""
    rng = np.random.default_rng(conf.seed)
    chosen = [specs[i] for i in rng.integers(len(specs), size=conf.dataset_size)]
    return family.vae_input(np.stack([task.render(s, rng, conf) for s in chosen])), [s.prompt for s in chosen]


def train_vae(vae, data: torch.Tensor, family, stage, generator: torch.Generator, metrics: _Metrics, log) -> float:
    """Reconstruction training of ``vae`` on ``data`` (its input layout, in [-1, 1]); returns the final MSE."""
    from tqdm import tqdm

    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=stage.lr, weight_decay=0.0)
    bar = tqdm(range(stage.steps), desc="vae", mininterval=5.0, disable=None)
    recent: list[float] = []
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = family.vae_lr(step, stage)
        x = data[torch.randint(len(data), (stage.batch_size,), generator=generator)]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        mse = F.mse_loss(family.vae_decode(vae, z), x)
        kl = posterior.kl().mean() / x[0].numel()
        optimizer.zero_grad(set_to_none=True)
        (mse + stage.kl_weight * kl).backward()
        optimizer.step()
        recent.append(mse.item())
        if (step + 1) % 50 == 0:
            value = float(np.mean(recent[-50:]))
            bar.set_postfix(mse=f"{value:.4f}")
            metrics.write(step + 1, {"vae/mse": value, "vae/kl": kl.item()})
    vae.eval()
    final = float(np.mean(recent[-100:]))
    log(f"vae: {stage.steps} steps, reconstruction MSE {final:.4f}")
    return final


@torch.no_grad()
def encode_dataset(vae, data: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of every sample (unnormalised latents)."""
    means, stds = [], []
    for start in range(0, len(data), batch_size):
        dist = vae.encode(data[start:start + batch_size]).latent_dist
        means.append(dist.mean)
        stds.append(dist.std)
    return torch.cat(means), torch.cat(stds)


def evaluate(task: Task, family, pipe, specs: list, conf, samples_per_prompt: int, seed: int,
             prefix: str) -> dict[str, float]:
    """The task's metrics of stock-pipeline samples of ``specs`` at each guidance scale: ``eval/<prefix>_g<g>/..``."""
    ev = conf.eval
    prompts = [s.prompt for s in specs for _ in range(samples_per_prompt)]
    expanded = [s for s in specs for _ in range(samples_per_prompt)]
    results = {}
    for g in ev.guidance_scales:
        samples = family.sample(pipe, prompts, float(g), ev.num_inference_steps, seed, ev.batch_size, conf)
        results.update({f"eval/{prefix}_g{g:g}/{k}": v for k, v in task.score(samples, expanded).items()})
    return results


class _Evaluation:
    """The periodic and final evaluation: held-out prompts and ``eval.train_prompts`` training (RL) prompts (a
    seeded subset), each with its own sampling seed, written to metrics.jsonl."""

    def __init__(self, task: Task, family, conf, train_specs: list, held_out: list, metrics: _Metrics | None, log):
        self.task, self.family, self.conf, self.held_out, self.metrics, self.log = task, family, conf, held_out, metrics, log
        order = np.random.default_rng(conf.seed + 1).permutation(len(train_specs)) if conf.eval.train_prompts else []
        self.train = [train_specs[i] for i in order][:conf.eval.train_prompts]

    def measure(self, pipe, samples_per_prompt: int) -> dict[str, float]:
        c = self.conf
        values = evaluate(self.task, self.family, pipe, self.held_out, c, samples_per_prompt, c.seed + 10_000,
                          "heldout")
        if self.train:
            values.update(evaluate(self.task, self.family, pipe, self.train, c, samples_per_prompt, c.seed + 20_000,
                                   "train"))
        return values

    def __call__(self, pipe, step: int, samples_per_prompt: int) -> dict[str, float]:
        t0 = time.time()
        values = self.measure(pipe, samples_per_prompt)
        values["time/eval"] = time.time() - t0
        self.metrics.write(step, values)
        self.log(f"step {step}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in values.items()
                                              if k.endswith(("/score", "/strict", "/ocr", "/exact"))))
        return values


def save_asset(pipe, directory: Path, settings: dict) -> Path:
    """``save_pretrained`` plus the ``grove.json`` that sampling and the RL domain read."""
    directory = Path(directory)
    pipe.save_pretrained(directory, safe_serialization=True)
    (directory / "grove.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return directory


def _measured(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in values.items()}


# ------------------------------------------------------------------------------------------------------ the loop
def train_transformer(task: Task, family, pipe, data: torch.Tensor, prompts: list[str], conf,
                      generator: torch.Generator, metrics: _Metrics, evaluation: _Evaluation, run_dir: Path,
                      log) -> tuple[Any, list[float]]:
    """Rectified-flow training of the transformer and text encoder(s) on the VAE's normalised latents of ``data``;
    returns the EMA pipeline (what is evaluated and saved) and the per-step losses."""
    from tqdm import tqdm

    lat_mean, lat_std = encode_dataset(pipe.vae, data, family.encode_batch)
    to_x0, how = family.normalise(pipe.vae, lat_mean)
    log(f"vae latents: {how}")
    tc, ev = conf.transformer, conf.eval
    modules = [pipe.transformer] + [getattr(pipe, name) for name in family.text_encoders]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train()
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    ema_modules = [copy.deepcopy(m).eval().requires_grad_(False) for m in modules]
    ema_pipe = copy.copy(pipe)  # shares the VAE, tokenizers and scheduler config; swaps in the EMA networks
    for name, ema in zip(("transformer",) + family.text_encoders, ema_modules):
        setattr(ema_pipe, name, ema)
    ema_pipe.scheduler = copy.deepcopy(pipe.scheduler)
    losses: list[float] = []
    bar = tqdm(range(tc.steps), desc="transformer", mininterval=5.0, disable=None)
    for step in bar:
        lr = tc.lr * _lr_factor(step, tc.warmup_steps, tc.steps, tc.lr_schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(data), (tc.batch_size,), generator=generator)
        x0 = to_x0(lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=generator))
        drop = torch.rand(tc.batch_size, generator=generator) < tc.empty_prompt_prob
        cond = family.condition(pipe, ["" if d else prompts[i] for d, i in zip(drop.tolist(), idx.tolist())], conf)
        t = torch.sigmoid(tc.logit_normal_mean + tc.logit_normal_std * torch.randn(tc.batch_size, generator=generator))
        noise = torch.randn(x0.shape, generator=generator)
        tb = t.view(-1, *([1] * (x0.dim() - 1)))
        x_t = (1.0 - tb) * x0 + tb * noise
        pred = pipe.transformer(hidden_states=x_t, timestep=t * 1000.0, return_dict=False, **cond)[0]
        loss = F.mse_loss(pred, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        optimizer.step()
        with torch.no_grad():
            decay = min(tc.ema_decay, (1 + step) / (10 + step))
            for live, ema in zip(modules, ema_modules):
                for p_ema, p in zip(ema.parameters(), live.parameters()):
                    p_ema.lerp_(p, 1.0 - decay)
        losses.append(loss.item())
        if (step + 1) % conf.log_every == 0:
            value = float(np.mean(losses[-conf.log_every:]))
            bar.set_postfix(loss=f"{value:.4f}")
            metrics.write(step + 1, {"loss/flow": value, "grad_norm": float(grad_norm), "lr": lr,
                                     "time/elapsed": time.time() - metrics.started})
        if ev.every and (step + 1) % ev.every == 0 and step + 1 < tc.steps:
            values = evaluation(ema_pipe, step + 1, ev.samples_per_prompt)
            if ev.save_snapshots:
                save_asset(ema_pipe, run_dir / f"step_{step + 1:06d}",
                           _settings(task, family, pipe, conf, step + 1, values))
    for live, ema in zip(modules, ema_modules):  # the live modules become the EMA weights (what is saved)
        live.load_state_dict(ema.state_dict())
        live.eval()
    return ema_pipe, losses


def _settings(task: Task, family, pipe, conf, step: int, measured: dict[str, float]) -> dict:
    return {**family.asset_settings(pipe, conf), **task.asset_settings(conf), "step": step,
            "num_inference_steps": conf.eval.num_inference_steps, "measured": _measured(measured)}


def samples_per_second(family, pipe, prompt: str, conf) -> float:
    """Samples/s at batch 16, the evaluation's steps, guidance 1 (no CFG), 64 samples."""
    t0 = time.time()
    family.sample(pipe, [prompt] * 64, 1.0, conf.eval.num_inference_steps, 0, 16, conf)
    return 64 / (time.time() - t0)


def run(cfg: dict, run_dir: Path, log: Callable[[str], Any] = print) -> dict[str, float]:
    """Pretrain the task's tiny pipeline (VAE, then transformer + text encoders), evaluate, save; returns the final
    metrics."""
    task, conf = load_config(cfg)
    family = MODELS[task.model]
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out_dir = Path(conf.output_dir) if conf.output_dir else run_dir / "pipeline"
    torch.set_num_threads(conf.threads)
    torch.set_flush_denormal(True)  # denormal floats make CPU convolutions crawl late in training
    _seed_everything(conf.seed)
    generator = torch.Generator().manual_seed(conf.seed)
    metrics = _Metrics(run_dir / "metrics.jsonl")
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(conf), indent=2) + "\n")
    started = time.time()
    train_specs, held_out = task.split(conf)
    log(f"{task.name}: {len(train_specs)} train prompts, {len(held_out)} held-out eval prompts")
    data, prompts = render_dataset(task, family, train_specs, conf)
    pipe = task.build_pipeline(conf)
    pipe.set_progress_bar_config(disable=True)
    result = {"vae/mse": train_vae(pipe.vae, data, family, conf.vae, generator, metrics, log)}
    pipe.vae.requires_grad_(False)
    vae_metrics = task.after_vae(pipe.vae, held_out, conf)
    if vae_metrics:
        metrics.write(conf.vae.steps, vae_metrics)
        log("vae: " + ", ".join(f"{k} {v:.3f}" for k, v in vae_metrics.items()))
    result.update(vae_metrics)
    evaluation = _Evaluation(task, family, conf, train_specs, held_out, metrics, log)
    ema_pipe, losses = train_transformer(task, family, pipe, data, prompts, conf, generator, metrics, evaluation,
                                         run_dir, log)
    result["loss/flow"] = float(np.mean(losses[-200:])) if losses else float("nan")
    result["time/train"] = time.time() - started
    result.update(evaluation(ema_pipe, conf.transformer.steps,
                             conf.eval.final_samples_per_prompt or conf.eval.samples_per_prompt))
    result["samples_per_s"] = samples_per_second(family, ema_pipe, held_out[0].prompt, conf)
    family.save_samples(ema_pipe, held_out, run_dir, conf, conf.seed + 30_000)
    save_asset(pipe, out_dir, _settings(task, family, pipe, conf, conf.transformer.steps, result))
    log(f"saved pipeline to {out_dir} ({result['time/train']:.0f}s training, {result['samples_per_s']:.1f} samples/s)")
    (run_dir / "final.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result


def evaluate_pipeline(directory: str | Path, samples_per_prompt: int = 4, guidance_scales=(1.0, 3.0),
                      steps: int = 10, seed: int = 0, train_prompts: int = 64, batch_size: int = 64) -> dict[str, float]:
    """Score a saved pipeline on the held-out prompts and on ``train_prompts`` training (RL) prompts.

    Uses the task and split recorded in its grove.json; sampling seeds and the training-prompt subset are the ones
    ``run`` uses for its final evaluation with the same ``seed``, so the numbers are comparable.
    """
    path = Path(directory) / "grove.json"
    settings = json.loads(path.read_text()) if path.is_file() else {}
    task = get_task(settings.get("task", "shapes"), f"{path}: task")
    family = MODELS[task.model]
    pipe = family.load(directory)
    _, conf = load_config({"task": task.name, "seed": seed, "split_seed": settings.get("split_seed", 0),
                           **family.asset_config(settings),
                           "eval": {"num_inference_steps": steps, "guidance_scales": list(guidance_scales),
                                    "batch_size": batch_size, "train_prompts": train_prompts}})
    train_specs, held_out = task.split(conf)
    values = _Evaluation(task, family, conf, train_specs, held_out, None, None).measure(pipe, samples_per_prompt)
    values["samples_per_s"] = samples_per_second(family, pipe, held_out[0].prompt, conf)
    return values


def main(argv: list[str] | None = None) -> dict[str, float]:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, nargs="?")
    parser.add_argument("--evaluate", type=Path, default=None, metavar="PIPELINE_DIR",
                        help="only score a saved pipeline (held-out and training prompts, guidance 1 and 3)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="where to save the pipeline (overrides output_dir)")
    parser.add_argument("--run-dir", type=Path, default=None, help="metrics/samples folder (default: runs/<name>)")
    parser.add_argument("--steps", type=int, default=None, help="override transformer.steps (quick trials)")
    args = parser.parse_args(argv)
    if args.evaluate is not None:
        torch.set_num_threads(args.threads)
        torch.set_flush_denormal(True)
        values = evaluate_pipeline(args.evaluate)
        print(json.dumps({k: round(v, 4) for k, v in values.items()}, indent=2))
        return values
    if args.config is None:
        parser.error("a config is required unless --evaluate is given")
    cfg = yaml.safe_load(args.config.read_text()) or {}
    cfg.pop("kind", None)
    cfg.pop("domain", None)
    if args.out is not None:
        cfg["output_dir"] = str(args.out)
    if args.steps is not None:
        cfg.setdefault("transformer", {})["steps"] = args.steps
    run_dir = args.run_dir or Path("runs") / f"{args.config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    return run(cfg, run_dir, print)


if __name__ == "__main__":
    main()
