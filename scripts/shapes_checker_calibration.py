"""Calibrate (and re-check) the shapes checker's shape thresholds on generated-looking images.

Renders single-object ground truth for every colour/shape/position, degrades it the way a small generator's
samples look (Gaussian blur, additive noise, brightness loss, optionally a VAE round-trip through a saved
pipeline), measures the per-component features the checker uses (3- and 4-fold angular moments) and prints, per
degradation, the feature range per true shape, the accuracy of the frozen thresholds, and the
accuracy-maximising square/circle threshold as a cross-check.

    python scripts/shapes_checker_calibration.py [--vae assets/shapes-sd3-tiny]
"""
from __future__ import annotations

import argparse

import numpy as np
from scipy import ndimage

from visgen.tasks import shapes as S


def degrade(images: np.ndarray, blur: float, noise: float, rng: np.random.Generator) -> np.ndarray:
    out = images.copy()
    if blur > 0:
        out = ndimage.gaussian_filter(out, sigma=(0, 0, blur, blur))
    out = out * rng.uniform(0.75, 1.0, size=(len(out), 1, 1, 1)) + noise * rng.standard_normal(out.shape)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def vae_roundtrip(images: np.ndarray, directory: str) -> np.ndarray:
    import torch

    from visgen import tiny

    vae = tiny.load_shapes_asset(directory).vae
    with torch.no_grad():
        x = torch.from_numpy(images) * 2 - 1
        recon = vae.decode(vae.encode(x).latent_dist.mean).sample
    return ((recon + 1) / 2).clamp(0, 1).numpy()


def features(images: np.ndarray, specs: list) -> list[tuple[str, float, float, str]]:
    rows = []
    for image, spec in zip(images, specs):
        comps = [c for c in S.find_components(image) if c.color == spec.objects[0].color]
        if comps:
            c = max(comps, key=lambda c: c.area)
            rows.append((spec.objects[0].shape, c.threefold, c.fourfold, c.shape))
        else:
            rows.append((spec.objects[0].shape, np.nan, np.nan, "missing"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vae", default=None, help="saved pipeline whose VAE round-trip to add as a degradation")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    specs = [s for s in S.all_prompts() if s.kind == "single"] * args.repeats
    clean = np.stack([S.render(s, rng) for s in specs])
    settings = [(0.0, 0.0), (0.5, 0.03), (0.8, 0.05), (1.0, 0.08), (1.2, 0.1)]
    variants = [(f"blur {b} noise {n}", degrade(clean, b, n, rng)) for b, n in settings]
    if args.vae:
        variants.append(("vae round-trip", vae_roundtrip(clean, args.vae)))
        variants.append(("vae + blur 0.8 noise 0.05", degrade(vae_roundtrip(clean, args.vae), 0.8, 0.05, rng)))
    print(f"frozen: TRIANGLE_MIN_THREEFOLD={S.TRIANGLE_MIN_THREEFOLD} SQUARE_MIN_FOURFOLD={S.SQUARE_MIN_FOURFOLD}")
    for name, images in variants:
        rows = features(images, specs)
        true = np.array([r[0] for r in rows])
        threefold = np.array([r[1] for r in rows])
        fourfold = np.array([r[2] for r in rows])
        pred = np.array([r[3] for r in rows])
        print(f"\n== {name}: accuracy {np.mean(pred == true):.3f}  (missing {np.mean(pred == 'missing'):.3f})")
        for shape in S.SHAPES:
            m = true == shape
            q = lambda a: " ".join(f"{v:.3f}" for v in np.nanquantile(a[m], [0.0, 0.5, 1.0]))
            print(f"  {shape:8s} 3-fold min/med/max {q(threefold)} | 4-fold {q(fourfold)} | "
                  f"acc {np.mean(pred[m] == shape):.3f}")
        sc = np.isin(true, ["square", "circle"]) & np.isfinite(fourfold)
        grid = np.arange(0.05, 0.35, 0.01)
        acc = [np.mean((fourfold[sc] >= t) == (true[sc] == "square")) for t in grid]
        best = grid[int(np.argmax(acc))]
        frozen = np.mean((fourfold[sc] >= S.SQUARE_MIN_FOURFOLD) == (true[sc] == "square"))
        print(f"  best square/circle 4-fold threshold {best:.2f} (acc {max(acc):.3f}); "
              f"frozen {S.SQUARE_MIN_FOURFOLD} acc {frozen:.3f}")


if __name__ == "__main__":
    main()
