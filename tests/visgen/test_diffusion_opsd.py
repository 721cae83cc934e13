"""Issue 63: DiffusionOPSD (worldbench/DiffusionOPSD ``scripts/train_opsd_ri_sd3.py``, ``config/opsd_defaults.py``,
``src/diffusers_patch/solver.py``) — the branch losses and the advantage mix worked out by hand on tiny tensors with
their gradient; the trust-ball targets (the EMA clean prediction itself when the reward gradient is zero or ρ = 0, the
clamp binding when the steps overshoot the ball); the DPM-Solver++(2M) step by hand; on the tiny pipeline the anchor
y0 = z_q − σ_q·v_old(z_q) at the query state, micro-batches giving the same update, the refusals in one line (a
non-differentiable reward, bad settings, exit 2 from the dry run) and both recipes."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared_rl.config import ConfigError, LossConfig, load_train_config, load_yaml
from shared_rl.domain import StepLogProbs
from shared_rl.flow_kernels import dpm2_step
from shared_rl.losses import DiffusionOPSDSettings, diffusion_opsd_loss
from shared_rl.trainer import Trainer
from visgen.objectives import opsd_branch_losses, opsd_query_index, trust_ball_targets

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
QUIET = {"logging": {"progress": False}, "eval": {"at_start": False, "every": 0}, "checkpoint": {"every": 0}}
TINY_EVAL = {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}


def _cfg(tiny_dir, objective=None, rewards=None, weights=None, **over):
    optim = {"lr": 1e-2, "minibatches_per_epoch": 1, **over.pop("optim", {})}
    return load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": 3},
        "advantage": {"estimator": "grpo", "weights": weights or {"shapes_colour": 1.0}},
        "loss": {"kl_coef": 0.0}, "optim": optim, **QUIET,
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "objective": {"name": "diffusion_opsd", **(objective or {})},
                   "rewards": rewards or [{"name": "shapes_colour"}], "eval": TINY_EVAL, "num_threads": 1, **over},
    })


# ------------------------------------------------------------------------------------------------ the loss by hand
def test_branch_losses_and_the_advantage_mix_by_hand():
    """One sample of two elements, β 1, σ_q 0.5: z = (1, 0), v = (0.4, −0.2), v_old = (0.2, 0), y⁺ = (0.9, 0.2),
    y⁻ = (0.7, 0). ŷ⁺ = z − σv = (0.8, 0.1): error (−0.1, −0.1), w⁺ = 0.1, P = 0.01/0.1 = 0.1.
    ŷ⁻ = z − σ(2v_old − v) = (1, −0.1): error (0.3, −0.1), w⁻ = 0.2, N = 0.05/0.2 = 0.25.
    A = 2.5 → r = 2.5/5/2 + 1/2 = 0.75: L = 5·(0.75·0.1 + 0.25·0.25) = 0.6875;
    ∂L/∂v = 5·[0.75·(−σ)·2(ŷ⁺ − y⁺)/(2w⁺) + 0.25·σ·2(ŷ⁻ − y⁻)/(2w⁻)] = (2.8125, 1.5625).
    A = −10 (clipped to −5, r = 0): L = 5·N = 1.25; dual_negative false: 0."""
    shape = (1, 1, 1, 2)
    z = torch.tensor([1.0, 0.0]).reshape(shape)
    v = torch.tensor([0.4, -0.2]).reshape(shape).requires_grad_(True)
    v_old = torch.tensor([0.2, 0.0]).reshape(shape)
    y_plus, y_minus = torch.tensor([0.9, 0.2]).reshape(shape), torch.tensor([0.7, 0.0]).reshape(shape)
    pos, neg = opsd_branch_losses(z, torch.tensor([0.5]), v, v_old, y_plus, y_minus, beta=1.0)
    assert pos.item() == pytest.approx(0.1) and neg.item() == pytest.approx(0.25)

    def call(adv, settings=DiffusionOPSDSettings()):
        terms = StepLogProbs(logp=torch.zeros(1, 1), objective_pos=pos[:, None], objective_neg=neg[:, None])
        loss, st = diffusion_opsd_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([adv]),
                                       torch.ones(1, 1, dtype=torch.bool), LossConfig(), settings, terms)
        return loss, st

    loss, st = call(2.5)
    assert loss.item() == pytest.approx(0.6875)
    assert st["ratio"].eq(1).all() and st["clipped"].eq(0).all()
    (grad,) = torch.autograd.grad(loss.sum(), v, retain_graph=True)
    assert grad.flatten().tolist() == pytest.approx([2.8125, 1.5625])
    assert call(-10.0)[0].item() == pytest.approx(1.25)
    assert call(-10.0, DiffusionOPSDSettings(dual_negative=False))[0].item() == 0.0


def test_beta_moves_the_implicit_velocities():
    """β 0.5: v⁺ = 0.5v + 0.5v_old, v⁻ = 1.5v_old − 0.5v (no division by β, unlike nft)."""
    z, v, v_old = torch.zeros(1, 1, 1, 1), torch.full((1, 1, 1, 1), 1.0), torch.zeros(1, 1, 1, 1)
    pos, neg = opsd_branch_losses(z, torch.tensor([1.0]), v, v_old, torch.zeros_like(z), torch.zeros_like(z), 0.5)
    # ŷ⁺ = −0.5, ŷ⁻ = 0.5: squared error 0.25 over w = 0.5
    assert pos.item() == pytest.approx(0.5) and neg.item() == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------------ the trust ball
def test_targets_are_the_ema_prediction_without_a_reward_gradient_or_radius():
    y0 = torch.tensor([[[[3.0, 4.0]]], [[[1.0, -1.0]]]])
    calls = []

    def zero(y):
        calls.append(1)
        return torch.zeros_like(y)

    yp, ym = trust_ball_targets(y0, zero, rho=0.1, n_ascent=2, eta=1.0)
    assert torch.equal(yp, y0) and torch.equal(ym, y0)
    assert len(calls) == 3  # the first gradient at y0 is shared by both directions: 2·2 − 1 reward gradients
    ones = lambda y: torch.ones_like(y)  # noqa: E731
    yp, ym = trust_ball_targets(y0, ones, rho=0.0, n_ascent=2, eta=1.0)
    assert torch.equal(yp, y0) and torch.equal(ym, y0)


def test_the_trust_ball_clamp_binds():
    """y0 = (3, 4): ‖y0‖ = 5, ρ 0.1 → radius 0.5. A fixed gradient direction ĝ = (1, 0): with η 3 the first step of
    length 3·0.5/2 = 0.75 leaves the ball and is clamped back to its edge, and so is the second: y± = y0 ± 0.5·ĝ.
    With η 1 two half-radius steps reach the edge exactly (the reference's default never needs the clamp)."""
    y0 = torch.tensor([[[[3.0, 4.0]]]])
    g = lambda y: torch.tensor([[[[2.0, 0.0]]]])  # noqa: E731
    for eta in (3.0, 1.0):
        yp, ym = trust_ball_targets(y0, g, rho=0.1, n_ascent=2, eta=eta)
        assert yp.flatten().tolist() == pytest.approx([3.5, 4.0]) and ym.flatten().tolist() == pytest.approx([2.5, 4.0])
    # a gradient that turns: the second step would leave the ball; the clamp keeps ‖y − y0‖ = 0.5
    turn = iter([torch.tensor([[[[0.0, 1.0]]]])] * 4)
    yp, _ = trust_ball_targets(y0, lambda y: next(turn) if y[0, 0, 0, 1] != 4.0 else torch.tensor([[[[1.0, 0.0]]]]),
                               rho=0.1, n_ascent=2, eta=1.5)
    assert (yp - y0).norm().item() == pytest.approx(0.5)


def test_query_index_is_the_nearest_sigma_at_least_step_one():
    sig = torch.tensor([1.0, 0.9, 0.6, 0.3, 0.1, 0.0])
    assert opsd_query_index(sig, 5, 0.278) == 3
    assert opsd_query_index(sig, 5, 0.99) == 1  # step 0 is never the query


# ------------------------------------------------------------------------------------------------ the sampler
def test_dpm2_step_by_hand():
    """σ grid 1 → 0.75 → 0.5 → 0.25 → 0, x0 = x − σv. Step 0 (no previous x0): DDIM, x' = (1 − σ')x0 + σ'ε̂,
    ε̂ = (x − (1 − σ)x0)/σ. Step 1 (σ_prev = 1: λ_prev = −∞, D1 = 0): the first-order DPM++ update, equal to DDIM.
    Step 2: λ = log((1 − σ)/σ), h = λ' − λ, h0 = λ − λ_prev, x' = (σ'/σ)x − (1 − σ')(e^{−h} − 1)(x0 + h/(2h0)·(x0 − x0_prev)).
    The last step (σ' = 0) returns x0."""
    x, v = torch.tensor([[0.8, -0.4]]), torch.tensor([[0.5, 1.0]])
    out, x0 = dpm2_step(x, v, 1.0, 0.75)
    assert x0.tolist()[0] == pytest.approx([0.3, -1.4])
    eps = x  # at σ = 1: ε̂ = x
    assert out.tolist()[0] == pytest.approx((0.25 * x0 + 0.75 * eps).tolist()[0])
    x1 = out
    out, x0b = dpm2_step(x1, v, 0.75, 0.5, 1.0, x0)
    ddim = 0.5 * x0b + 0.5 * (x1 - 0.25 * x0b) / 0.75
    assert out.tolist()[0] == pytest.approx(ddim.tolist()[0], abs=1e-6)
    x2 = out
    out, x0c = dpm2_step(x2, v, 0.5, 0.25, 0.75, x0b)
    lam = lambda s: math.log((1 - s) / s)  # noqa: E731
    h, h0 = lam(0.25) - lam(0.5), lam(0.5) - lam(0.75)
    hand = (0.25 / 0.5) * x2 - 0.75 * (math.exp(-h) - 1) * (x0c + h / (2 * h0) * (x0c - x0b))
    assert out.tolist()[0] == pytest.approx(hand.tolist()[0], abs=1e-6)
    out, x0d = dpm2_step(out, v, 0.25, 0.0, 0.5, x0c)
    assert torch.allclose(out, x0d)


def test_a_dpm2_chain_equals_diffusers_dpm_solver_multistep():
    """A whole 10-step chain of ``dpm2_step`` against diffusers' own DPMSolverMultistepScheduler (flow sigmas, flow
    prediction, DPM-Solver++ order 2, first-order last step, final sigma 0): the same latents to 1e-6."""
    from diffusers import DPMSolverMultistepScheduler

    sch = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                      algorithm_type="dpmsolver++", solver_order=2, lower_order_final=True,
                                      final_sigmas_type="zero", flow_shift=3.0)
    sch.set_timesteps(10)
    sig = sch.sigmas.float()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 4, 3, 3, generator=g), torch.randn(4, 4, generator=g) * 0.3
    velocity = lambda z, s: torch.einsum("ij,bjhw->bihw", w, z) * (1 + s)  # noqa: E731
    a, b, x0 = x.clone(), x.clone(), None
    for i, t in enumerate(sch.timesteps):
        s = float(sig[i])
        a = sch.step(velocity(a, s), t, a).prev_sample
        b, x0 = dpm2_step(b, velocity(b, s), s, float(sig[i + 1]), float(sig[i - 1]) if i else None, x0)
    assert (a - b).abs().max() < 1e-6


# ------------------------------------------------------------------------------------------------ the tiny pipeline
def test_anchor_targets_and_training_on_the_tiny_pipeline(tiny_dir):
    """The rollout samples with the old copy by dpm2; each leaf's query state is its rollout state at the step nearest
    σ 0.278; with ρ = 0 the targets are the EMA clean prediction y0 = z_q − σ_q·v_old(z_q) (recomputed here by hand)
    and the model timestep is floor(1000·σ_q) of σ_q as a Python float (the reference's long cast: 333 for the float32
    0.334); one trained column per leaf; nfe 2 per sample (policy + old)."""
    tr = Trainer(_cfg(tiny_dir, {"rho": 0.0}), None, log=lambda *_: None)
    dom = tr.domain
    assert dom.method.name == "dpm2"
    ro = dom.rollout([0, 1], 3, torch.Generator().manual_seed(0), 0)
    p = ro.payload
    assert ro.mask[:, 0].all() and not ro.mask[:, 1:].any()
    sig = p["obj_sigma"][:, 0]
    assert p["obj_timestep"][:, 0].tolist() == [float(math.floor(float(sig[0]) * 1000))] * 6
    k = int(p["obj_query_step"][0])
    assert torch.equal(p["obj_zq"], p["latents"][:, k])
    from visgen.pipelines.base import Conditioning

    r = dom.rollouts
    cond = Conditioning(p["cond"], **r._cond_meta)
    with torch.no_grad(), dom.policy.old_weights():
        v_old = r.adapter.velocity(p["obj_zq"], p["obj_timestep"][:, 0], cond)
    y0 = p["obj_zq"] - sig.reshape(-1, 1, 1, 1) * v_old
    assert torch.allclose(p["obj_y_plus"], y0, atol=1e-6) and torch.allclose(p["obj_y_minus"], y0, atol=1e-6)
    out = dom.log_probs(ro, torch.arange(len(ro.mask)), False)
    assert out.objective_pos.requires_grad and out.nfe == 2 * 6
    assert out.objective_pos[:, 1:].abs().max() == 0


def test_the_default_targets_move_along_the_reward_gradient(tiny_dir):
    """ρ 0.1: ‖y± − y0‖ ≤ 0.1‖y0‖ (equal here: two collinear-enough half steps), and the reward of the decoded y⁺
    exceeds that of y⁻."""
    tr = Trainer(_cfg(tiny_dir), None, log=lambda *_: None)
    dom = tr.domain
    ro = dom.rollout([0, 1], 3, torch.Generator().manual_seed(0), 0)
    p = ro.payload
    assert 0 < ro.info["opsd/delta_res"] <= 0.1 + 1e-5
    from visgen.pipelines.base import Conditioning

    cond = Conditioning(p["cond"], **dom.rollouts._cond_meta)
    prompts = [dom.train_prompts[ro.keys[g]] for g in ro.group_ids.tolist()]
    metas = [dom.train_meta[ro.keys[g]] for g in ro.group_ids.tolist()]
    with torch.no_grad():
        up = dom.rollouts.grad_reward(dom.adapter.decode_differentiable(p["obj_y_plus"], cond), prompts, metas)
        down = dom.rollouts.grad_reward(dom.adapter.decode_differentiable(p["obj_y_minus"], cond), prompts, metas)
    assert (up > down).all()


def test_micro_batches_give_the_same_update(tiny_dir):
    def weights(**optim):
        tr = Trainer(_cfg(tiny_dir, optim=optim), None, log=lambda *_: None)
        m = tr.iteration(0)
        assert math.isfinite(m["loss/policy"]) and m["loss/policy"] > 0 and m["grad_norm"] > 0
        return {n: p.detach().clone() for n, p in tr.domain.policy._named_trainable()}

    whole, split = weights(), weights(micro_batch_size=2)
    assert all(torch.allclose(whole[n], split[n], atol=1e-6) for n in whole)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("objective, message", [
    ({"beta": 0.0}, "beta must be > 0"),
    ({"rho": -0.1}, "rho, eta must be >= 0"),
    ({"query_sigma": 1.0}, "query_sigma must be in"),
    ({"adv_clip_max": 0.0}, "adv_clip_max must be > 0"),
])
def test_bad_settings_are_one_line(tiny_dir, objective, message):
    with pytest.raises(ConfigError, match=message) as info:
        _cfg(tiny_dir, objective)
    assert "\n" not in str(info.value)


def test_a_non_differentiable_reward_is_refused_in_one_line_before_weights_load(tiny_dir):
    with pytest.raises(ConfigError, match="reward 'shapes_soft' is not differentiable") as info:
        _cfg(tiny_dir, rewards=[{"name": "shapes_soft"}], weights={"shapes_soft": 1.0})
    assert "\n" not in str(info.value)
    # logged only (weight 0) is fine
    _cfg(tiny_dir, rewards=[{"name": "shapes_colour"}, {"name": "shapes"}],
         weights={"shapes_colour": 1.0, "shapes": 0.0, "shapes_strict": 0.0})
    with pytest.raises(ConfigError, match="grows trees") as info:
        _cfg(tiny_dir, method={"name": "branch_grpo", "split_steps": [0], "factor": [3]})
    assert "\n" not in str(info.value)


@pytest.mark.slow  # a fresh interpreter: ~14 s on the shared 2-core machine
def test_cli_dry_run_exits_2_on_a_non_differentiable_reward():
    out = subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", "configs/visgen/shapes_diffusion_opsd.yaml",
                          "--dry-run", "advantage.weights.shapes=1.0"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "is not differentiable" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ recipes
@pytest.mark.parametrize("name", ["shapes_diffusion_opsd", "sd35_diffusion_opsd"])
def test_recipes_parse_and_run_on_the_tiny_pipeline(name, tiny_dir):
    data = load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml")
    recipe = load_train_config(load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml"))
    choice = recipe.policy_loss_choice()
    assert choice.name == "diffusion_opsd" and choice.settings.adv_clip_max == 5.0
    obj = recipe.domain_config.training_objective().settings
    assert (obj.beta, obj.rho, obj.n_ascent, obj.eta, obj.query_sigma) == (1.0, 0.1, 2, 1.0, 0.278)
    assert recipe.domain_config.rollout_method().name == "dpm2" and recipe.loss.kl_coef == 0.0
    data.update(device="cpu", iterations=1, **QUIET)
    data["rollout"] = {"groups_per_iteration": 2, "group_size": 2}
    data["advantage"]["weights"] = {"shapes_colour": 1.0}
    data["optim"]["micro_batch_size"] = 0
    data["visgen"].update(model=str(tiny_dir), dtype="float32", num_inference_steps=3, rewards=[{"name": "shapes_colour"}],
                          eval=TINY_EVAL, task="shapes", num_threads=1, gradient_checkpointing=False)
    for key in ("train_prompts", "eval_prompts", "resolution", "max_sequence_length", "rollout_micro_batch"):
        data["visgen"].pop(key, None)
    tr = Trainer(load_train_config(data), None, log=lambda *_: None)
    m = tr.iteration(0)
    assert math.isfinite(m["loss/policy"]) and m["grad_norm"] > 0
