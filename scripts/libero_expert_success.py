"""Success rate of the scripted LIBERO expert (robotics/envs/libero_expert.py).

For each task: build one ControlEnv (no rendering), then for each of the
first N init states: env.reset() + set_init_state, 10 settle steps with the
gripper open (as LeRobot does), then at most 280 expert steps; an episode
succeeds if env.check_success() is true after any step (it ends there).

    MUJOCO_GL=egl PYOPENGL_PLATFORM=egl HF_HUB_OFFLINE=1 .venv/bin/python \
        scripts/libero_expert_success.py --suite libero_spatial --tasks 0 1 2 \
        --states 50 --noise 0 --out runs/libero_expert_spatial.json

Writes a JSON list with one record per task:
{suite, task_id, language, success_rate, n, mean_steps, noise, failed_states, wall_s}
(mean_steps: steps until success, 280 counted for failures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from robotics.envs.libero_expert import LiberoScriptedExpert  # noqa: E402

SETTLE_STEPS = 10
MAX_STEPS = 280


def make_env(suite, task_id):
    from libero.libero import get_libero_path
    from libero.libero.envs.env_wrapper import ControlEnv

    task = suite.get_task(task_id)
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    env = ControlEnv(bddl_file_name=bddl, has_offscreen_renderer=False, use_camera_obs=False,
                     hard_reset=False, camera_heights=128, camera_widths=128)
    return task, env


def run_episode(env, init_state, expert, max_steps=MAX_STEPS, verbose=False):
    env.reset()
    env.set_init_state(init_state)
    for _ in range(SETTLE_STEPS):
        env.step([0, 0, 0, 0, 0, 0, -1])
    expert.verbose = verbose
    expert.reset(env)
    for t in range(max_steps):
        env.step(expert.act(env))
        if env.check_success():
            return True, t + 1
    return False, max_steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="libero_spatial", choices=["libero_spatial", "libero_object"])
    ap.add_argument("--tasks", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--states", type=int, default=50, help="first N of the 50 init states")
    ap.add_argument("--first-state", type=int, default=0, help="start at this init state index")
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=MAX_STEPS)
    ap.add_argument("--verbose", action="store_true", help="print the expert's phase changes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from libero.libero import benchmark

    suite = benchmark.get_benchmark_dict()[args.suite]()
    records = []
    t_all = time.time()
    for task_id in args.tasks:
        t0 = time.time()
        task, env = make_env(suite, task_id)
        init_states = suite.get_task_init_states(task_id)
        env.seed(0)
        env.reset()
        expert = LiberoScriptedExpert(noise=args.noise, seed=args.seed * 1000 + task_id)
        idx = list(range(args.first_state, min(args.first_state + args.states, len(init_states))))
        succ, steps, failed = [], [], []
        for i in idx:
            ok, n = run_episode(env, init_states[i], expert, args.max_steps, args.verbose)
            succ.append(ok)
            steps.append(n)
            if not ok:
                failed.append(i)
                if args.verbose:
                    print(f"  state {i}: FAIL (phase {expert.phase}, attempts {expert.attempts})")
        env.close()
        wall = time.time() - t0
        rec = dict(suite=args.suite, task_id=task_id, language=task.language,
                   success_rate=float(np.mean(succ)), n=len(succ), mean_steps=float(np.mean(steps)),
                   noise=args.noise, failed_states=failed, wall_s=round(wall, 1))
        records.append(rec)
        print(f"[{args.suite} task {task_id}] success {rec['success_rate']:.2f} ({sum(succ)}/{len(succ)}) "
              f"steps/ep {rec['mean_steps']:.0f} wall {wall:.0f}s failed {failed} | {task.language}", flush=True)
    mean = np.mean([r["success_rate"] for r in records])
    print(f"[{args.suite}] mean success {mean:.3f} over {len(records)} tasks, noise {args.noise}, "
          f"total wall {time.time() - t_all:.0f}s", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
