"""FPO (``robotics.head_mode: fpo``): the flow-matching likelihood surrogate, its rollouts and its first ratio."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import math

import pytest
import torch

from shared_rl.config import ConfigError, from_dict, load_train_config
from shared_rl.domain import RunContext
from shared_rl.trainer import Trainer

from robotics.domain import RoboticsConfig, RoboticsDomain
from robotics.episodes import SamplingSettings, run_episodes
from robotics.fpo import FPOConfig, draw_pairs, log_likelihood

TINY_MODEL = {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64, "num_denoise_steps": 3}
POINT = {"kind": "point", "tasks": ["point-reach"], "horizon": 8}


def _domain(**extra):
    section = {"env": POINT, "checkpoint": "", "model": dict(TINY_MODEL, head="flow"), "head_mode": "fpo",
               "train_states_per_task": 8, "eval_states_per_task": 4, "gifs": False, **extra}
    return RoboticsDomain(from_dict(RoboticsConfig, section, "robotics"),
                          RunContext(run_dir=None, device=torch.device("cpu"), seed=0))


def test_log_likelihood_by_hand():
    """ℓ = mean_n w(τ_n) mean_d (v − (ε − a))², x_τ = (1−τ)a + τε, written out element by element."""
    w = torch.tensor([[0.5, -1.0], [2.0, 0.25]])

    def velocity_at(h, x, t):  # v = W x + h + t (a linear field the sum below can follow)
        return x @ w.T + h + t[:, None]

    h = torch.tensor([[0.1, -0.2]])
    a = torch.tensor([[0.3, -0.7]])
    eps = torch.tensor([[[1.0, 0.5], [-0.4, 2.0]]])
    tau = torch.tensor([[0.8, 0.2]])
    expected = {}
    for target in ("velocity", "epsilon"):
        total = 0.0
        for n in range(2):
            t = tau[0, n].item()
            x = [(1 - t) * a[0, d].item() + t * eps[0, n, d].item() for d in range(2)]
            err = 0.0
            for d in range(2):
                v = w[d, 0].item() * x[0] + w[d, 1].item() * x[1] + h[0, d].item() + t
                err += (v - (eps[0, n, d].item() - a[0, d].item())) ** 2 / 2
            total += err * ((1 - t) ** 2 if target == "epsilon" else 1.0) / 2
        expected[target] = -total
        got = log_likelihood(velocity_at, h, a, eps, tau, target)
        assert got.shape == (1,) and math.isclose(got.item(), expected[target], rel_tol=1e-6), (target, got)
    assert expected["epsilon"] > expected["velocity"]  # (1 − τ)² < 1 weighs every pair down
    summed = log_likelihood(velocity_at, h, a, eps, tau, "epsilon", reduce="sum")
    assert math.isclose(summed.item(), 2 * expected["epsilon"], rel_tol=1e-6)  # D = 2 dims summed, not averaged


def test_pairs_on_the_schedule_or_uniform():
    sigmas = torch.linspace(1.0, 0.0, 4)  # 3 steps: τ in {1, 2/3, 1/3}
    eps, tau = draw_pairs(FPOConfig(samples=5), (2, 3), 6, sigmas, torch.Generator().manual_seed(0))
    assert eps.shape == (2, 3, 5, 6) and tau.shape == (2, 3, 5)
    assert set(torch.round(tau * 3).long().unique().tolist()) <= {1, 2, 3}
    _, tau_u = draw_pairs(FPOConfig(timesteps="uniform"), (50,), 2, sigmas, torch.Generator().manual_seed(0))
    assert ((tau_u > 0) & (tau_u < 1)).all() and len(tau_u.unique()) == tau_u.numel()


def test_rollouts_are_the_ode_and_the_first_ratio_is_one():
    dom = _domain()
    keys = dom.train_keys()[:3]
    ro = dom.rollout(keys, 4, torch.Generator().manual_seed(0), 0)
    n, c, s = len(ro), dom.n_chunks, dom.steps_per_chunk
    per_chunk = ro.mask.view(n, c, s)
    executed = ro.payload["images"].flatten(2).any(-1)
    assert (per_chunk[..., 0] == executed).all() and not per_chunk[..., 1:].any(), "slot 0 of each executed chunk"
    assert torch.equal(ro.logp_deferred, ro.mask) and ro.logp_old[ro.mask].isnan().all()
    assert ro.payload["fpo_eps"].shape == (n, c, 8, ro.payload["chain"].shape[-1])
    # the episodes are the ODE's: the same generator stream in mode ode gives the same chains
    env_keys = [k for k in keys for _ in range(4)]
    ode = run_episodes(dom.policy, dom.venv, env_keys, ["point-reach"] * n, SamplingSettings(mode="ode"),
                       dom.cfg.env.horizon, torch.Generator().manual_seed(0))
    assert torch.equal(torch.from_numpy(ode.chain), ro.payload["chain"])
    assert not torch.allclose(ro.payload["chain"][0, 0, -1], ro.payload["chain"][1, 0, -1]), "the start noise explores"
    # two forwards on the same pairs agree (so ρ = 1 at the first step), the reference equals the policy at start
    a = dom.log_probs(ro, torch.arange(n), need_kl=True)
    b = dom.log_probs(ro, torch.arange(n), need_kl=False)
    assert torch.equal(a.logp, b.logp) and a.logp[ro.mask].isfinite().all() and (a.logp[ro.mask] < 0).all()
    assert (a.ref_logp - a.logp)[ro.mask].abs().max() < 1e-6
    # d(log p-hat)/dθ is minus the flow-matching loss gradient on the executed chunks
    a.logp[ro.mask].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in dom.parameters())


def test_fpo_refuses_what_would_not_explore():
    with pytest.raises(ConfigError, match="init_noise must be > 0"):
        from_dict(RoboticsConfig, {"head_mode": "fpo", "init_noise": 0.0}, "robotics")
    with pytest.raises(ConfigError, match="same episode"):
        from_dict(RoboticsConfig, {"head_mode": "fpo", "group_start_noise": "shared"}, "robotics")
    with pytest.raises(ConfigError, match="rollout.name: tree"):
        from_dict(RoboticsConfig, {"head_mode": "fpo", "rollout": {"name": "tree"}}, "robotics")
    with pytest.raises(ConfigError, match="samples must be >= 1"):
        from_dict(RoboticsConfig, {"head_mode": "fpo", "fpo": {"samples": 0}}, "robotics")


def test_fpo_improves_success_on_the_point_env():
    data = {
        "domain": "robotics", "seed": 0, "iterations": 8,
        "rollout": {"groups_per_iteration": 8, "group_size": 8},
        "optim": {"lr": 2e-3, "inner_epochs": 2, "minibatches_per_epoch": 2},
        "loss": {"clip_low": 0.05, "clip_high": 0.05},
        "logging": {"progress": False},
        "robotics": {"env": POINT, "checkpoint": "", "model": TINY_MODEL, "head_mode": "fpo",
                     "train_states_per_task": 32, "eval_states_per_task": 32, "gifs": False},
    }
    hist = Trainer(load_train_config(data), None, log=lambda s: None).fit()
    first, last = hist[0]["eval/success"], hist[-1]["eval/success"]
    rewards = [h["reward/mean"] for h in hist if "reward/mean" in h]
    assert last >= first + 0.3, (first, last)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
    assert all(h["clip_frac"] < 1 for h in hist if "clip_frac" in h)
