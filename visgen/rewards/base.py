"""The reward contract shared by every image reward: the registry, the input error and the batch check.

It is a module of its own (not the package ``__init__``) so that the reward modules can import it while the
package imports them to register the built-ins, without an import cycle; ``visgen.rewards`` re-exports all of it.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch


class RewardInputError(ValueError):
    """A malformed reward call (wrong shape, range, lengths) or an unknown reward name."""


class RewardFn(Protocol):
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
    ) -> dict[str, torch.Tensor]: ...


_REGISTRY: dict[str, Callable[..., RewardFn]] = {}


def register(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator registering a reward factory under ``name`` (a duplicate name is an error)."""

    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise RewardInputError(f"reward {name!r} is already registered (by {_REGISTRY[name].__module__})")
        _REGISTRY[name] = factory
        return factory

    return wrap


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str, **kwargs) -> RewardFn:
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
