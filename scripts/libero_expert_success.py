"""Success of grove's scripted LIBERO expert (robotics/envs/libero_expert.py) on the benchmark's fixed init states.

Each episode runs in grove's LIBERO env (robotics/envs/libero_env.py: LeRobot's reset, 10 settle steps, the suite's
280-step limit; the fixtures placed from a seed of the state's key) and succeeds when LIBERO's goal predicate holds
after any step.

    MUJOCO_GL=egl python scripts/libero_expert_success.py --suite libero_spatial --states 50 --out runs/libero/spatial.json
    MUJOCO_GL=egl python scripts/libero_expert_success.py --suite libero_object --tasks 0 4 --states 10 --noise 0.1

Writes a JSON list, one record per task: {suite, task_id, language, task, success_rate, n, mean_steps, noise,
failed_states, wall_s} (mean_steps: steps until success, the limit counted for a failure); ``grove bench
robotics-libero`` shows such files as rows (GROVE_BENCH_LIBERO_EXPERT).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from robotics.collect import libero_expert_success
from robotics.envs.libero_tasks import language


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="libero_spatial", choices=["libero_spatial", "libero_object", "libero_goal"])
    ap.add_argument("--tasks", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--states", type=int, default=50, help="fixed init states per task (of 50)")
    ap.add_argument("--first-state", type=int, default=0, help="start at this init state index")
    ap.add_argument("--noise", type=float, default=0.0, help="std of the Gaussian noise on the expert's actions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file for the records")
    args = ap.parse_args(argv)
    records = []
    for task_id in args.tasks:
        task = f"{args.suite}/{task_id}"
        rec = libero_expert_success(task, args.states, args.noise, args.seed * 1000 + task_id, args.first_state,
                                    log=lambda s: print(s, flush=True))
        records.append({"suite": args.suite, "task_id": task_id, "language": language(task), **rec})
    print(f"[{args.suite}] mean success {np.mean([r['success_rate'] for r in records]):.3f} over {len(records)} tasks, "
          f"noise {args.noise}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
