"""Reward registry for image generators.

A reward is built by name, ``get_reward(name, **kwargs)``, and called on a batch::

    reward = get_reward("shapes")
    out = reward(images, prompts, metadata)   # images: float Tensor [B,3,H,W] in [0,1]
    out["shapes"], out["shapes_strict"]        # each a float Tensor [B]

Every reward returns a dict of named float tensors of shape ``[B]`` (several named outputs are allowed, e.g.
a score and a strict flag). A sample the reward cannot score is NaN (the trainer masks and counts those); a
malformed batch raises ``RewardError`` with one actionable line. Never a silent zero.

New rewards (reward-model zoo, remote scorers) register a factory with :func:`register`::

    @register("my_reward")
    def build_my_reward(**kwargs) -> RewardFn: ...
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch


class RewardError(ValueError):
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
            raise RewardError(f"reward {name!r} is already registered (by {_REGISTRY[name].__module__})")
        _REGISTRY[name] = factory
        return factory

    return wrap


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str, **kwargs) -> RewardFn:
    """Build the reward registered as ``name`` with factory keyword arguments ``kwargs``."""
    if name not in _REGISTRY:
        raise RewardError(f"unknown reward {name!r}; available: {', '.join(available_rewards())}")
    return _REGISTRY[name](**kwargs)


def check_batch(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None) -> None:
    """Raise RewardError unless ``images`` is ``[B,3,H,W]`` floating in [0,1] (NaN allowed) and lengths agree."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise RewardError(f"images must be a Tensor [B,3,H,W], got {shape}")
    if not images.is_floating_point():
        raise RewardError(f"images must be floating point in [0,1], got {images.dtype}")
    finite = images[torch.isfinite(images)]
    if finite.numel() and (finite.min() < -1e-3 or finite.max() > 1 + 1e-3):
        raise RewardError(
            f"images must be in [0,1] (got min {finite.min():.3f}, max {finite.max():.3f}); "
            "decode with output_type='pt' or map [-1,1] outputs with x/2+0.5"
        )
    if len(prompts) != images.shape[0]:
        raise RewardError(f"{len(prompts)} prompts for {images.shape[0]} images")
    if metadata is not None and len(metadata) != images.shape[0]:
        raise RewardError(f"{len(metadata)} metadata entries for {images.shape[0]} images")


# Built-in rewards register themselves on import.
from . import compressibility as _compressibility  # noqa: E402,F401
from . import shapes as _shapes  # noqa: E402,F401
