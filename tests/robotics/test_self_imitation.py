"""Self-imitation (``robotics.replay: {source: successes, coef}``): the chunks it keeps are exactly
the executed chunks of the iteration's successful episodes, its batch draws tasks equally (hand-counted), its loss is
the BC loss on that batch as a function of (seed, iteration, step), it trains only the adapters of tasks that
succeeded, the config refuses what would do nothing, and a resumed run equals an uninterrupted one."""
import json
import os
import shutil

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch
import yaml

import robotics.rollouts as rollouts_mod
from shared_rl.cli import main
from shared_rl.config import ConfigError, from_dict, load_train_config
from shared_rl.domain import RunContext

from robotics.domain import RoboticsConfig, RoboticsDomain
from tests.robotics.test_domain import TINY_MODEL, _domain

TWO_TASKS = {"tasks": ["reach-v3", "push-v3"], "horizon": 12}


def _with_successes(monkeypatch, succeeded):
    """run_episodes as usual, then episodes ``succeeded`` (indices of the batch) marked successful."""
    real = rollouts_mod.run_episodes

    def fake(*args, **kwargs):
        batch = real(*args, **kwargs)
        batch.success_once = np.zeros_like(batch.success_once)
        batch.success_once[list(succeeded)] = True
        return batch

    monkeypatch.setattr(rollouts_mod, "run_episodes", fake)


@pytest.fixture(scope="module")
def two_tasks():
    dom = _domain("sde_one_step", env=TWO_TASKS, replay={"source": "successes", "coef": 1.0}, adapters={"rank": 4})
    yield dom
    dom.close()


def test_it_keeps_exactly_the_executed_chunks_of_successful_episodes(two_tasks, monkeypatch):
    dom = two_tasks
    keys = [dom.train_keys()[0], dom.train_keys()[-1]]  # one reach state, one push state
    _with_successes(monkeypatch, [1, 2])  # reach's second episode, push's first
    ro = dom.rollout(keys, 2, torch.Generator().manual_seed(0), iteration=5)
    valid = ro.payload["images"].flatten(2).any(-1)  # a chunk was planned = its observation was recorded
    assert dom.replay.kept_tasks() == [0, 1]
    for task, ep in ((0, 1), (1, 2)):
        kept = dom.replay.kept_chunks(task)
        n = int(valid[ep].sum())
        assert len(kept["actions"]) == n > 0
        assert torch.equal(kept["images"], ro.payload["images"][ep, :n])
        assert torch.equal(kept["proprio"], ro.payload["proprio"][ep, :n])
        want = ro.payload["chain"][ep, :n, -1].clamp(-1, 1).view(n, dom.policy.cfg.chunk, 4)
        assert torch.equal(kept["actions"], want)  # the chunk the env executed
    # another call in the same iteration adds; a new iteration starts over
    before = len(dom.replay.kept_chunks(0)["actions"])
    dom.rollout(keys, 2, torch.Generator().manual_seed(1), iteration=5)
    assert len(dom.replay.kept_chunks(0)["actions"]) > before
    _with_successes(monkeypatch, [3])  # only push succeeds in iteration 6
    dom.rollout(keys, 2, torch.Generator().manual_seed(2), iteration=6)
    assert dom.replay.kept_tasks() == [1]  # success_window 1: iteration 5's set is gone


def test_the_batch_draws_tasks_equally_and_rows_from_their_task(two_tasks, monkeypatch):
    dom = two_tasks
    keys = [dom.train_keys()[0], dom.train_keys()[-1]]
    _with_successes(monkeypatch, [0, 1, 2])  # reach has two successful episodes, push one: unequal chunk counts
    dom.rollout(keys, 2, torch.Generator().manual_seed(0), iteration=7)
    dom.cfg.replay.batch = 400
    try:
        imgs, pro, tids, acts = dom.replay.sample(np.random.default_rng([0, 7, 1]))
    finally:
        dom.cfg.replay.batch = 256
    # hand count: row r goes to task (sorted) integers(0, 2)[r]; the rows come grouped by task in that order
    pick = np.random.default_rng([0, 7, 1]).integers(0, 2, size=400)
    n_reach = int((pick == 0).sum())
    reach_ids, push_ids = dom._text_ids["reach-v3"], dom._text_ids["push-v3"]
    assert tids == [reach_ids] * n_reach + [push_ids] * (400 - n_reach)
    assert 150 < n_reach < 250 and imgs.dtype == torch.uint8 and acts.shape == (400, dom.policy.cfg.chunk, 4)
    push_acts = dom.replay.kept_chunks(1)["actions"]
    assert all((push_acts == a).all(-1).all(-1).any() for a in acts[n_reach:])  # push rows are push's chunks


def test_the_loss_is_the_bc_loss_of_its_batch_and_moves_only_succeeding_adapters(two_tasks, monkeypatch):
    dom = two_tasks
    keys = [dom.train_keys()[0], dom.train_keys()[-1]]
    _with_successes(monkeypatch, [3])  # push only
    dom.rollout(keys, 2, torch.Generator().manual_seed(0), iteration=8)
    a, b, c = dom.replay.loss(8, 1), dom.replay.loss(8, 1), dom.replay.loss(8, 2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    seed = [0, 8, 1]
    imgs, pro, tids, acts = dom.replay.sample(np.random.default_rng(seed))
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))
    want = dom.policy.bc_loss(dom.policy.encode(imgs, pro, tids), acts, gen)
    assert torch.allclose(a, want, rtol=0, atol=0)
    dom.policy.zero_grad()
    a.backward()
    up = dom.policy.adapters.up.grad  # (down's gradient is 0 while up is still its initial 0: LoRA)
    assert up[1].abs().sum() > 0 and up[0].abs().sum() == 0  # push's adapter, not reach's
    dom.policy.zero_grad()
    # nothing succeeded: a zero with a gradient path, so the trainer's backward works and nothing moves
    _with_successes(monkeypatch, [])
    dom.rollout(keys, 2, torch.Generator().manual_seed(0), iteration=9)
    zero = dom.replay.loss(9, 0)
    assert float(zero.detach()) == 0.0 and zero.requires_grad


def test_a_window_keeps_earlier_iterations_and_travels_in_the_state_dict(monkeypatch):
    dom = _domain("sde_one_step", env=TWO_TASKS, replay={"source": "successes", "coef": 1.0, "success_window": 2},
                  adapters={"rank": 4})
    keys = [dom.train_keys()[0], dom.train_keys()[-1]]
    sizes = {}
    for it, succeeded in ((10, [0]), (11, [3]), (12, [2])):
        _with_successes(monkeypatch, succeeded)
        dom.rollout(keys, 2, torch.Generator().manual_seed(it), iteration=it)
        sizes[it] = {t: len(dom.replay.kept_chunks(t)["actions"]) for t in dom.replay.kept_tasks()}
    assert list(sizes[11]) == [0, 1]  # reach's success of 10 is still kept at 11 ...
    assert list(sizes[12]) == [1] and sizes[12][1] > sizes[11][1]  # ... and gone at 12; push's of 11 and 12 both kept
    state = dom.state_dict()
    assert sorted(k for k in state if k.startswith("successes.")) == [
        f"successes.{it}.1.{n}" for it in (11, 12) for n in ("actions", "images", "proprio")]
    other = _domain("sde_one_step", env=TWO_TASKS, replay={"source": "successes", "coef": 1.0, "success_window": 2},
                    adapters={"rank": 4})
    other.load_state_dict(state)
    assert other.replay.kept_tasks() == [1]
    for name, v in dom.replay.kept_chunks(1).items():
        assert torch.equal(other.replay.kept_chunks(1)[name], v)
    assert torch.equal(other.replay.loss(12, 0), dom.replay.loss(12, 0))
    with pytest.raises(ConfigError, match="success_window counts iterations"):
        _domain("sde_one_step", env=TWO_TASKS, replay={"source": "successes", "coef": 1.0, "success_window": 0})
    dom.close()
    other.close()


def test_config_errors():
    base = {"domain": "robotics", "iterations": 1, "logging": {"progress": False},
            "robotics": {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 8}, "checkpoint": "",
                         "model": TINY_MODEL, "gifs": False, "replay": {"source": "successes"}}}
    with pytest.raises(ConfigError, match="set robotics.replay.coef > 0"):
        load_train_config(base)
    with pytest.raises(ConfigError, match="replay.data .* would be unused"):
        load_train_config({**base, "robotics": {**base["robotics"],
                                                "replay": {"source": "successes", "coef": 1.0, "data": "demos.npz"}}})
    plain = {**base, "robotics": {**base["robotics"], "replay": {"source": "demos", "coef": 1.0}}}
    with pytest.raises(ConfigError, match="replay.source: successes"):
        load_train_config(plain)  # the demos error names the alternative
    cfg = from_dict(RoboticsConfig, {**base["robotics"], "replay": {"source": "successes", "coef": 1.0}}, "robotics")
    with pytest.raises(ConfigError, match="launch one process"):
        RoboticsDomain(cfg, RunContext(run_dir=None, device=torch.device("cpu"), seed=0, num_processes=2))


def _rl_config(window=1):
    return {"domain": "robotics", "seed": 0, "iterations": 3,
            "rollout": {"groups_per_iteration": 4, "group_size": 4},
            "optim": {"lr": 3e-3, "inner_epochs": 1, "minibatches_per_epoch": 2},
            "eval": {"at_start": False}, "logging": {"progress": False},
            "checkpoint": {"every": 1, "keep_last": 3},
            "robotics": {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 16}, "checkpoint": "",
                         "model": TINY_MODEL, "head_mode": "flow_sde", "train_states_per_task": 8,
                         "eval_states_per_task": 2, "gifs": False,
                         "replay": {"source": "successes", "coef": 1.0, "batch": 32, "success_window": window}}}


@pytest.mark.parametrize("window", [1, 3])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, window):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_rl_config(window)))
    run = tmp_path / "run"
    assert main(["train", str(path), "--out", str(run)]) == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    want = [{k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"} for r in records]
    # the point env's start succeeds sometimes, so the term was live (non-zero) in this run
    assert any(r.get("loss/replay", 0) > 0 for r in want), want
    shutil.rmtree(run / "checkpoints" / "step_000003")
    assert main(["train", "--resume", str(run), "iterations=3"]) == 0
    again = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    got = [{k: v for k, v in r.items() if not k.startswith(("time/", "resume/")) and k != "samples_per_s"}
           for r in again]
    assert got[-1] == want[-1]


# ---- filtered BC: loss.policy_coef 0, the replay of the run's successes alone (ReST-EM / RAFT) -----------------------
def _filtered_bc(**extra):
    data = _rl_config(window=100)
    data["iterations"] = extra.pop("iterations", 1)
    data["loss"] = {"policy_coef": 0}
    data["optim"] = {"lr": 3e-3, "inner_epochs": 3, "minibatches_per_epoch": 1}
    data["robotics"]["head_mode"] = "sde_one_step"
    data["robotics"]["noise_level"] = 0.7
    for k, v in extra.items():
        data["robotics"][k] = v
    return data


def test_policy_coef_zero_steps_the_replay_gradient_alone(monkeypatch):
    """Each optimizer step's gradient is exactly the BC gradient of that step's replay batch (hand-built from
    (seed, iteration, step)); no policy-gradient forward runs; and the weights move."""
    from shared_rl.trainer import Trainer

    tr = Trainer(load_train_config(_filtered_bc()), None, log=lambda s: None)
    dom = tr.domain
    monkeypatch.setattr(dom, "log_probs", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a PG forward ran")))
    _with_successes(monkeypatch, [0, 5, 9])
    real_step, seen = tr.optim.step, []
    params = [p for p in dom.parameters() if p.requires_grad]

    def step(stats):
        it, k = tr._aux_at[0], tr._aux_at[1] - 1  # the trainer's counter moved past this step's replay batch
        want = torch.autograd.grad(dom.replay.loss(it, k), params, allow_unused=True)
        for p, g in zip(params, want):
            g = torch.zeros_like(p) if g is None else g
            got = torch.zeros_like(p) if p.grad is None else p.grad
            assert torch.allclose(got, g, rtol=1e-5, atol=1e-8)
        seen.append(k)
        return real_step(stats)

    monkeypatch.setattr(tr.optim, "step", step)
    before = [p.detach().clone() for p in params]
    metrics = tr.iteration(0)
    assert seen == [0, 1, 2] and metrics["loss/replay"] > 0 and metrics["loss/policy"] == 0
    assert any(not torch.equal(b, p) for b, p in zip(before, params)), "the BC steps moved the policy"
    dom.close()


def test_policy_coef_zero_refuses_what_would_train_nothing():
    with pytest.raises(ConfigError, match="policy_coef must be >= 0"):
        load_train_config({**_filtered_bc(), "loss": {"policy_coef": -1}})
    from shared_rl.trainer import Trainer

    no_replay = _filtered_bc()
    no_replay["robotics"].pop("replay")
    with pytest.raises(ConfigError, match="policy_coef: 0 trains the auxiliary losses alone"):
        Trainer(load_train_config(no_replay), None, log=lambda s: None)
    with pytest.raises(ConfigError, match="set robotics.adapters.steps: equal"):
        Trainer(load_train_config(_filtered_bc(adapters={"rank": 4, "steps": "by_episodes"})), None, log=lambda s: None)


def test_filtered_bc_resumes_exactly(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_filtered_bc(iterations=3)))
    run = tmp_path / "run"
    assert main(["train", str(path), "--out", str(run)]) == 0
    want = [{k: v for k, v in json.loads(x).items() if not k.startswith("time/") and k != "samples_per_s"}
            for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("loss/replay", 0) > 0 for r in want), want
    shutil.rmtree(run / "checkpoints" / "step_000003")
    assert main(["train", "--resume", str(run), "iterations=3"]) == 0
    got = [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "resume/")) and k != "samples_per_s"}
           for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert got[-1] == want[-1]


def test_filtered_bc_improves_success_on_the_point_env():
    """Imitating its own successes lifts the point env's held-out success (checked: imitating the failures instead,
    the same run ends below its start)."""
    from shared_rl.trainer import Trainer

    data = _filtered_bc(iterations=8, train_states_per_task=32, eval_states_per_task=32)
    data["rollout"] = {"groups_per_iteration": 8, "group_size": 8}
    data["eval"] = {"at_start": True}
    hist = Trainer(load_train_config(data), None, log=lambda s: None).fit()
    first, last = hist[0]["eval/success"], hist[-1]["eval/success"]
    assert last >= first + 0.3, (first, last)
