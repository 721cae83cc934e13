"""The CPU recipes' first half: a tiny SmolVLA- or π0 / π0.5-architecture LeRobot policy, behaviour-cloned on grove's
Meta-World demos, written as a LeRobot policy directory that a tiny GRPO recipe post-trains.

    python scripts/robotics_lerobot_tiny.py                      # -> runs/lerobot/smolvla-tiny (~6 min on 2 cores)
    grove train configs/robotics/lerobot_smolvla_tiny_grpo.yaml  # GRPO with LoRA, held-out success before/after
    python scripts/robotics_lerobot_tiny.py --family pi05        # -> runs/lerobot/pi05-tiny
    grove train configs/robotics/pi05_tiny_grpo.yaml
    python scripts/robotics_lerobot_tiny.py --env libero --demos runs/bench-libero-rl/demos/K5-of-20.npz
    grove train configs/robotics/libero_smolvla_tiny_grpo.yaml   # LIBERO: the four tasks and 5 demos per task of the
                                                                 # tiny VLA's RL rows (grove bench robotics-libero-rl);
                                                                 # without --demos, collects --demos-per-task of each

The policy is LeRobot's own class (``SmolVLAPolicy`` on a 2-layer SmolVLM built from config, its config and tokenizer
in ``OUT/vlm``; or ``PI0Policy`` / ``PI05Policy`` at the sizes of ``tiny_pi.TinyPi``, a word-level tokenizer in
``OUT/tokenizer``): no hub download. Its pre/postprocessors carry the demos' normalisation statistics, and the BC
loss is LeRobot's own (``policy.forward``). A tiny π keeps its two 257,152-token embedding tables frozen in BC
(``--train-embeddings`` trains them): the word-level prompts use ~300 rows, and Adam over 33M mostly-zero gradients
would be most of a CPU step. ``OUT/bc.json`` records the losses and the held-out success per task.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from robotics.collect import collect_demos
from robotics.data import load_episodes, save_episodes
from robotics.envs.vector import EnvConfig
from robotics.evaluation import evaluate_policy
from robotics.policies.lerobot.bc import behaviour_clone
from robotics.policies.lerobot.load import load_lerobot_policy
from robotics.policies.lerobot.settings import PolicySettings
from robotics.policies.lerobot.tiny import TinySmolVLA, build_tiny_smolvla, demo_stats
from robotics.policies.lerobot.tiny_pi import TinyPi, build_tiny_pi

TASKS = ["door-open-v3", "button-press-topdown-v3"]
LIBERO_TASKS = ["libero_spatial/0", "libero_object/0", "libero_goal/1", "libero_goal/6"]  # libero_bc.yaml's four


def libero_demo_file(tasks: list[str], per_task: int) -> str:
    """Where LIBERO demos are collected when --demos is not given: named by what the file holds (its tasks and demos
    per task), so a recipe never reads a file of another size under its own name."""
    slug = "_".join(t.replace("libero_", "").replace("/", "") for t in tasks)
    return f"runs/libero-demos/{slug}_dart{per_task}.npz"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=["smolvla", "pi0", "pi05"], default="smolvla")
    p.add_argument("--env", choices=["metaworld", "libero"], default="metaworld",
                   help="libero: LIBERO's two cameras, 8-d state and 7-d actions; demos from grove's LIBERO expert")
    p.add_argument("--out", default=None, help="policy directory (default runs/lerobot/<family>-tiny)")
    p.add_argument("--train-embeddings", action="store_true", help="π: also train the token embedding tables")
    p.add_argument("--demos", default=None,
                   help="grove episodes .npz; collected (noisy expert demos) when missing (default: "
                        "runs/robotics-demos/lerobot_tiny_demos.npz; LIBERO: "
                        + libero_demo_file(LIBERO_TASKS, 20).replace("20.npz", "N.npz") + ", N = --demos-per-task)")
    p.add_argument("--tasks", nargs="+", default=None, help=f"default {TASKS}; LIBERO {LIBERO_TASKS}")
    p.add_argument("--demos-per-task", type=int, default=20)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-states", type=int, default=20, help="held-out reset states per task (LIBERO: of 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    libero = a.env == "libero"
    if libero:
        env = EnvConfig(kind="libero", tasks=list(a.tasks or LIBERO_TASKS), horizon=280, cameras=["image", "image2"],
                        eval_batch=16, num_workers=2)  # ~0.35 GB an env
        env.check()
    else:
        env = EnvConfig(tasks=list(a.tasks or TASKS), horizon=150)
    demos = Path(a.demos or (libero_demo_file(env.tasks, a.demos_per_task) if libero
                             else "runs/robotics-demos/lerobot_tiny_demos.npz"))
    if demos.is_file():
        episodes = [e for e in load_episodes(demos) if e.task in env.tasks]
    elif libero:  # as configs/robotics/libero_bc.yaml collects them: DART labels, noise 0.2
        episodes = collect_demos(env, a.demos_per_task, 0.2, a.seed, labels="expert")
        save_episodes(episodes, demos)
    else:
        episodes = collect_demos(env, a.demos_per_task, 0.3, a.seed)
        save_episodes(episodes, demos)
    out = Path(a.out or f"runs/lerobot/{a.family}-tiny" + ("-libero" if libero else ""))
    if a.family == "smolvla":
        build_tiny_smolvla(out, env, TinySmolVLA(), stats=demo_stats(episodes), seed=a.seed)
    else:
        build_tiny_pi(out, env, TinyPi(family=a.family), stats=demo_stats(episodes), seed=a.seed)
    vla = load_lerobot_policy(PolicySettings(type="lerobot", path=str(out)), env, str(out), a.seed, env.action_dim)
    if a.family != "smolvla" and not a.train_embeddings:
        for name, param in vla.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                param.requires_grad_(False)
    t0 = time.time()
    losses = behaviour_clone(vla, episodes, a.steps, a.batch, a.lr, a.seed)
    bc_s = time.time() - t0
    vla.save_pretrained(out)
    result = evaluate_policy(vla, env, a.eval_states)
    record = {"family": a.family, "env": a.env, "demos": len(episodes), "steps": a.steps, "batch": a.batch, "lr": a.lr, "bc_seconds": round(bc_s, 1),
              "loss_first_100": sum(losses[:100]) / min(100, len(losses)),
              "loss_last_100": sum(losses[-100:]) / min(100, len(losses)), **result}
    (out / "bc.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
