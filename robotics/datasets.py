"""Supervised samples from recorded episodes: (frame, proprio, instruction ids, next-K-action chunk).

Used by behaviour cloning (``robotics.bc``) and by the RL domain's demonstration replay (``robotics.replay``).
"""
from __future__ import annotations

import numpy as np
import torch

from .data import Episode
from .envs.metaworld_env import OBJECT_XYZ
from .policies.vla import TinyVLA


class ChunkDataset:
    """(frame, proprio, instruction ids, next-K-action chunk) samples from every step of every episode."""

    def __init__(self, episodes: list[Episode], chunk: int, policy: TinyVLA):
        self.images = np.concatenate([e.images for e in episodes])
        self.proprio = np.concatenate([e.proprio for e in episodes]).astype(np.float32)
        chunks, tids = [], []
        for e in episodes:
            a = e.actions
            # after the last action the episode is over (success): pad with "stay" (zero) actions
            padded = np.concatenate([a, np.zeros((chunk - 1, a.shape[1]), a.dtype)])
            chunks.append(np.stack([padded[t : t + chunk] for t in range(len(e))]))
            ids = policy.text.token_ids([e.instruction])[0]
            tids += [ids] * len(e)
        self.chunks = np.concatenate(chunks).astype(np.float32)
        self.text_ids = tids
        # the object's xyz per frame (Meta-World's 39-d state, obs[4:7]) for the auxiliary loss, when recorded
        self.objects = (np.concatenate([e.states[:, OBJECT_XYZ] for e in episodes]).astype(np.float32)
                        if all(e.states is not None for e in episodes) else None)

    def __len__(self) -> int:
        return len(self.chunks)

    def batch(self, idx: np.ndarray, shift: int, rng: np.random.Generator):
        imgs = torch.from_numpy(self.images[idx]).permute(0, 3, 1, 2).float() / 255.0 - 0.5
        if shift:
            imgs = random_shift(imgs, shift, rng)
        return imgs, torch.from_numpy(self.proprio[idx]), [self.text_ids[i] for i in idx], torch.from_numpy(self.chunks[idx])


def random_shift(imgs: torch.Tensor, pad: int, rng: np.random.Generator) -> torch.Tensor:
    """Pad by replication and crop back at a random offset per image (DrQ's augmentation)."""
    n, _, h, w = imgs.shape
    padded = torch.nn.functional.pad(imgs, (pad, pad, pad, pad), mode="replicate")
    out = torch.empty_like(imgs)
    offs = rng.integers(0, 2 * pad + 1, size=(n, 2))
    for i, (dy, dx) in enumerate(offs):
        out[i] = padded[i, :, dy : dy + h, dx : dx + w]
    return out
