"""Per-task adapters (``robotics.adapters.rank``): added, they leave the policy bitwise unchanged; an update from one
task's rows cannot move another task's actions; only the adapters train; they survive save/load and a resume."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch

from shared_rl.config import ConfigError, from_dict

from robotics.domain import RoboticsConfig
from robotics.envs.metaworld_env import TASK_INSTRUCTIONS
from robotics.policies.vla import TinyVLA, VLAConfig
from tests.robotics.test_domain import TINY_MODEL, _domain

TASKS = ["reach-v3", "door-open-v3"]


def _inputs(policy, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = policy.cfg
    images = torch.randint(0, 255, (n, c.image_size, c.image_size, c.image_channels), generator=g, dtype=torch.uint8)
    proprio = torch.randn(n, c.proprio_dim, generator=g)
    ids = policy.text.token_ids([TASK_INSTRUCTIONS[TASKS[i % 2]] for i in range(n)])
    return images, proprio, ids


def _policy():
    torch.manual_seed(0)
    return TinyVLA(VLAConfig(**TINY_MODEL))


def test_adding_adapters_leaves_the_policy_bitwise_unchanged():
    policy = _policy()
    x = _inputs(policy)
    before = policy.encode(*x)
    policy.add_task_adapters([TASK_INSTRUCTIONS[t] for t in TASKS], rank=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(policy.encode(*x), before)
    a = policy.act(policy.encode(*x), torch.Generator().manual_seed(1))
    policy.adapters = None  # the same noise through the bare policy
    assert torch.equal(policy.act(before, torch.Generator().manual_seed(1)), a)


def test_an_update_from_one_task_does_not_move_the_other_tasks_actions():
    policy = _policy()
    policy.add_task_adapters([TASK_INSTRUCTIONS[t] for t in TASKS], rank=4, generator=torch.Generator().manual_seed(0))
    for name, p in policy.named_parameters():
        p.requires_grad_(name.startswith("adapters."))
    x = _inputs(policy)
    reach = torch.tensor([i % 2 == 0 for i in range(6)])
    h0 = policy.encode(*x).detach()
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):  # a loss on the reach rows only
        loss = policy.bc_loss(policy.encode(*x)[reach], torch.full((int(reach.sum()), 4, 4), 0.5),
                              torch.Generator().manual_seed(2))
        opt.zero_grad()
        loss.backward()
        assert policy.adapters.up.grad[1].abs().sum() == 0  # door-open's adapter gets no gradient
        opt.step()
    h1 = policy.encode(*x).detach()
    assert torch.equal(h1[~reach], h0[~reach])  # door-open rows: bitwise the same features, so the same actions
    assert not torch.allclose(h1[reach], h0[reach])
    # an instruction without an adapter passes through
    other = policy.text.token_ids([TASK_INSTRUCTIONS["push-v3"]]) * 6
    assert torch.equal(policy.encode(x[0], x[1], other), _bare(policy).encode(x[0], x[1], other))


def _bare(policy):
    import copy

    p = copy.deepcopy(policy)
    p.adapters = None
    return p


def test_save_and_load_keep_the_adapters(tmp_path):
    policy = _policy()
    policy.add_task_adapters([TASK_INSTRUCTIONS[t] for t in TASKS], rank=3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        policy.adapters.up.normal_()
    policy.save_pretrained(tmp_path / "m")
    back = TinyVLA.load_pretrained(tmp_path / "m")
    assert back.cfg.task_adapters == policy.cfg.task_adapters and back.cfg.adapter_rank == 3
    x = _inputs(policy)
    assert torch.equal(back.encode(*x), policy.encode(*x))
    # the same adapters again is a no-op, different ones are refused
    back.add_task_adapters([TASK_INSTRUCTIONS[t] for t in TASKS], rank=3)
    with pytest.raises(ValueError, match="already has task adapters"):
        back.add_task_adapters([TASK_INSTRUCTIONS["reach-v3"]], rank=3)


def test_the_domain_trains_only_the_adapters():
    dom = _domain("sde_one_step", adapters={"rank": 4})
    names = [n for n, p in dom.policy.named_parameters() if p.requires_grad]
    assert names == ["adapters.down", "adapters.up"]
    assert dom.policy.cfg.task_adapters == [TASK_INSTRUCTIONS["point-reach"]]
    plain = _domain("sde_one_step")
    assert any(n.startswith("flow.") for n, p in plain.policy.named_parameters() if p.requires_grad)
    # the starting policy is the checkpoint's: the same rollout as without adapters
    g = lambda: torch.Generator().manual_seed(0)
    keys = dom.train_keys()[:2]
    a, b = dom.rollout(keys, 2, g(), 0), plain.rollout(keys, 2, g(), 0)
    assert torch.equal(a.rewards["success"], b.rewards["success"]) and torch.equal(a.logp_old, b.logp_old)
    dom.close()
    plain.close()
    with pytest.raises(ConfigError, match="adapters.rank is a rank"):
        from_dict(RoboticsConfig, {"adapters": {"rank": -1}}, "robotics")


def test_a_run_with_adapters_resumes_exactly_and_saves_them(tmp_path):
    import json
    import shutil

    import yaml

    from shared_rl.cli import main

    cfg = {"domain": "robotics", "seed": 0, "iterations": 3, "checkpoint": {"every": 1, "keep_last": 3},
           "rollout": {"groups_per_iteration": 4, "group_size": 4},
           "optim": {"lr": 3e-3, "inner_epochs": 1, "minibatches_per_epoch": 2},
           "eval": {"at_start": False}, "logging": {"progress": False},
           "robotics": {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 8}, "checkpoint": "",
                        "model": TINY_MODEL, "head_mode": "flow_sde", "train_states_per_task": 8,
                        "eval_states_per_task": 2, "gifs": False, "adapters": {"rank": 4}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    assert main(["train", str(path), "--out", str(run)]) == 0
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time/", "resume/")) and k != "samples_per_s"}
                        for r in rs]
    want = strip(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
    shutil.rmtree(run / "checkpoints" / "step_000003")
    assert main(["train", "--resume", str(run), "iterations=3"]) == 0
    got = strip(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
    assert got[-1] == want[-1]
    final = next(p for p in run.rglob("config.json") if (p.parent / "model.safetensors").exists())
    back = TinyVLA.load_pretrained(final.parent)
    assert back.cfg.task_adapters and back.adapters.up.abs().sum() > 0  # trained adapters were saved


def _demos(policy, n=4, steps=6, seed=0):
    from robotics.data import Episode

    rng = np.random.default_rng(seed)
    c = policy.cfg
    return [Episode(task=TASKS[i % 2], instruction=TASK_INSTRUCTIONS[TASKS[i % 2]],
                    images=rng.integers(0, 255, (steps, c.image_size, c.image_size, c.image_channels), dtype=np.uint8),
                    proprio=rng.normal(size=(steps, c.proprio_dim)).astype(np.float32),
                    actions=np.full((steps, c.action_dim), 0.6 if i % 2 == 0 else -0.6, np.float32),
                    success=np.zeros(steps, bool)) for i in range(n)]


def _action_error(policy, demos):
    """Mean distance of the ODE policy's action chunks (fixed start noise) from the demos' on every demo frame."""
    from robotics.datasets import ChunkDataset

    data = ChunkDataset(demos, policy.cfg.chunk, policy)
    imgs, pro, tids, chunks = data.batch(np.arange(len(data)), 0, np.random.default_rng(0))
    with torch.no_grad():
        acts = policy.act(policy.encode(imgs, pro, tids), torch.Generator().manual_seed(5))
    return float((acts - chunks).abs().mean())


def test_fitting_the_adapters_trains_only_them_learns_the_demos_and_is_deterministic():
    from robotics.bc import fit_task_adapters

    def fit(tasks, steps=200):
        policy = _policy()
        policy.add_task_adapters([TASK_INSTRUCTIONS[t] for t in TASKS], rank=4, generator=torch.Generator().manual_seed(0))
        trunk = {k: v.clone() for k, v in policy.state_dict().items() if not k.startswith("adapters.")}
        demos = [e for e in _demos(policy) if e.task in tasks]
        before = _action_error(policy, demos)
        losses = fit_task_adapters(policy, demos, steps, batch_size=8, lr=5e-2, augment_shift=0, log_every=0)
        after = policy.state_dict()
        assert all(torch.equal(trunk[k], after[k]) for k in trunk)  # nothing but the adapters moved
        assert _action_error(policy, demos) < 0.9 * before  # the demos are being fitted
        return policy, losses

    _, losses = fit(TASKS)
    _, again = fit(TASKS)
    assert again == losses  # seeded: the same losses bit for bit
    reach_only, _ = fit(["reach-v3"])
    assert torch.count_nonzero(reach_only.adapters.up[1]) == 0  # door-open had no demos: its adapter stays zero
    assert torch.count_nonzero(reach_only.adapters.up[0]) > 0
    with pytest.raises(ValueError, match="needs task adapters"):
        fit_task_adapters(_policy(), _demos(_policy()), 1)
