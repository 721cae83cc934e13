"""Re-measure a saved LIBERO / Meta-World world model on its training config's held-out episodes (apart from
``heldout``, which ``train`` imports: this module imports both).

    python -m robotics.world_model.remeasure ASSET CONFIG [key=value ...] > report.json
"""
from __future__ import annotations

import torch

from .heldout import keyframe_rollouts, success_report
from .model import WorldModel
from .reward import SuccessModel


def evaluate_asset(asset: str, config: str, overrides: list[str] | None = None) -> dict:
    """Re-measure a saved world model + success model on the held-out episodes of its training config (the same
    ``data``, ``holdout_fraction``, ``holdout_stratify`` and ``seed``, so the same whole episodes): the keyframe
    rollouts and the success report at the model's threshold and at 0.5."""
    from pathlib import Path

    from shared_rl.config import apply_overrides, from_dict, load_yaml

    from .data import load_chunk_episodes
    from .train import WorldModelTrainConfig, resolve, split_episodes

    raw = apply_overrides(load_yaml(config), overrides or [])
    c = from_dict(WorldModelTrainConfig, raw, "robotics-wm")
    episodes = [e for e in load_chunk_episodes(resolve(c.data)) if e.task in c.env.tasks or c.env.kind == "point"]
    _, hold = split_episodes(episodes, c.holdout_fraction, c.seed, stratify=c.holdout_stratify)
    wm, sm = WorldModel.load(Path(asset)), SuccessModel.load(Path(asset))
    return {"asset": str(asset), "heldout_episodes": len(hold),
            "heldout_keyframe_rollouts": keyframe_rollouts(wm, hold, sm, c.report_depth, c.report_stride),
            "success_heldout_report": success_report(wm, sm, hold),
            "success_heldout_report_at_0.5": success_report(wm, sm, hold, threshold=0.5)}


if __name__ == "__main__":  # python -m robotics.world_model.remeasure ASSET CONFIG [key=value ...] > report.json
    import json
    import sys

    torch.set_num_threads(1)
    print(json.dumps(evaluate_asset(sys.argv[1], sys.argv[2], sys.argv[3:]), indent=1, default=float))
