"""Reward registry for image generators.

A reward is built by name, ``get_reward(name, **kwargs)``, and called on a batch::

    reward = get_reward("shapes")
    out = reward(images, prompts, metadata)   # images: float Tensor [B,3,H,W] in [0,1]
    out["shapes"], out["shapes_strict"]        # each a float Tensor [B]

Every reward returns a dict of named float tensors of shape ``[B]`` (several named outputs are allowed, e.g.
a score and a strict flag). A sample the reward cannot score is NaN (the trainer masks and counts those); a
malformed batch raises ``RewardInputError`` with one actionable line. Never a silent zero.

New rewards (reward-model zoo, remote scorers) register a factory with :func:`register`::

    @register("my_reward")
    def build_my_reward(**kwargs) -> RewardFn: ...
"""
from __future__ import annotations

from .base import (  # noqa: F401 — _REGISTRY too: tests register a reward for one test with monkeypatch.setitem
    _REGISTRY,
    RewardFn,
    RewardInputError,
    available_rewards,
    check_batch,
    get_reward,
    register,
)

__all__ = ["RewardFn", "RewardInputError", "available_rewards", "check_batch", "get_reward", "register"]

# Built-in rewards register themselves on import.
from . import compressibility as _compressibility  # noqa: F401
from . import shapes as _shapes  # noqa: F401
