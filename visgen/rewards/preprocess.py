"""The image pre-processing of the CLIP/BLIP-family reward models, exactly as their reference code does it.

The anchors (Flow-GRPO, DanceGRPO, DDPO, the reward models' own repositories) hand these models PIL images made
from uint8 pixels; the models' eval transforms then resize the shorter side to ``size`` with PIL's bicubic filter
(the long side becomes ``int(size * long / short)``), centre-crop ``size x size``, scale to [0,1] and normalise by
the CLIP mean/std. Two details differ between the libraries and are kept apart here:

- the crop offset: torchvision's ``CenterCrop`` (open_clip: HPSv2; ImageReward; the LAION aesthetic predictor
  through OpenAI CLIP) rounds ``(H - size) / 2``, the transformers ``CLIPImageProcessor`` (PickScore, CLIPScore
  through transformers) floors it (``crop="round"`` / ``"floor"``);
- transformers 5's ``CLIPImageProcessor`` resizes with torchvision's antialiased bicubic, not PIL's: up to 0.03
  (normalised units) from the PIL transform the models were trained with; grove uses the PIL transform.

Feeding float tensors straight into a transformers processor (``do_rescale=False``) is *not* equivalent: on
transformers 5 it differed from the uint8 path by up to 0.63 (normalised units), so every reward here quantises
to uint8 first, like the anchors.

The differentiable path (:func:`differentiable_preprocess`, the rewards' ``differentiable`` calls that DiffusionOPSD
follows) is the same geometry in torch: Pillow's bicubic kernel and weights (:func:`pil_bicubic_weights`), the
horizontal pass then the vertical one, each clipped to [0,1], the same crop, the same normalisation — without the
uint8 roundings, so it is a smooth function of the pixels (within 1-2 uint8 levels of the PIL path, measured at
real sizes in ``tests/visgen/test_rewards_differentiable.py``). Its value is then the PIL path's exactly
(straight-through: ``smooth + (pil - smooth).detach()``), its gradient the smooth filter's.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from .base import RewardInputError, to_uint8

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """(width, height) after resizing the shorter side to ``size`` (long side truncated, as both libraries do)."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def pil_resize_crop(pixels: np.ndarray, size: int, crop: str = "round") -> np.ndarray:
    """One ``[H,W,3]`` uint8 image -> ``[size,size,3]`` uint8: PIL bicubic shorter-side resize, centre crop."""
    from PIL import Image

    if crop not in ("round", "floor"):
        raise RewardInputError(f"crop must be 'round' (torchvision) or 'floor' (transformers), got {crop!r}")
    image = Image.fromarray(pixels)
    w, h = image.size
    nw, nh = resized_size(w, h, size)
    if (nw, nh) != (w, h):
        image = image.resize((nw, nh), Image.BICUBIC)
    if crop == "round":
        top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
    else:
        top, left = (nh - size) // 2, (nw - size) // 2
    return np.asarray(image.crop((left, top, left + size, top + size)))


def clip_preprocess(images: torch.Tensor, size: int, mean: Sequence[float] = OPENAI_CLIP_MEAN,
                    std: Sequence[float] = OPENAI_CLIP_STD, crop: str = "round") -> torch.Tensor:
    """``[B,3,H,W]`` in [0,1] -> ``[B,3,size,size]`` normalised model input (uint8 -> PIL -> resize/crop)."""
    pixels = np.stack([pil_resize_crop(p, size, crop) for p in to_uint8(images)])
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255.0
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def _pil_bicubic(x: float) -> float:
    """Pillow's bicubic kernel (``Resample.c``: a = -0.5, support 2)."""
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


@functools.lru_cache(maxsize=64)
def pil_bicubic_weights(in_size: int, out_size: int) -> np.ndarray:
    """``[out_size, in_size]`` float64: the weights of Pillow's bicubic resize of one axis (its ``precompute_coeffs``:
    the kernel's support widened by the reduction factor, the taps from ``int(centre ± support + 0.5)`` clipped to the
    image, each output's weights normalised to sum 1)."""
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support, inv = 2.0 * filterscale, 1.0 / filterscale
    weights = np.zeros((out_size, in_size))
    for out in range(out_size):
        centre = (out + 0.5) * scale
        lo = max(int(centre - support + 0.5), 0)
        hi = min(int(centre + support + 0.5), in_size)
        taps = [_pil_bicubic((x - centre + 0.5) * inv) for x in range(lo, hi)]
        total = sum(taps)
        weights[out, lo:hi] = [t / total for t in taps] if total != 0.0 else taps
    return weights


def smooth_preprocess(images: torch.Tensor, size: int, mean: Sequence[float] = OPENAI_CLIP_MEAN,
                      std: Sequence[float] = OPENAI_CLIP_STD, crop: str = "round") -> torch.Tensor:
    """:func:`clip_preprocess` in torch without its roundings, with the graph to ``images``: Pillow's bicubic weights
    (:func:`pil_bicubic_weights`), horizontal pass then vertical, each clipped to [0,1] as Pillow clips, the centre
    crop and the normalisation. float64 images stay float64 (finite-difference checks), others compute in float32."""
    if crop not in ("round", "floor"):
        raise RewardInputError(f"crop must be 'round' (torchvision) or 'floor' (transformers), got {crop!r}")
    dtype = torch.float64 if images.dtype == torch.float64 else torch.float32
    x = images.to(dtype).clamp(0, 1)
    h, w = x.shape[-2:]
    nw, nh = resized_size(w, h, size)
    if (nw, nh) != (w, h):
        if nw != w:
            x = (x @ torch.from_numpy(pil_bicubic_weights(w, nw)).to(x.device, dtype).T).clamp(0, 1)
        if nh != h:
            x = (torch.from_numpy(pil_bicubic_weights(h, nh)).to(x.device, dtype) @ x).clamp(0, 1)
    if crop == "round":
        top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
    else:
        top, left = (nh - size) // 2, (nw - size) // 2
    x = x[..., top:top + size, left:left + size]
    return (x - torch.tensor(mean, device=x.device, dtype=dtype).view(1, 3, 1, 1)) / torch.tensor(
        std, device=x.device, dtype=dtype).view(1, 3, 1, 1)


def differentiable_preprocess(images: torch.Tensor, size: int, mean: Sequence[float] = OPENAI_CLIP_MEAN,
                              std: Sequence[float] = OPENAI_CLIP_STD, crop: str = "round",
                              straight_through: bool = True) -> torch.Tensor:
    """The rewards' differentiable model input on ``images``' device: the PIL path's values (:func:`clip_preprocess`,
    so the differentiable score is the scored one) with the gradient of :func:`smooth_preprocess`
    (straight-through); ``straight_through=False``: the smooth function itself (its value within 1-2 uint8 levels)."""
    smooth = smooth_preprocess(images, size, mean, std, crop)
    if not straight_through:
        return smooth
    exact = clip_preprocess(images.detach(), size, mean, std, crop).to(smooth.device, smooth.dtype)
    return smooth + (exact - smooth).detach()


def processor_geometry(processor) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
    """(crop size, mean, std) of a transformers CLIP image processor (or a processor wrapping one)."""
    ip = getattr(processor, "image_processor", processor)
    crop = getattr(ip, "crop_size", None) or {}
    size = crop.get("height") if isinstance(crop, dict) else getattr(crop, "height", None)
    if size is None:
        s = getattr(ip, "size", None) or {}
        size = s.get("shortest_edge") if isinstance(s, dict) else getattr(s, "shortest_edge", None)
    if size is None:
        raise RewardInputError(f"cannot read the image size from processor {type(ip).__name__}")
    return int(size), tuple(ip.image_mean), tuple(ip.image_std)


def load_checkpoint_file(where: str, checkpoint: str) -> dict[str, torch.Tensor]:
    """A tensor state dict from a local ``.safetensors``/``.pt``/``.pth`` file or ``"<hub repo>:<file>"``
    (fetched with huggingface_hub when the reward is built). Never unpickles arbitrary objects."""
    from pathlib import Path

    path = Path(checkpoint).expanduser()
    if not path.is_file():
        if ":" in checkpoint and not checkpoint.startswith(("/", ".", "~")):
            repo, filename = checkpoint.split(":", 1)
            try:
                from huggingface_hub import hf_hub_download

                path = Path(hf_hub_download(repo, filename))
            except Exception as exc:  # noqa: BLE001 — offline, unknown repo: one line saying what to do
                raise RewardInputError(f"{where}: cannot fetch {checkpoint!r} ({type(exc).__name__}); download it "
                                       "and pass its local path as checkpoint") from None
        else:
            raise RewardInputError(f"{where}: checkpoint {checkpoint!r} is neither a file nor '<hub repo>:<file>'")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise RewardInputError(f"{where}: {path} is not a plain tensor state dict ({type(exc).__name__}); convert it "
                               "to safetensors with a trusted script") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise RewardInputError(f"{where}: {path} holds a {type(state).__name__}, not a state dict")
    return {k.removeprefix("module."): v for k, v in state.items()}
