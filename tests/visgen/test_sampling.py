"""Step kernels (hand-computed values, invariants) and step plans."""
from __future__ import annotations

import math

import pytest
import torch

from shared_rl.config import ConfigError
from visgen.plans import (
    PLANS,
    DanceGRPOPlan,
    ExplicitPlan,
    FlowGRPOFastPlan,
    FlowGRPOPlan,
    MixGRPOPlan,
    ODEPlan,
    StepPlan,
    plan_from_config,
)
from shared_rl.flow_kernels import (
    KERNELS,
    cps_step,
    cps_unnormalized_log_prob,
    dance_step,
    flow_step,
    gaussian_entropy,
    gaussian_log_prob,
    ode_step,
    sde_mean_kl,
    sde_step,
)

X = [1.0, -2.0]
V = [0.5, 1.5]
EPS = [0.3, -1.0]
SIGMA, SIGMA_NEXT = 0.8, 0.6
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def t(values):
    return torch.tensor([values], dtype=torch.float32)  # batch of one, two latent elements


def expected_log_prob(sample, mean, std):
    """Mean over elements of the scalar Gaussian log-density, written out by hand."""
    terms = [-((s - m) ** 2) / (2 * std**2) - math.log(std) - HALF_LOG_2PI for s, m in zip(sample, mean)]
    return sum(terms) / len(terms)


# ------------------------------------------------------------------------------------------ hand-computed kernels


def test_ode_step_hand_computed():
    out = ode_step(t(X), t(V), SIGMA, SIGMA_NEXT)
    # dt = -0.2: 1 + 0.5 * -0.2 = 0.9 ; -2 + 1.5 * -0.2 = -2.3
    assert torch.allclose(out.next_sample, t([0.9, -2.3]), atol=1e-7)
    assert out.std.item() == 0 and out.log_prob.item() == 0


def test_sde_step_hand_computed():
    a = 0.7
    out = sde_step(t(X), t(V), SIGMA, SIGMA_NEXT, a, noise=t(EPS))
    std_t = a * math.sqrt(SIGMA / (1 - SIGMA))  # 1.4
    dt = SIGMA_NEXT - SIGMA
    coef_x = 1 + std_t**2 * dt / (2 * SIGMA)  # 0.755
    coef_v = (1 + std_t**2 * (1 - SIGMA) / (2 * SIGMA)) * dt  # -0.249
    mean = [x * coef_x + v * coef_v for x, v in zip(X, V)]
    assert mean == pytest.approx([0.6305, -1.8835], abs=1e-12)
    std = std_t * math.sqrt(-dt)
    sample = [m + std * e for m, e in zip(mean, EPS)]
    assert out.mean[0].tolist() == pytest.approx(mean, abs=1e-6)
    assert out.std.item() == pytest.approx(std, abs=1e-6)
    assert out.next_sample[0].tolist() == pytest.approx(sample, abs=1e-6)
    assert out.log_prob.item() == pytest.approx(expected_log_prob(sample, mean, std), abs=1e-5)


def test_sde_step_at_sigma_one_uses_next_sigma_in_denominator():
    a = 0.7
    out = sde_step(t(X), t(V), 1.0, 0.75, a, noise=t(EPS))
    std_t = a * math.sqrt(1.0 / (1 - 0.75))  # 1.4, finite although sigma = 1
    assert out.std.item() == pytest.approx(std_t * math.sqrt(0.25), abs=1e-6)
    dt = -0.25
    mean = [x * (1 + std_t**2 * dt / 2) + v * (1 + 0.0) * dt for x, v in zip(X, V)]
    assert out.mean[0].tolist() == pytest.approx(mean, abs=1e-6)
    assert torch.isfinite(out.log_prob).all()


def test_cps_step_hand_computed():
    a = 0.5
    out = cps_step(t(X), t(V), SIGMA, SIGMA_NEXT, a, noise=t(EPS))
    std = SIGMA_NEXT * math.sin(a * math.pi / 2)
    x0 = [x - SIGMA * v for x, v in zip(X, V)]
    x1 = [x + (1 - SIGMA) * v for x, v in zip(X, V)]
    mean = [p0 * (1 - SIGMA_NEXT) + p1 * math.sqrt(SIGMA_NEXT**2 - std**2) for p0, p1 in zip(x0, x1)]
    sample = [m + std * e for m, e in zip(mean, EPS)]
    assert out.std.item() == pytest.approx(std, abs=1e-6)
    assert out.mean[0].tolist() == pytest.approx(mean, abs=1e-6)
    assert out.next_sample[0].tolist() == pytest.approx(sample, abs=1e-6)
    assert out.log_prob.item() == pytest.approx(expected_log_prob(sample, mean, std), abs=1e-5)
    assert cps_unnormalized_log_prob(out.next_sample, out.mean).item() == pytest.approx(
        -sum((s - m) ** 2 for s, m in zip(sample, mean)) / 2, abs=1e-6
    )


def test_dance_step_hand_computed():
    eta = 0.3
    out = dance_step(t(X), t(V), SIGMA, SIGMA_NEXT, eta, noise=t(EPS))
    dt = SIGMA_NEXT - SIGMA
    std = eta * math.sqrt(SIGMA - SIGMA_NEXT)
    mean = []
    for x, v in zip(X, V):
        x0 = x - SIGMA * v
        score = -(x - (1 - SIGMA) * x0) / SIGMA**2
        mean.append(x + dt * v - 0.5 * eta**2 * score * dt)
    sample = [m + std * e for m, e in zip(mean, EPS)]
    assert out.std.item() == pytest.approx(std, abs=1e-6)
    assert out.mean[0].tolist() == pytest.approx(mean, abs=1e-6)
    assert out.log_prob.item() == pytest.approx(expected_log_prob(sample, mean, std), abs=1e-5)


def test_cps_preserves_marginal_coefficients_with_exact_velocity():
    # x = (1 - s) x0 + s e, v = e - x0  =>  mean = (1 - s') x0 + sqrt(s'^2 - std^2) e and total noise var s'^2
    gen = torch.Generator().manual_seed(0)
    x0, e = torch.randn(2, 1, 16, generator=gen)
    x = (1 - SIGMA) * x0 + SIGMA * e
    out = cps_step(x, e - x0, SIGMA, SIGMA_NEXT, 0.6, noise=torch.zeros_like(x))
    std = out.std.item()
    assert torch.allclose(out.mean, (1 - SIGMA_NEXT) * x0 + math.sqrt(SIGMA_NEXT**2 - std**2) * e, atol=1e-6)
    assert (SIGMA_NEXT**2 - std**2) + std**2 == pytest.approx(SIGMA_NEXT**2)


# ------------------------------------------------------------------------------------------ invariants


def _random_step(batch=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, 3, 3, generator=gen)
    v = torch.randn(batch, 4, 3, 3, generator=gen)
    noise = torch.randn(batch, 4, 3, 3, generator=gen)
    return x, v, noise


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.7, 0.45), (0.2, 0.0)])
def test_noise_level_zero_is_exactly_ode(sigma, sigma_next):
    x, v, noise = _random_step()
    ode = ode_step(x, v, sigma, sigma_next)
    for kernel in (sde_step, dance_step):  # exact by construction of the formula
        out = kernel(x, v, sigma, sigma_next, 0.0, noise=noise)
        assert torch.equal(out.next_sample, ode.next_sample), kernel.__name__
        assert torch.equal(out.log_prob, torch.zeros(3))
    for name in KERNELS:  # flow_step routes deterministic rows to the Euler formula for every kernel
        out = flow_step(name, x, v, sigma, sigma_next, 0.0, noise=noise)
        assert torch.equal(out.next_sample, ode.next_sample), name
        assert torch.equal(out.mean, ode.mean) and torch.equal(out.log_prob, torch.zeros(3))
    # cps at a = 0 equals Euler algebraically; only rounding differs
    assert torch.allclose(cps_step(x, v, sigma, sigma_next, 0.0, noise=noise).next_sample, ode.next_sample, atol=1e-6)


def test_ode_step_matches_diffusers_scheduler_bit_for_bit():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(5)
    x, v, _ = _random_step()
    for i, timestep in enumerate(scheduler.timesteps):
        expected = scheduler.step(v, timestep, x, return_dict=False)[0]
        ours = ode_step(x, v, scheduler.sigmas[i], scheduler.sigmas[i + 1]).next_sample
        assert torch.equal(ours, expected)
        x = expected


@pytest.mark.parametrize("kernel", ["sde", "cps", "dance"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_log_prob_equals_torch_normal(kernel, reduction):
    x, v, noise = _random_step()
    out = flow_step(kernel, x, v, torch.tensor([0.9, 0.5, 0.3]), torch.tensor([0.7, 0.3, 0.1]), 0.7, noise=noise,
                    reduction=reduction)
    elementwise = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.next_sample)
    expected = elementwise.mean((1, 2, 3)) if reduction == "mean" else elementwise.sum((1, 2, 3))
    assert torch.allclose(out.log_prob, expected, rtol=1e-5, atol=1e-5)
    # scoring a given next sample reproduces the sampled log-prob exactly (the recompute path)
    again = flow_step(kernel, x, v, torch.tensor([0.9, 0.5, 0.3]), torch.tensor([0.7, 0.3, 0.1]), 0.7,
                      next_sample=out.next_sample, reduction=reduction)
    assert torch.equal(again.log_prob, out.log_prob)
    assert torch.equal(gaussian_log_prob(out.next_sample, out.mean, out.std, reduction), out.log_prob)


def test_mixed_stochastic_rows_and_finite_gradients():
    x, v, noise = _random_step()
    v = v.clone().requires_grad_(True)
    stochastic = torch.tensor([True, False, True])
    out = flow_step("cps", x, v, 0.5, torch.tensor([0.3, 0.3, 0.0]), 0.7, noise=noise, stochastic=stochastic)
    ode = ode_step(x, v, 0.5, torch.tensor([0.3, 0.3, 0.0]))
    assert torch.equal(out.next_sample[1], ode.next_sample[1])  # ODE row
    assert out.log_prob[1] == 0 and out.log_prob[2] == 0  # row 2: last step (sigma' = 0) has zero std in CPS
    assert out.log_prob[0] != 0 and out.std[0].item() > 0
    # training scores the stored (detached) next sample; the gradient reaches v only through the mean
    scored = flow_step("cps", x, v, 0.5, torch.tensor([0.3, 0.3, 0.0]), 0.7, next_sample=out.next_sample.detach(),
                       stochastic=stochastic)
    assert torch.equal(scored.log_prob, out.log_prob)
    scored.log_prob.sum().backward()
    assert torch.isfinite(v.grad).all() and v.grad[0].abs().sum() > 0


def test_entropy_and_kl_hand_computed():
    std = torch.tensor([0.5, 0.0])
    h = gaussian_entropy(std, numel=8)
    assert h[0].item() == pytest.approx(0.5 * math.log(2 * math.pi * math.e * 0.25), abs=1e-6)
    assert h[1].item() == 0
    assert gaussian_entropy(std, numel=8, reduction="sum")[0].item() == pytest.approx(8 * h[0].item(), abs=1e-5)
    normal = torch.distributions.Normal(torch.zeros(8), torch.full((8,), 0.5))
    assert h[0].item() == pytest.approx(normal.entropy().mean().item(), abs=1e-6)

    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    mean_ref = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    kl = sde_mean_kl(mean, mean_ref, torch.tensor([[0.5], [0.0]]))
    # row 0: ((1)^2 + (2)^2) / (2 * 0.25) / 2 = 5 ; row 1: zero std -> 0
    assert kl.tolist() == pytest.approx([5.0, 0.0])


def test_stochastic_step_without_noise_is_an_error():
    x, v, _ = _random_step()
    with pytest.raises(ValueError, match="needs `noise`"):
        sde_step(x, v, 0.5, 0.3, 0.7)
    with pytest.raises(ValueError, match="unknown sampler"):
        flow_step("euler_ancestral", x, v, 0.5, 0.3, 0.7)


# ------------------------------------------------------------------------------------------ plans


def _all_plans():
    return [
        FlowGRPOPlan(), FlowGRPOPlan(train_fraction=0.5, select="random"), DanceGRPOPlan(), FlowGRPOFastPlan(),
        FlowGRPOFastPlan(per_sample=True), MixGRPOPlan(window_size=3, iters_per_shift=2),
        MixGRPOPlan(window_size=3, schedule="random"), ODEPlan(), ExplicitPlan(sde_steps=[0, 1, 2]),
    ]


@pytest.mark.parametrize("num_steps", [4, 10])
def test_plans_never_train_the_last_step_and_train_only_sde(num_steps):
    for spec in _all_plans():
        for iteration in range(0, 12, 3):
            plan = spec.build(num_steps, 5, torch.Generator().manual_seed(iteration), iteration)
            assert plan.sde.shape == (5, num_steps) == plan.train.shape
            assert not plan.train[:, -1].any(), spec
            assert not (plan.train & ~plan.sde).any(), spec


def test_plans_deterministic_given_generator_and_iteration():
    for spec in _all_plans():
        a = spec.build(10, 6, torch.Generator().manual_seed(7), 4)
        b = spec.build(10, 6, torch.Generator().manual_seed(7), 4)
        assert torch.equal(a.sde, b.sde) and torch.equal(a.train, b.train), spec


def test_step_plan_rejects_training_last_or_ode_steps():
    with pytest.raises(ValueError, match="final denoising step"):
        StepPlan(torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="deterministic"):
        StepPlan(torch.zeros(1, 3, dtype=torch.bool), torch.tensor([[True, False, False]]))


def test_flow_grpo_plan_trains_the_first_fraction():
    plan = FlowGRPOPlan(train_fraction=0.6).build(10, 2)
    assert plan.sde.all()
    assert plan.train[0].tolist() == [True] * 6 + [False] * 4
    assert FlowGRPOPlan(train_fraction=1.0).build(10, 1).train[0].tolist() == [True] * 9 + [False]


def test_dance_plan_random_subset_per_sample():
    plan = DanceGRPOPlan(train_fraction=0.6).build(10, 8, torch.Generator().manual_seed(0))
    assert plan.sde.all()
    assert plan.train.sum(1).tolist() == [6] * 8
    assert len({tuple(row.tolist()) for row in plan.train}) > 1  # samples get different subsets


def test_fast_plan_window_of_one_to_three_steps():
    spec = FlowGRPOFastPlan()
    seen = set()
    for seed in range(30):
        plan = spec.build(10, 3, torch.Generator().manual_seed(seed))
        steps = torch.nonzero(plan.sde[0]).flatten().tolist()
        assert 1 <= len(steps) <= 3 and steps == list(range(steps[0], steps[0] + len(steps)))
        assert steps[-1] < 5  # default range: the first half of the schedule
        assert torch.equal(plan.sde, plan.train) and (plan.sde == plan.sde[0]).all()
        seen.add(len(steps))
    assert seen == {1, 2, 3}


def test_mix_grpo_window_moves_toward_low_noise():
    spec = MixGRPOPlan(window_size=3, shift=1, iters_per_shift=2)
    starts = []
    for iteration in range(0, 20, 2):
        plan = spec.build(8, 2, None, iteration)
        window = torch.nonzero(plan.sde[0]).flatten().tolist()
        assert len(window) == 3 and torch.equal(plan.sde, plan.train)
        assert (~plan.sde[0, [s for s in range(8) if s not in window]]).all()  # ODE outside the window
        starts.append(window[0])
    assert starts == [0, 1, 2, 3, 4, 4, 4, 4, 4, 4]  # stops at T - 1 - window
    rolled = MixGRPOPlan(window_size=3, iters_per_shift=1, roll_back=True)
    assert [rolled.window_start(8, it) for it in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    random_spec = MixGRPOPlan(window_size=3, schedule="random")
    random_starts = {random_spec.window_start(8, 0, torch.Generator().manual_seed(s)) for s in range(40)}
    assert random_starts == {0, 1, 2, 3, 4}


def test_plan_from_config_validates():
    spec = plan_from_config({"name": "mix_grpo", "window_size": 2, "schedule": "random"})
    assert isinstance(spec, MixGRPOPlan) and spec.window_size == 2
    assert isinstance(plan_from_config("dance_grpo"), DanceGRPOPlan)
    assert set(PLANS) == {"flow_grpo", "dance_grpo", "flow_grpo_fast", "mix_grpo", "ode", "dpm2", "explicit"}
    with pytest.raises(ConfigError, match="window_sise"):
        plan_from_config({"name": "mix_grpo", "window_sise": 2})
    with pytest.raises(ConfigError, match="schedule"):
        plan_from_config({"name": "mix_grpo", "schedule": "sideways"})
    with pytest.raises(ConfigError, match="train_fraction"):
        plan_from_config({"name": "flow_grpo", "train_fraction": 1.5})
    with pytest.raises(ConfigError, match="plan.name"):
        plan_from_config({"name": "grpo_guard"})
    with pytest.raises(ConfigError, match="does not fit"):
        MixGRPOPlan(window_size=4).build(4, 1)
