"""Tiny, randomly initialised stock diffusers pipelines of the video and new image families, built offline.

Wan 2.1 / 2.2 (two experts, per-token timesteps), HunyuanVideo 1.5, Qwen-Image, FLUX.2 (dev-style with a Mistral-3
text encoder, and klein with Qwen3), Z-Image. Each is the real pipeline class with a few-thousand-parameter
transformer, VAE and text encoder and a word-level tokenizer built here (chat templates where the pipeline applies
one), so the parity tests exercise the unmodified diffusers code in a second or two on CPU.

Pitfalls handled here: prompt templates whose fixed prefix the pipeline crops by a hard-coded token count
(Qwen-Image 34, HunyuanVideo 1.5 108) are replaced on the instance by a short template with a matching count;
FLUX.2 reads hidden states of fixed layers (``text_encoder_out_layers``), which the tests pass; Z-Image's
transformer has ``torch.empty`` pad tokens, which are filled.
"""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

WORDS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"] + (
    "a an the photo of red green blue yellow square circle triangle star left right top bottom and on moving to up "
    "down describe video image bad quality".split())
VOCAB = {w: i for i, w in enumerate(WORDS)}
PAD, UNK, BOS, EOS = 0, 1, 2, 3
PROMPTS = ["a red square", "blue circle moving to the left"]
# a chat template that renders the conversation as plain words (the pipelines only need apply_chat_template)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} "
                 "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                 "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }} {% endif %}{% endfor %}"
                 "{% endif %} <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def word_tokenizer(max_length: int = 16, template: bool = False, padding_side: str = "right",
                   add_bos_eos: bool = True) -> PreTrainedTokenizerFast:
    backend = Tokenizer(WordLevel(vocab=VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos_eos:
        backend.post_processor = processors.TemplateProcessing(
            single="<bos> $A <eos>", special_tokens=[("<bos>", BOS), ("<eos>", EOS)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                  eos_token="<eos>", model_max_length=max_length, padding_side=padding_side)
    if template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def ready(pipe):
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -------------------------------------------------------------------------------------------------------- Wan
def build_wan(two_experts: bool = False, expand_timesteps: bool = False, scheduler=None, z_dim: int = 4):
    """WanPipeline: AutoencoderKLWan(base_dim 3, z_dim 4), UMT5, WanTransformer3DModel; 5 frames at 16x16 give
    latents [B, 4, 2, 2, 2]. ``two_experts``: Wan 2.2 A14B style (``transformer_2``, boundary 0.875);
    ``expand_timesteps``: Wan 2.2 TI2V-5B style (per-token timesteps)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1 * i for i in range(z_dim)],
                           latents_std=[1.0 + 0.2 * i for i in range(z_dim)])
    torch.manual_seed(1)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(VOCAB), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
        pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD))

    def transformer(seed):
        torch.manual_seed(seed)
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                     in_channels=z_dim, out_channels=z_dim, text_dim=16, freq_dim=16, ffn_dim=32,
                                     num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                     rope_max_seq_len=32)

    kwargs = {}
    if two_experts:
        kwargs.update(transformer_2=transformer(3), boundary_ratio=0.875)
    if expand_timesteps:
        kwargs.update(expand_timesteps=True)
    return ready(WanPipeline(tokenizer=word_tokenizer(), text_encoder=text_encoder, vae=vae,
                             scheduler=scheduler or FlowMatchEulerDiscreteScheduler(shift=3.0),
                             transformer=transformer(2), **kwargs))


WAN_CALL = {"height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 8}


# -------------------------------------------------------------------------------------------------- Qwen-Image
QWEN_TEMPLATE = ("<|im_start|> system describe the image <|im_end|> <|im_start|> user {} <|im_end|> "
                 "<|im_start|> assistant")
QWEN_TEMPLATE_PREFIX = 8  # tokens before "{}": what the pipeline crops


def build_qwen_image(guidance_embeds: bool = False):
    """QwenImagePipeline: Qwen2.5-VL (text 16 wide, 2 layers, tiny vision tower), AutoencoderKLQwenImage (z 4,
    4x down), QwenImageTransformer2DModel (patch 2); 32x32 images are 4x4 packed tokens of 16 channels."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, \
        QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=3, joint_attention_dim=16,
                                              guidance_embeds=guidance_embeds, axes_dims_rope=(8, 4, 4))
    torch.manual_seed(1)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.1, -0.1, 0.0, 0.2],
                                 latents_std=[1.0, 1.5, 0.8, 1.2])
    torch.manual_seed(2)
    n = len(VOCAB)
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": n, "rope_theta": 1000000.0, "bos_token_id": BOS,
                     "eos_token_id": EOS, "pad_token_id": PAD,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=n, vision_start_token_id=n + 1, vision_end_token_id=n + 2, image_token_id=n + 3,
        video_token_id=n + 4)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=16,
        max_image_seq_len=256), vae=vae, text_encoder=text_encoder,
        tokenizer=word_tokenizer(64, add_bos_eos=False), transformer=transformer)
    pipe.prompt_template_encode = QWEN_TEMPLATE
    pipe.prompt_template_encode_start_idx = QWEN_TEMPLATE_PREFIX
    return ready(pipe)


# ------------------------------------------------------------------------------------------------------ FLUX.2
FLUX2_LAYERS = (1, 2)  # hidden states the tiny text encoders give (the real ones use (10, 20, 30) / (9, 18, 27))


def _flux2_parts(guidance_embeds: bool):
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                          timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
                                          guidance_embeds=guidance_embeds)
    torch.manual_seed(1)
    vae = AutoencoderKLFlux2(sample_size=16, in_channels=3, out_channels=3,
                             down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             block_out_channels=(8, 8), layers_per_block=1, latent_channels=2, norm_num_groups=2,
                             use_quant_conv=False, use_post_quant_conv=False)
    with torch.no_grad():  # non-trivial batch-norm statistics, so decoding's de-normalisation is exercised
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, vae.bn.running_mean.numel()))
        vae.bn.running_var.copy_(torch.linspace(0.5, 1.5, vae.bn.running_var.numel()))
    return transformer, vae


def build_flux2_klein(is_distilled: bool = False):
    """Flux2KleinPipeline: Qwen3ForCausalLM (16 wide, 2 layers), AutoencoderKLFlux2 (2 latent channels, 2x down),
    Flux2Transformer2DModel without guidance embedding; 16x16 images are 16 tokens of 8 channels."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    transformer, vae = _flux2_parts(guidance_embeds=False)
    torch.manual_seed(2)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        intermediate_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8, vocab_size=len(VOCAB), max_position_embeddings=128, bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=PAD))
    return ready(Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                                    tokenizer=word_tokenizer(64, template=True, add_bos_eos=False),
                                    transformer=transformer, is_distilled=is_distilled))


def build_flux2():
    """Flux2Pipeline (FLUX.2 [dev] layout): a tiny Mistral3ForConditionalGeneration (text 16 wide, 2 layers, a tiny
    Pixtral tower), guidance-embedding transformer, same VAE as klein."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    transformer, vae = _flux2_parts(guidance_embeds=True)
    n = len(VOCAB)
    torch.manual_seed(3)
    config = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": n, "hidden_size": 16, "intermediate_size": 32,
                     "max_position_embeddings": 128, "num_attention_heads": 2, "num_hidden_layers": 2,
                     "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                     "sliding_window": None, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 32, "image_size": 30, "patch_size": 6, "num_channels": 3},
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, image_seq_length=4, vision_feature_layer=-1,
        image_token_index=n + 1)
    text_encoder = Mistral3ForConditionalGeneration(config)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    return ready(Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                               tokenizer=word_tokenizer(64, template=True, add_bos_eos=False), transformer=transformer))


# ------------------------------------------------------------------------------------------------------ Z-Image
def build_z_image():
    """ZImagePipeline: Qwen3Model (16 wide, 2 layers), AutoencoderKL (4 latent channels, 2x down, scaling and
    shift), ZImageTransformer2DModel (patch 2, dim 32); 32x32 images are 16x16 latents."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5,
                                           qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
                                           axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    with torch.no_grad():  # created with torch.empty
        transformer.x_pad_token.copy_(torch.ones_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.ones_like(transformer.cap_pad_token))
    torch.manual_seed(1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=32, scaling_factor=0.36, shift_factor=0.12)
    torch.manual_seed(2)
    text_encoder = Qwen3Model(Qwen3Config(hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                          vocab_size=len(VOCAB), max_position_embeddings=128, bos_token_id=BOS,
                                          eos_token_id=EOS, pad_token_id=PAD))
    return ready(ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                                tokenizer=word_tokenizer(64, template=True, add_bos_eos=False),
                                transformer=transformer))


# ------------------------------------------------------------------------------------------ HunyuanVideo 1.5
HY_SYSTEM = "describe the video"


def build_hunyuan_video15(guidance_scale: float = 1.0):
    """HunyuanVideo15Pipeline: Qwen2.5-VL text model (16 wide, 3 layers), ByT5 (T5 16 wide), AutoencoderKLHunyuanVideo15
    (4 latent channels, 4x space, 2x time), HunyuanVideo15Transformer3DModel (t2v); 5 frames at 16x16 are latents
    [B, 4, 3, 4, 4]. The system message is shortened and the crop set to its token count."""
    from diffusers import (AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline,
                           HunyuanVideo15Transformer3DModel)
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1, num_refiner_layers=1,
        mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=16, image_embed_dim=12,
        rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v")
    torch.manual_seed(1)
    vae = AutoencoderKLHunyuanVideo15(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16),
                                      layers_per_block=1, spatial_compression_ratio=4, temporal_compression_ratio=2,
                                      downsample_match_channel=False, upsample_match_channel=False)
    torch.manual_seed(2)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=len(VOCAB), rope_theta=1000000.0, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}))
    torch.manual_seed(3)
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                             num_heads=2, relative_attention_num_buckets=8, pad_token_id=0,
                                             eos_token_id=1, decoder_start_token_id=0))
    pipe = HunyuanVideo15Pipeline(text_encoder=text_encoder, tokenizer=word_tokenizer(64, template=True,
                                                                                      add_bos_eos=False),
                                  transformer=transformer, vae=vae,
                                  scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                                  text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                  guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    pipe.system_message = HY_SYSTEM
    template = word_tokenizer(64, template=True, add_bos_eos=False).apply_chat_template(
        [{"role": "system", "content": HY_SYSTEM}, {"role": "user", "content": "X"}], tokenize=False,
        add_generation_prompt=True)
    pipe.prompt_template_encode_start_idx = template.split().index("X")  # tokens before the prompt
    pipe.tokenizer_max_length = 16
    pipe.tokenizer_2_max_length = 8
    return ready(pipe)


# ------------------------------------------------------------------------------------------------------- LTX-2
def build_ltx2():
    """LTX2Pipeline (audio + video): Gemma-3 (text 32 wide, 2 layers, a tiny SigLIP tower), LTX2TextConnectors,
    AutoencoderKLLTX2Video (2x space and time), AutoencoderKLLTX2Audio + LTX2Vocoder, LTX2VideoTransformer3DModel;
    5 frames at 32x32 are video latents [B, 4, 3, 16, 16] plus audio latents."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    n = len(VOCAB)
    torch.manual_seed(0)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={"vocab_size": n, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64,
                     "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "sliding_window": 16},
        vision_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, image_token_index=n + 1, boi_token_index=n + 2, eoi_token_index=n + 3))
    hidden, layers = 32, 2
    torch.manual_seed(1)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=hidden, rope_double_precision=False, rope_type="split")
    torch.manual_seed(2)
    connectors = LTX2TextConnectors(
        caption_channels=hidden, text_proj_in_factor=layers + 1, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
    torch.manual_seed(3)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False)
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    torch.manual_seed(5)
    vocoder = LTX2Vocoder(in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32,
                          out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                          resnet_kernel_sizes=[3],
                          resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    return ready(LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                              text_encoder=text_encoder, tokenizer=word_tokenizer(16, padding_side="left"),
                              connectors=connectors, transformer=transformer, vocoder=vocoder, processor=None,
                              prompt_enhancer=None, duration_head=None))


LTX2_CALL = {"height": 32, "width": 32, "num_frames": 5, "frame_rate": 25.0, "max_sequence_length": 16}
LTX2_OFF = {"stg_scale": 0.0, "modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_scale": 1.0,
            "audio_stg_scale": 0.0, "audio_modality_scale": 1.0, "audio_guidance_rescale": 0.0,
            "spatio_temporal_guidance_blocks": None, "use_cross_timestep": False}
