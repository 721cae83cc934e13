"""The reward contract shared by every image reward: the registry, the input error and the batch check.

It is a module of its own (not the package ``__init__``) so that the reward modules can import it while the
package imports them to register the built-ins, without an import cycle; ``visgen.rewards`` re-exports all of it.

Each registered reward carries a :class:`RewardInfo` (where its weights come from, their licence, the range of its
score, the extra it needs): ``grove rewards`` prints them and ``docs/rewards.md`` is checked against them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch


class RewardInputError(ValueError):
    """A malformed reward call (wrong shape, range, lengths) or an unknown reward name."""


class RewardFn(Protocol):
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
    ) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class RewardInfo:
    """What ``grove rewards`` lists about a reward."""

    weights: str = "none (analytic)"  # where the weights come from (hub id, wheel, none)
    licence: str = "Apache-2.0 (grove)"
    range: str = ""  # the score's range as the reward returns it (after its configured scaling)
    extra: str = ""  # the pip extra / package it needs ("" = core install)
    summary: str = ""
    # the reward object offers ``differentiable(images, prompts, metadata) -> {name: [B] with grad to images}``
    # (DiffusionOPSD follows its gradient); the others score without gradients only
    differentiable: bool = False


_REGISTRY: dict[str, Callable[..., RewardFn]] = {}
_INFO: dict[str, RewardInfo] = {}


def register(name: str, info: RewardInfo | None = None) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator registering a reward factory under ``name`` (a duplicate name is an error)."""

    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise RewardInputError(f"reward {name!r} is already registered (by {_REGISTRY[name].__module__})")
        _REGISTRY[name] = factory
        summary = ((factory.__doc__ or "").strip().splitlines() or [""])[0]
        _INFO[name] = info or RewardInfo(summary=summary)
        if info is not None and not info.summary:
            _INFO[name] = RewardInfo(info.weights, info.licence, info.range, info.extra, summary, info.differentiable)
        return factory

    return wrap


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def reward_info(name: str) -> RewardInfo:
    if name not in _REGISTRY:
        raise RewardInputError(f"unknown reward {name!r}; available: {', '.join(available_rewards())}")
    return _INFO.get(name, RewardInfo())


def get_reward(name: str, /, **kwargs) -> RewardFn:
    """Build the reward registered as ``name`` with factory keyword arguments ``kwargs``."""
    if name not in _REGISTRY:
        raise RewardInputError(f"unknown reward {name!r}; available: {', '.join(available_rewards())}")
    return _REGISTRY[name](**kwargs)


def check_batch(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None) -> None:
    """Raise RewardInputError unless ``images`` is ``[B,3,H,W]`` floating in [0,1] (NaN allowed) and lengths agree."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise RewardInputError(f"images must be a Tensor [B,3,H,W], got {shape}")
    if not images.is_floating_point():
        raise RewardInputError(f"images must be floating point in [0,1], got {images.dtype}")
    if images.numel() and not _in_unit_range(images):
        # the exact (slower) path: it ignores NaN/Inf, which the fast check cannot tell from a bad value
        finite = images[torch.isfinite(images)]
        if finite.numel() and (finite.min() < -1e-3 or finite.max() > 1 + 1e-3):
            raise RewardInputError(
                f"images must be in [0,1] (got min {finite.min():.3f}, max {finite.max():.3f}); "
                "decode with output_type='pt' or map [-1,1] outputs with x/2+0.5"
            )
    if len(prompts) != images.shape[0]:
        raise RewardInputError(f"{len(prompts)} prompts for {images.shape[0]} images")
    if metadata is not None and len(metadata) != images.shape[0]:
        raise RewardInputError(f"{len(metadata)} metadata entries for {images.shape[0]} images")


def _in_unit_range(images: torch.Tensor) -> bool:
    """True when every value is finite and in [-1e-3, 1+1e-3]: one min/max pass without a copy (NaN propagates to
    the min and max, Inf is out of range), the common case of :func:`check_batch` (~1 ms per 512 images of 32x32
    on one CPU thread, vs ~90 ms for the masked copy of the finite values)."""
    low, high = torch.aminmax(images.detach())
    return bool((low >= -1e-3) & (high <= 1 + 1e-3))


def finite_rows(images: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: images without NaN/Inf (the others score NaN)."""
    return torch.isfinite(images.detach()).flatten(1).all(1).cpu()


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """``[B,3,H,W]`` in [0,1] -> ``[B,H,W,3]`` uint8, rounded to the nearest level (NaN -> 0)."""
    x = torch.nan_to_num(images.detach().float(), nan=0.0).clamp(0, 1)
    return (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_dtype(where: str, device: str | None, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``device`` (None: cuda when available) and ``dtype`` by name; a bad name is a RewardInputError."""
    if dtype not in _DTYPES:
        raise RewardInputError(f"{where}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise RewardInputError(f"{where}: unknown device {device!r} (cpu, cuda, cuda:1, ...)") from None
    return dev, _DTYPES[dtype]


def check_positive(where: str, **values: float) -> None:
    for key, value in values.items():
        if value < 1:
            raise RewardInputError(f"{where}: {key} must be >= 1, got {value}")
