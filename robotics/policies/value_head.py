"""The critic of PPO for the tiny VLA: V(h, c) from the policy's fused features h and the chunk's time.

RL4VLA (Liu et al. 2025, "What Can RL Bring to VLA Generalization?") and πRL put a value head on the VLA's
features and train it with the clipped value loss; here it is a 2-layer MLP on the fused features (detached by
default, so the critic's gradient never moves the policy) plus a Fourier embedding of the chunk index's fraction
of the horizon (values of a finite-horizon task depend on the time left). Its last layer starts at zero, so every
value starts at ``init_value``.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class ValueHead(nn.Module):
    def __init__(self, feature_dim: int, hidden: int = 256, time_dim: int = 16, init_value: float = 0.0):
        super().__init__()
        self.time_dim = time_dim
        self.net = nn.Sequential(nn.Linear(feature_dim + time_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                                 nn.GELU(), nn.Linear(hidden, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.constant_(self.net[-1].bias, init_value)

    def time_features(self, frac: torch.Tensor) -> torch.Tensor:
        k = torch.arange(self.time_dim // 2, dtype=torch.float32, device=frac.device)
        args = frac.float()[:, None] * math.pi * (2.0 ** k)[None]
        return torch.cat([torch.sin(args), torch.cos(args)], -1)

    def forward(self, h: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
        """``h`` [B, F] features, ``frac`` [B] chunk index / number of chunks in [0, 1) -> values [B]."""
        return self.net(torch.cat([h.float(), self.time_features(frac)], -1)).squeeze(-1)
