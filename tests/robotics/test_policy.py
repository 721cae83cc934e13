"""Action heads: hand-computed Flow-GRPO kernel, log-prob recompute ratio 1 for every head mode, limits."""
import math
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch

from robotics.policies import TinyVLA, VLAConfig
from robotics.policies.flow_head import FlowActionHead, sigma_schedule
from shared_rl.flow_kernels import flow_step

TINY = dict(cnn_channels=[8, 8, 8, 8], feature_dim=32, text_dim=8, hidden=64, num_denoise_steps=4)


def test_flow_sde_transition_hand_computed():
    """The head's flow_sde step is the shared Flow-GRPO kernel: sigma 0.6 -> 0.4 (5 steps of 0.2 from sigma 1),
    a = 0.7: std_t = 0.7*sqrt(0.6/0.4), std_t^2 = 0.735; mean = x(1 + 0.735*(-0.2)/1.2) + v(1 + 0.735*0.4/1.2)(-0.2)
    = 0.8775 - 0.498 = 0.3795 for x = 1, v = 2; transition std = std_t*sqrt(0.2)."""
    out = flow_step("sde", torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.tensor([0.6]), torch.tensor([0.4]), 0.7,
                    noise=torch.zeros(1, 1), reduction="sum")
    assert out.mean.item() == pytest.approx(0.3795, abs=1e-5)
    assert out.std.item() == pytest.approx(0.7 * math.sqrt(1.5) * math.sqrt(0.2), rel=1e-6)
    assert torch.allclose(sigma_schedule(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    # the head routes flow_sde through that kernel: same mean and std as flow_step on the head's own velocity
    head = FlowActionHead(feature_dim=4, action_dim=3, hidden=8, num_steps=5)
    h, x = torch.randn(2, 4), torch.randn(2, 3)
    got = head.transition(h, x, torch.tensor([2, 2]), "flow_sde", 0.7, noise=torch.zeros(2, 3))
    v = head.velocity_at(h, x, torch.full((2,), 0.6))
    ref = flow_step("sde", x, v, torch.full((2,), 0.6), torch.full((2,), 0.4), 0.7, noise=torch.zeros(2, 3))
    assert torch.allclose(got.mean, ref.mean) and torch.allclose(got.std, ref.std)


def test_flow_noise_log_prob_matches_torch_normal():
    head = FlowActionHead(feature_dim=4, action_dim=5, hidden=8, num_steps=3)
    h, x, x_next = torch.randn(3, 4), torch.randn(3, 5), torch.randn(3, 5)
    for reduce in ("sum", "mean"):
        logp, ent, mean, std = head.step_log_prob(h, x, x_next, torch.tensor([0, 1, 2]), "flow_noise", reduce=reduce)
        normal = torch.distributions.Normal(mean, std)
        ref = normal.log_prob(x_next)
        assert torch.allclose(logp, ref.sum(-1) if reduce == "sum" else ref.mean(-1), atol=1e-5)
        e = normal.entropy()
        assert torch.allclose(ent, e.sum(-1) if reduce == "sum" else e.mean(-1), atol=1e-5)


def _policy(head="flow"):
    torch.manual_seed(0)
    return TinyVLA(VLAConfig(head=head, **TINY))


def _features(policy, b=6):
    g = torch.Generator().manual_seed(1)
    img = torch.randint(0, 256, (b, 64, 64, 3), dtype=torch.uint8, generator=g)
    ids = policy.text.token_ids(["push the puck to the green goal"] * b)
    return policy.encode(img, torch.randn(b, 4, generator=g), ids)


def test_small_noise_level_sde_equals_ode():
    policy = _policy()
    h = _features(policy)
    ode = policy.flow.sample(h, "ode", torch.Generator().manual_seed(3)).actions
    sde = policy.flow.sample(h, "flow_sde", torch.Generator().manual_seed(3), noise_level=1e-7).actions
    assert torch.allclose(ode, sde, atol=1e-5)
    sde_big = policy.flow.sample(h, "flow_sde", torch.Generator().manual_seed(3), noise_level=0.7).actions
    assert not torch.allclose(ode, sde_big, atol=1e-2)



def test_zero_init_noise_makes_the_ode_deterministic_and_mix_still_explores():
    policy = _policy()
    h = _features(policy)
    a = policy.flow.sample(h, "ode", torch.Generator().manual_seed(3), init_noise=0.0)
    b = policy.flow.sample(h, "ode", torch.Generator().manual_seed(4), init_noise=0.0)
    assert (a.chain[:, 0] == 0).all(), "the chain must start at the origin"
    assert torch.equal(a.actions, b.actions), "with no starting noise the ODE ignores the generator"
    c = policy.flow.sample(h, "ode", torch.Generator().manual_seed(4))
    assert not torch.allclose(a.actions, c.actions, atol=1e-3)
    # sde_one_step from the origin: the SDE step is the only randomness, and its log-prob is recomputed exactly
    m1 = policy.flow.sample(h, "sde_one_step", torch.Generator().manual_seed(5), noise_level=0.7, init_noise=0.0)
    m2 = policy.flow.sample(h, "sde_one_step", torch.Generator().manual_seed(6), noise_level=0.7, init_noise=0.0)
    assert not torch.allclose(m1.actions, m2.actions, atol=1e-3)
    rows, steps = torch.nonzero(m1.stochastic, as_tuple=True)
    logp, _, _, _ = policy.flow.step_log_prob(h[rows], m1.chain[rows, steps], m1.chain[rows, steps + 1], steps, "sde_one_step", 0.7)
    assert torch.allclose(logp, m1.logp[rows, steps], atol=1e-4)


@pytest.mark.parametrize("mode,expected_steps", [("flow_sde", 3), ("flow_noise", 4), ("sde_one_step", 1)])
def test_flow_head_recompute_ratio_is_one(mode, expected_steps):
    policy = _policy()
    h = _features(policy)
    out = policy.flow.sample(h, mode, torch.Generator().manual_seed(5), noise_level=0.7)
    assert (out.stochastic.sum(1) == expected_steps).all()
    if mode == "flow_sde":
        assert not out.stochastic[:, -1].any(), "the last denoising step is never stochastic in flow_sde"
    b, s = out.stochastic.shape
    rows, steps = torch.nonzero(out.stochastic, as_tuple=True)
    h2 = _features(policy)  # a fresh forward, as the trainer does
    logp, ent, _, _ = policy.flow.step_log_prob(h2[rows], out.chain[rows, steps], out.chain[rows, steps + 1], steps, mode, 0.7)
    ratio = torch.exp(logp - out.logp[rows, steps])
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4)
    assert torch.isfinite(ent).all()
    # the ODE part of the chain is deterministic: unsampled steps carry log-prob 0
    assert (out.logp[~out.stochastic] == 0).all()


def test_discrete_head_bins_roundtrip():
    policy = _policy("discrete")
    a = torch.tensor([-1.0, -0.999, 0.0, 0.5, 1.0])
    bins = policy.actions_to_bins(a)
    assert bins.tolist() == [0, 0, 128, 192, 255]
    centers = policy.bin_centers()[bins]
    assert (centers - a).abs().max() <= 1.0 / 256 + 1e-6


def test_save_load_pretrained_roundtrip(tmp_path):
    policy = _policy()
    policy.save_pretrained(tmp_path / "m")
    again = TinyVLA.load_pretrained(tmp_path / "m")
    h1, h2 = _features(policy), _features(again)
    assert torch.equal(h1, h2)
    a1 = policy.act(h1, torch.Generator().manual_seed(0))
    assert torch.equal(a1, again.act(h2, torch.Generator().manual_seed(0)))
    assert a1.shape == (6, 4, 4) and a1.abs().max() <= 1.0
