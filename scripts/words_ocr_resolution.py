"""How well does the OCR reward read the words task's ground truth, per image size and OCR setting?

Renders every word of ``visgen.tasks.words`` (512, or every ``--every``-th; jittered as in pretraining) at each size, reads them with
``visgen.rewards.ocr`` under several settings and prints, per (size, setting): the exact-read rate, the mean OCR
score and the milliseconds per image on one onnxruntime thread. ``--vae DIR`` also reads the VAE reconstructions
of a saved pipeline (the latent bottleneck the generator must draw through). The table in docs/tasks/words.md is
this script's output:

    nice -n 10 python scripts/words_ocr_resolution.py [--sizes 16 24 32 48 64] [--vae assets/words-sd3-tiny]
"""
from __future__ import annotations

import argparse
import time

import torch

from visgen.rewards.ocr import OcrReward
from visgen.tasks import words

SETTINGS = {
    "det+rec, det input 736 (RapidOCR default)": {"mode": "det_rec", "det_limit_side_len": 736},
    "det+rec, det input 64": {"mode": "det_rec", "det_limit_side_len": 64},
    "det+rec, det input 64, image x2 bicubic": {"mode": "det_rec", "det_limit_side_len": 64, "upscale": 2},
    "rec only (whole image = one line)": {"mode": "rec"},
}


def measure(reward: OcrReward, images: torch.Tensor, prompts: list[str]) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    score = reward(images, prompts)["ocr"]
    ms = (time.perf_counter() - t0) / len(prompts) * 1000
    return float((score == 1).float().mean()), float(score.mean()), ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 24, 32, 48, 64])
    parser.add_argument("--vae", default=None, help="a saved words pipeline: also read its VAE reconstructions")
    parser.add_argument("--every", type=int, default=1, help="use every k-th word only (quicker)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    specs = words.all_prompts()[::args.every]
    prompts = [s.prompt for s in specs]
    readers = {name: OcrReward(num_threads=1, **kw) for name, kw in SETTINGS.items()}
    print("| size | font px | setting | exact | OCR score | ms/image |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        images = torch.from_numpy(words.render_batch(specs, seed=0, size=size))
        for name, reader in readers.items():
            exact, score, ms = measure(reader, images, prompts)
            print(f"| {size} | {words.font_size_for(size)} | {name} | {exact:.3f} | {score:.3f} | {ms:.0f} |", flush=True)
    if args.vae:
        from visgen import tiny

        pipe = tiny.load_shapes_asset(args.vae)
        size = int(tiny.asset_settings(args.vae).get("resolution", words.IMAGE_SIZE))
        images = torch.from_numpy(words.render_batch(specs, seed=0, size=size))
        with torch.no_grad():
            recon = (pipe.vae.decode(pipe.vae.encode(images * 2 - 1).latent_dist.mean).sample / 2 + 0.5).clamp(0, 1)
        for name, reader in readers.items():
            exact, score, ms = measure(reader, recon, prompts)
            print(f"| {size} (VAE round trip) | {words.font_size_for(size)} | {name} | {exact:.3f} | {score:.3f} | {ms:.0f} |")


if __name__ == "__main__":
    main()
