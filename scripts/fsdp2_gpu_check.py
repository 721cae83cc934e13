"""FSDP2 on GPUs (NCCL), ready for the day a machine with 2+ GPUs is lent: each case runs ``grove train`` once in
one process and once under ``torchrun --nproc_per_node N`` with ``distributed.strategy=fsdp2``, and compares the
metric records (and, where a case resumes, the final weights). Nothing here was run on GPUs yet (docs/scaling.md).

    python scripts/fsdp2_gpu_check.py --out runs/gpu-check                 # 2 GPUs, every case
    python scripts/fsdp2_gpu_check.py --procs 4 --only toy,sd3-full        # some cases, 4 GPUs
    python scripts/fsdp2_gpu_check.py --device cpu --only toy,toy-resume   # the same flow on gloo CPU processes

Cases: ``toy`` (fp32), ``toy-bf16`` (``distributed.mixed_precision=bf16``, to bf16 accuracy), ``toy-offload``
(``distributed.cpu_offload=true``, GPUs only), ``toy-resume`` (the N-process sharded checkpoint of the last-but-one
step resumed in one process: the final weights), ``sd3-lora`` / ``sd3-full`` (a tiny SD3 built here, LoRA / full
fine-tuning with the sharded reference copy, KL on), ``wan22`` (a tiny two-expert Wan 2.2, LoRA) and ``llm-lora``
(the tiny arithmetic LM asset, LoRA). Each fsdp2 run's log must say that process 0 alone loaded the model where the
domain does so. Prints one line per case (largest metric difference, the tolerance, PASS / FAIL), writes
``OUT/summary.json`` and exits 1 if any case fails. ``--tolerance`` scales every tolerance (GPU kernels round
differently from one launch to the next; 1e-5 is the CPU figure).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("reward/mean", "loss/policy", "loss/kl", "grad_norm", "clip_frac", "ratio/mean")

TOY = ["configs/toy.yaml", "iterations=4", "rollout.groups_per_call=1", "checkpoint.every=1", "eval.every=0",
       "logging.progress=false"]


def _sd3(out: Path, full: bool) -> list[str]:
    return [str(ROOT / "configs/visgen/shapes_grpo.yaml"), f"visgen.model={_tiny_sd3(out)}", "iterations=2",
            "rollout.groups_per_iteration=4", "rollout.group_size=2", "rollout.groups_per_call=1",
            "optim.minibatches_per_epoch=2", "optim.micro_batch_size=2", "optim.backward_steps=0", "loss.kl_coef=0.05",
            "eval.every=2",
            "eval.at_start=false", "checkpoint.every=1", "logging.progress=false", "visgen.num_inference_steps=4",
            "visgen.method={name: dance_grpo}", "visgen.lora={rank: 2, alpha: 4}", "visgen.num_threads=0",
            "visgen.eval={max_prompts: 2, samples_per_prompt: 1, grid_prompts: 0}",
            *(["visgen.train_mode=full", "visgen.gradient_checkpointing=true"] if full else [])]


def _tiny_sd3(out: Path) -> Path:
    path = out / "tiny-sd3"
    if not (path / "model_index.json").is_file():
        from visgen import tiny
        from visgen.tasks.shapes import vocabulary

        pipe = tiny.build_pipeline(vocabulary(), seed=0, sample_size=16, vae_channels=(8, 16), num_layers=2,
                                   num_heads=2, head_dim=8, text_hidden=16)
        tiny.save_pipeline(pipe, path)
    return path


def _wan22(out: Path) -> list[str]:
    path = out / "tiny-wan22"
    if not (path / "model_index.json").is_file():
        sys.path.insert(0, str(ROOT))
        from tests.visgen import tiny_families as tf
        from visgen.tasks import video as vtask

        pipe = tf.build_wan(two_experts=True)
        pipe.register_to_config(boundary_ratio=0.7)
        pipe.save_pretrained(path, safe_serialization=True)
        (path / "grove.json").write_text(json.dumps({"num_frames": 5, "resolution": 16, "max_sequence_length": 8,
                                                     "fps": 4}))
        vtask.write_prompt_files(path)
    return [str(ROOT / "configs/visgen/video_shapes_grpo.yaml"), f"visgen.model={path}", "visgen.task=file",
            f"visgen.train_prompts={path}/video_shapes_train.jsonl", f"visgen.eval_prompts={path}/video_shapes_eval.jsonl",
            "iterations=1", "rollout.groups_per_iteration=4", "rollout.group_size=2", "rollout.groups_per_call=1",
            "optim.minibatches_per_epoch=2", "optim.micro_batch_size=2", "loss.kl_coef=0.05", "eval.every=0",
            "eval.at_start=false", "checkpoint.every=0", "logging.progress=false", "visgen.num_inference_steps=4",
            "visgen.kernel=dance", "visgen.method={name: dance_grpo, train_fraction: 0.5}",
            "visgen.lora={rank: 2, alpha: 4}", "visgen.rewards=[{name: video_motion}, {name: video_shapes}]",
            "advantage.weights={video_shapes: 0.0}", "visgen.eval={max_prompts: 1, samples_per_prompt: 1, grid_prompts: 0}"]


LLM = ["configs/llm/arith_grpo.yaml", "iterations=2", "rollout.groups_per_call=1", "llm.eval.num_prompts=32", "eval.every=0", "eval.at_start=false", "checkpoint.every=0",
       "llm.share_prompt_forward=false", "llm.lora.enabled=true", "logging.progress=false"]

# name -> (config + overrides, extra fsdp2 overrides, tolerance, needs a GPU, the log says process 0 loaded alone)
CASES = {
    "toy": (lambda out: TOY, [], 1e-5, False, False),
    "toy-bf16": (lambda out: TOY, ["distributed.mixed_precision=bf16"], 2e-2, False, False),
    "toy-offload": (lambda out: TOY, ["distributed.cpu_offload=true"], 1e-5, True, False),
    "toy-resume": (lambda out: TOY, [], 1e-5, False, False),
    "sd3-lora": (lambda out: _sd3(out, False), [], 1e-5, False, True),
    "sd3-full": (lambda out: _sd3(out, True), [], 1e-5, False, True),
    "wan22": (_wan22, [], 1e-5, False, True),
    "llm-lora": (lambda out: LLM, [], 1e-5, False, True),
}


def _env(device: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def _train(args: list[str], out: Path, device: str, procs: int = 1) -> str:
    """``grove train`` (one process, or ``torchrun`` with ``procs``); returns its output, raises on failure."""
    launch = [sys.executable, "-m", "shared_rl.cli"] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs), "-m",
        "shared_rl.cli"]
    cmd = [*launch, "train", *args, f"device={device}", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(device), capture_output=True, text=True)
    if proc.returncode != 0:  # grove's own one-line errors first (torchrun's traceback summary follows them)
        said = [line for line in (proc.stdout + proc.stderr).splitlines() if "grove: error" in line or "Error" in line]
        raise RuntimeError(f"{' '.join(cmd)}\n" + "\n".join(dict.fromkeys(said[:20])) +
                           f"\n{(proc.stdout + proc.stderr)[-1500:]}")
    return proc.stdout + proc.stderr


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def largest_difference(a: list[dict], b: list[dict], keys=KEYS) -> float:
    """The largest |a - b| over the metric records' shared ``keys`` (inf when the records do not line up)."""
    if len(a) != len(b) or [r.get("step") for r in a] != [r.get("step") for r in b]:
        return float("inf")
    diffs = [abs(ra[k] - rb[k]) for ra, rb in zip(a, b) for k in keys if k in ra and k in rb]
    return max(diffs, default=0.0)


def _weights_difference(a: Path, b: Path) -> float:
    import torch
    from safetensors.torch import load_file

    fa, fb = load_file(str(a)), load_file(str(b))
    if fa.keys() != fb.keys():
        return float("inf")
    return max((float((fa[k].float() - fb[k].float()).abs().max()) for k in fa), default=0.0) if fa else 0.0


def run_case(name: str, out: Path, device: str, procs: int, scale: float) -> dict:
    build, extra, tol, gpu_only, rank0 = CASES[name]
    tol *= scale
    if gpu_only and device != "cuda":
        return {"case": name, "skipped": "needs a GPU"}
    args = build(out)
    one = out / f"{name}-1"
    if not one.exists():
        _train(args, one, device)
    many = out / f"{name}-{procs}"
    import shutil

    shutil.rmtree(many, ignore_errors=True)  # a rerun compares a fresh sharded run with the cached 1-process one
    log = _train([*args, "distributed.strategy=fsdp2", *extra], many, device, procs)
    result = {"case": name, "tolerance": tol, "largest_metric_difference": largest_difference(_records(one),
                                                                                               _records(many))}
    if rank0 and "loaded by process 0 alone" not in log:
        result["error"] = "the fsdp2 run did not load on process 0 alone"
    if name == "toy-resume":  # the sharded checkpoint of the last-but-one step, resumed in one process
        steps = sorted((many / "checkpoints").glob("step_*"))
        resumed = out / f"{name}-resumed"
        shutil.rmtree(resumed, ignore_errors=True)
        shutil.copytree(many, resumed)
        shutil.rmtree(resumed / "checkpoints" / steps[-1].name)
        shutil.rmtree(resumed / "final", ignore_errors=True)
        subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", "--resume", str(resumed)], cwd=ROOT,
                       env=_env(device), check=True, capture_output=True)
        result["largest_weight_difference"] = _weights_difference(one / "final" / "model.safetensors",
                                                                  resumed / "final" / "model.safetensors")
    worst = max(result["largest_metric_difference"], result.get("largest_weight_difference", 0.0))
    result["pass"] = worst <= tol and "error" not in result
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fsdp2-gpu-check")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--only", default="", help="comma-separated cases (default: all): " + ", ".join(CASES))
    parser.add_argument("--tolerance", type=float, default=1.0, help="scale every case's tolerance")
    a = parser.parse_args(argv)
    names = [n for n in a.only.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    if a.device == "cuda":
        import torch

        if torch.cuda.device_count() < a.procs:
            print(f"fsdp2_gpu_check: {torch.cuda.device_count()} GPUs visible, {a.procs} processes asked for "
                  f"(NCCL needs one GPU per process)", file=sys.stderr)
            return 2
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        try:
            r = run_case(name, out, a.device, a.procs, a.tolerance)
        except Exception as exc:  # one failing case must not hide the others' numbers
            r = {"case": name, "pass": False, "error": str(exc)[-2000:]}
        results.append(r)
        if "skipped" in r:
            print(f"{name:12s} skipped ({r['skipped']})")
        else:
            diff = max(r.get("largest_metric_difference", float("inf")), r.get("largest_weight_difference", 0.0))
            print(f"{name:12s} largest difference {diff:.3g} (tolerance {r.get('tolerance', 0):.0e}) "
                  f"{'PASS' if r['pass'] else 'FAIL'}" + (f": {r['error'][:300]}" if "error" in r else ""))
    (out / "summary.json").write_text(json.dumps({"device": a.device, "procs": a.procs, "results": results},
                                                 indent=1) + "\n")
    return 0 if all(r.get("pass", True) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
