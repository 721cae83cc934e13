"""Supervised pretraining of the tiny SD3 pipeline on the procedural shapes task (the RL demo's starting point).

Two stages, both seeded:

1. VAE (``AutoencoderKL``) on rendered shapes: pixel MSE plus a small KL term. Afterwards ``shift_factor`` and
   ``scaling_factor`` are set from the latent mean/std so the transformer sees roughly unit-variance latents.
2. Transformer and both CLIP text encoders jointly, by rectified flow (Liu et al., "Flow Straight and Fast",
   2022; the SD3 recipe of Esser et al., 2024): x_t = (1-t)·x0 + t·ε with logit-normal t, the model predicts
   v = ε - x0 at timestep 1000·t, MSE loss; 10% of prompts are replaced by "" so classifier-free guidance
   (Ho & Salimans, 2022) works at sampling time. An EMA of the weights is what gets evaluated and saved.

Periodic evaluation samples held-out prompts with the stock pipeline (10 Euler ODE steps) at each guidance
scale in the config and scores them with the analytic shapes checker: ``eval/<split>_g<g>/score`` (mean
fraction of attributes correct) and ``.../strict`` (all correct).

The ``words`` task (``task: words``, ``visgen.tasks.words``) trains the same way on rendered signs with a
tokenizer that spells the quoted word letter by letter; its evaluation reads the samples with the OCR reward
(``visgen.rewards.ocr``): ``.../ocr`` (1 - normalised edit distance) and ``.../exact`` (read exactly), and
``vae/ocr`` checks that the VAE's reconstructions of held-out renders stay legible.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from visgen import tiny
from visgen.tasks import shapes

try:  # the lead's typed config loader; a minimal local fallback keeps this module usable on its own
    from shared_rl.config import ConfigError, from_dict
except ImportError:  # pragma: no cover - exercised only before shared_rl.config exists

    class ConfigError(ValueError):
        pass

    def from_dict(cls, data, where="config"):
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
        kwargs = {}
        for name, value in data.items():
            ftype = fields[name].type
            sub = globals().get(ftype) if isinstance(ftype, str) else ftype
            if dataclasses.is_dataclass(sub):
                value = from_dict(sub, value, where=f"{where}.{name}")
            kwargs[name] = value
        return cls(**kwargs)


@dataclass
class VaeStage:
    steps: int = 1500
    batch_size: int = 64
    lr: float = 2e-3
    kl_weight: float = 1e-6


@dataclass
class TransformerStage:
    steps: int = 6000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 200
    empty_prompt_prob: float = 0.1
    logit_normal_mean: float = 0.0
    logit_normal_std: float = 1.0
    ema_decay: float = 0.999
    grad_clip: float = 1.0
    # "constant" (after warm-up) makes the step-k snapshot of a long run equal to a k-step run's result.
    lr_schedule: str = "constant"


@dataclass
class PretrainEvalSettings:
    every: int = 1000
    samples_per_prompt: int = 1
    final_samples_per_prompt: int = 4
    num_inference_steps: int = 10
    guidance_scales: list = field(default_factory=lambda: [1.0, 3.0])
    batch_size: int = 64
    train_prompts: int = 64  # how many training (RL) prompts to score alongside the held-out ones
    save_snapshots: bool = True  # save the EMA pipeline at every periodic eval under run_dir/step_<k>


@dataclass
class PretrainConfig:
    task: str = "shapes"  # or "words"
    seed: int = 0
    threads: int = 1  # one thread was ~10x faster than two on 2 shared cores
    split_seed: int = 0
    eval_fraction: float = 0.2
    dataset_size: int = 16384
    output_dir: str | None = None
    log_every: int = 50
    resolution: int = 32  # image side (words only; the shapes renderer draws 32x32)
    pipeline: dict = field(default_factory=dict)  # extra tiny.build_pipeline arguments (words only)
    vae: VaeStage = field(default_factory=VaeStage)
    transformer: TransformerStage = field(default_factory=TransformerStage)
    eval: PretrainEvalSettings = field(default_factory=PretrainEvalSettings)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _render_dataset(specs: list, n: int, seed: int, render=None) -> tuple[torch.Tensor, list[str]]:
    rng = np.random.default_rng(seed)
    chosen = [specs[i] for i in rng.integers(len(specs), size=n)]
    render = render or shapes.render
    images = np.stack([render(s, rng) for s in chosen])
    return torch.from_numpy(images), [s.prompt for s in chosen]


def _lr_factor(step: int, warmup: int, total: int, schedule: str = "cosine") -> float:
    """Linear warm-up, then constant or cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


class _Metrics:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def write(self, step: int, values: dict[str, float]) -> None:
        row = {"step": step, **{k: float(v) for k, v in values.items()}}
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


def train_vae(pipe, images: torch.Tensor, cfg: VaeStage, generator: torch.Generator, log, metrics: _Metrics):
    """Reconstruction training of ``pipe.vae`` on ``images`` in [0,1]; returns the final MSE (in [-1,1] units)."""
    from tqdm import tqdm

    vae = pipe.vae
    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=cfg.lr, weight_decay=0.0)
    data = images * 2.0 - 1.0
    bar = tqdm(range(cfg.steps), desc="vae", mininterval=5.0, disable=None)
    recent = []
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * _lr_factor(step, 50, cfg.steps)
        idx = torch.randint(len(data), (cfg.batch_size,), generator=generator)
        x = data[idx]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(z).sample
        mse = F.mse_loss(recon, x)
        kl = posterior.kl().mean() / x[0].numel()
        loss = mse + cfg.kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        recent.append(mse.item())
        if (step + 1) % 50 == 0:
            value = float(np.mean(recent[-50:]))
            bar.set_postfix(mse=f"{value:.4f}")
            metrics.write(step + 1, {"vae/mse": value, "vae/kl": kl.item()})
    vae.eval()
    final = float(np.mean(recent[-100:]))
    log(f"vae: {cfg.steps} steps, reconstruction MSE {final:.4f}")
    return final


@torch.no_grad()
def encode_dataset(vae, images: torch.Tensor, batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of every image (unscaled latents)."""
    means, stds = [], []
    for start in range(0, len(images), batch_size):
        dist = vae.encode(images[start : start + batch_size] * 2.0 - 1.0).latent_dist
        means.append(dist.mean)
        stds.append(dist.std)
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def sample_images(pipe, prompts: list[str], guidance: float, steps: int, seed: int, batch_size: int) -> torch.Tensor:
    """Stock-pipeline ODE samples ``[N,3,H,W]`` in [0,1]; sample i uses the generator seeded ``seed + i // B``."""
    out = []
    for start in range(0, len(prompts), batch_size):
        generator = torch.Generator().manual_seed(seed + start)
        images = pipe(
            prompts[start : start + batch_size],
            num_inference_steps=steps,
            guidance_scale=guidance,
            max_sequence_length=tiny.MAX_SEQUENCE_LENGTH,
            output_type="pt",
            generator=generator,
        ).images
        out.append(images.float().cpu())
    return torch.cat(out)


_OCR = None


def words_scores(images: torch.Tensor, specs: list) -> dict[str, float]:
    """OCR score (1 - normalised edit distance) and exact-read rate of word images (``visgen.rewards.ocr``)."""
    global _OCR
    from visgen.rewards.ocr import OcrReward
    from visgen.tasks import words

    if _OCR is None:
        _OCR = OcrReward(**words.OCR_SETTINGS)
    score = _OCR(images, [s.prompt for s in specs])["ocr"]
    return {"ocr": float(score.nanmean()), "exact": float((score == 1).float().mean())}


def evaluate(pipe, specs: list, guidance_scales, samples_per_prompt: int, steps: int, seed: int,
             batch_size: int, prefix: str, task: str = "shapes") -> dict[str, float]:
    """Mean attribute score and strict accuracy of pipeline samples for ``specs`` at each guidance scale
    (words: OCR score and exact-read rate)."""
    prompts = [s.prompt for s in specs for _ in range(samples_per_prompt)]
    expanded = [s for s in specs for _ in range(samples_per_prompt)]
    results = {}
    for g in guidance_scales:
        images = sample_images(pipe, prompts, float(g), steps, seed, batch_size)
        if task == "words":
            results.update({f"eval/{prefix}_g{g:g}/{k}": v for k, v in words_scores(images, expanded).items()})
            continue
        score, strict = shapes.score_batch(images.numpy(), expanded)
        tag = f"eval/{prefix}_g{g:g}"
        results[f"{tag}/score"] = float(np.nanmean(score))
        results[f"{tag}/strict"] = float(np.nanmean(strict))
        for kind in ("single", "count", "pair"):
            mask = np.array([s.kind == kind for s in expanded])
            if mask.any():
                results[f"{tag}/strict_{kind}"] = float(np.nanmean(strict[mask]))
    return results


def save_grid(pipe, specs: list, path: Path, guidance_scales, steps: int, seed: int, per_prompt: int = 4) -> None:
    """A PNG grid: one row per (prompt, guidance), ``per_prompt`` samples each, upscaled 4x; prompts in .txt."""
    from torchvision.utils import save_image

    rows, captions = [], []
    for spec in specs:
        for g in guidance_scales:
            rows.append(sample_images(pipe, [spec.prompt] * per_prompt, float(g), steps, seed, per_prompt))
            captions.append(f"g={g:g}: {spec.prompt}")
    grid = torch.cat(rows)
    grid = F.interpolate(grid, scale_factor=4, mode="nearest")
    save_image(grid, path, nrow=per_prompt, padding=2, pad_value=0.5)
    path.with_suffix(".txt").write_text("\n".join(captions) + "\n")


def evaluate_pipeline(directory: str | Path, samples_per_prompt: int = 4, guidance_scales=(1.0, 3.0),
                      steps: int = 10, seed: int = 0, train_prompts: int = 64, batch_size: int = 64) -> dict[str, float]:
    """Score a saved pipeline on the held-out prompts and on ``train_prompts`` training (RL) prompts.

    Uses the split recorded in its grove.json; sampling seeds and the training-prompt subset are the ones
    ``run`` uses for its final evaluation with the same ``seed``, so the numbers are comparable.
    """
    pipe = tiny.load_shapes_asset(directory)
    settings = tiny.asset_settings(directory)
    task = settings.get("task", "shapes")
    module = _task_module(task)
    train_specs, eval_specs = module.split_prompts(settings.get("split_seed", 0), settings.get("eval_fraction", 0.2))
    rl_specs = [train_specs[i] for i in np.random.default_rng(seed + 1).permutation(len(train_specs))][:train_prompts]
    values = evaluate(pipe, eval_specs, guidance_scales, samples_per_prompt, steps, seed + 10_000, batch_size, "heldout",
                      task)
    values.update(evaluate(pipe, rl_specs, guidance_scales, samples_per_prompt, steps, seed + 20_000, batch_size, "train",
                           task))
    t0 = time.time()
    sample_images(pipe, [eval_specs[0].prompt] * 64, 1.0, steps, 0, 16)
    values["samples_per_s"] = 64 / (time.time() - t0)
    return values


def _task_module(task: str):
    if task == "words":
        from visgen.tasks import words

        return words
    return shapes


def _words_vae_check(vae, specs: list, size: int) -> float:
    """OCR score of the VAE's reconstructions of 64 held-out renders (is the latent space legible?)."""
    from visgen.tasks import words

    truth = torch.from_numpy(words.render_batch(specs[:64], seed=123, size=size))
    with torch.no_grad():
        recon = (vae.decode(vae.encode(truth * 2 - 1).latent_dist.mean).sample / 2 + 0.5).clamp(0, 1)
    return words_scores(recon, specs[:64])["ocr"]


def run(cfg: dict, run_dir: Path, log: Callable[[str], Any] = print) -> dict[str, float]:
    """Pretrain the tiny pipeline (VAE, then transformer + text encoders), evaluate, save; returns final metrics."""
    from tqdm import tqdm

    if dict(cfg).get("task") == "video_shapes":  # the tiny Wan on the moving-shapes video task
        from visgen.tasks.video_pretrain import run as run_video

        return run_video(cfg, run_dir, log)
    conf: PretrainConfig = from_dict(PretrainConfig, dict(cfg), where="pretrain")
    if conf.transformer.lr_schedule not in ("constant", "cosine"):
        raise ConfigError(f"pretrain.transformer.lr_schedule: 'constant' or 'cosine', got {conf.transformer.lr_schedule!r}")
    if conf.task not in ("shapes", "words"):
        raise ConfigError(f"pretrain.task: 'shapes', 'words' or 'video_shapes', got {conf.task!r}")
    if conf.task == "shapes" and (conf.resolution != 32 or conf.pipeline):
        raise ConfigError("pretrain.resolution and pretrain.pipeline are for task: words (shapes is 32x32, fixed)")
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

    module = _task_module(conf.task)
    train_specs, eval_specs = module.split_prompts(conf.split_seed, conf.eval_fraction)
    log(f"{conf.task}: {len(train_specs)} train prompts, {len(eval_specs)} held-out eval prompts")
    if conf.task == "words":
        images, prompts = _render_dataset(train_specs, conf.dataset_size, conf.seed,
                                          lambda s, rng: module.render(s.word, rng, conf.resolution))
        pipe = tiny.build_pipeline(words=module.vocabulary(), seed=conf.seed, sample_size=conf.resolution,
                                   **conf.pipeline)
        pipe.tokenizer = pipe.tokenizer_2 = module.build_tokenizer()  # same ids; spells the quoted word
    else:
        images, prompts = _render_dataset(train_specs, conf.dataset_size, conf.seed)
        pipe = tiny.build_pipeline(seed=conf.seed)
    pipe.set_progress_bar_config(disable=True)
    vae_mse = train_vae(pipe, images, conf.vae, generator, log, metrics)
    for p in pipe.vae.parameters():
        p.requires_grad_(False)
    lat_mean, lat_std = encode_dataset(pipe.vae, images)
    shift = float(lat_mean.mean())
    scale = float(1.0 / (lat_mean - shift).std())
    pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    log(f"vae latents: shift_factor {shift:.4f}, scaling_factor {scale:.4f} ({time.time() - started:.0f}s)")
    vae_extra = {}
    if conf.task == "words":
        vae_extra["vae/ocr"] = _words_vae_check(pipe.vae, eval_specs, conf.resolution)
        metrics.write(conf.vae.steps, vae_extra)
        log(f"vae: OCR score of reconstructed held-out renders {vae_extra['vae/ocr']:.3f}")

    # ---- transformer + text encoders -------------------------------------------------------------------------
    tc = conf.transformer
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train()
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    ema_modules = [copy.deepcopy(m).eval().requires_grad_(False) for m in modules]
    ema_pipe = copy.copy(pipe)  # shares vae/tokenizers/scheduler; swaps in the EMA networks
    ema_pipe.transformer, ema_pipe.text_encoder, ema_pipe.text_encoder_2 = ema_modules
    ema_pipe.scheduler = copy.deepcopy(pipe.scheduler)

    rl_specs = [train_specs[i] for i in np.random.default_rng(conf.seed + 1).permutation(len(train_specs))]
    rl_specs = rl_specs[: conf.eval.train_prompts]
    ev = conf.eval
    result: dict[str, float] = {"vae/mse": vae_mse, **vae_extra}

    def run_eval(step: int, samples: int) -> dict[str, float]:
        t0 = time.time()
        values = evaluate(ema_pipe, eval_specs, ev.guidance_scales, samples, ev.num_inference_steps,
                          conf.seed + 10_000, ev.batch_size, "heldout", conf.task)
        values.update(evaluate(ema_pipe, rl_specs, ev.guidance_scales, samples, ev.num_inference_steps,
                               conf.seed + 20_000, ev.batch_size, "train", conf.task))
        values["time/eval"] = time.time() - t0
        metrics.write(step, values)
        summary = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in values.items()
                            if k.endswith(("/score", "/strict", "/ocr", "/exact")))
        log(f"step {step}: {summary}")
        return values

    bar = tqdm(range(tc.steps), desc="transformer", mininterval=5.0, disable=None)
    losses = []
    for step in bar:
        lr = tc.lr * _lr_factor(step, tc.warmup_steps, tc.steps, tc.lr_schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(images), (tc.batch_size,), generator=generator)
        latents = lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=generator)
        x0 = (latents - shift) * scale
        drop = torch.rand(tc.batch_size, generator=generator) < tc.empty_prompt_prob
        batch_prompts = ["" if d else prompts[i] for d, i in zip(drop.tolist(), idx.tolist())]
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=batch_prompts, prompt_2=None, prompt_3=None, device=torch.device("cpu"),
            do_classifier_free_guidance=False, max_sequence_length=tiny.MAX_SEQUENCE_LENGTH,
        )
        t = torch.sigmoid(tc.logit_normal_mean + tc.logit_normal_std * torch.randn(tc.batch_size, generator=generator))
        noise = torch.randn(x0.shape, generator=generator)
        tb = t.view(-1, 1, 1, 1)
        x_t = (1.0 - tb) * x0 + tb * noise
        pred = pipe.transformer(
            hidden_states=x_t, timestep=t * 1000.0, encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled, return_dict=False,
        )[0]
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
                                     "time/elapsed": time.time() - started})
        if ev.every and (step + 1) % ev.every == 0 and step + 1 < tc.steps:
            run_eval(step + 1, ev.samples_per_prompt)
            if ev.save_snapshots:
                tiny.save_pipeline(ema_pipe, run_dir / f"step_{step + 1:06d}", {"step": step + 1, **(
                    {"task": "words", "split_seed": conf.split_seed, "eval_fraction": conf.eval_fraction}
                    if conf.task == "words" else {})})

    result["loss/flow"] = float(np.mean(losses[-200:]))
    result["time/train"] = time.time() - started
    result.update(run_eval(tc.steps, ev.final_samples_per_prompt))

    # Sampling speed: images/s at batch 16, 10 steps, guidance 1 (no CFG).
    t0 = time.time()
    sample_images(ema_pipe, [eval_specs[0].prompt] * 64, 1.0, ev.num_inference_steps, 0, 16)
    result["samples_per_s"] = 64 / (time.time() - t0)
    save_grid(ema_pipe, eval_specs[:: max(1, len(eval_specs) // 8)][:8], run_dir / "samples.png",
              ev.guidance_scales, ev.num_inference_steps, conf.seed + 30_000)

    for live, ema in zip(modules, ema_modules):
        live.load_state_dict(ema.state_dict())
        live.eval()
    extra = {
        **({"task": "words"} if conf.task == "words" else {}),
        "split_seed": conf.split_seed,
        "eval_fraction": conf.eval_fraction,
        "num_inference_steps": ev.num_inference_steps,
        "measured": {k: round(v, 4) for k, v in result.items()},
    }
    tiny.save_pipeline(pipe, out_dir, extra)
    log(f"saved pipeline to {out_dir} ({result['time/train']:.0f}s training, {result['samples_per_s']:.1f} img/s)")
    (run_dir / "final.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result


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
