"""Tiny world-model fixtures on the synthetic point env (seconds, not minutes)."""
from __future__ import annotations

from pathlib import Path

import torch

TINY_VLA = {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64, "num_denoise_steps": 3}
TINY_WM = {"latent_channels": 4, "width": 8, "ensemble": 2}
POINT_ENV = {"kind": "point", "tasks": ["point-reach"], "horizon": 24}


def tiny_policy_dir(root: Path) -> Path:
    from robotics.policies.vla import TinyVLA, VLAConfig

    torch.manual_seed(0)
    cfg = VLAConfig(**TINY_VLA)
    cfg.proprio_dim = 4
    out = root / "vla"
    TinyVLA(cfg).save_pretrained(out)
    return out


def tiny_wm_asset(root: Path, train_steps: int = 30) -> Path:
    """Collect point-env rollouts of a tiny random VLA, train a tiny world model + success model on them."""
    from robotics.world_model.train import run

    pol = tiny_policy_dir(root)
    cfg = {"data": str(root / "data.npz"), "env": dict(POINT_ENV), "model": dict(TINY_WM),
           "collect": {"demos_per_task": 0, "policy": str(pol), "rollout_states_per_task": 6, "rollouts_per_state": 2,
                       "head_mode": "flow_sde"},
           "train_steps": train_steps, "batch_size": 8, "success_steps": 30, "holdout_fraction": 0.2,
           "export_dir": str(root / "wm")}
    run(cfg, root / "run", log=lambda *_: None)
    return root / "wm"


def wm_train_config(asset: Path, policy: Path, **wm) -> dict:
    return {
        "domain": "robotics", "seed": 0, "iterations": 3,
        "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "advantage": {"estimator": "grpo"}, "optim": {"lr": 1e-4, "inner_epochs": 1, "minibatches_per_epoch": 1},
        "eval": {"at_start": False, "every": 0}, "logging": {"progress": False},
        "robotics": {"env": dict(POINT_ENV), "checkpoint": str(policy), "head_mode": "flow_sde",
                     "train_states_per_task": 6, "eval_states_per_task": 2, "gifs": False,
                     "rollout": {"name": "world_model",
                                 "world_model": {"checkpoint": str(asset), "horizon": 12, "keyframe_states": 6,
                                                 "keyframe_stride": 1, **wm}}},
    }
