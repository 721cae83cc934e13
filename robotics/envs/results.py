"""What every batched env's ``step_chunk`` returns, in a module of its own.

The Meta-World vector envs (``vector.py``) and the synthetic point env (``point.py``) both build it, and
``vector.make_vector_env`` constructs either env; keeping the result type here lets both import it without
importing each other (no import cycle).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ChunkResult:
    """What ``step_chunk`` returns for a batch of B slots and chunk length K."""

    image: np.ndarray  # [B, H, W, C] uint8, the frame after the chunk (zeros where not rendered)
    proprio: np.ndarray  # [B, P] float32
    state: np.ndarray  # [B, 39] Meta-World state after the chunk
    reward: np.ndarray  # [B, K] float32 dense Meta-World reward of each executed step (0 if not executed)
    success: np.ndarray  # [B, K] bool, per-step success flag
    executed: np.ndarray  # [B, K] bool, which actions were executed
    done: np.ndarray  # [B] bool, the episode has ended (now or before)
    success_once: np.ndarray  # [B] bool
    success_end: np.ndarray  # [B] bool, success flag of the last executed step

    @staticmethod
    def cat(parts: list["ChunkResult"]) -> "ChunkResult":
        return ChunkResult(**{k: np.concatenate([getattr(p, k) for p in parts], 0) for k in ChunkResult.__dataclass_fields__})
