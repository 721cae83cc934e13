"""Tiny, randomly initialised stock diffusers pipelines (SD3, FLUX, SANA) built offline from configs.

Each is a real ``StableDiffusion3Pipeline`` / ``FluxPipeline`` / ``SanaPipeline`` object with a few-thousand-parameter
transformer, VAE and text encoders, so the tests exercise the unmodified diffusers code paths in seconds on CPU.
Pitfalls handled here (DESIGN section 7): a word-level ``PreTrainedTokenizerFast`` built locally; the CLIP end-of-text
id is not 2 (the legacy CLIP pooling branch would take the max id instead); ``text_encoder_3=None`` for SD3 with a
small ``max_sequence_length`` (the pipeline appends that many zero tokens); dims that must agree
(``joint_attention_dim`` = sum of CLIP hidden sizes, ``pooled_projection_dim`` = sum of projections).
"""
from __future__ import annotations

import pytest
import torch
from diffusers import (
    AutoencoderDC,
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SanaPipeline,
    SanaTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    Gemma2Config,
    Gemma2Model,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

torch.set_num_threads(1)  # the machine's cores are shared between several agents

WORDS = ["<pad>", "<unk>", "<bos>", "<eos>"] + (
    "a an the photo of red green blue yellow square circle triangle star left right top bottom and on".split()
)
VOCAB = {w: i for i, w in enumerate(WORDS)}
PAD, UNK, BOS, EOS = 0, 1, 2, 3
PROMPT_LEN = 8  # CLIP tokenizer length and T5/Gemma max_sequence_length used by the tests
PROMPTS = ["a red square", "blue circle on the left"]


def word_tokenizer(max_length: int = PROMPT_LEN) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer that adds ``<bos> ... <eos>`` like CLIP does."""
    backend = Tokenizer(WordLevel(vocab=VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", BOS), ("<eos>", EOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=max_length,
    )


def tiny_kl_vae() -> AutoencoderKL:
    """Two blocks -> latent = image / 2, 4 channels; non-trivial scaling and shift factors."""
    return AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        scaling_factor=1.3,
        shift_factor=0.1,
    )


def _clip_config(hidden: int, **extra) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=PROMPT_LEN, pad_token_id=PAD, bos_token_id=BOS,
        eos_token_id=EOS, **extra,
    )


def build_sd3() -> StableDiffusion3Pipeline:
    torch.manual_seed(0)
    text_encoder = CLIPTextModelWithProjection(_clip_config(16, projection_dim=16))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(16, projection_dim=16))
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=16,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_kl_vae(),
        text_encoder=text_encoder, tokenizer=word_tokenizer(), text_encoder_2=text_encoder_2,
        tokenizer_2=word_tokenizer(), text_encoder_3=None, tokenizer_3=None,
    )


def build_flux(guidance_embeds: bool = True) -> FluxPipeline:
    torch.manual_seed(1)
    clip = CLIPTextModel(_clip_config(16))
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(VOCAB), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD,
    ))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16, guidance_embeds=guidance_embeds,
        axes_dims_rope=(2, 2, 4),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler, vae=tiny_kl_vae(), text_encoder=clip, tokenizer=word_tokenizer(), text_encoder_2=t5,
        tokenizer_2=word_tokenizer(), transformer=transformer,
    )


def build_sana(scheduler=None) -> SanaPipeline:
    torch.manual_seed(2)
    gemma = Gemma2Model(Gemma2Config(
        vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS,
        eos_token_id=EOS,
    ))
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=4,
        encoder_block_types=("ResBlock", "EfficientViTBlock"), decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 16), decoder_block_out_channels=(8, 16),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
        encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        upsample_block_type="interpolate", downsample_block_type="Conv", scaling_factor=0.5,
    )
    transformer = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16,
        mlp_ratio=2.0, sample_size=16, patch_size=1,
    )
    return SanaPipeline(
        tokenizer=word_tokenizer(), text_encoder=gemma, vae=vae, transformer=transformer,
        scheduler=scheduler or FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


# image sizes: SANA checks height % 32; the KL VAE halves, the DC VAE halves (2 blocks)
SIZES = {"sd3": 16, "flux": 16, "sana": 32}
# per-family pipeline call options the tests pass both to the pipeline and to visgen.sample
CALL_OPTIONS = {
    "sd3": {"max_sequence_length": 4},
    "flux": {"max_sequence_length": 6},
    "sana": {"max_sequence_length": 6, "complex_human_instruction": None},
}


def ready(pipe):
    """Eval mode like ``from_pretrained`` leaves it (T5 has dropout 0.1 in train mode), quiet progress bars."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def sd3_pipe() -> StableDiffusion3Pipeline:
    return ready(build_sd3())


@pytest.fixture(scope="session")
def flux_pipe() -> FluxPipeline:
    return ready(build_flux())


@pytest.fixture(scope="session")
def sana_pipe() -> SanaPipeline:
    return ready(build_sana())


@pytest.fixture(params=["sd3", "flux", "sana"])
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_pipe(family, request):
    return request.getfixturevalue(f"{family}_pipe")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny SD3 pipeline (shapes vocabulary, 16x16 images) saved like the project's asset."""
    from visgen import tiny
    from visgen.tasks.shapes import vocabulary as shapes_vocabulary

    path = tmp_path_factory.mktemp("visgen") / "tiny-sd3"
    pipe = tiny.build_pipeline(shapes_vocabulary(), seed=0, sample_size=16, vae_channels=(8, 16), num_layers=1, num_heads=2, head_dim=8,
                               text_hidden=16)
    tiny.save_pipeline(pipe, path)
    return path
