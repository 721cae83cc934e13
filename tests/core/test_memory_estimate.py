"""``grove train --dry-run``'s memory estimate (``shared_rl.memory_estimate``, the domains' ``parameter_groups``):
parameter counts on the meta device equal the loaded model's, the arithmetic is the one of docs/scaling.md's
computed table, and the line says it is an estimate (issue 64)."""
from __future__ import annotations

from pathlib import Path

from shared_rl.cli import main
from shared_rl.config import apply_overrides, load_train_config, load_yaml
from shared_rl.memory_estimate import ParameterGroup, full_finetune_groups, per_process_bytes

ROOT = Path(__file__).resolve().parents[2]


def _cfg(config: str, overrides: list[str]):
    return load_train_config(apply_overrides(load_yaml(ROOT / config), overrides))


def test_the_arithmetic_per_process():
    trained, frozen = ParameterGroup("w", 100, True), ParameterGroup("ref", 100, False, sharded=False)
    assert per_process_bytes([trained, frozen]) == 100 * 16 + 100 * 4  # fp32: weight, gradient, 2 AdamW moments
    assert per_process_bytes([trained, frozen], "fsdp2", 4) == 100 * 16 // 4 + 100 * 4  # the reference replicated
    assert per_process_bytes([trained], "replicate", 4) == 100 * 16
    assert per_process_bytes(full_finetune_groups(10), "fsdp2", 2) == 20 * 10 // 2  # docs/scaling.md: 20 B/param
    assert ParameterGroup("bf16", 1, True, 2).bytes_per_parameter == 8


def test_llm_counts_on_the_meta_device_equal_the_loaded_model():
    from shared_rl.llm.model import load_causal_lm

    cfg = _cfg("configs/llm/arith_grpo.yaml", ["llm.keep_reference=true"])
    groups = cfg.domain_config.parameter_groups(cfg)
    model = load_causal_lm(cfg.domain_config.model)
    n = sum(p.numel() for p in model.parameters())
    assert [(g.name, g.count, g.trainable) for g in groups] == [("model", n, True), ("reference copy", n, False)]
    lora = _cfg("configs/llm/arith_grpo.yaml", ["llm.lora.enabled=true"]).domain_config
    with_adapters = load_causal_lm(lora.model, lora=lora.lora)
    trained = sum(p.numel() for p in with_adapters.parameters() if p.requires_grad)
    adapters, base = lora.parameter_groups(cfg)
    assert (adapters.count, adapters.trainable, base.count, base.trainable) == (trained, True, n, False)


def test_dry_run_prints_the_estimate(capsys):
    assert main(["train", "configs/toy.yaml", "--dry-run"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("#   memory:")]
    assert line == ["#   memory: estimate from parameter counts, ~640 B per process (replicate, 1 process) = logit "
                    "table 32 x 16 B (weights, gradients, AdamW moments) + reference copy 32 x 4 B (weights); "
                    "activations, rollout buffers and caches not included"]
    for recipe in ("configs/visgen/shapes_grpo.yaml", "configs/robotics/metaworld_grpo.yaml"):  # tests/visgen,
        assert main(["train", recipe, "--dry-run"]) == 0  # tests/robotics: test_memory_estimate.py (by hand)
        assert "#   memory: estimate from parameter counts, ~" in capsys.readouterr().out
    assert main(["train", "configs/robotics/world_model_grpo.yaml", "--dry-run"]) == 0  # the world model uncounted
    assert "#   memory: no estimate (the robotics domain counts no parameters" in capsys.readouterr().out
