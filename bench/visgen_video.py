"""visgen video benchmark: rollout frames/s and peak memory with and without each memory control.
``grove bench visgen-video --out DIR [--quick]`` calls ``run(out_dir, quick)``.

Setup: a randomly initialised Wan pipeline (Wan 2.1 layout VAE, 8x space / 4x time; a UMT5 text encoder; a
``WanTransformer3DModel``) larger than the task asset so activations, not the interpreter, dominate memory: 17
frames at 64x64 with a 4-block transformer over 320 tokens (``--quick``: 9 frames at 32x32), built deterministically
and saved to a temporary directory. Each
variant runs in a **fresh process** (peak memory is a per-process high-water mark): the visgen domain loads the
pipeline with that variant's ``visgen.memory`` / ``rollout_micro_batch`` / ``gradient_checkpointing`` settings;
the first rollout of ``PROMPTS`` prompts x ``GROUP`` clips (Flow-GRPO, 10 SDE steps; prompt encoding, sampling,
decoding, the ``video_motion`` reward) gives the peak memory, the next ``ROLLOUTS`` the throughput, and one training
micro-batch (recomputed log-probs with grad + backward) the training peak.

Per row: ``frames_per_s`` (generated video frames per second of warm rollout wall time), ``rollout_peak_mb`` (peak
memory of the first rollout above the memory held before it: resident set size sampled every 2 ms on CPU,
``torch.cuda.max_memory_allocated`` on CUDA), ``train_peak_mb`` (the same for the training micro-batch), the ratios to
the baseline, ``exact`` (the rewards of every rollout equal the baseline's bit for bit: the control changed nothing
the reward can see) and, for the cache, its hit rate over the warm rollouts (the first rollout's prompts again).

On a CPU the offloading controls cannot save anything (the "device" is the host); their rows show the cost of the
moves only. The accelerator numbers come from running the same command on a GPU. Wall times are from a shared CPU:
the ratios are the result.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bench" / "visgen_video.md"
PROMPTS = ["a red circle moving to the right", "a blue square moving up", "a green circle moving down",
           "a yellow square moving to the left"]
GROUP = 2
ROLLOUTS = 2
STEPS = 10

# variant -> visgen settings (everything else is the baseline's: no cache, no controls)
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline (no controls)": {},
    "prompt cache": {"memory": {"prompt_cache": True}},
    "rollout micro-batch 2": {"rollout_micro_batch": 2},
    "VAE slicing": {"memory": {"vae_slicing": True}},
    "VAE tiling (32 px tiles)": {"memory": {"vae_tiling": True, "vae_tile_size": 32}},
    "frame-chunked decode (1)": {"memory": {"decode_frame_chunk": 1}},
    "offload text encoders": {"memory": {"offload_text_encoders": True}},
    "offload reward models": {"memory": {"offload_rewards": True}},
    "gradient checkpointing": {"gradient_checkpointing": True},
    "all of them": {"rollout_micro_batch": 2, "gradient_checkpointing": True,
                    "memory": {"prompt_cache": True, "vae_slicing": True, "decode_frame_chunk": 1,
                               "offload_text_encoders": True, "offload_rewards": True}},
}


def build_model(directory: Path, quick: bool) -> Path:
    """The benchmark's random Wan pipeline, saved with a grove.json (frames, resolution, text length)."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from visgen.tasks.video import vocabulary
    from visgen.tiny import build_tokenizer

    frames, size = (9, 32) if quick else (17, 64)
    tokenizer = build_tokenizer(vocabulary(), model_max_length=12)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8 if quick else 16, z_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=64, d_kv=32, d_ff=128,
                                               num_layers=2, num_heads=2, relative_attention_num_buckets=8,
                                               pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               decoder_start_token_id=tokenizer.pad_token_id))
    heads, patch = (2, (1, 2, 2)) if quick else (4, (1, 1, 1))
    transformer = WanTransformer3DModel(patch_size=patch, num_attention_heads=heads, attention_head_dim=32,
                                        in_channels=8, out_channels=8, text_dim=64, freq_dim=32,
                                        ffn_dim=4 * heads * 32, num_layers=2 if quick else 4, cross_attn_norm=True,
                                        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer)
    directory.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(directory, safe_serialization=True)
    (directory / "grove.json").write_text(json.dumps({"num_frames": frames, "resolution": size,
                                                      "max_sequence_length": 10}))
    (directory / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return directory


class PeakMemory:
    """Peak memory above the level at ``start()``: CUDA allocator peak, else the sampled resident set size."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.torch = torch

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.cuda:
            self.torch.cuda.synchronize()
            self.base = self.torch.cuda.memory_allocated()
            self.torch.cuda.reset_peak_memory_stats()
        else:
            self.base = self.peak = self._rss()
            self._stop = threading.Event()

            def sample():
                while not self._stop.is_set():
                    self.peak = max(self.peak, self._rss())
                    time.sleep(0.002)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.peak = self.torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss())

    @property
    def mb(self) -> float:
        return max(0, self.peak - self.base) / 2 ** 20


def measure(model: str, name: str) -> dict[str, Any]:
    """One variant, in this process: rollout frames/s and peak memory, training micro-batch peak, rewards."""
    import torch

    from shared_rl.config import load_train_config
    from shared_rl.trainer import Trainer
    from visgen.pipelines.cache import prompt_cache

    torch.set_num_threads(1)
    visgen = {"model": model, "task": "file", "train_prompts": str(Path(model) / "prompts.txt"),
              "num_inference_steps": STEPS, "method": {"name": "flow_grpo", "train_fraction": 0.3},
              "rewards": [{"name": "video_motion"}], "lora": {"rank": 4, "alpha": 8}, "num_threads": 1,
              "memory": {"prompt_cache": False}}
    over = json.loads(json.dumps(VARIANTS[name]))
    visgen["memory"].update(over.pop("memory", {}))
    visgen.update(over)
    cfg = load_train_config({"domain": "visgen", "seed": 0, "iterations": 1, "logging": {"progress": False},
                             "rollout": {"groups_per_iteration": len(PROMPTS), "group_size": GROUP},
                             "eval": {"at_start": False}, "visgen": visgen})
    domain = Trainer(cfg, None, log=lambda *_: None).domain
    keys = list(range(len(PROMPTS)))
    with PeakMemory(domain.ctx.device) as peak:  # the first rollout: its peak includes every one-time allocation
        ro = domain.rollout(keys, GROUP, torch.Generator().manual_seed(0), 0)  # (and the cache's misses)
    rewards = [ro.rewards["video_motion"]]
    cache = prompt_cache(domain.pipe)
    cache.reset_stats()
    frames = 0
    t0 = time.perf_counter()
    for i in range(ROLLOUTS):  # warm: the throughput
        ro = domain.rollout(keys, GROUP, torch.Generator().manual_seed(1 + i), 1 + i)
        frames += ro.logp_old.shape[0] * int(domain.num_frames)
        rewards.append(ro.rewards["video_motion"])
    seconds = time.perf_counter() - t0
    idx = torch.arange(ro.logp_old.shape[0])  # the whole last rollout as one training micro-batch
    with PeakMemory(domain.ctx.device) as train_peak:
        out = domain.log_probs(ro, idx, need_kl=False)
        out.logp.sum().backward()
    stats = cache.stats()
    return {"frames_per_s": frames / seconds, "rollout_peak_mb": peak.mb, "train_peak_mb": train_peak.mb,
            "rewards": torch.cat(rewards).tolist(), "cache_hit_rate": stats["hit_rate"],
            "cache_lookups": stats["hits"] + stats["misses"], "applied": json.loads(json.dumps(domain.memory,
                                                                                              default=str))}


def _subprocess(model: str, name: str, out: Path) -> dict[str, Any]:
    # glibc: allocations over 64 kB get their own mapping and go back to the OS when freed, so the resident set
    # follows the live tensors (with its default dynamic threshold freed blocks stay in the heap and RSS hides peaks)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "bench.visgen_video", "--measure", name, "--model", model, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"visgen-video variant {name!r} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.read_text())


def run(out_dir: Path, quick: bool = False, variants: list[str] | None = None, log=print,
        write_doc: bool | None = None) -> dict[str, Any]:
    from shared_rl.bench import write_results

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = variants or list(VARIANTS)
    if "baseline (no controls)" not in names:
        names = ["baseline (no controls)"] + names
    t_start = time.perf_counter()
    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "wan", quick))
        for name in names:
            log(f"visgen-video: {name}")
            measured[name] = _subprocess(model, name, Path(tmp) / "variant.json")
    base = measured["baseline (no controls)"]
    rows = []
    for name in names:
        m = measured[name]
        row = {"variant": name, "frames_per_s": round(m["frames_per_s"], 2),
               "speed_ratio": round(m["frames_per_s"] / base["frames_per_s"], 3),
               "rollout_peak_mb": round(m["rollout_peak_mb"], 1),
               "peak_ratio": round(m["rollout_peak_mb"] / max(base["rollout_peak_mb"], 1e-9), 3),
               "train_peak_mb": round(m["train_peak_mb"], 1),
               "train_peak_ratio": round(m["train_peak_mb"] / max(base["train_peak_mb"], 1e-9), 3),
               "exact": "yes" if m["rewards"] == base["rewards"] else
               f"max |dr| {max(abs(a - b) for a, b in zip(m['rewards'], base['rewards'])):.2g}"}
        if m["cache_lookups"]:
            row["cache_hit_rate"] = round(m["cache_hit_rate"], 3)
        rows.append(row)
    import platform

    frames, size = (9, 32) if quick else (17, 64)
    notes = (f"{len(PROMPTS)} prompts x {GROUP} clips per rollout; peak memory of the first rollout, frames/s of the "
             f"next {ROLLOUTS}; "
             f"{frames} frames at {size}x{size}, {STEPS} SDE steps, one torch thread; a fresh process per variant. "
             f"Peak memory: {'CUDA allocator' if _cuda() else 'sampled RSS above the pre-rollout level'}. "
             f"Total {time.perf_counter() - t_start:.0f} s on {platform.machine()}. Reproduce: "
             f"`grove bench visgen-video{' --quick' if quick else ''}`.")
    doc = DOC if (write_doc if write_doc is not None else not quick) else None
    return write_results(out_dir, "visgen-video", rows, notes, extra={"measured": measured}, doc_path=doc)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="one visgen-video variant in this process (used by run)")
    parser.add_argument("--measure", required=True, choices=sorted(VARIANTS))
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", required=True, type=Path)
    args = parser.parse_args(argv)
    args.json.write_text(json.dumps(measure(args.model, args.measure)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
