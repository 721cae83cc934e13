"""The features of a LeRobot policy's batch of observations (:class:`Prefix`): what ``families.py`` builds from the VLM
prefix pass and what ``adapter.py``, the domain and the value head read. Its own module so both import it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Prefix:
    """The features of a batch of observations: the VLM prefix's KV cache (per layer a (keys, values) pair, batch
    first) and pad mask, ``pooled`` [B, hidden], the mean of the VLM's final prefix hidden states over the non-pad
    tokens (πRL's ``value_vlm_mode: mean_token``: what the value head reads), and ``state`` [B, max_state_dim], the
    padded normalised state for a family whose action expert reads it (π0's suffix; None for SmolVLA and π0.5, which
    put the state in the prefix). Indexing selects rows (a row of the rollout's chunk, shared by its denoising
    steps)."""

    kv: tuple
    pad_masks: torch.Tensor
    pooled: torch.Tensor | None = None
    state: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.pad_masks.shape[0]])

    @property
    def device(self) -> torch.device:
        return self.pad_masks.device

    def __len__(self) -> int:
        return self.pad_masks.shape[0]

    def __getitem__(self, rows) -> "Prefix":
        kv = tuple((k[rows], v[rows]) for k, v in self.kv)
        pick = (lambda t: None if t is None else t[rows])
        return Prefix(kv, self.pad_masks[rows], pick(self.pooled), pick(self.state))

    @staticmethod
    def cache_tensors(cache) -> tuple:
        """The (keys, values) of every layer of a transformers ``DynamicCache``."""
        return tuple((layer.keys, layer.values) for layer in cache.layers)

    def cache(self):
        """A fresh ``DynamicCache`` over the prefix tensors: LeRobot's denoising steps append the suffix's keys to the
        cache they get (and crop or clone it), so each step gets its own and the stored tensors never change."""
        from .compat import legacy_crop_cache

        return legacy_crop_cache()(self.kv)  # SmolVLA crops it back with crop(prefix_len) (compat.py, item 4)
