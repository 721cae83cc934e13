"""How far the five-task recipe's per-task adapters get by imitation alone (no RL): behaviour cloning through the
rank-16 task adapters of the object clone (``robotics.bc.fit_task_adapters``), every other weight frozen, on
demonstrations of some tasks; optionally saved as a policy a run can start from.

    python scripts/robotics_adapter_bc.py [--demos runs/robotics-demos/demos40_dart_object.npz] [--tasks push-v3]
        [--steps 2000] [--batch 64] [--rank 16] [--out runs/adapter-bc/push.json] [--save DIR]

The default demos are the clone's own (configs/robotics/metaworld_bc_dart_object.yaml's `data`, collected with its
seed and settings when missing, ~3 min on 2 cores). It answers a question of docs/methods/robotics.md ("Where
push's limit is not", "The clone underfits its own demos"): how much better can imitation of the same demos make
the clone through the adapters RL trains? Measured: ``--tasks push-v3`` lifts push 0.075 -> 0.275 in 2000 steps,
0.675 in 6000 (0.775 with ``--rank 64``), the other four tasks as they were; all five tasks, ``--steps 12000
--batch 128 --save assets/metaworld-vla-tiny-dart-object-fit`` (~10 min), 0.69 -> 0.93 — the fitted clone that
configs/robotics/metaworld_mt5_rl_fit.yaml starts from. The evaluation is the recipe's (ODE, 40 held-out reset
states per task, the five-task env), so its numbers compare with the recipe's ``eval before training`` line (0.69).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from robotics.bc import BCConfig, fit_task_adapters  # noqa: E402
from robotics.evaluation import evaluate_policy  # noqa: E402
from robotics.collect import collect_demos  # noqa: E402
from robotics.data import load_episodes, save_episodes  # noqa: E402
from robotics.envs.metaworld_env import instruction_for  # noqa: E402
from robotics.envs.vector import make_vector_env  # noqa: E402
from robotics.policies.vla import TinyVLA  # noqa: E402
from shared_rl.cli import check_output_dir, check_output_file  # noqa: E402
from shared_rl.config import ConfigError, from_dict, load_yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLONE = ROOT / "assets/metaworld-vla-tiny-dart-object"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demos", default="", help="episodes .npz; default: the clone's own demos (collected if missing)")
    p.add_argument("--tasks", nargs="+", default=[], help="tasks whose demos are imitated; default: all five")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/adapter-bc/result.json")
    p.add_argument("--save", default="", help="also save the adapted policy here (a TinyVLA directory that "
                                               "robotics.checkpoint can start a run from); default: not saved")
    args = p.parse_args()
    out = check_output_file(args.out, "--out", suffix=".json")
    save_dir = check_output_dir(args.save, "--save") if args.save else None
    raw = load_yaml(ROOT / "configs/robotics/metaworld_bc_dart_object.yaml")
    c = from_dict(BCConfig, {k: v for k, v in raw.items() if k not in ("kind", "domain")}, "bc")
    env = c.env
    tasks = args.tasks or list(env.tasks)
    unknown = sorted(set(tasks) - set(env.tasks))
    if unknown:
        raise ConfigError(f"--tasks {unknown} are not among the clone's tasks {env.tasks}")
    demos_path = Path(args.demos or c.data)
    if not demos_path.is_file():
        if args.demos:
            raise ConfigError(f"--demos {args.demos}: no such file")
        print(f"collecting the clone's demos into {demos_path} (its config's seed and settings)")
        demos_path.parent.mkdir(parents=True, exist_ok=True)
        save_episodes(collect_demos(env, c.collect.demos_per_task, c.collect.noise_std, c.collect.seed,
                                    labels=c.collect.labels), demos_path)
    episodes = [e for e in load_episodes(demos_path) if e.task in tasks]
    if not episodes:
        raise ConfigError(f"{demos_path} has no demos of {tasks}")
    torch.set_num_threads(1)
    policy = TinyVLA.load_pretrained(CLONE)
    policy.add_task_adapters([instruction_for(t) for t in env.tasks], args.rank, torch.Generator().manual_seed(args.seed))
    env.num_workers = 2
    venv = make_vector_env(env)
    result = {"demos": str(demos_path), "tasks": tasks, "episodes": len(episodes), "steps": args.steps,
              "batch": args.batch, "lr": args.lr, "rank": args.rank}
    try:
        result["before"] = evaluate_policy(policy, env, 40, venv)
        print("before:", json.dumps({k: round(v, 3) for k, v in result["before"].items()}), flush=True)
        fit_task_adapters(policy, episodes, args.steps, args.batch, args.lr, c.augment_shift, args.seed,
                          log=lambda m: print(m, flush=True))
        result["after"] = evaluate_policy(policy, env, 40, venv)
        print("after:", json.dumps({k: round(v, 3) for k, v in result["after"].items()}), flush=True)
    finally:
        venv.close()
    if save_dir is not None:
        policy.save_pretrained(save_dir)  # as an asset: the model and its evaluation, as `bc` exports one
        (save_dir / "eval.json").write_text(json.dumps({k: round(v, 4) for k, v in result["after"].items()}, indent=1))
        result["saved"] = str(save_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
