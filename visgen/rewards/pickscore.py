"""PickScore (Kirstain et al., "Pick-a-Pic: An Open Dataset of User Preferences for Text-to-Image Generation",
2023): a CLIP-H model fine-tuned on human preferences. The score is CLIP's scaled cosine similarity,
``exp(logit_scale) * cos(image_embedding, text_embedding)`` (about 18-24 for real images), times the named
``scaling`` (``raw``: 1; ``flow_grpo``: 1/26, Flow-GRPO's division that brings it near [0, 1]) times ``scale``.
Output name: ``pickscore``.

Loaded with transformers' ``CLIPModel`` + ``AutoProcessor`` from a hub id or a local directory; no download
happens at import time. Images are quantised to uint8 and pre-processed with PIL like the anchors
(``visgen.rewards.preprocess``), scored without gradients, in batches of ``batch_size``. ``differentiable`` (what
DiffusionOPSD follows) is the same score with the graph to the pixels: its value the scored one's, its gradient that
of the same pre-processing in torch (``preprocess.differentiable_preprocess``), the text side without grad.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ._clip import ClipScorer
from .base import RewardInfo, RewardInputError, check_batch, finite_rows, register

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
SCALINGS = {"raw": 1.0, "flow_grpo": 1.0 / 26.0}


class PickScore:
    def __init__(self, model: str = PICKSCORE_MODEL, processor: str | None = PICKSCORE_PROCESSOR,
                 device: str | None = None, dtype: str = "float32", batch_size: int = 32, scale: float = 1.0,
                 scaling: str = "raw", name: str = "pickscore") -> None:
        if scaling not in SCALINGS:
            raise RewardInputError(f"pickscore scaling must be one of {sorted(SCALINGS)}, got {scaling!r}")
        self.clip = ClipScorer("pickscore", model, processor, device, dtype, batch_size, crop="floor")
        self.factor, self.name = float(scale) * SCALINGS[scaling], name

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        ok = finite_rows(images)
        scores = torch.full((images.shape[0],), float("nan"))
        idx = torch.nonzero(ok).flatten()
        if idx.numel():
            img = self.clip.image_embeds(images[idx])
            txt = self.clip.text_embeds([prompts[i] for i in idx.tolist()])
            logit_scale = self.clip.model.logit_scale.exp().float().cpu()
            scores[idx] = logit_scale * (img * txt).sum(-1) * self.factor
        return {self.name: scores}

    def differentiable(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
                       ) -> dict[str, torch.Tensor]:
        """The score with the graph to ``images`` (``ClipScorer.pixels_differentiable``: the scored value, the
        torch pre-processing's gradient), on the images' device; the text side without grad (DiffusionOPSD)."""
        check_batch(images, prompts, metadata)
        img = self.clip.image_embeds_differentiable(images)
        txt = self.clip.text_embeds(list(prompts)).to(img.device)
        logit_scale = self.clip.model.logit_scale.exp().float().detach()
        return {self.name: (logit_scale * (img * txt).sum(-1) * self.factor).to(images.device)}


@register("pickscore", RewardInfo(weights=f"hub: {PICKSCORE_MODEL} (processor {PICKSCORE_PROCESSOR}) or a local dir",
                                  licence="MIT (PickScore model card); check the card before commercial use",
                                  range="~18-24 raw (x1/26 with scaling: flow_grpo)", differentiable=True,
                                  summary="CLIP-H preference model: exp(logit_scale) * cos(image, prompt)"))
def build_pickscore(model: str = PICKSCORE_MODEL, processor: str | None = PICKSCORE_PROCESSOR,
                    device: str | None = None, dtype: str = "float32", batch_size: int = 32, scale: float = 1.0,
                    scaling: str = "raw", name: str = "pickscore") -> PickScore:
    """kwargs: model (hub id or dir), processor (None: same as model), device, dtype, batch_size, scaling, scale."""
    return PickScore(model, processor, device, dtype, batch_size, scale, scaling, name)
