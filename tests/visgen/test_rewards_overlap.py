"""Overlapped scoring (``visgen.score_chunks`` + ``visgen.overlap_rewards``) gives the same metrics as the same
sub-chunked run scored sequentially, for flat and tree methods; the gold-reward hacking guard (metrics, warning,
curves); and their config errors."""
from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer
from tests.golden.runs import compare
from visgen.rewards import base as reward_base
from visgen.rewards.gold import hacking_warnings

torch.set_num_threads(1)
quiet = lambda *_: None  # noqa: E731


def _cfg(tiny_dir, **visgen):
    tree = visgen.get("method", {}).get("name") == "branch_grpo"
    return load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 2,
        "rollout": {"groups_per_iteration": 3, "group_size": 4},
        "advantage": {"weights": {"shapes_strict": 0.0}, "estimator": "depth_zscore" if tree else "grpo"},
        "loss": {"clip_low": 1e-3}, "optim": {"lr": 1e-2, "minibatches_per_epoch": 2},
        "logging": {"progress": False}, "eval": {"every": 0},
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "eval": {"max_prompts": 3, "samples_per_prompt": 1, "grid_prompts": 0}, **visgen},
    })


@pytest.fixture
def slow_shapes(monkeypatch):
    """The shapes reward, slowed down, and the thread each domain scoring call comes from (so overlap is observable:
    every reward call itself runs in a guard thread of its own, ``shared_rl.rewards``)."""
    from visgen.domain import VisgenDomain
    from visgen.rewards.shapes import ShapesReward

    threads = []

    class Slow(ShapesReward):
        def __call__(self, images, prompts, metadata=None):
            time.sleep(0.05)
            return super().__call__(images, prompts, metadata)

    score = VisgenDomain.score

    def recorded(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return score(self, *args, **kwargs)

    monkeypatch.setitem(reward_base._REGISTRY, "shapes", lambda: Slow())  # same outputs
    monkeypatch.setattr(VisgenDomain, "score", recorded)
    return threads


@pytest.mark.parametrize("method", [{"name": "flow_grpo", "train_fraction": 0.5},
                                    {"name": "branch_grpo", "split_steps": [0, 2], "factor": [2]}])
def test_overlapped_scoring_equals_sequential_bit_for_bit(tiny_dir, slow_shapes, method):
    common = {"method": method, "rewards": [{"name": "shapes"}], "score_chunks": 3}
    seq = Trainer(_cfg(tiny_dir, **common), None, log=quiet)
    a = seq.fit()
    assert not any(t.startswith("grove-overlap") for t in slow_shapes)
    del slow_shapes[:]
    over = Trainer(_cfg(tiny_dir, **common, overlap_rewards=True), None, log=quiet)
    b = over.fit()
    # every rollout sub-chunk (2 iterations x 3) is scored in the worker; evaluation stays on the main thread
    assert sum(t.startswith("grove-overlap") for t in slow_shapes) == 6
    assert sum(t == "MainThread" for t in slow_shapes) == 2
    assert compare(a, b) == []  # every non-timing metric, exactly
    it = [r for r in b if "reward/mean" in r]
    assert it and all(r["score_chunks"] == 3.0 and r["time/reward"] >= 0.15 for r in it)
    assert all(r["time/reward_wait"] <= r["time/reward"] + 1e-6 for r in it)
    one = Trainer(_cfg(tiny_dir, method=method, rewards=[{"name": "shapes"}]), None, log=quiet).fit()
    assert compare(one, a)  # sub-chunks draw other noise than one batch: a different (equally valid) run


def test_overlap_config_errors(tiny_dir):
    with pytest.raises(ConfigError, match="overlap_rewards needs score_chunks >= 2"):
        _cfg(tiny_dir, overlap_rewards=True)
    with pytest.raises(ConfigError, match="score_chunks must be >= 1"):
        _cfg(tiny_dir, score_chunks=0)
    with pytest.raises(ConfigError, match="gold reward must never be trained on"):
        _cfg(tiny_dir, gold_rewards=[{"name": "shapes"}])
    with pytest.raises(ConfigError, match="unknown reward 'jpeg'"):
        _cfg(tiny_dir, gold_rewards=[{"name": "jpeg"}])


def test_gold_rewards_are_evaluated_never_trained_and_reported(tiny_dir, tmp_path):
    cfg = _cfg(tiny_dir, rewards=[{"name": "shapes"}], gold_rewards=[{"name": "jpeg_compressibility"}])
    cfg.eval.every = 1
    tr = Trainer(cfg, tmp_path / "run", log=quiet)
    history = tr.fit()
    evals = [r for r in history if "eval/score" in r]
    assert len(evals) == 3 and all("eval/gold/jpeg_compressibility" in r for r in evals)
    assert all(r["gold_sem/jpeg_compressibility"] > 0 for r in evals)
    trained = [r for r in history if "reward/mean" in r]
    assert trained and not any("jpeg" in k for r in trained for k in r if k.startswith("reward/"))  # never trained
    assert tr.domain.trained_outputs() == ["shapes"]  # shapes_strict has weight 0
    summary = (tmp_path / "run" / "summary.txt").read_text()
    assert "eval/gold/jpeg_compressibility" in summary and "eval/score" in summary
    visgen_summary = (tmp_path / "run" / "visgen_summary.txt").read_text()
    assert "gold jpeg_compressibility" in visgen_summary and "held out, never trained" in visgen_summary
    from PIL import Image

    assert Image.open(tmp_path / "run" / "curves.png").size[0] == 1500  # three panels (the trainer's has two)


def test_hacking_warning_needs_a_rise_and_a_fall_beyond_noise():
    def hist(t0, t1, g0, g1, sem):
        return [{"step": 0, "eval/ocr": t0, "eval/gold/pickscore": g0, "gold_sem/pickscore": sem},
                {"step": 5}, {"step": 10, "eval/ocr": t1, "eval/gold/pickscore": g1, "gold_sem/pickscore": sem}]

    lines, warnings = hacking_warnings(hist(0.2, 0.6, 20.0, 19.0, 0.1), ["ocr"])
    assert len(warnings) == 1 and "trained ocr +0.4 rose while gold pickscore fell -1" in warnings[0]
    assert any(line.startswith("gold pickscore: 20 -> 19") for line in lines)
    assert hacking_warnings(hist(0.2, 0.6, 20.0, 19.8, 0.1), ["ocr"])[1] == []  # within 2 s.e. (0.28)
    assert hacking_warnings(hist(0.6, 0.2, 20.0, 19.0, 0.1), ["ocr"])[1] == []  # trained fell too: no hacking
    assert hacking_warnings(hist(0.2, 0.6, 20.0, 21.0, 0.1), ["ocr"])[1] == []  # gold rose
    assert hacking_warnings(hist(0.2, 0.6, 20.0, math.nan, 0.1), ["ocr"])[1] == []
    assert hacking_warnings([{"step": 0, "eval/gold/x": 1.0}], ["ocr"])[1] == []
    json.dumps(lines)  # plain strings


@pytest.mark.parametrize("mode", ["sum_then_normalize", "normalize_then_sum"])
def test_two_weighted_rewards_train_with_per_reward_metrics(tiny_dir, mode):
    cfg = _cfg(tiny_dir, rewards=[{"name": "shapes"}, {"name": "jpeg_compressibility"}])
    cfg.iterations = 1
    cfg.advantage.weights = {"shapes": 1.0, "shapes_strict": 0.0, "jpeg_compressibility": 0.1}
    cfg.advantage.multi_reward = mode
    m = Trainer(cfg, None, log=quiet).iteration(0)
    for name in ("shapes", "shapes_strict", "jpeg_compressibility"):
        assert math.isfinite(m[f"reward/{name}/mean"])
    assert m["reward/jpeg_compressibility/mean"] < 0 and m["advantage/abs_mean"] > 0
