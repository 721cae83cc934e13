"""The value head of PPO in the robotics domain (``robotics.critic``): its architecture and its part of the domain.

The head (``policies.value_head.ValueHead``) reads the policy's fused features of a chunk's observation and the
chunk's time (a LeRobot policy's features are its prefix: the head reads ``Prefix.pooled``, the VLM's mean prefix
token, πRL's ``value_after_vlm`` / ``mean_token`` choice). A flat rollout gets the values of every executed chunk
in its payload (``values``, ``value_mask``, without grad); ``log_probs`` recomputes them with grad (``Critic.values``) for the value loss of the ``gae``
advantage estimator, which owns every training setting of the critic (``advantage.estimator: {name: gae, gamma,
lam, normalize, value_coef, value_clip, warmup, lr}``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from shared_rl.errors import ConfigError

from .parts import Part
from .part_settings import CriticConfig  # noqa: F401  (torch-free, re-exported here)
from .policies.value_head import ValueHead


def vector(h) -> torch.Tensor:
    """The feature vector [B, F] of a policy's features: the tiny VLA's fused features as they are, a LeRobot
    policy's ``Prefix`` by its pooled VLM tokens (``critic.input: prefix``)."""
    return h if torch.is_tensor(h) else h.pooled


class Critic(Part):
    """The value head, its payload entries and its recomputed values. ``encode(images, proprio, task_index)``: the
    policy's fused features of observations (the domain's)."""

    state_prefix = "critic."

    def __init__(self, cfg: CriticConfig, feature_dim: int, n_chunks: int, device: torch.device,
                 encode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 features: Callable[[Any], torch.Tensor] = vector):
        """``features``: the policy's features -> the head's input [B, feature_dim] (:func:`vector`, or a LeRobot
        policy's ``expert_value_features`` with ``critic.input: expert``: computed only when values are)."""
        self.cfg, self.n_chunks, self.device, self._encode, self._features = cfg, n_chunks, device, encode, features
        self.head = ValueHead(feature_dim, cfg.hidden, init_value=cfg.init).to(device)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.head.parameters())

    def on_rollout(self, batch, payload: dict[str, Any], iteration: int) -> None:
        valid = torch.from_numpy(batch.chunk_valid)
        payload["value_mask"] = valid
        payload["values"] = self._rollout_values(payload["images"], payload["proprio"], payload["task_index"], valid)

    @torch.no_grad()
    def _rollout_values(self, images, proprio, task_index, valid, batch: int = 512) -> torch.Tensor:
        """``[N, C]`` the values of every executed chunk's observation (0 elsewhere), without grad."""
        ep, ch = torch.nonzero(valid, as_tuple=True)
        out = torch.zeros(valid.shape)
        for i in range(0, len(ep), batch):
            e, c = ep[i: i + batch], ch[i: i + batch]
            h = self._features(self._encode(images[e, c], proprio[e, c], task_index[e]))
            out[e, c] = self.head(h, c.float().to(self.device) / self.n_chunks).float().cpu()
        return out

    def values(self, h: torch.Tensor, ep: torch.Tensor, ch: torch.Tensor, n: int) -> torch.Tensor:
        """``[n, C]`` the values (with grad) of the chunks (``ep``, ``ch``) whose features are ``h``; 0 elsewhere."""
        c, h = self.n_chunks, self._features(h)
        v = self.head(h.detach() if self.cfg.detach else h, ch.float().to(self.device) / c)
        return torch.zeros(n * c, device=self.device).index_put(((ep * c + ch).to(self.device),), v).view(n, c)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{self.state_prefix}{k}": v.detach().clone() for k, v in self.head.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        n = len(self.state_prefix)
        self.head.load_state_dict({k[n:]: v for k, v in state.items() if k.startswith(self.state_prefix)})
