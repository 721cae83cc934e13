"""The demos of ``assets/metaworld-vla-tiny-dart-object-push160``: the object-observing DART demos of the five tasks
(40 each, as configs/robotics/metaworld_bc_dart_object.yaml collects them) with push-v3's 40 replaced by 160 push
demos collected on their own (seed 0), so the other four tasks' demos are exactly the object clone's.

    python scripts/robotics_object_push160_demos.py [--out runs/robotics-demos/demos_dart_object_push160.npz]

(~1 min per 40 demos on 2 cores; the five-task file, ``data`` of that config, is reused when present.) Then
``grove train configs/robotics/metaworld_bc_dart_object_push160.yaml``. ``collect.task_demos: {push-v3: 160}`` in one
collection would give different demos of the later tasks (one noise stream runs through all tasks), so this
script keeps the measured asset's data reproducible.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from robotics.bc import BCConfig  # noqa: E402
from robotics.collect import collect_demos  # noqa: E402
from robotics.data import load_episodes, save_episodes  # noqa: E402
from shared_rl.cli import check_output_file  # noqa: E402
from shared_rl.config import from_dict, load_yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/robotics-demos/demos_dart_object_push160.npz")
    p.add_argument("--push-demos", type=int, default=160)
    args = p.parse_args()
    out = check_output_file(args.out, "--out", suffix=".npz")
    # the object clone's own config says where its demos are and how they are collected
    raw = load_yaml(ROOT / "configs/robotics/metaworld_bc_dart_object.yaml")
    c = from_dict(BCConfig, {k: v for k, v in raw.items() if k not in ("kind", "domain")}, "bc")
    base_path = Path(c.data)
    if base_path.is_file():
        base = load_episodes(base_path)
    else:
        base = collect_demos(c.env, c.collect.demos_per_task, c.collect.noise_std, c.collect.seed, labels=c.collect.labels)
        save_episodes(base, base_path)
    c.env.tasks = ["push-v3"]
    push = collect_demos(c.env, args.push_demos, c.collect.noise_std, c.collect.seed, labels=c.collect.labels)
    merged = [e for e in base if e.task != "push-v3"] + push
    path = save_episodes(merged, out)
    print(f"wrote {len(merged)} episodes ({len(push)} push) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
