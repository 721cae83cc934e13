"""What a GPU user needs to know about π0 / π0.5's memory in grove (docs/methods/lerobot_policies.md):

- **counted at full size**: LeRobot 0.6's ``PI0Pytorch`` / ``PI05Pytorch`` built on the ``meta`` device from the real
  ``gemma_2b`` + ``gemma_300m`` table and SigLIP-So400m at 224x224 (no weights, no memory): parameters per part,
  the LoRA parameters grove trains (rank r on LeRobot's default targets), the prefix tokens and KV-cache bytes;
- **measured at tiny size**: one training step of grove's recomputation (prefix pass + one expert step with LoRA,
  batch 8), bytes autograd keeps for backward (saved-tensor hooks), with and without gradient checkpointing;
- **estimated at full size** from the counts: weights, LoRA's Adam state, the rollout's prefix KV cache per env.

    python scripts/robotics_pi_memory.py [--rank 32] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import torch

from robotics.envs.vector import EnvConfig
from robotics.policies.lerobot import PolicySettings, import_policies
from robotics.policies.lerobot.load import load_lerobot_policy
from robotics.policies.lerobot.tiny_pi import TinyPi, build_tiny_pi
from shared_rl.config import from_dict

GIB = 2 ** 30
ENV = EnvConfig(tasks=["reach-v3"], horizon=8)


def full_size_counts(family: str, rank: int, cameras: int = 1) -> dict:
    """Parameter counts of a full-size π (built on the meta device), LoRA's on LeRobot's default targets, the prefix
    length and its KV bytes per sample (bfloat16)."""
    import_policies()
    from lerobot.configs.types import FeatureType, PolicyFeature

    if family == "pi0":
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy, PI0Pytorch as Core
    else:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy, PI05Pytorch as Core
    inputs = {f"observation.images.cam{i}": PolicyFeature(FeatureType.VISUAL, (3, 224, 224)) for i in range(cameras)}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (4,))
    cfg = Config(device="cpu", dtype="bfloat16", input_features=inputs,
                 output_features={"action": PolicyFeature(FeatureType.ACTION, (4,))})
    with torch.device("meta"):
        core = Core(cfg)
    parts: dict[str, int] = {}
    for name, p in core.named_parameters():
        if "vision_tower" in name or "multi_modal_projector" in name:
            key = "SigLIP + projector"
        elif "lm_head" in name:
            key = "lm heads (unused by π's forward)"
        elif "embed_tokens" in name:
            key = "PaliGemma token embeddings"
        elif "gemma_expert" in name:
            key = "action expert"
        elif "paligemma" in name:
            key = "PaliGemma decoder"
        else:
            key = "projections (state / action / time)"
        parts[key] = parts.get(key, 0) + p.numel()
    targets = re.compile(Policy._get_default_peft_targets(None)["target_modules"])
    lora = sum(rank * (m.in_features + m.out_features) for n, m in core.named_modules()
               if isinstance(m, torch.nn.Linear) and targets.fullmatch(f"model.{n}"))
    text = core.paligemma_with_expert.paligemma.config.text_config
    image_tokens = (224 // 14) ** 2
    prefix = cameras * image_tokens + cfg.tokenizer_max_length
    kv_per_sample = text.num_hidden_layers * 2 * prefix * text.num_key_value_heads * text.head_dim * 2
    return {"parameters": sum(parts.values()), "parts": parts, "lora": lora, "prefix_tokens": prefix,
            "kv_bytes_per_sample": kv_per_sample, "chunk": [cfg.chunk_size, cfg.max_action_dim],
            "denoise_steps": cfg.num_inference_steps}


def tiny_step_bytes(family: str, checkpointing: bool, batch: int = 8) -> dict:
    """Bytes autograd keeps for one recomputation step at tiny size (prefix + one expert step, LoRA rank 8)."""
    with tempfile.TemporaryDirectory() as tmp:  # the tiny policy is ~150 MB: never leave it behind
        return _tiny_step_bytes(Path(tmp) / "policy", family, checkpointing, batch)


def _tiny_step_bytes(path: Path, family: str, checkpointing: bool, batch: int) -> dict:
    t = TinyPi(family=family)
    build_tiny_pi(path, ENV, t, seed=0)
    s = from_dict(PolicySettings, {"type": "lerobot", "path": str(path), "lora": {"rank": 8},
                                   "gradient_checkpointing": checkpointing}, "robotics.policy")
    vla = load_lerobot_policy(s, ENV, str(path), seed=0).train()
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (batch, 64, 64, 3), dtype=torch.uint8, generator=g)
    proprio = torch.randn(batch, 4, generator=g) * 0.1
    ids = vla.text.token_ids(["reach the red goal with the gripper"] * batch)
    x = torch.randn(batch, t.chunk_size * t.max_action_dim, generator=g)
    kept = [0]

    def pack(tensor):
        kept[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        h = vla.encode(images, proprio, ids)
        lp, *_ = vla.flow.step_log_prob(h, x, x + 0.01, torch.zeros(batch, dtype=torch.long), "flow_sde", 0.7)
    lp.sum().backward()
    return {"kept_mib": kept[0] / 2 ** 20, "parameters": sum(p.numel() for p in vla.parameters()),
            "lora": sum(p.numel() for p in vla.parameters() if p.requires_grad)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=32, help="LoRA rank of the GPU recipes")
    p.add_argument("--envs", type=int, default=64, help="envs whose prefix caches a rollout keeps at once")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = {}
    for family in ("pi0", "pi05"):
        full = full_size_counts(family, a.rank)
        tiny = {ck: tiny_step_bytes(family, ck) for ck in (False, True)}
        n = full["parameters"]
        est = {"weights_bf16_gib": 2 * n / GIB, "weights_fp32_gib": 4 * n / GIB,
               "lora_adam_fp32_gib": 16 * full["lora"] / GIB,  # weights + grad + Adam m, v in fp32
               "prefix_kv_gib_for_envs": full["kv_bytes_per_sample"] * a.envs / GIB}
        out[family] = {"full_size_counted": full, "tiny_measured": {str(k): v for k, v in tiny.items()},
                       "full_size_estimated": est}
        print(f"{family}: {n / 1e9:.2f}B parameters ({', '.join(f'{k} {v / 1e6:.0f}M' for k, v in full['parts'].items())}); "
              f"LoRA r={a.rank}: {full['lora'] / 1e6:.1f}M; prefix {full['prefix_tokens']} tokens, "
              f"KV {full['kv_bytes_per_sample'] / 2 ** 20:.1f} MiB per sample (bf16)")
        print(f"  weights {est['weights_bf16_gib']:.1f} GiB bf16 / {est['weights_fp32_gib']:.1f} GiB fp32; LoRA + Adam "
              f"{est['lora_adam_fp32_gib']:.2f} GiB; prefix caches of {a.envs} envs {est['prefix_kv_gib_for_envs']:.2f} GiB")
        print(f"  tiny ({tiny[False]['parameters'] / 1e6:.1f}M parameters, LoRA {tiny[False]['lora'] / 1e3:.0f}k): kept for "
              f"backward per step of 8 rows {tiny[False]['kept_mib']:.2f} MiB, with checkpointing "
              f"{tiny[True]['kept_mib']:.2f} MiB")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float))
    return out


if __name__ == "__main__":
    main()
