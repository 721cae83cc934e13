"""The hooks a part of the robotics domain may implement; the domain forwards each one to all of its parts.

A part is one feature with its own config section and its own state: the critic (``robotics.critic``), the replay of
demonstrations or of the run's successes (``robotics.replay``), the task adapters' step scaling and keep-best
selection (``robotics.adapters``), and the rollout strategy (``robotics.rollout``). ``RoboticsDomain`` builds the
parts its config asks for and calls every hook below on each of them, in a fixed order, so a feature never shows
up as a branch inside the domain's own methods. Every default does nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class Part:
    # The prefix of this part's tensors in the domain's ``state_dict`` (none: it keeps no tensors there).
    state_prefix = ""

    def parameters(self) -> list[torch.nn.Parameter]:
        """Trainable parameters besides the policy's (stepped by the trainer's optimizer)."""
        return []

    def on_rollout(self, batch, payload: dict[str, Any], iteration: int) -> None:
        """After a flat rollout (``episodes.EpisodeBatch`` ``batch``, its ``Rollout.payload``): keep data from it or
        add payload entries."""

    def on_training_forward(self, payload: dict[str, Any]) -> None:
        """Before a ``log_probs`` forward with grad on the rows of ``payload`` (a minibatch's share)."""

    def before_optimizer_step(self) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors to resume exactly, every key starting with ``state_prefix``."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """``state``: the domain's whole state dict; a part reads its own prefix."""

    def extra_state(self) -> dict[str, Any]:
        """JSON-serialisable state to resume exactly (keys distinct across parts)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def evaluate(self, iteration: int) -> dict[str, float]:
        """Metrics computed at every evaluation, before the domain's held-out one."""
        return {}

    def before_final_evaluation(self, iteration: int) -> dict[str, float]:
        return {}

    def save_pretrained(self, out_dir: Path) -> None:
        pass
