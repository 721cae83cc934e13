"""Reward registry for image generators.

A reward is built by name, ``get_reward(name, **kwargs)``, and called on a batch::

    reward = get_reward("shapes")
    out = reward(images, prompts, metadata)   # images: float Tensor [B,3,H,W] in [0,1]
    out["shapes"], out["shapes_strict"]        # each a float Tensor [B]

Every reward returns a dict of named float tensors of shape ``[B]`` (several named outputs are allowed, e.g.
a score and a strict flag). A sample the reward cannot score is NaN (the trainer masks and counts those); a
malformed batch raises ``RewardInputError`` with one actionable line. Never a silent zero.

Built in: the analytic ``shapes``/``shapes_soft`` checkers, DDPO's ``jpeg_(in)compressibility``, ``ocr``
(PP-OCRv4, offline), the model-backed preference rewards ``pickscore``, ``hps``, ``clipscore``, ``aesthetic``,
``imagereward`` (loaded lazily from a hub id or a local path when built, never at import), ``vlm_judge`` (any
OpenAI-compatible chat endpoint) and ``remote`` (a ``grove reward-server``). ``docs/rewards.md`` lists each
one's weights, licence and range; ``grove rewards`` prints the same from :func:`reward_info`.

New rewards register a factory with :func:`register`::

    @register("my_reward", RewardInfo(weights="hub:me/my-model", licence="MIT", range="[0, 1]"))
    def build_my_reward(**kwargs) -> RewardFn: ...
"""
from __future__ import annotations

from .base import (  # noqa: F401 — _REGISTRY too: tests register a reward for one test with monkeypatch.setitem
    _REGISTRY,
    RewardFn,
    RewardInfo,
    RewardInputError,
    available_rewards,
    check_batch,
    get_reward,
    register,
    reward_info,
)

__all__ = ["RewardFn", "RewardInfo", "RewardInputError", "available_rewards", "check_batch", "get_reward",
           "register", "reward_info"]

# Built-in rewards register themselves on import (none imports a model library until it is built).
from . import aesthetic as _aesthetic  # noqa: F401, E402
from . import clipscore as _clipscore  # noqa: F401, E402
from . import compressibility as _compressibility  # noqa: F401, E402
from . import hps as _hps  # noqa: F401, E402
from . import imagereward as _imagereward  # noqa: F401, E402
from . import ocr as _ocr  # noqa: F401, E402
from . import pickscore as _pickscore  # noqa: F401, E402
from . import remote as _remote  # noqa: F401, E402
from . import shapes as _shapes  # noqa: F401, E402
from . import shapes_colour as _shapes_colour  # noqa: F401, E402
from . import shapes_soft as _shapes_soft  # noqa: F401, E402
from . import vlm_judge as _vlm_judge  # noqa: F401, E402
