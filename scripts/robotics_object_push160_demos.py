"""The demos of ``assets/metaworld-vla-tiny-dart-object-push160``: the object-observing DART demos of the five tasks
(40 each, as configs/robotics/metaworld_bc_dart_object.yaml collects them) with push-v3's 40 replaced by 160 push
demos collected on their own (seed 0), so the other four tasks' demos are exactly the object clone's.

    python scripts/robotics_object_push160_demos.py [--out runs/robotics-demos/demos_dart_object_push160.npz]

(~1 min per 40 demos on 2 cores; the five-task file is reused when present.) Then
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

from robotics.collect import collect_demos  # noqa: E402
from robotics.data import load_episodes, save_episodes  # noqa: E402
from robotics.envs import EnvConfig  # noqa: E402

TASKS = ["reach-v3", "push-v3", "door-open-v3", "button-press-topdown-v3", "drawer-close-v3"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/robotics-demos/demos_dart_object_push160.npz")
    p.add_argument("--five-task", default="runs/robotics-demos/demos40_dart_object.npz",
                   help="the object clone's demos (collected here first if missing)")
    args = p.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"error: {out} already exists; remove it or pass another --out")
    env = dict(include_goal=True, include_object=True, horizon=150, cameras=["corner"], image_size=64)
    base_path = Path(args.five_task)
    if base_path.is_file():
        base = load_episodes(base_path)
    else:
        base = collect_demos(EnvConfig(tasks=TASKS, **env), 40, 0.3, 0, labels="expert")
        save_episodes(base, base_path)
    push = collect_demos(EnvConfig(tasks=["push-v3"], **env), 160, 0.3, 0, labels="expert")
    merged = [e for e in base if e.task != "push-v3"] + push
    path = save_episodes(merged, out)
    print(f"wrote {len(merged)} episodes ({len(push)} push) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
