"""A long robotics evaluation reports progress with an ETA (``shared_rl.metrics.Progress``), through the run's log."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import re

import torch

from shared_rl.config import from_dict
from shared_rl.domain import RunContext

import robotics.evaluation as evaluation
from robotics.domain import RoboticsConfig, RoboticsDomain

TINY_MODEL = {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64, "num_denoise_steps": 2,
              "chunk": 4}


def _domain(log):
    section = {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 12, "success_mode": "end"},
               "checkpoint": "", "model": TINY_MODEL, "train_states_per_task": 2, "eval_states_per_task": 3,
               "gifs": False}
    cfg = from_dict(RoboticsConfig, section, "robotics")
    return RoboticsDomain(cfg, RunContext(run_dir=None, device=torch.device("cpu"), seed=0, log=log))


def test_a_long_evaluation_reports_progress_with_an_eta(monkeypatch):
    lines = []
    monkeypatch.setattr(evaluation, "PROGRESS_EVERY", 0.0)  # every chunk counts as "a while"
    dom = _domain(lines.append)
    out = dom.evaluate(0)
    assert "eval/success" in out
    progress = [s for s in lines if s.startswith("evaluation (3 episodes)")]
    assert progress, lines
    pattern = r"evaluation \(3 episodes\): (\d+)/12 env steps, .+ elapsed, (ETA .+|done)"
    steps = [int(re.fullmatch(pattern, s).group(1)) for s in progress]
    assert steps == sorted(steps) and steps[0] == 4 and "ETA" in progress[0]


def test_a_short_evaluation_stays_quiet():
    lines = []
    _domain(lines.append).evaluate(0)  # well under PROGRESS_EVERY seconds
    assert not [s for s in lines if s.startswith("evaluation (")]


def test_an_evaluation_in_slices_counts_its_progress_across_them(monkeypatch):
    """env.eval_batch: the slices run one after the other, so the count goes on from one to the next (0..24 of 24
    for two slices of a 12-step horizon) instead of restarting, and ends at the total."""
    lines = []
    monkeypatch.setattr(evaluation, "PROGRESS_EVERY", 0.0)
    dom = _domain(lines.append)
    dom.cfg.env.eval_batch = 2  # 3 episodes: slices of 2 and 1
    dom.evaluate(0)
    pattern = r"evaluation \(3 episodes\): (\d+)/24 env steps, .+ elapsed, (ETA .+|done)"
    steps = [int(re.fullmatch(pattern, s).group(1)) for s in lines if s.startswith("evaluation (3 episodes)")]
    assert steps == sorted(steps) and steps[-1] == 24 and any(s > 12 for s in steps), lines


def test_a_long_rollout_reports_its_episodes_progress_and_a_short_one_stays_quiet(monkeypatch):
    lines = []
    dom = _domain(lines.append)
    keys = dom.rollouts.train_keys()
    monkeypatch.setattr(evaluation, "PROGRESS_EVERY", 1e9)  # "shorter than PROGRESS_EVERY" without a clock
    dom.rollout(keys, 2, torch.Generator().manual_seed(0), 0)
    assert not [s for s in lines if s.startswith("rollout (")], "under PROGRESS_EVERY seconds: quiet"
    monkeypatch.setattr(evaluation, "PROGRESS_EVERY", 0.0)
    dom.rollout(keys, 2, torch.Generator().manual_seed(0), 0)
    pattern = r"rollout \(4 episodes\): (\d+)/12 env steps, .+ elapsed, (ETA .+|done)"
    steps = [int(re.fullmatch(pattern, s).group(1)) for s in lines if s.startswith("rollout (")]
    assert steps and steps == sorted(steps) and steps[0] == 4, lines
