"""Short imagined branches bootstrapped by a critic of real returns (``robotics.rollout.name: short_horizon``): the
reward is the critic's value where a branch ends (never an imagined success), the critic's targets are real
Monte-Carlo returns, training runs with its metrics (point env, tiny models, seconds)."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer

from robotics.world_model.data import ChunkEpisode

from .test_world_model_fixtures import tiny_wm_asset, wm_train_config


@pytest.fixture(scope="module")
def tiny_asset(tmp_path_factory):
    root = tmp_path_factory.mktemp("wmsh")
    return root, tiny_wm_asset(root)


def _config(asset, root, **short):
    cfg = wm_train_config(asset, root / "vla", audit_fraction=0.0)
    cfg["advantage"] = {"estimator": "grpo", "weights": {"return": 1.0}}
    cfg["robotics"]["rollout"]["name"] = "short_horizon"
    cfg["robotics"]["rollout"]["short_horizon"] = {"horizon": 8, "real_episodes": 2, "critic_steps": 5,
                                                   "audit_groups": 1, **short}
    return cfg


def test_a_branch_is_rewarded_by_the_critic_never_by_an_imagined_success(tiny_asset):
    root, asset = tiny_asset
    tr = Trainer(load_train_config(_config(asset, root, critic_steps=0, real_episodes=0, audit_groups=0)), None,
                 log=lambda s: None)
    dom, strat = tr.domain, tr.domain.rollouts
    with torch.no_grad():  # V = 0.5 everywhere: the return is gamma^depth x 0.5
        strat.value.net[-1].bias.fill_(0.5)
    keys = dom.train_keys()[:2]
    ro = dom.rollout(keys, 4, torch.Generator().manual_seed(0), 0)
    assert list(ro.rewards) == ["return"]
    depth = torch.tensor([len(st.trace["frames"]) - st.truncated for st in strat.imagine.slots], dtype=torch.float32)
    assert torch.allclose(ro.rewards["return"], 0.5 * 0.97 ** depth)
    assert (depth == 2).any(), "an untruncated branch runs its whole horizon (8 steps = 2 chunks)"
    strat.success.cfg.threshold = -1.0  # imagination now says every branch succeeds at once: nothing changes
    again = dom.rollout(keys, 4, torch.Generator().manual_seed(0), 0)
    assert torch.equal(again.rewards["return"], ro.rewards["return"])


def test_the_critic_learns_real_monte_carlo_returns(tiny_asset):
    root, asset = tiny_asset
    tr = Trainer(load_train_config(_config(asset, root, critic_steps=1000, real_episodes=0, audit_groups=0,
                                           critic_lr=3e-3)), None, log=lambda s: None)
    strat = tr.domain.rollouts
    n0 = sum(len(t) for t in strat._buf["target"])
    rng = np.random.default_rng(0)

    def episode(success_at):
        succ = np.zeros(4, bool)
        if success_at is not None:
            succ[success_at] = True
        return ChunkEpisode("point-reach", 0, rng.integers(0, 255, (5, 64, 64, 3), dtype=np.uint8),
                            rng.normal(size=(5, 4)).astype(np.float32), np.zeros((4, 4, 4), np.float32), succ,
                            np.full(4, 4), start_steps=8)

    strat._add_returns([episode(2), episode(None)])
    t = strat._buf["target"]
    assert np.allclose(t[-2], [0.97 ** 2, 0.97, 1.0, 1.0, 1.0]) and np.allclose(t[-1], 0.0)
    assert list(strat._buf["chunk"][-1]) == [2, 3, 4, 5, 6], "time from the episode's absolute start"
    assert sum(len(x) for x in t) == n0 + 10
    out = strat.fit_critic(torch.Generator().manual_seed(0))
    assert out["short/critic_explained_variance"] > 0.3, out  # fits the real returns (the tiny random features vary little)


def test_short_horizon_training_logs_and_counts_real_steps(tiny_asset):
    root, asset = tiny_asset
    cfg = _config(asset, root)
    cfg["robotics"]["rollout"]["world_model"].update(coevolve_every=1, coevolve_episodes=0, refit_steps=2,
                                                     refit_success_steps=2)
    cfg["iterations"] = 2
    tr = Trainer(load_train_config(cfg), None, log=lambda s: None)
    strat = tr.domain.rollouts
    steps0, keys0 = strat.real_env_steps, len(tr.domain.train_keys())
    hist = tr.fit()
    its = [h for h in hist if "groups/kept" in h]
    for name in ("short/critic_loss", "short/critic_explained_variance", "short/rank_spearman", "short/value_mean",
                 "short/fresh_success", "wm/imagined_steps", "wm/real_env_steps", "env/steps", "reward/return/mean"):
        assert all(name in h for h in its), name
    assert strat.real_env_steps == steps0 + sum(h["env/steps"] for h in its) > steps0, "fresh rollouts are counted"
    assert strat.audit_steps > 0 and len(tr.domain.train_keys()) > keys0, "audits run apart; fresh states are starts"
    assert any("coevolve/refit_episodes" in h for h in its), "the fresh episodes refit the world model"
    state = tr.domain.state_dict()
    assert any(k.startswith("short_horizon.") for k in state)
    tr.domain.load_state_dict(state)


def test_short_horizon_config_errors(tiny_asset):
    root, asset = tiny_asset
    bad = _config(asset, root)
    bad["robotics"]["dense_reward"] = True
    with pytest.raises(ConfigError, match="dense_reward: false"):
        load_train_config(bad)
    bad = _config(asset, root)
    bad["advantage"]["weights"] = {"success": 1.0}
    with pytest.raises(ConfigError, match="return"):
        load_train_config(bad)
    bad = _config(asset, root, gamma=0.0)
    with pytest.raises(ConfigError, match="gamma"):
        load_train_config(bad)
