"""HPS v2 / v2.1 (Wu et al., "Human Preference Score v2: A Solid Benchmark for Evaluating Human Preferences of
Text-to-Image Synthesis", 2023): an open_clip ViT-H-14 fine-tuned on human preference pairs. The score is the
cosine similarity of the normalised image and text embeddings (about 0.2-0.35); DanceGRPO and MixGRPO train
FLUX on it. Output name: ``hps``.

Needs the ``open_clip_torch`` package (``pip install open_clip_torch``; an optional extra of grove). The
checkpoint is a local ``.pt`` file or ``"<hub repo>:<file>"`` (default ``xswu/HPSv2:HPS_v2.1_compressed.pt``),
fetched with ``huggingface_hub`` only when the reward is built. ``arch`` is the open_clip model name; a local JSON
model config may be passed instead (it is registered with ``open_clip.add_model_config``). Pre-processing is
open_clip's eval transform on uint8 PIL images, as the anchors feed it (``visgen.rewards.preprocess``: bicubic
shorter-side resize, centre crop with torchvision rounding, CLIP mean/std). ``differentiable`` is the same score
with the graph to the pixels (DiffusionOPSD): the scored value, the gradient of that pre-processing in torch
(``preprocess.differentiable_preprocess``), the text side without grad. HPSv3 (Ma et al., 2025) is a
Qwen2-VL-7B reward model with its own inference wrapper; it is not built in (see docs/rewards.md) — serve it
and use ``vlm_judge`` or ``remote``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from .base import RewardInfo, RewardInputError, check_batch, register
from .preprocess import clip_preprocess, differentiable_preprocess

HPS_CHECKPOINT = "xswu/HPSv2:HPS_v2.1_compressed.pt"
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def _import_open_clip():
    try:
        import open_clip
    except ImportError:
        raise RewardInputError("the 'hps' reward needs the open_clip_torch package: pip install open_clip_torch") from None
    return open_clip


def _checkpoint_path(checkpoint: str | None) -> str | None:
    if checkpoint is None or Path(checkpoint).expanduser().is_file():
        return None if checkpoint is None else str(Path(checkpoint).expanduser())
    if ":" in checkpoint and not checkpoint.startswith(("/", ".")):
        repo, filename = checkpoint.split(":", 1)
        try:
            from huggingface_hub import hf_hub_download

            return hf_hub_download(repo, filename)
        except Exception as exc:  # offline, unknown repo: one line that says what to do
            raise RewardInputError(f"hps: cannot fetch {checkpoint!r} ({type(exc).__name__}); download the checkpoint "
                              "and pass its local path as checkpoint") from None
    raise RewardInputError(f"hps: checkpoint {checkpoint!r} is neither a file nor '<hub repo>:<file>'")


class HPSv2:
    def __init__(self, checkpoint: str | None = HPS_CHECKPOINT, arch: str = "ViT-H-14", device: str | None = None,
                 batch_size: int = 32, name: str = "hps") -> None:
        open_clip = _import_open_clip()
        if batch_size < 1:
            raise RewardInputError(f"hps batch_size must be >= 1, got {batch_size}")
        if arch.endswith(".json"):
            if not Path(arch).is_file():
                raise RewardInputError(f"hps: model config {arch!r} does not exist")
            open_clip.add_model_config(Path(arch))
            arch = Path(arch).stem
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        path = _checkpoint_path(checkpoint)
        try:
            model = open_clip.create_model(arch, pretrained=None, device="cpu")
        except RuntimeError as exc:
            raise RewardInputError(f"hps: unknown open_clip architecture {arch!r} ({exc})") from None
        if path is not None:
            if str(path).endswith(".safetensors"):
                from safetensors.torch import load_file

                state = load_file(str(path))
            else:
                try:  # never unpickle arbitrary objects from a downloaded file
                    state = torch.load(path, map_location="cpu", weights_only=True)
                except Exception as exc:  # noqa: BLE001
                    raise RewardInputError(f"hps: {path} is not a plain tensor state dict ({exc}); convert it to "
                                      "safetensors with a trusted script") from None
            state = state.get("state_dict", state) if isinstance(state, dict) else state
            state = {k.removeprefix("module."): v for k, v in state.items()}
            missing, unexpected = model.load_state_dict(state, strict=False)
            if missing:
                raise RewardInputError(f"hps: checkpoint {path} does not fit {arch} (missing {missing[:3]})")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(arch)
        size = self.model.visual.image_size
        self.image_size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        cfg = getattr(self.model.visual, "preprocess_cfg", {}) or {}
        self.mean = torch.tensor(cfg.get("mean", OPENAI_MEAN)).view(1, 3, 1, 1)
        self.std = torch.tensor(cfg.get("std", OPENAI_STD)).view(1, 3, 1, 1)
        self.batch_size, self.name = batch_size, name
        self.straight_through = True  # differentiable's value: the scored one's (differentiable_preprocess)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """open_clip's eval transform: uint8 -> PIL bicubic shorter-side resize -> centre crop -> normalise."""
        th, tw = self.image_size
        if th != tw:
            raise RewardInputError(f"hps: non-square model input {self.image_size} is not supported")
        return clip_preprocess(images, th, tuple(self.mean.flatten().tolist()), tuple(self.std.flatten().tolist()),
                               crop="round")

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        finite = torch.isfinite(images).flatten(1).all(1)
        scores = torch.full((images.shape[0],), float("nan"))
        for start in range(0, images.shape[0], self.batch_size):
            idx = torch.arange(start, min(start + self.batch_size, images.shape[0]))
            idx = idx[finite[idx]]
            if not idx.numel():
                continue
            pixels = self.preprocess(images[idx].cpu()).to(self.device)
            tokens = self.tokenizer([prompts[i] for i in idx.tolist()]).to(self.device)
            image_emb = torch.nn.functional.normalize(self.model.encode_image(pixels).float(), dim=-1)
            text_emb = torch.nn.functional.normalize(self.model.encode_text(tokens).float(), dim=-1)
            scores[idx] = (image_emb * text_emb).sum(-1).cpu()
        return {self.name: scores}

    def differentiable(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
                       ) -> dict[str, torch.Tensor]:
        """The score with the graph to ``images``, on their device; the text side without grad (DiffusionOPSD)."""
        check_batch(images, prompts, metadata)
        th, tw = self.image_size
        if th != tw:
            raise RewardInputError(f"hps: non-square model input {self.image_size} is not supported")
        dtype = next(self.model.parameters()).dtype
        pixels = differentiable_preprocess(images.to(self.device), th, tuple(self.mean.flatten().tolist()),
                                           tuple(self.std.flatten().tolist()), "round", self.straight_through)
        image = self.model.encode_image(pixels.to(dtype))
        image_emb = torch.nn.functional.normalize(image.to(torch.promote_types(image.dtype, torch.float32)), dim=-1)
        with torch.no_grad():
            tokens = self.tokenizer(list(prompts)).to(self.device)
            text_emb = torch.nn.functional.normalize(self.model.encode_text(tokens).float(), dim=-1)
        return {self.name: (image_emb * text_emb).sum(-1).to(images.device)}


@register("hps", RewardInfo(weights=f"hub: {HPS_CHECKPOINT} (open_clip ViT-H-14) or a local .pt/.safetensors",
                            licence="Apache-2.0 (HPSv2 repository); check the model card",
                            range="~0.2-0.35 (cosine similarity)", extra="rewards (open_clip_torch)",
                            differentiable=True,
                            summary="HPS v2.1: preference-tuned open_clip ViT-H-14, cos(image, prompt)"))
def build_hps(checkpoint: str | None = HPS_CHECKPOINT, arch: str = "ViT-H-14", device: str | None = None,
              batch_size: int = 32, name: str = "hps") -> HPSv2:
    """checkpoint (path or '<repo>:<file>', None = untrained weights), arch, device, batch_size."""
    return HPSv2(checkpoint, arch, device, batch_size, name)
