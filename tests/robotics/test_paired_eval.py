"""The paired held-out evaluation of the robotics domain (``robotics.eval_seed``, ``robotics.eval_noise_draws``):
the run's first evaluation is the baseline, every later one is read episode by episode against it
(``eval/success_delta`` ± ``eval/success_delta_se``), the baseline survives a resume, and each evaluation's
episodes are on disk (``RUN/eval_episodes/itNNNN.json``)."""
import json
import os
import shutil

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch
import yaml

from shared_rl.cli import main

from robotics.evaluation import EvalOutcomes, evaluate_episodes, paired_delta
from tests.robotics.test_domain import TINY_MODEL, _domain

ENV = {"kind": "point", "tasks": ["point-reach"], "horizon": 8}


def _chains_and_success(out: EvalOutcomes):
    return out.success.tolist(), out.length.tolist()


def test_a_draw_is_seed_plus_its_index_and_each_draw_meets_other_noise():
    dom = _domain("sde_one_step", eval_states_per_task=6)
    two = evaluate_episodes(dom.policy, dom.cfg.env, 6, dom.venv, seed=0, noise_draws=2)
    one = evaluate_episodes(dom.policy, dom.cfg.env, 6, dom.venv, seed=1)
    assert two.draws == [0] * 6 + [1] * 6 and two.keys[:6] == two.keys[6:] == one.keys
    # draw 1 of seed 0 is draw 0 of seed 1: the same episodes
    assert two.success[6:].tolist() == one.success.tolist() and two.length[6:].tolist() == one.length.tolist()
    dom.close()


def test_the_same_start_noise_pairs_two_policies(tmp_path):
    """Baseline at iteration 0; a changed policy's later evaluation is paired with it, and the delta is exactly the
    change of the mean success (equal episodes); the baseline travels in the domain's extra state."""
    dom = _domain("sde_one_step", eval_states_per_task=8, eval_standard_error=True)
    first = dom.evaluate(0)
    assert "eval/success_delta" not in first and dom.eval_baseline is not None
    with torch.no_grad():
        for p in dom.policy.flow.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    later = dom.evaluate(3)
    assert later["eval/success_delta"] == pytest.approx(later["eval/success"] - first["eval/success"])
    base = dom.eval_baseline
    # the same numbers from the recorded episodes
    again = evaluate_episodes(dom.policy, dom.cfg.env, 8, dom.venv)
    assert paired_delta(base, again)["eval/success_delta_se"] == later["eval/success_delta_se"]
    other = _domain("sde_one_step", eval_states_per_task=8)
    other.load_extra_state(json.loads(json.dumps(dom.extra_state())))
    assert other.eval_baseline.pairs_with(base) and (other.eval_baseline.success == base.success).all()
    dom.close()
    other.close()


def _config(tmp_path, **robotics):
    cfg = {"domain": "robotics", "seed": 0, "iterations": 4, "rollout": {"groups_per_iteration": 2, "group_size": 4},
           "optim": {"lr": 3e-3}, "eval": {"at_start": True, "every": 2}, "checkpoint": {"every": 1, "keep_last": 5},
           "logging": {"progress": False},
           "robotics": {"env": ENV, "checkpoint": "", "model": TINY_MODEL, "head_mode": "sde_one_step",
                        "train_states_per_task": 8, "eval_states_per_task": 6, "gifs": False,
                        "eval_noise_draws": 2, **robotics}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_the_paired_change_and_a_resume_keeps_its_baseline(tmp_path):
    path = _config(tmp_path)
    run = tmp_path / "run"
    assert main(["train", str(path), "--out", str(run)]) == 0
    recs = _records(run)
    evals = [r for r in recs if "eval/success" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert "eval/success_delta" not in evals[0] and "eval/success_draw_sd" in evals[0]
    for r in evals[1:]:
        assert r["eval/success_delta"] == pytest.approx(r["eval/success"] - evals[0]["eval/success"])
        assert np.isfinite(r["eval/success_delta_se"])
    files = sorted(p.name for p in (run / "eval_episodes").iterdir())
    assert files == ["it0000.json", "it0002.json", "it0004.json"]
    base = EvalOutcomes.from_json(json.loads((run / "eval_episodes" / "it0000.json").read_text()))
    last = EvalOutcomes.from_json(json.loads((run / "eval_episodes" / "it0004.json").read_text()))
    assert len(base.success) == 12 and paired_delta(base, last)["eval/success_delta"] == pytest.approx(
        evals[-1]["eval/success_delta"])
    # resume from iteration 3: the baseline comes from the checkpoint, not from a new evaluation
    want = {k: v for k, v in recs[-1].items() if k.startswith("eval/")}
    shutil.rmtree(run / "checkpoints" / "step_000004")
    assert main(["train", "--resume", str(run)]) == 0
    got = {k: v for k, v in _records(run)[-1].items() if k.startswith("eval/")}
    assert got == want and "eval/success_delta" in got


def test_a_saved_baseline_pairs_a_run_that_skips_its_first_evaluation(tmp_path):
    """robotics.eval_baseline: a run started from the same weights pairs with an earlier run's iteration-0 episodes
    (eval.at_start: false saves that evaluation); the same deltas as evaluating at start; a file of other episodes
    or other weights is one line and exit 2."""
    from shared_rl.config import ConfigError, load_train_config
    from shared_rl.trainer import Trainer

    # a clone on disk: the tiny VLA saved by a first run, so both runs start from the same checkpoint
    seed_run = tmp_path / "seed"
    assert main(["train", str(_config(tmp_path, eval_noise_draws=1)), "--out", str(seed_run), "iterations=1"]) == 0
    clone = seed_run / "final"
    assert (clone / "model.safetensors").is_file() or any(clone.iterdir())
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", str(_config(tmp_path, checkpoint=str(clone))), "--out", str(a)]) == 0
    base = a / "eval_episodes" / "it0000.json"
    assert main(["train", str(_config(tmp_path, checkpoint=str(clone), eval_baseline=str(base))), "--out", str(b),
                 "eval.at_start=false"]) == 0
    ra, rb = _records(a), _records(b)
    assert "eval/success" not in rb[0] or rb[0]["step"] != 0
    summary = (b / "summary.txt").read_text()  # the paired change is the summary (not the rewards', not step 2 -> 4)
    assert summary.startswith("summary at step 4, paired with the baseline") and "eval/success: " in summary
    assert "(paired change " in summary
    keys = ("eval/success", "eval/success_delta", "eval/success_delta_se")
    assert [{k: r[k] for k in keys} for r in ra if "eval/success_delta" in r] == \
        [{k: r[k] for k in keys} for r in rb if "eval/success" in r]
    # other episodes (another seed) and other weights are refused before anything runs
    for extra, match in (({"eval_seed": 1}, "its seed is 0, this run's 1"), ({}, "evaluated other weights")):
        data = yaml.safe_load(_config(tmp_path, checkpoint=str(clone) if extra else "", eval_baseline=str(base),
                                      **extra).read_text())
        with pytest.raises(ConfigError, match=match):
            Trainer(load_train_config(data), tmp_path / "x", log=lambda s: None)


def test_the_committed_libero_clone_carries_its_own_held_out_episodes():
    """assets/libero-vla-tiny-bc5: the eval_baseline of configs/robotics/libero_grpo.yaml is this clone's evaluation
    (its weights' digest) on the recipe's own episodes (the 50 fixed states of its four tasks, seed 0)."""
    from pathlib import Path

    from shared_rl.config import load_train_config

    from robotics.evaluation import eval_settings, policy_digest
    from robotics.policies.vla import TinyVLA

    root = Path(__file__).resolve().parents[2]
    asset = root / "assets" / "libero-vla-tiny-bc5"
    base = EvalOutcomes.from_json(json.loads((asset / "eval_episodes.json").read_text()))
    assert base.policy == policy_digest(TinyVLA.load_pretrained(asset))
    cfg = load_train_config(yaml.safe_load((root / "configs/robotics/libero_grpo.yaml").read_text())).domain_config
    assert cfg.eval_baseline.endswith("libero-vla-tiny-bc5/eval_episodes.json")
    assert base.settings == eval_settings(cfg.env, cfg.eval_states_per_task, cfg.eval_split, 0, cfg.eval_seed,
                                          cfg.eval_noise_draws, cfg.eval_init_noise)
    assert len(base.success) == 200 and abs(base.success.mean() - 0.62) < 1e-9
