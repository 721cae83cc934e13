"""LAION aesthetic predictor v2 (Schuhmann et al., "improved-aesthetic-predictor", 2022; the LAION-5B
aesthetics subsets): an MLP on the L2-normalised CLIP ViT-L/14 image embedding, trained to regress human 1-10
aesthetic ratings (SAC + LOGOS + AVA). DDPO (Black et al., "Training Diffusion Models with Reinforcement
Learning", 2023) trains on it, raw. Prompt-independent. Output name: ``aesthetic`` (about 1-10; ``scale``
multiplies it).

Weights: the MLP from ``checkpoint`` (a local ``.pth``/``.safetensors`` or ``"<hub repo>:<file>"``, default the
copy TRL's DDPO example uses, ``trl-lib/ddpo-aesthetic-predictor:aesthetic-model.pth``; keys ``layers.{0,2,4,6,7}``)
and the CLIP from ``clip_model`` (default ``openai/clip-vit-large-patch14``). The MLP is the predictor's
Linear(768,1024) -> Dropout -> Linear(1024,128) -> Dropout -> Linear(128,64) -> Dropout -> Linear(64,16) ->
Linear(16,1), no activations (as published), evaluated in eval mode. ``hidden`` overrides the widths (tests).
``differentiable`` is the same score with the graph to the pixels (the scored value, the gradient of the torch
pre-processing, ``preprocess.differentiable_preprocess``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ._clip import ClipScorer
from .base import RewardInfo, RewardInputError, check_batch, finite_rows, register
from .preprocess import load_checkpoint_file

AESTHETIC_CHECKPOINT = "trl-lib/ddpo-aesthetic-predictor:aesthetic-model.pth"
CLIP_MODEL = "openai/clip-vit-large-patch14"


class AestheticMLP(torch.nn.Module):
    """The improved-aesthetic-predictor / ImageReward head: five linear layers, dropout between the first four."""

    def __init__(self, input_size: int = 768, hidden: Sequence[int] = (1024, 128, 64, 16)) -> None:
        super().__init__()
        h1, h2, h3, h4 = hidden
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(input_size, h1), torch.nn.Dropout(0.2), torch.nn.Linear(h1, h2), torch.nn.Dropout(0.2),
            torch.nn.Linear(h2, h3), torch.nn.Dropout(0.1), torch.nn.Linear(h3, h4), torch.nn.Linear(h4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Aesthetic:
    def __init__(self, checkpoint: str | None = AESTHETIC_CHECKPOINT, clip_model: str = CLIP_MODEL,
                 processor: str | None = None, device: str | None = None, dtype: str = "float32",
                 batch_size: int = 32, scale: float = 1.0, hidden: Sequence[int] = (1024, 128, 64, 16),
                 name: str = "aesthetic") -> None:
        self.clip = ClipScorer("aesthetic", clip_model, processor, device, dtype, batch_size, crop="round")
        dim = int(self.clip.model.config.projection_dim)
        if len(hidden) != 4:
            raise RewardInputError(f"aesthetic hidden must list 4 widths, got {list(hidden)}")
        self.mlp = AestheticMLP(dim, tuple(int(h) for h in hidden))
        if checkpoint is not None:
            state = load_checkpoint_file("aesthetic", checkpoint)
            try:
                self.mlp.load_state_dict(state)
            except RuntimeError as exc:
                raise RewardInputError(f"aesthetic: checkpoint {checkpoint!r} does not fit the predictor MLP on "
                                       f"{dim}-d CLIP embeddings ({str(exc).splitlines()[0]})") from None
        self.mlp.eval().requires_grad_(False)
        self.scale, self.name = float(scale), name

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        scores = torch.full((images.shape[0],), float("nan"))
        idx = torch.nonzero(finite_rows(images)).flatten()
        if idx.numel():
            scores[idx] = self._head(self.clip.image_embeds(images[idx])).float().cpu() * self.scale
        return {self.name: scores}

    def differentiable(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
                       ) -> dict[str, torch.Tensor]:
        """The score with the graph to ``images``, on their device (prompt-independent; DiffusionOPSD)."""
        check_batch(images, prompts, metadata)
        return {self.name: (self._head(self.clip.image_embeds_differentiable(images)) * self.scale).to(images.device)}

    def _head(self, emb: torch.Tensor) -> torch.Tensor:
        """The MLP on ``emb`` where the MLP is (the CPU, or the device while ``visgen.memory.offload_rewards`` holds it
        there), in its dtype."""
        w = self.mlp.layers[0].weight
        return self.mlp(emb.to(w.device, w.dtype)).squeeze(-1)


@register("aesthetic", RewardInfo(weights=f"MLP: hub {AESTHETIC_CHECKPOINT}; CLIP: hub {CLIP_MODEL}",
                                  licence="Apache-2.0 (improved-aesthetic-predictor); MIT (OpenAI CLIP)",
                                  range="~1-10 (human rating scale)", differentiable=True,
                                  summary="LAION aesthetic predictor v2: MLP on the CLIP ViT-L/14 image embedding"))
def build_aesthetic(checkpoint: str | None = AESTHETIC_CHECKPOINT, clip_model: str = CLIP_MODEL,
                    processor: str | None = None, device: str | None = None, dtype: str = "float32",
                    batch_size: int = 32, scale: float = 1.0, hidden: Sequence[int] = (1024, 128, 64, 16),
                    name: str = "aesthetic") -> Aesthetic:
    return Aesthetic(checkpoint, clip_model, processor, device, dtype, batch_size, scale, hidden, name)
