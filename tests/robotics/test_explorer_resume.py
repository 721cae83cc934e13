"""The explorer recipe (``configs/robotics/world_model_verified_ranker.yaml``: verified rollouts in Meta-World scored
by a sibling ranker learned from the run's own re-executed groups, co-evolution every 3 iterations, keyframes from
the re-executions, the ranking probe) resumed at iteration 10 of 20 equals the uninterrupted run — records, weights,
the exported policy, world model and ranker (issue 65). Shrunk to minutes: 2 keyframes x 4 candidates, 2 kept,
16-step imagined horizon, 2 evaluation states; the world model's real data is re-collected from the asset's
meta.json into the test's own folder. ``slow``: three 20-iteration runs with MuJoCo."""
import copy
import os
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch
import yaml

from tests.golden.runs import merge
from tests.resume_harness import resume_mismatches

ROOT = Path(__file__).resolve().parents[2]


def explorer_config(data: Path) -> dict:
    cfg = yaml.safe_load((ROOT / "configs/robotics/world_model_verified_ranker.yaml").read_text())
    return merge(cfg, {
        "iterations": 20, "rollout": {"groups_per_iteration": 2, "group_size": 2},
        "robotics": {"eval_states_per_task": 2, "eval_standard_error": False, "env": {"horizon": 32},
                     "rollout": {"verify": {"candidates": 4, "ranker_refit_steps": 20, "probe_keys": 1},
                                 "world_model": {"data": str(data), "horizon": 16, "keyframe_limit": 40,
                                                 "coevolve_episodes": 1}}}})


@pytest.mark.slow
@pytest.mark.timeout(3600)  # minutes alone; a loaded 2-core machine stretches them
def test_the_explorer_recipe_resumed_at_10_of_20_equals_the_uninterrupted_run(tmp_path):
    torch.set_num_threads(1)
    cfg = explorer_config(tmp_path / "wm_data.npz")
    bad = resume_mismatches(copy.deepcopy(cfg), tmp_path, n=20, at=10)
    assert not bad, "\n".join(bad[:20])
    # the packed history is in the checkpoint, and it grows with the run
    from safetensors.torch import load_file

    ckpts = tmp_path / "full" / "checkpoints"
    sizes = {p.name: load_file(str(p / "model.safetensors"))["wm_rollout.learned"].numel()
             for p in sorted(ckpts.iterdir())}
    assert sizes["step_000020"] > sizes["step_000010"] > 0, sizes
