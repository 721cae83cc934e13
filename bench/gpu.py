"""Prepared GPU benchmark: where the demo's time and memory go on an accelerator.

``grove bench gpu --out DIR [--quick]`` (or ``python -m bench.gpu``) runs the shapes demo
(``configs/visgen/shapes_grpo.yaml``: 512 images per iteration, 3 trained steps of 10, LoRA) on the first CUDA
device, one fresh ``Trainer`` per row, and writes its table after every row (a time-out keeps what finished):

- the iteration split — sampling, the (CPU) shapes reward, training — and the share of the iteration the GPU is
  busy sampling or training (``gpu_share`` = (time/sample + time/train) / time/iteration; the rest is the reward on
  the host, selection and bookkeeping), from the second iteration (the first warms up the kernels);
- the peak GPU memory of the training phase with ``optim.backward_steps`` 0 (every trained step's graph at once)
  and 1 (one step at a time: the demo's setting), and their gradient norms (the same update).

Without a CUDA device it writes a page that says it was not run (exit 0), unless ``device="cpu"`` is asked for (a
rehearsal of the script). Results: ``DIR/results.json``, ``DIR/results.md``; ``docs/bench/gpu.md`` when asked.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _row(name: str, device: str, over: list[str], quick: bool, log) -> dict[str, Any]:
    from shared_rl.config import apply_overrides, load_train_config, load_yaml
    from shared_rl.trainer import Trainer

    base = ["iterations=2", "eval.at_start=false", "eval.every=0", "logging.progress=false", f"device={device}",
            "checkpoint.every=0"]
    if quick:
        base += ["rollout.groups_per_iteration=2", "rollout.group_size=4", "visgen.num_inference_steps=4"]
    cfg = load_train_config(apply_overrides(load_yaml(ROOT / "configs/visgen/shapes_grpo.yaml"), base + over))
    trainer = Trainer(cfg, None, log=lambda *_: None)
    cuda = trainer.device.type == "cuda"
    t0 = time.perf_counter()
    trainer.iteration(0)  # warm-up: kernels, allocator, caches
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    m = trainer.iteration(1)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    it = m.get("time/iteration", float("nan"))
    row = {"variant": name, "device": str(trainer.device), "images_per_iteration": cfg.rollout.groups_per_iteration
           * cfg.rollout.group_size, "time_iteration_s": it, "time_sample_s": m.get("time/sample"),
           "time_reward_s": m.get("time/reward"), "time_train_s": m.get("time/train"),
           "gpu_share": (m.get("time/sample", 0.0) + m.get("time/train", 0.0)) / it if it == it and it > 0 else None,
           "peak_gpu_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "grad_norm": m.get("grad_norm"), "wall_two_iterations_s": wall}
    log(f"gpu bench: {row}")
    return row


VARIANTS = {
    "demo, backward_steps 0": ["optim.backward_steps=0"],
    "demo, backward_steps 1": ["optim.backward_steps=1"],
}


def run(out_dir: Path, quick: bool = False, log=print, device: str | None = None, write_doc: bool | None = None,
        variants: list[str] | None = None) -> dict[str, Any]:
    from shared_rl.bench import write_results

    out_dir = Path(out_dir)
    device = device or ("cuda" if torch.cuda.is_available() else None)
    doc = ROOT / "docs/bench/gpu.md" if (write_doc if write_doc is not None else (device == "cuda" and not quick)) else None
    if device is None:
        notes = "Not run: no CUDA device on this machine (run `grove bench gpu` where one is at hand)."
        return write_results(out_dir, "gpu", [{"variant": "skipped", "reason": "no CUDA device"}], notes)
    rows: list[dict[str, Any]] = []
    notes = ("The shapes demo (configs/visgen/shapes_grpo.yaml), second of two iterations per row, one process. "
             "gpu_share = (time/sample + time/train) / time/iteration.")
    result: dict[str, Any] = {}
    for name in variants or list(VARIANTS):
        rows.append(_row(name, device, VARIANTS[name], quick, log))
        result = write_results(out_dir, "gpu", rows, notes, doc_path=doc)  # after every row: a time-out keeps it
    return result


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench-gpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--doc", action="store_true", help="also write docs/bench/gpu.md")
    a = p.parse_args()
    run(Path(a.out), a.quick, device=a.device, write_doc=a.doc or None)
