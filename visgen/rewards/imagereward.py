"""ImageReward (Xu et al., "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation",
NeurIPS 2023) without its ``image-reward`` package (unmaintained; it pins old transformers/timm APIs).

The model is BLIP (Li et al., 2022): a ViT-L/16 image encoder at 224 px and a BERT-base text encoder whose
layers cross-attend to the image tokens. The prompt (BERT ``bert-base-uncased`` tokenizer, padded to 35 tokens,
truncated) is encoded against the image; the [CLS] state goes through a five-layer linear head (the LAION
aesthetic MLP shape) and the result is standardised by ImageReward's published statistics,
``(r - 0.16717362830052426) / 1.0333394966054072`` (``scaling: normalised``, default; ``raw``: the head's
output). Images: uint8 -> PIL bicubic shorter side 224 -> centre crop (torchvision rounding) -> CLIP mean/std,
exactly ImageReward's ``_transform``. Output name: ``imagereward`` (about -2..2). The model call (BLIP's ViT, the
cross-attending BERT, the head) is a torch function of the pixel values, so ``differentiable`` is the same score with
the graph to the pixels (DiffusionOPSD): the scored value, the gradient of that pre-processing in torch
(``preprocess.differentiable_preprocess``); the tokens carry no gradient.

Built here on transformers' ``BlipVisionModel`` + ``BlipTextModel`` (same computation as BLIP's ``med.py``:
pre-norm ViT with LayerNorm eps 1e-6, BERT with cross-attention, no token-type embeddings). The released
checkpoint (``THUDM/ImageReward:ImageReward.pt``, BLIP/timm key names ``blip.visual_encoder.*``,
``blip.text_encoder.*``, ``mlp.layers.*``) is renamed by :func:`convert_original_state_dict`; a checkpoint saved
by :meth:`ImageReward.save` (transformers names) loads as is. ``config`` overrides the architecture (tests build a
tiny random one).
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from .aesthetic import AestheticMLP
from .base import RewardInfo, RewardInputError, check_batch, check_positive, finite_rows, register, resolve_device_dtype
from .preprocess import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, clip_preprocess, differentiable_preprocess,
                         load_checkpoint_file)

IMAGEREWARD_CHECKPOINT = "THUDM/ImageReward:ImageReward.pt"
BERT_TOKENIZER = "bert-base-uncased"
MEAN, STD = 0.16717362830052426, 1.0333394966054072
TEXT_LENGTH = 35
# ImageReward-v1.0: BLIP ViT-L/16 at 224 px and BERT-base (med_config.json: encoder_width 1024, vocab 30524)
DEFAULT_CONFIG: dict[str, Any] = {
    "image_size": 224,
    "vision": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
               "patch_size": 16, "layer_norm_eps": 1e-6, "hidden_act": "gelu"},
    "text": {"vocab_size": 30524, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "max_position_embeddings": 512, "layer_norm_eps": 1e-12,
             "hidden_act": "gelu"},
    "mlp_hidden": [1024, 128, 64, 16],
}
_VISION_RENAMES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


def convert_original_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageReward.pt (BLIP/timm names) -> this module's names (``vision.*``, ``text.*``, ``mlp.*``); keys the
    scorer does not use (projections, momentum encoders, position-id buffers) are dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            sub = key.removeprefix("blip.visual_encoder.")
            for pattern, repl in _VISION_RENAMES:
                if re.search(pattern, sub):
                    out["vision." + re.sub(pattern, repl, sub)] = value
                    break
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            sub = key.removeprefix("blip.text_encoder.")
            if not sub.startswith("pooler."):
                out["text." + sub] = value
        elif key.startswith("mlp.layers."):
            out[key] = value
    return out


def _merge(base: dict, override: dict | None) -> dict:
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for k, v in (override or {}).items():
        if k not in merged:
            raise RewardInputError(f"imagereward config: unknown key {k!r}; known: {sorted(merged)}")
        merged[k] = {**merged[k], **v} if isinstance(merged[k], dict) else v
    return merged


class ImageRewardModel(torch.nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        from transformers import BlipTextConfig, BlipVisionConfig
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        vision = BlipVisionConfig(image_size=config["image_size"], **config["vision"])
        text = BlipTextConfig(encoder_hidden_size=vision.hidden_size, **config["text"])
        self.vision = BlipVisionModel(vision)
        self.text = BlipTextModel(text, add_pooling_layer=False)
        self.mlp = AestheticMLP(text.hidden_size, tuple(config["mlp_hidden"]))

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        image = self.vision(pixel_values=pixel_values).last_hidden_state
        image_mask = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
        text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                         encoder_attention_mask=image_mask).last_hidden_state
        w = self.mlp.layers[0].weight  # the [CLS] state in the head's dtype (a bfloat16 model: a bfloat16 head)
        return self.mlp(text[:, 0, :].to(w.dtype)).squeeze(-1)


class ImageReward:
    def __init__(self, checkpoint: str | None = IMAGEREWARD_CHECKPOINT, tokenizer: str = BERT_TOKENIZER,
                 config: dict | None = None, device: str | None = None, dtype: str = "float32", batch_size: int = 16,
                 scaling: str = "normalised", name: str = "imagereward") -> None:
        from transformers import AutoTokenizer

        check_positive("imagereward", batch_size=batch_size)
        if scaling not in ("normalised", "raw"):
            raise RewardInputError(f"imagereward scaling must be 'normalised' or 'raw', got {scaling!r}")
        self.device, self.dtype = resolve_device_dtype("imagereward", device, dtype)
        self.config = _merge(DEFAULT_CONFIG, config)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        except OSError as exc:
            raise RewardInputError(f"imagereward: cannot load tokenizer {tokenizer!r} ({str(exc).splitlines()[0]}); "
                                   "give a local directory or download it first") from None
        self.model = ImageRewardModel(self.config)
        if checkpoint is not None:
            state = load_checkpoint_file("imagereward", checkpoint)
            if any(k.startswith("blip.") for k in state):
                state = convert_original_state_dict(state)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.endswith("position_ids")]
            if missing or unexpected:
                raise RewardInputError(f"imagereward: checkpoint {checkpoint!r} does not fit the configured model "
                                       f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.batch_size, self.scaling, self.name = batch_size, scaling, name
        self.straight_through = True  # differentiable's value: the scored one's (differentiable_preprocess)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        return clip_preprocess(images, self.config["image_size"], OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, crop="round")

    def save(self, path: str) -> None:
        """The weights in this module's names (safetensors), loadable as ``checkpoint``."""
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, path)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        scores = torch.full((images.shape[0],), float("nan"))
        idx = torch.nonzero(finite_rows(images)).flatten()
        for start in range(0, idx.numel(), self.batch_size):
            rows = idx[start:start + self.batch_size]
            pixels = self.preprocess(images[rows]).to(self.device, self.dtype)
            tokens = self.tokenizer([prompts[i] for i in rows.tolist()], padding="max_length", truncation=True,
                                    max_length=TEXT_LENGTH, return_tensors="pt")
            raw = self.model(pixels, tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device))
            scores[rows] = ((raw - MEAN) / STD if self.scaling == "normalised" else raw).float().cpu()
        return {self.name: scores}

    def differentiable(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
                       ) -> dict[str, torch.Tensor]:
        """The score with the graph to ``images``, on their device (DiffusionOPSD)."""
        check_batch(images, prompts, metadata)
        dtype = next(self.model.parameters()).dtype
        pixels = differentiable_preprocess(images.to(self.device), self.config["image_size"], OPENAI_CLIP_MEAN,
                                           OPENAI_CLIP_STD, "round", self.straight_through)
        tokens = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=TEXT_LENGTH,
                                return_tensors="pt")
        raw = self.model(pixels.to(dtype), tokens["input_ids"].to(self.device),
                         tokens["attention_mask"].to(self.device))
        raw = raw.to(torch.promote_types(raw.dtype, torch.float32))
        return {self.name: ((raw - MEAN) / STD if self.scaling == "normalised" else raw).to(images.device)}


@register("imagereward", RewardInfo(weights=f"hub: {IMAGEREWARD_CHECKPOINT} (+ tokenizer {BERT_TOKENIZER}); no "
                                            "image-reward package", licence="Apache-2.0 (ImageReward repository)",
                                    range="~-2..2 (standardised by the published mean/std)", differentiable=True,
                                    summary="BLIP ViT-L + cross-attending BERT + MLP head, human-preference reward"))
def build_imagereward(checkpoint: str | None = IMAGEREWARD_CHECKPOINT, tokenizer: str = BERT_TOKENIZER,
                      config: dict | None = None, device: str | None = None, dtype: str = "float32",
                      batch_size: int = 16, scaling: str = "normalised", name: str = "imagereward") -> ImageReward:
    return ImageReward(checkpoint, tokenizer, config, device, dtype, batch_size, scaling, name)
