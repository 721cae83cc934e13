"""What ``robotics.policy.gradient_checkpointing`` buys on a LeRobot SmolVLA (docs/methods/lerobot_policies.md):
the bytes autograd keeps for backward (counted with saved-tensor hooks; with checkpointing only each checkpointed
region's inputs are kept) and the time of one training forward/backward (prefix pass + one expert step, batch 8,
every weight trainable), with and without, on the test's tiny policy and a mid-size one (CPU, 1 thread).

    python scripts/robotics_lerobot_checkpointing_probe.py
"""
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import torch

from robotics.envs.vector import EnvConfig
from robotics.policies.lerobot import PolicySettings
from robotics.policies.lerobot.load import load_lerobot_policy
from robotics.policies.lerobot.tiny import TinySmolVLA, build_tiny_smolvla
from shared_rl.config import from_dict

ENV = EnvConfig(tasks=["reach-v3", "push-v3"], horizon=8)
TEXT = "reach the red goal with the gripper"
SIZES = {"tiny (the tests')": TinySmolVLA(chunk_size=8, n_action_steps=4, max_action_dim=8, num_steps=4),
         "mid": TinySmolVLA(vlm_hidden=256, vlm_layers=4, heads=4, kv_heads=2, head_dim=64, chunk_size=16,
                            n_action_steps=4, max_action_dim=8, num_steps=4, vision_size=64)}


def measure(path: Path, size: TinySmolVLA, checkpointing: bool, batch: int = 8) -> tuple[float, float, int]:
    s = from_dict(PolicySettings, {"type": "lerobot", "path": str(path), "gradient_checkpointing": checkpointing},
                  "robotics.policy")
    vla = load_lerobot_policy(s, ENV, str(path), seed=0).train()
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (batch, 64, 64, 3), dtype=torch.uint8, generator=g)
    proprio = torch.randn(batch, 4, generator=g) * 0.1
    ids = vla.text.token_ids([TEXT] * batch)
    x = torch.randn(batch, size.chunk_size * size.max_action_dim, generator=g)
    steps = torch.zeros(batch, dtype=torch.long)
    kept, times = [0], []

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t

    for _ in range(3):
        kept[0] = 0
        vla.zero_grad()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, *_ = vla.flow.step_log_prob(vla.encode(images, proprio, ids), x, x + 0.01, steps, "flow_sde", 0.7)
        lp.sum().backward()
        times.append(time.perf_counter() - t0)
    return kept[0] / 2 ** 20, min(times), sum(p.numel() for p in vla.parameters())


def main() -> None:
    torch.set_num_threads(1)
    for name, size in SIZES.items():
        with tempfile.TemporaryDirectory() as tmp:  # the tiny policies are ~150 MB each: never leave them behind
            path = Path(tmp) / "policy"
            build_tiny_smolvla(path, ENV, size, seed=0)
            (m0, t0, n), (m1, t1, _) = measure(path, size, False), measure(path, size, True)
        print(f"{name} ({n / 1e6:.2f}M parameters): kept for backward {m0:.2f} -> {m1:.2f} MiB ({m1 / m0:.2f}x), "
              f"step {t0 * 1e3:.0f} -> {t1 * 1e3:.0f} ms ({t1 / t0:.2f}x)")


if __name__ == "__main__":
    main()
