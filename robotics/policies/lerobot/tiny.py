"""A tiny SmolVLA-architecture policy built from LeRobot's config classes, with no hub download: a SmolVLM backbone
of a few layers (config, word-level tokenizer and processor written to a local folder that ``vlm_model_name``
points at), LeRobot's ``SmolVLAPolicy`` on it, and LeRobot's own pre/postprocessors with normalisation statistics.
Tests and the CPU recipe use it; a real run brings ``lerobot/smolvla_base`` (or its own fine-tune) instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .compat import import_policies

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<global-img>",
           "<image>", "<video>"]


@dataclass
class TinySmolVLA:
    """Sizes of the tiny policy (SmolVLA's own fields where it has them)."""

    image_size: int = 64  # the image feature's side (the env renders it); SigLIP sees it resized to vision_size
    vision_size: int = 32  # SigLIP input side (resize_imgs_with_padding)
    patch_size: int = 8
    vlm_hidden: int = 64
    vlm_layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    expert_width_multiplier: float = 0.5
    chunk_size: int = 8
    n_action_steps: int = 4
    max_state_dim: int = 8
    max_action_dim: int = 8
    num_steps: int = 4
    tokenizer_max_length: int = 16
    # a fresh backbone has nothing to keep frozen: behaviour cloning trains all of it (SmolVLA's defaults freeze
    # the pretrained VLM and train the expert)
    train_expert_only: bool = False
    freeze_vision_encoder: bool = False
    words: list[str] = field(default_factory=list)  # the instruction vocabulary ([] = Meta-World's instructions)


def _words() -> list[str]:
    from ...envs.metaworld_env import TASK_INSTRUCTIONS

    return sorted({w for text in TASK_INSTRUCTIONS.values() for w in text.lower().split()})


def env_words(env_cfg) -> list[str]:
    """Instruction words a tiny policy for ``env_cfg`` must know beyond Meta-World's: every LIBERO instruction's
    for a LIBERO env (a word-level tokenizer maps an unknown word to <unk>)."""
    if env_cfg.kind != "libero":
        return []
    from ...envs.libero_tasks import all_languages

    return sorted({w for text in all_languages() for w in text.lower().split()})


def write_tiny_vlm(out: Path, t: TinySmolVLA) -> Path:
    """A SmolVLM config + processor (word-level tokenizer with SmolVLM's special tokens) in ``out``."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    words = SPECIAL + (t.words or _words())
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", extra_special_tokens={
        "fake_image_token": "<fake_token_around_image>", "global_image_token": "<global-img>",
        "image_token": "<image>", "end_of_utterance_token": "<end_of_utterance>"})
    cfg = SmolVLMConfig(
        vision_config=dict(hidden_size=t.vlm_hidden // 2, intermediate_size=t.vlm_hidden, num_hidden_layers=1,
                           num_attention_heads=2, image_size=t.vision_size, patch_size=t.patch_size),
        text_config=dict(model_type="llama", hidden_size=t.vlm_hidden, intermediate_size=2 * t.vlm_hidden,
                         num_hidden_layers=t.vlm_layers, num_attention_heads=t.heads, num_key_value_heads=t.kv_heads,
                         head_dim=t.head_dim, vocab_size=len(words), max_position_embeddings=256),
        scale_factor=2, image_token_id=vocab["<image>"])
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    side = {"longest_edge": t.vision_size}
    SmolVLMProcessor(image_processor=SmolVLMImageProcessor(size=side, max_image_size=side), tokenizer=tok,
                     video_processor=SmolVLMVideoProcessor(),
                     image_seq_len=(t.vision_size // t.patch_size) ** 2 // 4).save_pretrained(out)
    return out


def demo_stats(episodes) -> dict[str, dict[str, torch.Tensor]]:
    """LeRobot's normalisation statistics of the demos' state and action: mean / std / min / max, and the 1st / 99th
    (and 10th / 90th) percentiles π0.5's QUANTILES normalisation reads."""
    stats = {}
    for key, rows in (("observation.state", [e.proprio for e in episodes]), ("action", [e.actions for e in episodes])):
        x = np.concatenate(rows).astype(np.float32)
        q = {f"q{p:02d}": torch.from_numpy(np.percentile(x, p, axis=0).astype(np.float32)) for p in (1, 10, 90, 99)}
        stats[key] = {"mean": torch.from_numpy(x.mean(0)), "std": torch.from_numpy(x.std(0) + 1e-6),
                      "min": torch.from_numpy(x.min(0)), "max": torch.from_numpy(x.max(0)), **q}
    return stats


def build_tiny_smolvla(out_dir: str | Path, env_cfg, t: TinySmolVLA | None = None, stats: dict | None = None,
                       seed: int = 0):
    """Write a fresh tiny SmolVLA policy directory (``out_dir``, with its VLM in ``out_dir/vlm``) whose features are
    the env's: one image feature ``observation.images.<camera>`` per env camera at ``t.image_size``, the proprio
    state, a 4-d action. ``stats``: normalisation statistics (:func:`demo_stats`); None = the identity (mean 0,
    std 1). Returns the policy (LeRobot's ``SmolVLAPolicy``)."""
    t = t or TinySmolVLA()
    import_policies()
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    out = Path(out_dir)
    if env_words(env_cfg):
        t = dataclasses.replace(t, words=sorted(set(t.words or _words()) | set(env_words(env_cfg))))
    vlm = write_tiny_vlm(out / "vlm", t)
    inputs = {f"observation.images.{cam}": PolicyFeature(FeatureType.VISUAL, (3, t.image_size, t.image_size))
              for cam in env_cfg.cameras}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (env_cfg.proprio_dim,))
    config = SmolVLAConfig(
        vlm_model_name=str(vlm.resolve()), load_vlm_weights=False, num_vlm_layers=t.vlm_layers,
        expert_width_multiplier=t.expert_width_multiplier, chunk_size=t.chunk_size, n_action_steps=t.n_action_steps,
        max_state_dim=t.max_state_dim, max_action_dim=t.max_action_dim, num_steps=t.num_steps,
        resize_imgs_with_padding=(t.vision_size, t.vision_size), tokenizer_max_length=t.tokenizer_max_length,
        train_expert_only=t.train_expert_only, freeze_vision_encoder=t.freeze_vision_encoder,
        device="cpu", input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (env_cfg.action_dim,))})
    if stats is None:
        dims = {"observation.state": env_cfg.proprio_dim, "action": env_cfg.action_dim}
        stats = {k: {"mean": torch.zeros(d), "std": torch.ones(d), "min": -torch.ones(d), "max": torch.ones(d)}
                 for k, d in dims.items()}
    torch.manual_seed(seed)
    policy = SmolVLAPolicy(config)
    pre, post = make_smolvla_pre_post_processors(config, dataset_stats=stats)
    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    from .local_files import bundle_local_files

    bundle_local_files(out, config, pre)  # vlm/ is inside: the directory loads wherever it is moved
    return policy
