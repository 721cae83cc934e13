"""LeRobot's flow-matching VLAs (SmolVLA) as grove robotics policies: ``robotics.policy: {type: lerobot, path: ...}``.

- ``settings``: the ``robotics.policy`` section (light: no torch, no LeRobot);
- ``compat``: importing ``lerobot.policies`` under transformers 5 (GR00T's package init skipped);
- ``load``: a policy directory or cached hub id -> :class:`~.adapter.LeRobotVLA`, the env's features checked;
- ``adapter``: the policy behind grove's policy interface (chunk sampling with per-step log-probs on the shared
  flow kernels, recomputation, LoRA, export as a LeRobot policy directory);
- ``tiny``: a tiny SmolVLA built from LeRobot's config classes (tests, the CPU recipe).

See docs/methods/lerobot_policies.md.
"""
from .compat import import_policies
from .settings import LoraSettings, PolicySettings

__all__ = ["import_policies", "LoraSettings", "PolicySettings"]
