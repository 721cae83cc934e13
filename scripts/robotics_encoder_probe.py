"""Does a tiny VLA's image encoder see the objects? A linear (ridge) probe from its image features to object
positions, fit on frames of training reset states and scored (R², RMSE) on held-out ones (used for
docs/methods/robotics.md, "What limits the five-task gain").

    python scripts/robotics_encoder_probe.py [ASSET] [--frames 600] [--tasks push-v3 reach-v3] [--cameras corner]

Frames: each reset state plus 0-29 random actions (so the hand moves too). Targets from Meta-World's state: the
object xy (push's puck: obs[4:6]) or the goal xy (reach: obs[-3:-1]) and, as the control, the hand xy (obs[0:2]).
Features: the encoder's image vector gelu(image_proj(cnn(frame))), i.e. what the fusion MLP and the action head
read. A frozen encoder (RL's ``robotics.train_encoder: false``) cannot be taught by RL what it does not encode.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from robotics.envs.metaworld_env import MetaWorldTaskEnv, RenderSettings, TaskRenderer, make_key  # noqa: E402
from robotics.policies.vla import TinyVLA  # noqa: E402

TARGETS = {"push-v3": ("puck xy", slice(4, 6)), "reach-v3": ("goal xy", slice(-3, -1))}


def ridge_probe(f: np.ndarray, y: np.ndarray, n_train: int, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """R² and RMSE per target dim of a ridge regression fit on the first ``n_train`` rows, scored on the rest."""
    x = np.c_[f, np.ones(len(f))]
    tr, te = slice(0, n_train), slice(n_train, None)
    w = np.linalg.solve(x[tr].T @ x[tr] + lam * np.eye(x.shape[1]), x[tr].T @ y[tr])
    err = x[te] @ w - y[te]
    r2 = 1 - (err ** 2).sum(0) / ((y[te] - y[te].mean(0)) ** 2).sum(0)
    return r2, np.sqrt((err ** 2).mean(0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("asset", nargs="?", default="assets/metaworld-vla-tiny-dart-goal")
    ap.add_argument("--frames", type=int, default=600, help="frames per task (3/4 fit, 1/4 scored)")
    ap.add_argument("--tasks", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--lam", type=float, default=1e-2, help="ridge penalty")
    ap.add_argument("--cameras", nargs="+", default=["corner"], help="the cameras the asset was cloned with")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    policy = TinyVLA.load_pretrained(args.asset).eval()
    rng = np.random.default_rng(0)
    for task in args.tasks:
        env = MetaWorldTaskEnv(task)
        renderer = TaskRenderer(env.model, RenderSettings(size=policy.cfg.image_size, cameras=args.cameras))
        name, where = TARGETS[task]
        frames, target, hand = [], [], []
        for i in range(args.frames):
            obs = env.reset(make_key(0, "train", 5000 + i))
            for _ in range(int(rng.integers(0, 30))):
                obs, _, _ = env.step(rng.uniform(-1, 1, 4))
            frames.append(renderer.render(env.data))
            target.append(obs[where])
            hand.append(obs[0:2])
        renderer.close()
        x = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255.0 - 0.5
        with torch.no_grad():
            feats = policy.image_features(x).numpy()
        n_train = args.frames * 3 // 4
        for label, y in ((name, np.stack(target)), ("hand xy", np.stack(hand))):
            r2, rmse = ridge_probe(feats, y, n_train, args.lam)
            spread = 100 * y[n_train:].std(0)
            print(f"{task:10s} {label:8s} R2 x/y {r2[0]:.2f} / {r2[1]:.2f}   RMSE {100 * rmse[0]:.1f} / "
                  f"{100 * rmse[1]:.1f} cm   (spread {spread[0]:.1f} / {spread[1]:.1f} cm)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
