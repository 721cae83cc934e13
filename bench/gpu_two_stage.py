"""Prepared GPU benchmark for the Sol-RL two-stage rollout: FP8 vs BF16 rollout throughput on a mid-size DiT.

``grove bench gpu-two-stage --out DIR [--quick]`` (or ``python -m bench.gpu_two_stage``) calls ``run``. Where a
CUDA GPU with FP8 kernels is present (compute capability >= 8.9: Hopper such as the H200, Ada, Blackwell) it
builds an SD3-style ``SD3Transformer2DModel`` from a config (no downloads; by default 12 joint blocks of 24 heads
x 64 = 1536 wide, SD3.5-Medium's width at half its depth), and times a whole denoising rollout (``steps`` Euler
steps of a batch of 1024x1024-image latents, 128 x 128 x 16 -> 4096 tokens) four ways: BF16 eager, BF16
``torch.compile``, FP8 W8A8 (torchao ``Float8DynamicActivationFloat8WeightConfig``, per-row scales, through
``quantize_`` — the config the explorer uses, ``visgen.lowprec._native_config("fp8")``) eager and compiled.
Rows: images/s, ms per denoising step, peak memory, the speed and memory ratios against BF16 (same compile
mode), and the FP8 velocity's relative error against BF16 on the same inputs. On a machine without such a GPU it
writes a results page that says it was skipped and why (exit 0): CPU runs skip it.

The Sol-RL paper ("FP4 Explore, BF16 Train") reports 2.4x faster rollouts with NVFP4 on Blackwell; this script
measures what FP8 gives on the GPU that is lent (an H200 has no FP4 tensor cores).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

SIZES = {  # name -> (joint blocks, heads, head dim, latent side, batch, steps)
    "full": (12, 24, 64, 128, 8, 10),
    "quick": (4, 12, 64, 64, 4, 4),
}


def build_dit(layers: int, heads: int, head_dim: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised SD3-family transformer from a config (the weights do not matter for timing)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, out_channels=16,
                                  num_layers=layers, attention_head_dim=head_dim, num_attention_heads=heads,
                                  joint_attention_dim=1024, caption_projection_dim=heads * head_dim,
                                  pooled_projection_dim=768, pos_embed_max_size=192)
    return model.to(device=device, dtype=dtype).eval()


def inputs(batch: int, side: int, device: torch.device | str, dtype: torch.dtype, text_tokens: int = 77,
           seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return {"x": torch.randn(batch, 16, side, side, generator=g).to(device, dtype),
            "text": torch.randn(batch, text_tokens, 1024, generator=g).to(device, dtype),
            "pooled": torch.randn(batch, 768, generator=g).to(device, dtype)}


@torch.no_grad()
def rollout(model, inp: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
    """One ODE rollout: ``steps`` Euler steps x <- x + (sigma' - sigma) v(x, sigma) from sigma = 1 to 0."""
    x = inp["x"]
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((x.shape[0],), s * 1000.0, device=x.device, dtype=x.dtype)
        v = model(hidden_states=x, encoder_hidden_states=inp["text"], pooled_projections=inp["pooled"],
                  timestep=t, return_dict=False)[0]
        x = x + (s_next - s) * v
    return x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rollouts(model, inp: dict[str, torch.Tensor], steps: int, warmup: int = 2, repeats: int = 3) -> dict[str, float]:
    """Images/s and ms per denoising step of whole rollouts (after ``warmup`` rollouts: compilation, autotune)."""
    device = inp["x"].device
    for _ in range(warmup):
        rollout(model, inp, steps)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    for _ in range(repeats):
        rollout(model, inp, steps)
    _sync(device)
    dt = (time.perf_counter() - t) / repeats
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    return {"images_per_s": inp["x"].shape[0] / dt, "ms_per_step": 1000 * dt / steps, "peak_mb": peak}


def fp8_copy(model: torch.nn.Module) -> torch.nn.Module:
    """FP8 W8A8 copy through torchao ``quantize_`` with the explorer's config (every Linear whose sides are
    multiples of 16: the FP8 GEMM's alignment)."""
    import copy

    from torchao.quantization import quantize_

    from visgen.lowprec import _native_config

    q = copy.deepcopy(model)
    quantize_(q, _native_config("fp8"),
              filter_fn=lambda m, _fqn: isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0
              and m.out_features % 16 == 0)
    return q


def velocity_error(ref: torch.nn.Module, other: torch.nn.Module, inp: dict[str, torch.Tensor]) -> float:
    """‖v_other − v_ref‖ / ‖v_ref‖ at sigma = 0.5 on the same inputs."""
    t = torch.full((inp["x"].shape[0],), 500.0, device=inp["x"].device, dtype=inp["x"].dtype)
    with torch.no_grad():
        a = ref(hidden_states=inp["x"], encoder_hidden_states=inp["text"], pooled_projections=inp["pooled"],
                timestep=t, return_dict=False)[0].float()
        b = other(hidden_states=inp["x"], encoder_hidden_states=inp["text"], pooled_projections=inp["pooled"],
                  timestep=t, return_dict=False)[0].float()
    return float((b - a).norm() / a.norm())


def run(out_dir: Path, quick: bool = False, log=print, compile_modes: tuple[bool, ...] = (False, True),
        device: str | None = None) -> dict[str, Any]:
    from shared_rl.bench import markdown_table, write_results
    from visgen.lowprec import native

    out_dir = Path(out_dir)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layers, heads, head_dim, side, batch, steps = SIZES["quick" if quick else "full"]
    if not native("fp8", dev):
        why = (f"skipped: no CUDA GPU with FP8 kernels (compute capability >= 8.9) on this machine ({dev}); run "
               f"`grove bench gpu-two-stage` where an H200 (or Ada/Blackwell) is present")
        log(f"gpu-two-stage: {why}")
        return write_results(out_dir, "gpu-two-stage", [], notes=why + "\n", extra={"skipped": True})
    t0 = time.perf_counter()
    base = build_dit(layers, heads, head_dim, dev)
    inp = inputs(batch, side, dev, torch.bfloat16)
    params = sum(p.numel() for p in base.parameters())
    log(f"gpu-two-stage: DiT {layers} blocks x {heads * head_dim} wide ({params / 1e6:.0f}M parameters), batch "
        f"{batch}, {side}x{side} latents, {steps} steps, on {torch.cuda.get_device_name(dev)}")
    q = fp8_copy(base)
    err = velocity_error(base, q, inp)
    rows: list[dict[str, Any]] = []
    for compiled in compile_modes:
        timed = {}
        for name, m in (("bf16", base), ("fp8", q)):
            model = torch.compile(m) if compiled else m
            timed[name] = time_rollouts(model, inp, steps)
            log(f"  {name}{' compiled' if compiled else ''}: {timed[name]}")
        for name in ("bf16", "fp8"):
            rows.append({"variant": f"{name}-{'compiled' if compiled else 'eager'}", **timed[name],
                         "speed_ratio_vs_bf16": timed[name]["images_per_s"] / timed["bf16"]["images_per_s"],
                         "peak_ratio_vs_bf16": timed[name]["peak_mb"] / timed["bf16"]["peak_mb"],
                         "velocity_rel_error_vs_bf16": err if name == "fp8" else 0.0})
    total = time.perf_counter() - t0
    notes = (f"Command: `grove bench gpu-two-stage{' --quick' if quick else ''}` ({total:.0f} s). SD3-style DiT from a "
             f"config: {layers} joint blocks, {heads} heads x {head_dim} ({params / 1e6:.0f}M parameters), batch {batch} "
             f"of {side}x{side}x16 latents, {steps}-step ODE rollouts, timed after 2 warm-up rollouts. FP8 = torchao "
             f"Float8DynamicActivationFloat8WeightConfig (per-row) via quantize_, the two-stage explorer's config.\n")
    return write_results(out_dir, "gpu-two-stage", rows, notes=notes,
                         extra={"table": markdown_table(rows), "total_s": total, "params": params})


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/bench-gpu-two-stage")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    run(Path(a.out), a.quick)
