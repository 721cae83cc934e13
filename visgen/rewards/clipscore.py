"""CLIPScore (Hessel et al., "CLIPScore: A Reference-free Evaluation Metric for Image Captioning", 2021): the
cosine similarity of CLIP's image and text embeddings, clipped at 0 and scaled. Named scalings:

- ``hessel`` (default): ``2.5 * max(cos, 0)`` (the paper's w = 2.5), in [0, 2.5];
- ``torchmetrics``: ``100 * max(cos, 0)`` (torchmetrics' ``CLIPScore``), in [0, 100];
- ``cosine``: the raw cosine, in [-1, 1].

``text_prefix`` is prepended to every prompt (the paper prefixes captions with ``"A photo depicts "``; default
none). transformers ``CLIPModel`` from a hub id (default ``openai/clip-vit-large-patch14``) or a local directory.
Output name: ``clipscore``. ``differentiable`` gives the same score with the graph to the pixels (the scored value,
the gradient of the torch pre-processing, ``preprocess.differentiable_preprocess``; zero where the clip at 0 bites).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ._clip import ClipScorer
from .base import RewardInfo, RewardInputError, check_batch, finite_rows, register

CLIP_MODEL = "openai/clip-vit-large-patch14"
SCALINGS = ("hessel", "torchmetrics", "cosine")


def scale_cosine(cos: torch.Tensor, scaling: str) -> torch.Tensor:
    if scaling == "hessel":
        return 2.5 * cos.clamp(min=0)
    if scaling == "torchmetrics":
        return 100.0 * cos.clamp(min=0)
    return cos


class ClipScore:
    def __init__(self, model: str = CLIP_MODEL, processor: str | None = None, device: str | None = None,
                 dtype: str = "float32", batch_size: int = 32, scaling: str = "hessel", text_prefix: str = "",
                 name: str = "clipscore") -> None:
        if scaling not in SCALINGS:
            raise RewardInputError(f"clipscore scaling must be one of {list(SCALINGS)}, got {scaling!r}")
        self.clip = ClipScorer("clipscore", model, processor, device, dtype, batch_size, crop="floor")
        self.scaling, self.text_prefix, self.name = scaling, text_prefix, name

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        scores = torch.full((images.shape[0],), float("nan"))
        idx = torch.nonzero(finite_rows(images)).flatten()
        if idx.numel():
            cos = (self.clip.image_embeds(images[idx])
                   * self.clip.text_embeds([self.text_prefix + prompts[i] for i in idx.tolist()])).sum(-1)
            scores[idx] = scale_cosine(cos, self.scaling)
        return {self.name: scores}

    def differentiable(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
                       ) -> dict[str, torch.Tensor]:
        """The score with the graph to ``images``, on their device; the text side without grad (DiffusionOPSD)."""
        check_batch(images, prompts, metadata)
        img = self.clip.image_embeds_differentiable(images)
        txt = self.clip.text_embeds([self.text_prefix + p for p in prompts]).to(img.device)
        return {self.name: scale_cosine((img * txt).sum(-1), self.scaling).to(images.device)}


@register("clipscore", RewardInfo(weights=f"hub: {CLIP_MODEL} (any transformers CLIP id or dir)",
                                  licence="MIT (OpenAI CLIP weights)",
                                  range="[0, 2.5] hessel | [0, 100] torchmetrics | [-1, 1] cosine", differentiable=True,
                                  summary="CLIP image-prompt cosine, clipped and scaled (Hessel et al. 2021)"))
def build_clipscore(model: str = CLIP_MODEL, processor: str | None = None, device: str | None = None,
                    dtype: str = "float32", batch_size: int = 32, scaling: str = "hessel", text_prefix: str = "",
                    name: str = "clipscore") -> ClipScore:
    return ClipScore(model, processor, device, dtype, batch_size, scaling, text_prefix, name)
