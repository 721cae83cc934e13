"""Per-task adapter steps (``robotics.adapters.steps``): with ``by_episodes`` each task's adapter moves
n_t / max_u n_u of AdamW's step (n_t: the task's episodes in the minibatch), hand-checked against the same step with
``equal``; a task without episodes in the minibatch does not move (with ``equal`` AdamW's momentum moves it); the
trainer calls the hooks around its step; the config refuses what would do nothing."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch

from shared_rl.config import ConfigError, from_dict

from robotics.domain import RoboticsConfig
from tests.robotics.test_domain import TINY_MODEL, _domain

TWO_TASKS = {"tasks": ["reach-v3", "push-v3"], "horizon": 12}


@pytest.fixture(scope="module")
def setup():
    dom = _domain("sde_one_step", env=TWO_TASKS, adapters={"rank": 4})
    # one reach group of 2 episodes, two push groups of 2: n = (2, 4), so reach's adapter moves 2 / 4 of the step
    reach, push = dom.train_keys()[0], dom.train_keys()[-1]
    ro = dom.rollout([reach, push, push], 2, torch.Generator().manual_seed(0), iteration=0)
    assert ro.payload["task_index"].tolist() == [0, 0, 1, 1, 1, 1]
    yield dom, ro
    dom.close()


def _adapters(dom):
    return torch.cat([dom.policy.adapters.down.detach().flatten(1), dom.policy.adapters.up.detach().flatten(1)], 1)


def _steps(dom, ro, mode, rows_per_step, start):
    """From adapters ``start``, AdamW steps on a fixed surrogate loss of ``rows_per_step[i]``; the adapters after
    each step."""
    dom.cfg.adapters.steps = mode
    a = dom.policy.adapters
    with torch.no_grad():
        a.down.copy_(start[0])
        a.up.copy_(start[1])
    opt = torch.optim.AdamW([a.down, a.up], lr=1e-2, weight_decay=0.0)
    weights = torch.linspace(-1, 1, ro.mask.shape[1])
    after = []
    for rows in rows_per_step:
        opt.zero_grad(set_to_none=True)
        out = dom.log_probs(ro, torch.tensor(rows), need_kl=False)
        (out.logp * weights * ro.mask[rows]).sum().backward()
        dom.before_optimizer_step()
        opt.step()
        dom.after_optimizer_step()
        after.append(_adapters(dom))
    return after


def test_each_task_adapter_moves_its_share_of_the_step(setup):
    dom, ro = setup
    a = dom.policy.adapters
    start = (a.down.detach().clone(), a.up.detach().clone() + 0.01)  # up != 0: down gets a gradient too
    before = torch.cat([start[0].flatten(1), start[1].flatten(1)], 1)
    equal, = _steps(dom, ro, "equal", [[0, 1, 2, 3, 4, 5]], start)
    scaled, = _steps(dom, ro, "by_episodes", [[0, 1, 2, 3, 4, 5]], start)
    d_equal, d_scaled = equal - before, scaled - before
    assert d_equal[0].abs().sum() > 0 and d_equal[1].abs().sum() > 0
    assert torch.allclose(d_scaled[1], d_equal[1], atol=1e-7)  # push: the most episodes, the full step
    assert torch.allclose(d_scaled[0], 0.5 * d_equal[0], atol=1e-7)  # reach: 2 of 4 episodes, half of it
    steps = dom.adapter_steps
    assert steps.step_episodes.sum() == 0 and steps.adapters_before is None  # counted per step


def test_a_task_without_episodes_in_the_minibatch_does_not_move(setup):
    dom, ro = setup
    a = dom.policy.adapters
    start = (a.down.detach().clone(), a.up.detach().clone() + 0.01)
    steps = [[0, 1, 2, 3], [2, 3, 4, 5]]  # the second step has push episodes only
    equal = _steps(dom, ro, "equal", steps, start)
    scaled = _steps(dom, ro, "by_episodes", steps, start)
    assert not torch.equal(equal[1][0], equal[0][0])  # AdamW's momentum moves reach's adapter without reach rows
    assert torch.equal(scaled[1][0], scaled[0][0])  # by_episodes holds it where it was
    assert not torch.equal(scaled[1][1], scaled[0][1])


def test_a_skipped_step_leaves_no_counts_behind(setup):
    dom, ro = setup
    dom.cfg.adapters.steps = "by_episodes"
    dom.log_probs(ro, torch.arange(6), need_kl=False).logp.sum().backward()  # counted: (2, 4) ...
    dom.policy.adapters.zero_grad(set_to_none=True)  # ... then the trainer skips the step (non-finite gradients)
    dom.log_probs(ro, torch.arange(2, 6), need_kl=False).logp.sum().backward()  # the next step's first forward
    assert dom.adapter_steps.step_episodes.tolist() == [0, 4]
    dom.policy.adapters.zero_grad(set_to_none=True)
    dom.adapter_steps.step_episodes.zero_()
    dom.cfg.adapters.steps = "equal"


def test_no_grad_forwards_are_not_counted(setup):
    dom, ro = setup
    dom.cfg.adapters.steps = "by_episodes"
    with torch.no_grad():  # the trainer's up-front behaviour log-probs
        dom.log_probs(ro, torch.arange(6), need_kl=False)
    assert dom.adapter_steps.step_episodes.sum() == 0
    dom.cfg.adapters.steps = "equal"


def test_the_trainer_calls_the_hooks_around_its_step(tmp_path, monkeypatch):
    import yaml

    import robotics.domain as domain_mod
    from shared_rl.cli import main

    calls = []
    for name in ("before_optimizer_step", "after_optimizer_step"):
        real = getattr(domain_mod.RoboticsDomain, name)
        monkeypatch.setattr(domain_mod.RoboticsDomain, name,
                            lambda self, _real=real, _name=name: (calls.append((_name, int(self.adapter_steps.step_episodes.sum()))),
                                                                  _real(self)))
    cfg = {"domain": "robotics", "seed": 0, "iterations": 1, "rollout": {"groups_per_iteration": 2, "group_size": 2},
           "optim": {"lr": 3e-3, "inner_epochs": 1, "minibatches_per_epoch": 2},
           "selection": {"filter": "none"}, "eval": {"at_start": False}, "logging": {"progress": False},
           "robotics": {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 8}, "checkpoint": "",
                        "model": TINY_MODEL, "head_mode": "flow_sde",
                        "train_states_per_task": 4, "eval_states_per_task": 2, "gifs": False,
                        "adapters": {"rank": 2, "steps": "by_episodes"}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--out", str(tmp_path / "run")]) == 0
    # two minibatches of one group (2 episodes) each: before sees the step's 2 counted episodes, after resets them
    assert calls == [("before_optimizer_step", 2), ("after_optimizer_step", 2)] * 2


def test_by_episodes_needs_task_adapters():
    with pytest.raises(ConfigError, match="set robotics.adapters.rank"):
        from_dict(RoboticsConfig, {"adapters": {"steps": "by_episodes"}}, "robotics").check()
