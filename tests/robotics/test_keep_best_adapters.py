"""Per-task early stopping (``robotics.adapters.keep_best``): every evaluation scores each task's adapter on
validation reset states; the run ends with each task's best-scoring adapter (ties to the later one), the final
held-out evaluation measures exactly that policy, and a resumed run selects what an uninterrupted one does."""
import json
import os
import shutil

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch
import yaml

from shared_rl.config import ConfigError, from_dict, load_train_config

import robotics.domain as domain_module
from robotics.adapters import VAL_FIRST_INDEX
from robotics.domain import RoboticsConfig
from robotics.envs.metaworld_env import decode_key
from tests.robotics.test_domain import TINY_MODEL, _domain

TASKS = ["reach-v3", "door-open-v3"]


def test_each_task_ends_with_its_best_scoring_adapter(monkeypatch):
    pytest.importorskip("metaworld")
    # validation success per (iteration, task), chosen by hand: reach peaks at 10 and ties at 20 (the later wins),
    # door-open peaks once at 10; both fall at the end
    scripted = {0: (0.50, 0.50), 10: (0.75, 1.00), 20: (0.75, 0.50), 30: (0.50, 0.25)}
    calls = []

    def fake_evaluate(policy, env_cfg, per_task, venv=None, gif_dir=None, tag="", seed=0, init_noise=1.0,
                      split="eval", first_index=0, standard_errors=False, log=None, **_):
        it = int(policy.adapters.up[0, 0, 0].item())  # the test writes the iteration into every adapter weight
        calls.append((split, first_index, per_task, it))
        reach, door = scripted[it] if split == "train" else (it / 100, it / 100)
        return {"eval/success": (reach + door) / 2, "eval/success/reach-v3": reach, "eval/success/door-open-v3": door,
                "eval/episode_length": 10.0}

    monkeypatch.setattr(domain_module, "evaluate_policy", fake_evaluate)
    dom = _domain("sde_one_step", env={"kind": "metaworld", "tasks": TASKS, "horizon": 10, "image_size": 32,
                                       "num_workers": 0},
                  adapters={"rank": 4, "keep_best": True, "val_states_per_task": 3})
    a = dom.policy.adapters

    def set_adapters(it):
        with torch.no_grad():
            a.up.fill_(it)
            a.down.fill_(it + 0.5)

    for it in (0, 10, 20):
        set_adapters(it)
        out = dom.evaluate(it)
        assert out["eval/success"] == it / 100  # the held-out numbers are the live policy's
    assert out["select/best_iteration/reach-v3"] == 20 and out["select/best_iteration/door-open-v3"] == 10
    set_adapters(30)
    sel = dom.before_final_evaluation(30)
    assert sel["select/val/reach-v3"] == 0.50 and sel["select/val_best"] == (0.75 + 1.00) / 2
    assert sel["select/env_steps"] == 10.0 * 2 * 3
    # the last adapters' held-out success, measured before the kept ones replace them (the fake scores it/100)
    assert sel["eval_last/success"] == 0.30 and sel["eval_last/success/reach-v3"] == 0.30
    # row t of the adapters is task t's kept one, bit for bit
    assert torch.equal(a.up[0], torch.full_like(a.up[0], 20)) and torch.equal(a.down[0], torch.full_like(a.down[0], 20.5))
    assert torch.equal(a.up[1], torch.full_like(a.up[1], 10)) and torch.equal(a.down[1], torch.full_like(a.down[1], 10.5))
    n_val = sum(c[0] == "train" for c in calls)
    dom.evaluate(30)  # the final held-out evaluation measures the kept adapters and scores nothing more
    assert sum(c[0] == "train" for c in calls) == n_val == 4 and sum(c[0] == "eval" for c in calls) == 5
    assert all(c[1] == VAL_FIRST_INDEX and c[2] == 3 for c in calls if c[0] == "train")
    dom.close()


def test_validation_states_are_neither_training_nor_held_out_states():
    dom = _domain("sde_one_step", adapters={"rank": 4, "keep_best": True, "val_states_per_task": 5})
    from robotics.evaluation import eval_keys

    val = eval_keys(dom.cfg.env, 5, "train", VAL_FIRST_INDEX)[0]
    assert not set(val) & set(dom.train_keys()) and not set(val) & set(dom.eval_keys())
    assert all(decode_key(k)[1] == "train" and decode_key(k)[2] >= VAL_FIRST_INDEX for k in val)
    from robotics.collect import DEMO_INDEX_OFFSET

    # the demonstrations (BC's training states) are train-split indices DEMO_INDEX_OFFSET + attempt, attempts far
    # below this gap: a validation state is never a state the asset was cloned on
    assert VAL_FIRST_INDEX - DEMO_INDEX_OFFSET >= 100_000
    dom.close()


def _cli_config(tmp_path, **robotics):
    cfg = {"domain": "robotics", "seed": 0, "iterations": 4, "checkpoint": {"every": 1, "keep_last": 5},
           "rollout": {"groups_per_iteration": 4, "group_size": 4},
           "optim": {"lr": 3e-2, "inner_epochs": 1, "minibatches_per_epoch": 2},
           "eval": {"at_start": True, "every": 1}, "logging": {"progress": False},
           "robotics": {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 8}, "checkpoint": "",
                        "model": TINY_MODEL, "head_mode": "flow_sde", "train_states_per_task": 8,
                        "eval_states_per_task": 8, "gifs": False,
                        "adapters": {"rank": 4, "keep_best": True, "val_states_per_task": 4}, **robotics}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_final_evaluation_is_the_kept_iterations_and_a_resume_selects_the_same(tmp_path, monkeypatch):
    import hashlib

    from shared_rl.cli import main

    # Scores by the adapter weights, assigned in order of first sight (the tiny point policy hardly moves its success
    # in 4 iterations): validation scripted per distinct weights, held-out a fingerprint. Nothing depends on the
    # weights' float bits, and a resumed run that reproduces the same weights gets the same scores.
    seen: dict[bytes, int] = {}
    val_script = [0.75, 0.0, 0.75, 0.0, 0.25]

    def hashed_evaluation(policy, env_cfg, per_task, venv=None, gif_dir=None, tag="", seed=0, init_noise=1.0,
                          split="eval", first_index=0, standard_errors=False, log=None, **_):
        a = policy.adapters
        digest = hashlib.sha256(a.up.detach().numpy().tobytes() + a.down.detach().numpy().tobytes()).digest()
        i = seen.setdefault(digest, len(seen))
        if split == "eval":
            return {"eval/success": (i + 1) / 10, "eval/episode_length": 8.0}
        return {"eval/success": val_script[i], "eval/success/point-reach": val_script[i], "eval/episode_length": 8.0}

    monkeypatch.setattr(domain_module, "evaluate_policy", hashed_evaluation)
    run = tmp_path / "run"
    assert main(["train", str(_cli_config(tmp_path)), "--out", str(run)]) == 0
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time/", "resume/")) and k != "samples_per_s"}
                        for r in rs]
    want = strip(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
    by_step = {r["step"]: r for r in want}
    final = want[-1]
    kept = int(final["select/best_iteration/point-reach"])
    vals = {s: by_step[s]["select/val/point-reach"] for s in range(5)}
    # iteration 1 drew no mixed group, so its weights are iteration 0's (same score); ties go to the later iteration
    assert [vals[s] for s in range(5)] == [0.75, 0.75, 0.0, 0.75, 0.0] and kept == 3
    # the evaluation is a deterministic function of the weights: the final one repeats the kept iteration's
    assert final["eval/success"] == by_step[3]["eval/success"] and len({r["eval/success"] for r in want[1:]}) == 3
    # resumed after iteration 3, the run must remember that 3 scored 0.75 (else 4's 0.0 would be kept)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    assert main(["train", "--resume", str(run), "iterations=4"]) == 0
    got = strip(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
    assert got == want


def test_keep_best_adapters_refuses_what_it_cannot_select(tmp_path):
    with pytest.raises(ConfigError, match="set robotics.adapters.rank"):
        from_dict(RoboticsConfig, {"adapters": {"keep_best": True}}, "robotics")
    with pytest.raises(ConfigError, match="val_states_per_task must be >= 1"):
        from_dict(RoboticsConfig, {"adapters": {"keep_best": True, "rank": 4, "val_states_per_task": 0}}, "robotics")
    raw = yaml.safe_load(_cli_config(tmp_path).read_text())
    raw["optim"]["ema_decay"] = 0.9
    with pytest.raises(ConfigError, match="optim.ema_decay"):
        load_train_config(raw)
