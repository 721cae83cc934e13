"""A learning check of RL in LIBERO (slow: ~20 min on 2 cores; `pytest -m slow tests/robotics/test_libero_learning.py`).

From the committed 5-demo clone (assets/libero-vla-tiny-bc5), RIPT-VLA's LOOP recipe as `grove bench
robotics-libero-rl` runs it (the bench's ``ript-loop`` overrides of configs/robotics/libero_grpo.yaml), on the task
where that recipe gained most (libero_goal/6: +0.16 ± 0.07 held out in 6 iterations), trained on 8 reset states and
evaluated on the same 8 (eval_split: train) with 4 start-noise draws each: the paired change on the training states
must exceed 2 paired standard errors (the band the same evaluation measures for itself).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("libero")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_loop_run_from_the_5_demo_clone_gains_on_its_training_states(tmp_path):
    from shared_rl.config import apply_overrides, load_train_config
    from shared_rl.trainer import Trainer

    from bench.robotics_libero_rl import RL_VARIANTS

    data = yaml.safe_load((ROOT / "configs" / "robotics" / "libero_grpo.yaml").read_text())
    data = apply_overrides(data, [*RL_VARIANTS["ript-loop"], "iterations=4", "eval.at_start=true", "eval.every=4",
                                  "rollout.groups_per_iteration=8", "robotics.eval_baseline=''",
                                  "robotics.env.tasks=[libero_goal/6]", "robotics.train_states_per_task=8",
                                  "robotics.eval_split=train", "robotics.eval_states_per_task=8",
                                  "robotics.eval_noise_draws=4", "robotics.env.eval_batch=16",
                                  "selection.history_readmit_after=1"])
    data["robotics"]["checkpoint"] = str(ROOT / "assets" / "libero-vla-tiny-bc5")
    hist = Trainer(load_train_config(data), tmp_path / "run", log=lambda s: None).fit()
    last = [h for h in hist if "eval/success" in h][-1]
    delta, se = last["eval/success_delta"], last["eval/success_delta_se"]
    assert delta > 2 * se, (delta, se, last["eval/success"])
