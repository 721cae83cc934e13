"""``grove train --dry-run``'s memory estimate for the robotics domain (``RoboticsConfig.parameter_groups``): the
tiny VLA built on the meta device from its ``config.json`` (or ``robotics.model`` sized for the env), so no weight
is read, split as the domain splits it (``trains``, the rule of ``robotics.domain.trainable``, which
tests/robotics/test_memory_estimate.py checks it equals: the task adapters only with ``adapters.rank``, no encoders
with ``train_encoder: false``), plus its frozen KL reference copy (the domain always
makes one; fsdp2 shards both, ``robotics.fsdp.fsdp_units``) and the critic's value head (trained, replicated).

Not counted, so no estimate (None): a LeRobot policy (its size is known once its config loads, which imports
LeRobot; its run logs a ``memory`` line) and the world-model strategies (their world model is loaded from its own
checkpoint)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from shared_rl.memory_estimate import ParameterGroup

from .part_settings import WORLD_MODEL_ROLLOUTS

if TYPE_CHECKING:
    from .config import RoboticsConfig
    from .policies.vla_config import VLAConfig


ENCODER_MODULES = ("cnn", "image_proj", "text", "proprio")  # frozen unless robotics.train_encoder


def trains(name: str, cfg: RoboticsConfig) -> bool:
    """Whether RL trains the tiny VLA's parameter ``name``: with task adapters only they (and ReinFlow's std), else
    everything but the encoders when ``train_encoder`` is off; the learned std only exists in ReinFlow mode. The one
    rule: the domain (``robotics.domain.trainable``) and the dry-run's memory estimate both use it."""
    if cfg.head_mode != "flow_noise" and name.startswith("flow.noise_std"):
        return False
    if cfg.adapters.rank:
        return name.startswith(("adapters.", "flow.noise_std"))
    return cfg.train_encoder or name.split(".")[0] not in ENCODER_MODULES


def parameter_groups(cfg: RoboticsConfig, mc: VLAConfig | None) -> list[ParameterGroup] | None:
    """The groups of a tiny VLA of architecture ``mc`` (``robotics.config.policy_vla_config``) under ``cfg``."""
    if cfg.policy.type != "tiny_vla" or cfg.rollout.name in WORLD_MODEL_ROLLOUTS or mc is None:
        return None
    import torch

    from .policies.value_head import ValueHead
    from .policies.vla import TinyVLA

    with torch.device("meta"):
        policy = TinyVLA(mc)
        if cfg.adapters.rank and policy.adapters is None:  # robotics.adapters.add_adapters, one per env task
            policy.add_task_adapters([f"task {i}" for i in range(len(cfg.env.tasks))], cfg.adapters.rank)
        critic = ValueHead(mc.hidden, cfg.critic.hidden) if cfg.critic.enabled else None
    trained = sum(p.numel() for n, p in policy.named_parameters() if trains(n, cfg))
    total = sum(p.numel() for p in policy.parameters())
    groups = [ParameterGroup("tiny VLA (trained)", trained, True)]
    if total > trained:
        groups.append(ParameterGroup("tiny VLA (frozen)", total - trained, False))
    groups.append(ParameterGroup("KL reference copy", total, False))
    if critic is not None:
        groups.append(ParameterGroup("value head", sum(p.numel() for p in critic.parameters()), True, sharded=False))
    return groups
