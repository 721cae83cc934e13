"""``grove train --dry-run``'s memory estimate for visgen (``visgen.parameter_count``): the pipeline's components
counted on the meta device equal the loaded pipeline's, the LoRA adapters of a tiny config counted here by hand
equal what ``FlowPolicy`` trains, and the bytes follow (issue 64)."""
from __future__ import annotations

from pathlib import Path

import torch

from shared_rl.config import apply_overrides, load_train_config, load_yaml
from shared_rl.memory_estimate import per_process_bytes

ROOT = Path(__file__).resolve().parents[2]
# assets/shapes-sd3-tiny's transformer: 4 MM-DiT blocks, 4 heads x 24 = 96 wide
BLOCKS, WIDTH = 4, 96


def _cfg(overrides: list[str]):
    return load_train_config(apply_overrides(load_yaml(ROOT / "configs/visgen/shapes_grpo.yaml"), overrides))


def _loaded():
    from visgen.pipelines.load import load_pipeline

    pipe, _, _ = load_pipeline(str(ROOT / "assets/shapes-sd3-tiny"), torch.float32)
    return pipe


def test_lora_of_a_tiny_config_by_hand():
    from visgen.policy import FlowPolicy

    cfg = _cfg(["visgen.lora.rank=2", "visgen.lora.target_modules=[to_q, to_v]"])
    groups = cfg.domain_config.parameter_groups(cfg)
    lora = BLOCKS * 2 * 2 * (WIDTH + WIDTH)  # 4 blocks x {to_q, to_v} x rank 2 x (in 96 + out 96)
    pipe = _loaded()
    n = {name: sum(p.numel() for p in m.parameters()) for name, m in pipe.components.items()
         if isinstance(m, torch.nn.Module)}
    assert [(g.name, g.count, g.trainable, g.sharded) for g in groups] == [
        ("LoRA adapters", lora, True, True), ("transformer (frozen)", n["transformer"], False, True),
        ("text_encoder", n["text_encoder"], False, False), ("text_encoder_2", n["text_encoder_2"], False, False),
        ("vae", n["vae"], False, False)]
    policy = FlowPolicy(pipe, "lora", cfg.domain_config.lora)
    assert sum(p.numel() for p in policy.trainable_parameters()) == lora == 3072
    frozen = n["transformer"] + n["text_encoder"] + n["text_encoder_2"] + n["vae"]
    # float32: the adapters 16 B each (weight, gradient, 2 AdamW moments), every frozen weight 4 B
    assert per_process_bytes(groups) == lora * 16 + frozen * 4
    assert per_process_bytes(groups, "fsdp2", 2) == (lora * 16 + n["transformer"] * 4) // 2 + (frozen - n["transformer"]) * 4


def test_full_fine_tuning_with_its_reference_and_ema_in_bfloat16():
    cfg = _cfg(["visgen.train_mode=full", "visgen.ema.enabled=true", "visgen.dtype=bfloat16"])
    n = sum(p.numel() for p in _loaded().transformer.parameters())
    transformer, reference, ema, *rest = cfg.domain_config.parameter_groups(cfg)
    assert (transformer.count, transformer.trainable, transformer.dtype_bytes) == (n, True, 4)  # float32 masters
    assert (reference.count, reference.trainable, reference.dtype_bytes) == (n, False, 2)
    assert (ema.count, ema.trainable, ema.dtype_bytes) == (n, False, 4)
    assert all(not g.trainable and g.dtype_bytes == 2 for g in rest)


def test_an_uncached_hub_id_has_no_estimate(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from visgen.parameter_count import pipeline_directory

    assert pipeline_directory("someone/not-a-cached-pipeline") is None
