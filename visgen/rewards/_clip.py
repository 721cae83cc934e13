"""A transformers ``CLIPModel`` loaded for scoring: the shared part of PickScore, CLIPScore and the LAION aesthetic
predictor (lazy: nothing is loaded until a reward is built; hub id or local directory; device and dtype)."""
from __future__ import annotations

from typing import Sequence

import torch

from .base import RewardInputError, check_positive, resolve_device_dtype
from .preprocess import clip_preprocess, differentiable_preprocess, processor_geometry


def features(output) -> torch.Tensor:
    """transformers 5 returns a model output (projected features in ``pooler_output``); 4.x a tensor."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipScorer:
    """CLIP image/text embeddings with the anchors' pre-processing (``visgen.rewards.preprocess``)."""

    def __init__(self, where: str, model: str, processor: str | None, device: str | None, dtype: str,
                 batch_size: int, crop: str = "floor") -> None:
        from transformers import AutoProcessor, CLIPModel

        check_positive(where, batch_size=batch_size)
        self.where = where
        self.device, self.dtype = resolve_device_dtype(where, device, dtype)
        try:
            self.processor = AutoProcessor.from_pretrained(processor or model)
            self.model = CLIPModel.from_pretrained(model, dtype=self.dtype)
        except OSError as exc:
            raise RewardInputError(f"{where}: cannot load {model!r} / processor {processor or model!r} "
                                   f"({str(exc).splitlines()[0]}); give local directories or download them first") from None
        self.model.to(self.device).eval().requires_grad_(False)
        self.size, self.mean, self.std = processor_geometry(self.processor)
        self.batch_size, self.crop = batch_size, crop
        self.straight_through = True  # the differentiable path's value is the scored one's (pixels_differentiable)

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        return clip_preprocess(images, self.size, self.mean, self.std, self.crop)

    def pixels_differentiable(self, images: torch.Tensor) -> torch.Tensor:
        """The model input with the graph to ``images`` (``preprocess.differentiable_preprocess``): the PIL path's
        values, the gradient of the same geometry in torch (Pillow's bicubic weights, no uint8 roundings);
        ``self.straight_through = False`` gives the smooth function itself (finite-difference checks)."""
        return differentiable_preprocess(images, self.size, self.mean, self.std, self.crop, self.straight_through)

    def image_embeds_differentiable(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` L2-normalised image embeddings on the model's device, with grad to ``images`` (float32; float64
        when the model runs in float64)."""
        x = self.pixels_differentiable(images.to(self.device)).to(self.dtype)
        emb = features(self.model.get_image_features(pixel_values=x))
        return torch.nn.functional.normalize(emb.to(torch.promote_types(emb.dtype, torch.float32)), dim=-1)

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` L2-normalised float32 image embeddings (CPU)."""
        out = []
        for start in range(0, images.shape[0], self.batch_size):
            x = self.pixels(images[start:start + self.batch_size]).to(self.device, self.dtype)
            out.append(torch.nn.functional.normalize(features(self.model.get_image_features(pixel_values=x)).float(),
                                                     dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, self.model.config.projection_dim)

    @torch.no_grad()
    def text_embeds(self, texts: Sequence[str]) -> torch.Tensor:
        """``[B, D]`` L2-normalised float32 text embeddings (CPU); truncated to the model's context."""
        tok = getattr(self.processor, "tokenizer", self.processor)
        out = []
        for start in range(0, len(texts), self.batch_size):
            t = tok(list(texts[start:start + self.batch_size]), padding=True, truncation=True, return_tensors="pt")
            emb = features(self.model.get_text_features(
                input_ids=t["input_ids"].to(self.device),
                attention_mask=t["attention_mask"].to(self.device) if "attention_mask" in t else None))
            out.append(torch.nn.functional.normalize(emb.float(), dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, self.model.config.projection_dim)
