"""Faults: SIGKILL at random points + resume equals an uninterrupted run; SIGTERM checkpoints and exits cleanly;
reward back-ends retried then masked or fatal; out-of-memory turned into advice."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml

from shared_rl.config import ResourceError, load_train_config
from shared_rl.rewards import RewardFailure, RewardGuardConfig, guarded_reward
from shared_rl.trainer import Trainer

CFG = {
    "domain": "toy", "seed": 1, "iterations": 16, "logging": {"progress": False},
    "checkpoint": {"every": 1, "keep_last": 2},
    "rollout": {"groups_per_iteration": 4, "group_size": 4},
    "optim": {"lr": 0.2, "minibatches_per_epoch": 2},
    "selection": {"sampler": "vade"},
    "toy": {"num_contexts": 6, "horizon": 3, "reward_noise": 0.1},
}


def _grove(args, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "shared_rl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, **kw)


def _records(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"} for r in records]


def _wait_for_step(run, step, proc, timeout=600):  # generous: a loaded machine starts python slowly
    t = time.time()
    while time.time() - t < timeout:
        if (run / "metrics.jsonl").is_file():
            lines = (run / "metrics.jsonl").read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        if proc.poll() is not None:
            return
        time.sleep(0.02)


def test_sigkill_at_several_points_then_resume_matches(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    ref = tmp_path / "ref"
    assert _grove(["train", str(cfg), "--out", str(ref)]).wait() == 0
    run = tmp_path / "killed"
    p = _grove(["train", str(cfg), "--out", str(run), "toy.num_contexts=6"])
    for kill_after in (3, 7, 12):
        _wait_for_step(run, kill_after, p)
        p.kill()  # SIGKILL: no handler runs
        p.wait()
        p = _grove(["train", "--resume", str(run)])
    assert p.wait() == 0, p.stdout.read().decode()[-2000:]
    assert _comparable(_records(run)) == _comparable(_records(ref))


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    data = dict(CFG, iterations=400, checkpoint={"every": 0, "keep_last": 2})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    p = _grove(["train", str(cfg), "--out", str(run)])
    _wait_for_step(run, 2, p)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0].decode()
    assert p.returncode == 0 and "SIGTERM" in out
    step = _records(run)[-1]["step"]
    assert (run / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
    assert step < 400


def test_reward_retries_then_nan_or_fatal():
    calls = []

    def flaky(images):
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("backend down")
        return {"r": [1.0] * len(images)}

    guarded = guarded_reward(flaky, "r", RewardGuardConfig(retries=2, backoff_s=0), len, log=lambda *_: None)
    assert torch.equal(guarded([0, 0])["r"], torch.tensor([1.0, 1.0])) and len(calls) == 3

    def dead(images):
        raise ConnectionError("backend down")

    masked = guarded_reward(dead, "r", RewardGuardConfig(retries=1, backoff_s=0), len, log=lambda *_: None,
                            output_names=["r", "r_strict"])
    out = masked([0, 0, 0])
    assert set(out) == {"r", "r_strict"} and torch.isnan(out["r"]).all() and out["r"].shape == (3,)
    fatal = guarded_reward(dead, "r", RewardGuardConfig(retries=0, on_failure="fatal"), len, log=lambda *_: None)
    with pytest.raises(RewardFailure, match="failed after 1 attempts"):
        fatal([0])

    release, finished = threading.Event(), threading.Event()

    def hung(images):  # a backend that answers only when released (or after 30 s)
        release.wait(30)
        finished.set()
        return {"r": [0.0]}

    timed = guarded_reward(hung, "r", RewardGuardConfig(retries=0, timeout_s=0.1), len, log=lambda *_: None)
    assert torch.isnan(timed([0])["r"]).all()
    assert not finished.is_set()   # the guard returned while the backend still hung (it did not wait to join it)
    release.set()


def test_reward_guard_remembers_output_names_and_never_retries_contract_errors():
    calls = []

    def backend(images):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("down")
        if len(calls) == 3:
            raise ValueError("images must be [B,3,H,W]")    # a bug in the caller: raised at once, not masked
        return {"score": [0.5] * len(images), "strict": [0.0] * len(images)}

    g = guarded_reward(backend, "score", RewardGuardConfig(retries=0, backoff_s=0), len, log=lambda *_: None)
    assert set(g([0, 0])) == {"score", "strict"}
    out = g([0, 0, 0])                                      # fails: NaN under the names it answered with before
    assert set(out) == {"score", "strict"} and all(torch.isnan(v).all() and v.shape == (3,) for v in out.values())
    with pytest.raises(ValueError, match="B,3,H,W"):
        g([0])
    assert len(calls) == 3
    with pytest.raises(Exception, match="retries must be >= 0"):
        RewardGuardConfig(retries=-1).check("visgen.reward_guard")


def test_nan_rewards_are_masked_and_counted(monkeypatch):
    tr = Trainer(load_train_config({**CFG, "checkpoint": {}}), None, log=lambda *_: None)
    real = tr.domain.rollout

    def some_nan(keys, group_size, generator, iteration):
        r = real(keys, group_size, generator, iteration)
        r.rewards["correct"][::3] = float("nan")
        return r

    monkeypatch.setattr(tr.domain, "rollout", some_nan)
    m = tr.iteration(0)
    assert m["reward/nan_count"] == 6 and m["reward/mean"] == m["reward/mean"]  # finite mean despite NaNs
    assert torch.isfinite(tr.domain.state_dict()["logits"]).all()


def test_out_of_memory_becomes_advice(monkeypatch):
    tr = Trainer(load_train_config({**CFG, "checkpoint": {}}), None, log=lambda *_: None)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(tr.domain, "rollout", oom)
    with pytest.raises(ResourceError, match="groups_per_call"):
        tr.iteration(0)
