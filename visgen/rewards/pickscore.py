"""PickScore (Kirstain et al., "Pick-a-Pic: An Open Dataset of User Preferences for Text-to-Image Generation",
2023): a CLIP-H model fine-tuned on human preferences. The score is CLIP's scaled cosine similarity,
``exp(logit_scale) * cos(image_embedding, text_embedding)`` (about 18-24 for real images), times ``scale``
(Flow-GRPO divides by 26 to bring it near [0, 1]). Output name: ``pickscore``.

Loaded with transformers' ``CLIPModel`` + ``AutoProcessor`` from a hub id or a local directory; no download
happens at import time. Images are scored without gradients, in batches of ``batch_size``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .base import RewardInputError, check_batch, register

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _features(output) -> torch.Tensor:
    """transformers 5 returns a model output (projected features in ``pooler_output``); 4.x a tensor."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class PickScore:
    def __init__(self, model: str = PICKSCORE_MODEL, processor: str | None = PICKSCORE_PROCESSOR,
                 device: str | None = None, dtype: str = "float32", batch_size: int = 32, scale: float = 1.0,
                 name: str = "pickscore") -> None:
        from transformers import AutoProcessor, CLIPModel

        if dtype not in _DTYPES:
            raise RewardInputError(f"pickscore dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if batch_size < 1:
            raise RewardInputError(f"pickscore batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            self.processor = AutoProcessor.from_pretrained(processor or model)
            self.model = CLIPModel.from_pretrained(model, dtype=_DTYPES[dtype])
        except OSError as exc:
            raise RewardInputError(f"pickscore: cannot load {model!r} / processor {processor or model!r} "
                              f"({str(exc).splitlines()[0]}); give local directories or download them first") from None
        self.model.to(self.device).eval().requires_grad_(False)
        self.dtype, self.batch_size, self.scale, self.name = _DTYPES[dtype], batch_size, float(scale), name

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        finite = torch.isfinite(images).flatten(1).all(1)
        scores = torch.full((images.shape[0],), float("nan"))
        for start in range(0, images.shape[0], self.batch_size):
            sl = slice(start, start + self.batch_size)
            ok = finite[sl]
            if not ok.any():
                continue
            chunk = images[sl][ok].float().clamp(0, 1).cpu()
            texts = [p for p, keep in zip(prompts[sl], ok.tolist()) if keep]
            pixels = self.processor(images=list(chunk), do_rescale=False, return_tensors="pt")["pixel_values"]
            tokens = self.processor(text=texts, padding=True, truncation=True, return_tensors="pt")
            image_emb = _features(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)))
            text_emb = _features(self.model.get_text_features(
                input_ids=tokens["input_ids"].to(self.device),
                attention_mask=tokens.get("attention_mask").to(self.device) if "attention_mask" in tokens else None,
            ))
            image_emb = torch.nn.functional.normalize(image_emb.float(), dim=-1)
            text_emb = torch.nn.functional.normalize(text_emb.float(), dim=-1)
            value = self.model.logit_scale.exp().float() * (image_emb * text_emb).sum(-1) * self.scale
            scores[torch.arange(start, min(start + self.batch_size, images.shape[0]))[ok]] = value.cpu()
        return {self.name: scores}


@register("pickscore")
def build_pickscore(**kwargs) -> PickScore:
    """kwargs: model (hub id or dir), processor (None: same as model), device, dtype, batch_size, scale."""
    return PickScore(**kwargs)
