"""JPEG (in)compressibility rewards from DDPO (Black et al., "Training Diffusion Models with Reinforcement
Learning", 2023): the size in kB of the image saved as JPEG at quality 95. ``jpeg_incompressibility`` is the
size, ``jpeg_compressibility`` its negation (smaller files score higher). Prompt-independent.
"""
from __future__ import annotations

import io
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from .base import RewardInfo, check_batch, register


def jpeg_size_kb(image: np.ndarray, quality: int = 95) -> float:
    """Size in kB (1000 bytes) of a ``[H,W,3]`` uint8 image encoded as JPEG at ``quality``."""
    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


def _sizes(images: torch.Tensor, quality: int) -> torch.Tensor:
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    finite = torch.isfinite(images.detach().float()).flatten(1).all(dim=1).cpu()
    sizes = [jpeg_size_kb(p, quality) if ok else float("nan") for p, ok in zip(pixels, finite.tolist())]
    return torch.tensor(sizes, dtype=torch.float32)


class JpegSize:
    def __init__(self, name: str, sign: float, quality: int = 95):
        if not 1 <= quality <= 100:
            raise ValueError(f"JPEG quality must be in [1, 100], got {quality}")
        self.name, self.sign, self.quality = name, sign, quality

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        return {self.name: self.sign * _sizes(images, self.quality)}


@register("jpeg_compressibility", RewardInfo(range="-kB (<= 0; ~-60..0 for 512x512 images)",
                                             summary="DDPO: minus the JPEG size (quality 95) in kB"))
def build_jpeg_compressibility(quality: int = 95) -> JpegSize:
    return JpegSize("jpeg_compressibility", -1.0, quality)


@register("jpeg_incompressibility", RewardInfo(range="kB (>= 0; ~0..60 for 512x512 images)",
                                               summary="DDPO: the JPEG size (quality 95) in kB"))
def build_jpeg_incompressibility(quality: int = 95) -> JpegSize:
    return JpegSize("jpeg_incompressibility", 1.0, quality)
