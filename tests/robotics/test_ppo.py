"""PPO with a value head in the robotics domain: the critic's payload, its values with grad, the config checks,
and a short PPO (gae) run on the point env that learns."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer

from tests.robotics.test_domain import TINY_MODEL, _domain


def test_critic_values_in_the_rollout_match_the_recomputed_ones():
    dom = _domain("sde_one_step", critic={"enabled": True})
    ro = dom.rollout(dom.train_keys()[:2], 3, torch.Generator().manual_seed(0), 0)
    vm = ro.payload["value_mask"]
    assert vm.shape == (6, dom.n_chunks) and vm.dtype == torch.bool
    assert torch.equal(vm, ro.payload["images"].flatten(2).any(-1) | vm)  # executed chunks
    with torch.no_grad():
        dom.critic.head.net[-1].bias.fill_(0.3)
        dom.critic.head.net[-1].weight.normal_(0, 0.1)
    ro = dom.rollout(dom.train_keys()[:2], 3, torch.Generator().manual_seed(0), 0)
    out = dom.log_probs(ro, torch.arange(6), need_kl=False)
    assert out.values is not None and out.values.shape == (6, dom.n_chunks)
    assert torch.allclose(out.values[ro.payload["value_mask"]], ro.payload["values"][ro.payload["value_mask"]], atol=1e-5)
    assert (out.values[~ro.payload["value_mask"]] == 0).all()
    out.values.sum().backward()
    assert dom.critic.head.net[0].weight.grad.abs().sum() > 0
    # detached by default: the critic's loss never reaches the policy
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in dom.policy.parameters())
    state = dom.state_dict()
    assert any(k.startswith("critic.") for k in state)
    dom.load_state_dict(state)
    assert {id(p) for p in dom.critic_parameters()} <= {id(p) for p in dom.parameters()}


def _ppo_config(**over):
    data = {
        "domain": "robotics", "seed": 0, "iterations": 10,
        "rollout": {"groups_per_iteration": 8, "group_size": 8},
        "advantage": {"estimator": {"name": "gae", "gamma": 1.0, "lam": 0.95, "normalize": "batch", "value_coef": 0.5,
                                    "value_clip": 0.2, "lr": 1e-3}},
        "optim": {"lr": 2e-3, "inner_epochs": 2, "minibatches_per_epoch": 2},
        "loss": {"clip_low": 0.2, "clip_high": 0.28},
        "logging": {"progress": False},
        "robotics": {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 8}, "checkpoint": "",
                     "model": TINY_MODEL, "head_mode": "flow_sde", "train_states_per_task": 32,
                     "eval_states_per_task": 32, "gifs": False, "critic": {"enabled": True}},
    }
    for k, v in over.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) else v
    return data


def test_gae_needs_the_critic():
    data = _ppo_config()
    data["robotics"] = {**data["robotics"], "critic": {"enabled": False}}
    with pytest.raises(ConfigError, match="robotics.critic.enabled: true"):
        load_train_config(data)
    grpo = _ppo_config(advantage={"estimator": "grpo"})  # a value head no estimator trains
    with pytest.raises(ConfigError, match="robotics.critic.enabled: the value head is trained by a critic estimator"):
        load_train_config(grpo)


def test_ppo_with_a_value_head_improves_success_on_the_point_env():
    trainer = Trainer(load_train_config(_ppo_config()), None, log=lambda s: None)
    hist = trainer.fit()
    first, last = hist[0]["eval/success"], hist[-1]["eval/success"]
    assert "loss/value" in hist[1] and "value/explained_variance" in hist[-1]
    losses = [h["loss/value"] for h in hist if "loss/value" in h]
    assert min(losses[-3:]) < losses[0], losses  # the critic fits
    assert last >= first + 0.3, (first, last)


def test_balance_draws_keys_per_task():
    """``robotics.balance``: the key sampler the trainer is given draws per task (the stratum is the key's task);
    off, it is the configured sampler itself."""
    from shared_rl.selection import StratifiedSampler, UniformSampler

    env = {"tasks": ["reach-v3", "drawer-close-v3"], "horizon": 8}
    plain = UniformSampler()
    dom = _domain("sde_one_step", env=env, train_states_per_task=3, balance={"enabled": True, "by": "need",
                                                                            "need_decay": 0.5})
    s = dom.key_sampler(plain)
    assert isinstance(s, StratifiedSampler) and s.inner is plain and (s.by_need, s.need_decay) == (True, 0.5)
    assert [s.stratum(k) for k in dom.train_keys()] == ["reach-v3"] * 3 + ["drawer-close-v3"] * 3
    drawn = s.select(dom.train_keys(), 4, torch.Generator().manual_seed(0))
    assert sorted(dom._task_of(k) for k in drawn) == ["drawer-close-v3"] * 2 + ["reach-v3"] * 2
    dom.close()
    off = _domain("sde_one_step", env=env, train_states_per_task=3)
    assert off.key_sampler(plain) is plain
    off.close()
    with pytest.raises(ConfigError, match="robotics.balance.by: need weights the tasks"):
        load_train_config({"domain": "robotics", "robotics": {"balance": {"by": "need"}}})
    with pytest.raises(ConfigError, match="need_floor=0 is the per-task minimum of by: need"):
        load_train_config({"domain": "robotics", "robotics": {"balance": {"enabled": True, "need_floor": 0}}})


def test_bench_posttrain_row_reads_before_after_and_env_steps(tmp_path):
    import json

    from bench.robotics_sim import posttrain_row

    recs = [{"step": 0, "eval/success": 0.5, "eval/success/a": 0.25},
            {"step": 1, "env/steps": 100}, {"step": 2, "env/steps": 50, "eval/success": 0.75, "eval/success/a": 0.5},
            {"step": 3, "env/steps": 70}]  # after the last evaluation: not counted
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    row = posttrain_row("v", tmp_path)
    assert row == {"variant": "v", "iterations": 2, "env_steps": 150, "success_before": 0.5, "success_after": 0.75,
                   "a": "0.250 -> 0.500"}


def test_bench_quick_overrides_fit_both_recipes():
    """``grove bench robotics-sim --quick`` shortens each post-training recipe with overrides (the PPO one also its
    critic's warm-up, a setting of its gae estimator); every override must land on a key of the current config."""
    from pathlib import Path

    from bench.robotics_sim import POSTTRAIN, QUICK_OVERRIDES
    from shared_rl.config import apply_overrides, load_yaml

    root = Path(__file__).resolve().parents[2]
    for name, _, recipe, own in POSTTRAIN:
        cfg = load_train_config(apply_overrides(load_yaml(root / recipe), QUICK_OVERRIDES + own))
        assert cfg.iterations == 2 and cfg.domain_config.env.horizon == 16, name
        if name == "ppo":
            assert cfg.advantage.estimator.name == "gae" and cfg.advantage.estimator.settings.warmup == 0
