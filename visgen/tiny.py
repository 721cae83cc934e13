"""A tiny StableDiffusion3Pipeline built from configs, for CPU tests and the embedded shapes task.

Architecture (Esser et al., "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis", 2024 —
SD3's MM-DiT — scaled down until it trains on a laptop CPU):

- VAE: ``AutoencoderKL`` with two blocks (16, 32 channels), 32x32x3 pixels -> 4x16x16 latents.
  ``shift_factor``/``scaling_factor`` are set from latent statistics after VAE training (SD3 decoding adds the
  shift back, so it must not be None).
- Transformer: ``SD3Transformer2DModel``, 4 joint blocks, 4 heads x 24, patch 2 (8x8 = 64 image tokens).
- Text: two ``CLIPTextModelWithProjection`` (hidden 32, 2 layers, projection 32) sharing one word-level
  tokenizer built locally from the task vocabulary; ``text_encoder_3``/``tokenizer_3`` are None.
- Scheduler: ``FlowMatchEulerDiscreteScheduler`` (shift 1.0: tiny images need no resolution shift).

Pitfall (measured): with ``text_encoder_3=None`` the pipeline still appends ``max_sequence_length`` zero
"T5" tokens to the text sequence (256 by default). The asset is trained with :data:`MAX_SEQUENCE_LENGTH`; pass
that same value to ``pipe(...)``/``encode_prompt`` in sampling and RL, or read it with :func:`asset_settings`
from the ``grove.json`` saved next to the pipeline.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

# Zero "T5" tokens appended by SD3's encode_prompt when text_encoder_3 is None; part of the trained model.
MAX_SEQUENCE_LENGTH = 1
# CLIP token window (bos + up to 14 words + eos); the longest shapes prompt has 13 words.
TOKENIZER_MAX_LENGTH = 16
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")  # ids 0..3: eos id 3, never 2 (see build_tokenizer)
GROVE_JSON = "grove.json"
ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "shapes-sd3-tiny"


def build_tokenizer(words: Sequence[str], model_max_length: int = TOKENIZER_MAX_LENGTH):
    """A word-level ``PreTrainedTokenizerFast`` over ``words``: lower-cased, whitespace split, ``<bos> ... <eos>``.

    The end-of-text id is 3, not 2: transformers' CLIP pooling treats ``eos_token_id == 2`` as the legacy
    "take the max id" rule, which would pool the wrong token here. Decoding joins words with spaces (the
    tokenizers default), so ``decode(encode(p)) == p`` for task prompts; a ``Fuse`` decoder is only right for
    character-level vocabularies.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in words:
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        padding_side="right",
    )


def build_pipeline(
    words: Sequence[str],
    seed: int = 0,
    sample_size: int = 32,
    vae_channels: Sequence[int] = (16, 32),
    latent_channels: int = 4,
    num_layers: int = 4,
    num_heads: int = 4,
    head_dim: int = 24,
    text_hidden: int = 32,
    text_layers: int = 2,
):
    """A randomly initialised tiny ``StableDiffusion3Pipeline`` (CPU, float32), deterministic given ``seed``.

    ``words``: the tokenizer vocabulary (defaults to the shapes task's). ``sample_size``: image side in pixels.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer = build_tokenizer(words)
    downsample = 2 ** (len(vae_channels) - 1)
    if sample_size % (downsample * 2):
        raise ValueError(f"sample_size {sample_size} must be divisible by {downsample * 2} (VAE x patch size)")

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(vae_channels),
        block_out_channels=tuple(vae_channels),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=sample_size,
        scaling_factor=1.0,
        shift_factor=0.0,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )

    def clip(offset: int):
        torch.manual_seed(seed + offset)
        config = CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=text_hidden,
            intermediate_size=text_hidden * 2,
            num_hidden_layers=text_layers,
            num_attention_heads=2,
            max_position_embeddings=TOKENIZER_MAX_LENGTH,
            projection_dim=text_hidden,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return CLIPTextModelWithProjection(config)

    text_encoder, text_encoder_2 = clip(1), clip(2)
    torch.manual_seed(seed + 3)
    latent_size = sample_size // downsample
    transformer = SD3Transformer2DModel(
        sample_size=latent_size,
        patch_size=2,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=num_layers,
        attention_head_dim=head_dim,
        num_attention_heads=num_heads,
        joint_attention_dim=2 * text_hidden,  # the two CLIP hidden states are concatenated feature-wise
        caption_projection_dim=num_heads * head_dim,
        pooled_projection_dim=2 * text_hidden,  # the two pooled projections are concatenated
        pos_embed_max_size=max(latent_size // 2, 16),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def save_pipeline(pipe, directory: str | Path, extra: dict | None = None) -> Path:
    """``save_pretrained`` plus a ``grove.json`` recording the settings sampling must reuse."""
    directory = Path(directory)
    pipe.save_pretrained(directory, safe_serialization=True)
    settings = {
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "resolution": int(pipe.transformer.config.sample_size * pipe.vae_scale_factor),
        "task": "shapes",
    }
    settings.update(extra or {})
    (directory / GROVE_JSON).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return directory


def asset_settings(directory: str | Path = ASSET_DIR) -> dict:
    """The ``grove.json`` next to a saved pipeline (max_sequence_length, resolution, measured scores)."""
    path = Path(directory) / GROVE_JSON
    if not path.exists():
        return {"max_sequence_length": MAX_SEQUENCE_LENGTH}
    return json.loads(path.read_text())


def load_shapes_asset(directory: str | Path = ASSET_DIR):
    """``StableDiffusion3Pipeline.from_pretrained(directory, text_encoder_3=None, tokenizer_3=None)``, offline, CPU."""
    from diffusers import StableDiffusion3Pipeline

    directory = Path(directory)
    if not (directory / "model_index.json").exists():
        raise FileNotFoundError(
            f"no pipeline at {directory}; build it with `python -m visgen.pretrain "
            f"configs/visgen/shapes_pretrain.yaml --out {directory}`"
        )
    # diffusers drops the saved `null` text_encoder_3/tokenizer_3 entries and then refuses to build SD3 without
    # them (they are not in its _optional_components), so they must be passed explicitly as None.
    pipe = StableDiffusion3Pipeline.from_pretrained(
        directory, text_encoder_3=None, tokenizer_3=None, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def merge_teacher(final_dir: str | Path, out_dir: str | Path, base: str | None = None) -> Path:
    """A trained run's ``final/`` as a full pipeline directory that on-policy distillation loads as its frozen teacher
    (``visgen.objective: {name: opd, teacher: out_dir}``): the base pipeline with the run's LoRA fused into the
    transformer and the adapter removed (the teacher never loads adapters), saved with the base's ``grove.json``
    settings when it has them. ``base`` overrides the recorded base pipeline, as in ``load_trained_pipeline``."""
    from .export import export_info, load_trained_pipeline, resolve_base

    pipe, _settings = load_trained_pipeline(final_dir, base=base)
    if not (Path(final_dir) / "transformer").is_dir():  # a LoRA run: merge it, then drop the adapter layers
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    info = export_info(final_dir)
    location = Path(resolve_base(base or str(info["base_model"]), None if base else info.get("base_model_in_checkout")))
    extra = asset_settings(location) if (location / GROVE_JSON).is_file() else {}
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    if extra:
        (out_dir / GROVE_JSON).write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")
    return out_dir
