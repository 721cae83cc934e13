"""Objects the caller already holds, handed to the robotics domain through ``RunContext.objects`` (``robotics.api``,
``shared_rl.api.train(objects=...)``) instead of being loaded from the config's paths:

- ``policy``: grove's ``TinyVLA`` (what ``robotics.checkpoint`` would load), grove's ``LeRobotVLA``, or a LeRobot
  ``PreTrainedPolicy`` (SmolVLA; ``robotics.policy.type: lerobot``) with ``preprocessor`` and ``postprocessor`` —
  LeRobot's own pair from ``make_pre_post_processors`` (its normalisation statistics and tokenizer);
- ``episode_rewards``: ``{name: fn}``, the functions that ``robotics.rewards`` names (``fn(episodes) -> [B]``).

The object is used as it is, so training changes it in place (a LeRobot policy with ``robotics.policy.lora.rank``
gets peft's LoRA layers injected into it, as loading from a path would).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from shared_rl.errors import ConfigError

HELD_PREFIX = "held/"  # the config's path for a held object only labels it (robotics.checkpoint, robotics.policy.path)


def is_lerobot_policy(obj: Any) -> bool:
    """A LeRobot ``PreTrainedPolicy`` (checked by its class's module, so LeRobot is not imported for a tiny VLA)."""
    return any(c.__module__.startswith("lerobot.") and c.__name__ == "PreTrainedPolicy" for c in type(obj).__mro__)


def lerobot_config_dict(policy) -> dict:
    """The fields of a LeRobot policy's config that ``policies.lerobot.load`` checks, as its ``config.json`` has them."""
    c = policy.config

    def features(d):
        return {k: {"type": getattr(f.type, "value", str(f.type)), "shape": list(f.shape)} for k, f in d.items()}

    return {"type": c.type, "input_features": features(c.input_features),
            "output_features": features(c.output_features), "n_action_steps": c.n_action_steps,
            "chunk_size": c.chunk_size, "adapt_to_pi_aloha": getattr(c, "adapt_to_pi_aloha", False)}


def wrap_lerobot(policy, preprocessor, postprocessor, cfg, seed: int, env_action_dim: int):
    """A held LeRobot policy as grove's ``LeRobotVLA``, checked against the env exactly as one loaded from
    ``robotics.policy.path`` (``policies.lerobot.load``), LoRA added with the run's seed when configured."""
    from .policies.lerobot.compat import FAMILIES
    from .policies.lerobot.load import feature_map

    config = lerobot_config_dict(policy)
    if config["type"] not in FAMILIES:
        raise ConfigError(f"robotics.api: the policy is a LeRobot {config['type']!r} policy; grove drives "
                          f"{', '.join(FAMILIES)}")
    if preprocessor is None or postprocessor is None:
        path = getattr(policy.config, "pretrained_path", None)
        if not path:
            raise ConfigError("robotics.api: a held LeRobot policy needs its processors (normalisation statistics, "
                              "tokenizer): pass preprocessor= and postprocessor= from lerobot.policies.factory."
                              "make_pre_post_processors(policy.config, pretrained_path=DIR), or the policy's path")
        from .policies.lerobot.compat import import_policies

        import_policies()
        from lerobot.policies.factory import make_pre_post_processors

        preprocessor, postprocessor = make_pre_post_processors(policy.config, pretrained_path=str(path))
    cameras, sizes = feature_map(config, cfg.env, cfg.policy)
    k = cfg.policy.n_action_steps or config["n_action_steps"]
    if k > config["chunk_size"]:
        raise ConfigError(f"robotics.policy.n_action_steps {k} exceeds the policy's chunk_size {config['chunk_size']}")
    from .policies.lerobot.adapter import LeRobotVLA

    vla = LeRobotVLA(policy, preprocessor, postprocessor, cameras, sizes, k, env_action_dim)
    path = getattr(policy.config, "pretrained_path", None)
    if path and Path(str(path)).is_dir():  # a tiny π loaded from a directory keeps its sizes for the export
        from .policies.lerobot.tiny_pi import read_tiny

        vla.tiny = read_tiny(path)
    if cfg.policy.lora.rank:
        lo = cfg.policy.lora
        vla.add_lora(lo.rank, lo.alpha, lo.vlm, lo.targets, seed)
    return vla


def held_policy(cfg, objects: Mapping[str, Any], seed: int, env_action_dim: int):
    """The policy the caller holds, ready for the domain (None when none was handed over)."""
    from .policies.vla import TinyVLA

    obj = objects.get("policy")
    if obj is None:
        return None
    if isinstance(obj, TinyVLA):
        if cfg.policy.type != "tiny_vla":
            raise ConfigError("robotics.policy.type: lerobot, but the held policy is grove's TinyVLA; leave "
                              "robotics.policy at its default")
        return obj
    if cfg.policy.type != "lerobot":
        raise ConfigError(f"robotics: the held policy is a {type(obj).__name__}; set robotics.policy.type: lerobot "
                          f"(robotics.api does) for a LeRobot policy")
    from .policies.lerobot.adapter import LeRobotVLA

    if isinstance(obj, LeRobotVLA):
        return obj
    if not is_lerobot_policy(obj):
        raise ConfigError(f"robotics: a held policy must be grove's TinyVLA or a LeRobot PreTrainedPolicy, not "
                          f"{type(obj).__name__}")
    return wrap_lerobot(obj, objects.get("preprocessor"), objects.get("postprocessor"), cfg, seed, env_action_dim)


def episode_rewards(names: list[str], objects: Mapping[str, Any]) -> list[tuple[str, Callable]]:
    """``robotics.rewards``' functions, by name, from the objects handed over."""
    given = dict(objects.get("episode_rewards") or {})
    missing = [n for n in names if n not in given]
    if missing:
        raise ConfigError(f"robotics.rewards {missing}: these are functions handed over from Python "
                          f"(robotics.api.VLAGRPOTrainer(reward_funcs=...)); none was given by that name"
                          + (f" (given: {sorted(given)})" if given else ""))
    return [(n, given[n]) for n in names]


def score_episodes(fns: list[tuple[str, Callable]], episodes) -> dict[str, torch.Tensor]:
    """Each function's values on a batch of episodes: one finite-or-NaN float per episode (NaN = missing)."""
    out = {}
    for name, fn in fns:
        values = torch.as_tensor(np.asarray(fn(episodes), dtype=np.float32)).flatten()
        if values.numel() != len(episodes.keys):
            raise ValueError(f"reward {name!r} returned {values.numel()} values for {len(episodes.keys)} episodes")
        out[name] = values
    return out
