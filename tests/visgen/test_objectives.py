"""Likelihood-free objectives (DiffusionNFT, AWM, DGPO): hand-computed losses, the policy-loss combination, training
slots, micro-batch invariance, the old policy, tree rollouts and the config contract. The reference-parity cases
(issue 37) are in test_reference_parity.py."""
from __future__ import annotations

import math

import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.domain import StepLogProbs
from shared_rl.config import LossConfig, PolicyLossChoice
from shared_rl.losses import AWMSettings, NFTSettings, awm_loss, nft_loss
from shared_rl.trainer import Trainer
from visgen.objectives import flow_matching_loss, nft_branch_losses, objective_from_config


def test_nft_branch_losses_hand_computed():
    x0, x_t, sigma = torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([0.5])
    v, v_old = torch.tensor([[1.0]]), torch.tensor([[0.0]])
    # beta 1: v+ = v = 1, x0+ = 0.5 - 0.5 = 0, err -1, w+ = 1 -> P = 1; v- = 2*0 - 1 = -1, x0- = 1, err 0 -> N = 0
    p, n = nft_branch_losses(x0, x_t, sigma, v, v_old, 1.0)
    assert p.item() == pytest.approx(1.0) and n.item() == pytest.approx(0.0)
    # beta 0.5: v+ = 0.5, x0+ = 0.25, err -0.75, w 0.75: P = 0.5625 / (0.5 * 0.75) = 1.5
    #           v- = -0.5, x0- = 0.75, err -0.25, w 0.25: N = 0.0625 / (0.5 * 0.25) = 0.5
    p, n = nft_branch_losses(x0, x_t, sigma, v, v_old, 0.5)
    assert p.item() == pytest.approx(1.5) and n.item() == pytest.approx(0.5)
    # the adaptive weights carry no gradient: dP/dv = 2 * err * (-sigma * beta) / (beta * w) = 2 * -0.75 * -0.25 / 0.375
    v = v.clone().requires_grad_(True)
    nft_branch_losses(x0, x_t, sigma, v, v_old, 0.5)[0].sum().backward()
    assert v.grad.item() == pytest.approx(1.0)


def test_nft_and_awm_policy_losses_hand_computed():
    cfg, nft = LossConfig(), NFTSettings(adv_max=5.0)
    zeros = torch.zeros(3, 1)
    terms = StepLogProbs(logp=zeros, objective_pos=torch.ones(3, 1), objective_neg=torch.full((3, 1), 2.0))
    # A = 5, -5, 0 -> r = 1, 0, 1/2 -> L = 5 * [1, 2, 1.5]
    loss, st = nft_loss(zeros, zeros, torch.tensor([5.0, -5.0, 0.0]), torch.ones(3, 1), cfg, nft, terms=terms)
    assert loss.flatten().tolist() == pytest.approx([5.0, 10.0, 7.5])
    assert (st["ratio"] == 1).all() and (st["clipped"] == 0).all()
    # advantages beyond A_max saturate r at 1 (and at 0 below -A_max)
    loss, _ = nft_loss(zeros, zeros, torch.tensor([50.0, -50.0, 2.5]), torch.ones(3, 1), cfg, nft, terms=terms)
    assert loss.flatten().tolist() == pytest.approx([5.0, 10.0, 5 * (0.75 + 0.5)])
    # AWM at ratio 1: -A' with A' = A / adv_clip_max * advantage_max = A / 5, plus ema_beta * the EMA-KL term;
    # masked steps contribute nothing
    awm_terms = StepLogProbs(logp=torch.zeros(2, 2), objective_pos=torch.tensor([[0.5, 9.0], [0.25, 9.0]]))
    loss, st = awm_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([2.0, -1.0]),
                        torch.tensor([[True, False], [True, False]]), cfg, AWMSettings(), terms=awm_terms)
    assert loss.flatten().tolist() == pytest.approx([-0.4 + 0.5, 0.0, 0.2 + 0.25, 0.0])
    assert (st["ratio"] == 1).all()
    with pytest.raises(ConfigError, match="likelihood-free"):
        nft_loss(zeros, zeros, torch.zeros(3), torch.ones(3, 1), cfg, nft, terms=StepLogProbs(logp=zeros))


def test_flow_matching_loss_hand_computed():
    x0, eps, v = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 0.0]])
    assert flow_matching_loss(x0, eps, v).item() == pytest.approx((1 + 1) / 2)  # target eps - x0 = [-1, 1]


def _cfg(tiny_dir, objective="nft", method=None, micro=0, lr=1e-2, **over):
    return load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": over.pop("group_size", 4)},
        "advantage": {"estimator": over.pop("estimator", "grpo"), "weights": {"shapes_strict": 0.0}},
        "loss": {"kl_coef": over.pop("kl_coef", 0.0)},  # policy_loss: null, the objective's
        "optim": {"lr": lr, "micro_batch_size": micro}, "logging": {"progress": False}, "eval": {"at_start": False},
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "method": method, "objective": {"name": objective, "timesteps_per_sample": 2},
                   "eval": {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}, **over},
    })


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_training_slots_and_micro_batches_give_the_same_update(tiny_dir, objective):
    trainers = [Trainer(_cfg(tiny_dir, objective, micro=m), None, log=lambda *_: None) for m in (0, 3)]
    metrics = [tr.iteration(0) for tr in trainers]
    ro = trainers[0].domain.rollouts
    assert metrics[0]["nfe/train"] == 8 * 2 * 2  # 8 images x 2 slots x (policy + old / EMA copy)
    # (AWM at ratio 1: -mean(A') ~ 0, so the loss values agree to float noise; the weights below carry the test)
    assert metrics[0]["loss/policy"] == pytest.approx(metrics[1]["loss/policy"], rel=1e-5, abs=1e-7)
    # Adam's first step is ~lr * sign(g) = 1e-2 per weight, so a wrong micro-batch split moves weights by ~1e-2; an
    # element whose gradient is ~0 divides float noise by its own tiny second moment (one such element of 64 moved
    # 1.4e-6 once the prompts were encoded one per call), hence 1e-5
    for (k, a), b in zip(trainers[0].domain.state_dict().items(), trainers[1].domain.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), k
    assert ro.objective.name == objective and metrics[0]["grad_norm"] > 0


def _old_and_live(dom):
    state = dom.state_dict()
    old = {k[4:]: v.clone() for k, v in state.items() if k.startswith("old.")}
    return old, {k: state[k].clone() for k in old}


def test_nft_rollout_trains_leaf_slots_and_keeps_an_old_policy(tiny_dir):
    tr = Trainer(_cfg(tiny_dir, "nft", kl_coef=0.1), None, log=lambda *_: None)
    dom = tr.domain
    ro = dom.rollout([0, 1], 4, torch.Generator().manual_seed(0), 0)
    assert ro.mask.sum(1).eq(2).all() and ro.mask[:, :2].all() and (ro.logp_old == 0).all()
    assert ro.payload["obj_sigma"].shape == (8, 2) and ro.payload["x0"].shape[0] == 8
    # two different grid timesteps per image, drawn per image
    assert (ro.payload["obj_sigma"][:, 0] != ro.payload["obj_sigma"][:, 1]).all()
    out = dom.log_probs(ro, torch.arange(8), need_kl=True)
    assert out.kl.abs().max() < 1e-10  # the policy still equals the reference
    old0, _ = _old_and_live(dom)
    tr.iteration(0)
    # v_old stays fixed during the iteration's optimizer steps (the reference updates it once per rollout epoch)
    old1, live1 = _old_and_live(dom)
    assert all(torch.equal(old0[k], old1[k]) for k in old0) and any(not torch.equal(old1[k], live1[k]) for k in old1)
    # the next iteration's first rollout soft-updates it once: d = min(0.5, 0.001 * 1 optimizer step) = 0.001
    dom.rollout([0, 1], 4, torch.Generator().manual_seed(1), 1)
    old2, _ = _old_and_live(dom)
    for k in old0:
        assert torch.allclose(old2[k], 0.001 * old1[k] + 0.999 * live1[k], atol=1e-7), k
    dom.rollout([0, 1], 4, torch.Generator().manual_seed(2), 1)  # a refill in the same iteration: no second update
    assert all(torch.equal(old2[k], _old_and_live(dom)[0][k]) for k in old2)
    assert int(dom.state_dict()["old_synced_iteration"]) == 1


def test_nft_on_tree_rollouts_trains_leaves_only(tiny_dir):
    cfg = _cfg(tiny_dir, "nft", method={"name": "branch_grpo", "split_steps": [0, 2], "factor": [2]},
               estimator="depth_zscore")
    tr = Trainer(cfg, None, log=lambda *_: None)
    ro = tr.domain.rollout([0], 4, torch.Generator().manual_seed(0), 0)
    leaf = torch.isfinite(ro.rewards["shapes"])
    assert ro.mask[leaf].sum(1).eq(2).all() and not ro.mask[~leaf].any()
    m = tr.iteration(0)
    assert m["grad_norm"] > 0 and math.isfinite(m["loss/policy"])


def test_objective_config_contract(tiny_dir):
    """A likelihood-free objective is one choice: it brings its loss (nft with the objective's adv_max) and the ODE
    sampler; a loss.policy_loss that says otherwise is one line; an explicit method stays the user's."""
    def load(loss=None, **visgen):
        return load_train_config({"domain": "visgen", **({"loss": loss} if loss else {}),
                                  "visgen": {"model": str(tiny_dir), **visgen}})

    cfg = load(objective={"name": "nft", "adv_max": 2.0})
    assert cfg.loss.policy_loss is None  # the config stays as written; the choice is derived
    assert cfg.policy_loss_choice() == PolicyLossChoice("nft", NFTSettings(adv_max=2.0))
    assert cfg.domain_config.method is None and cfg.domain_config.rollout_method().name == "ode"
    assert load(objective={"name": "awm"}).policy_loss_choice() == PolicyLossChoice("awm")
    assert load(objective={"name": "awm", "clip_range": 0.2}).policy_loss_choice().settings.clip_range == 0.2
    assert load(objective={"name": "dgpo"}).policy_loss_choice() == PolicyLossChoice("dgpo")
    assert load().policy_loss_choice().name == "clipped"
    assert load().domain_config.rollout_method().name == "flow_grpo"  # log_prob: Flow-GRPO's sampler
    consistent = load({"policy_loss": {"name": "nft", "adv_max": 2.0}}, objective={"name": "nft", "adv_max": 2.0})
    assert consistent.policy_loss_choice().settings.adv_max == 2.0
    assert load(objective={"name": "nft"}, method={"name": "flow_grpo"}).domain_config.rollout_method().name == \
        "flow_grpo"  # any sampler works (trees too: test_nft_on_tree_rollouts_trains_leaves_only)
    with pytest.raises(ConfigError, match=r"loss.policy_loss 'clipped' contradicts visgen.objective 'nft', which "
                                          r"trains with \{'name': 'nft', 'adv_max': 5.0, 'adv_mode': 'all'\}; "
                                          r"remove loss.policy_loss"):
        load({"policy_loss": "clipped"}, objective={"name": "nft"})
    with pytest.raises(ConfigError, match="contradicts visgen.objective 'nft'"):
        load({"policy_loss": {"name": "nft", "adv_max": 3.0}}, objective={"name": "nft"})
    with pytest.raises(ConfigError, match="contradicts visgen.objective 'awm'"):
        load({"policy_loss": "nft"}, objective={"name": "awm"})
    with pytest.raises(ConfigError, match="needs visgen.objective"):
        load({"policy_loss": "awm"})
    with pytest.raises(ConfigError, match="adv_max must be > 0"):
        objective_from_config({"name": "nft", "adv_max": 0.0})
    with pytest.raises(ConfigError, match="trains nothing under the log_prob objective"):
        load_train_config({"domain": "visgen", "visgen": {"model": str(tiny_dir), "method": {"name": "ode"}}})
    with pytest.raises(ConfigError, match="did you mean 'nft'"):
        objective_from_config({"name": "nf"})
    with pytest.raises(ConfigError, match="beta must be > 0"):
        objective_from_config({"name": "nft", "beta": 0.0})
    with pytest.raises(ConfigError, match="adv_mode must be one of"):
        objective_from_config({"name": "nft", "adv_mode": "positive"})
    with pytest.raises(ConfigError, match="weighting must be one of"):
        objective_from_config({"name": "awm", "weighting": "uniform"})
    with pytest.raises(ConfigError, match="more than the 3 grid steps"):
        objective_from_config({"name": "dgpo", "trunc_steps": 2})
    with pytest.raises(ConfigError, match="must hold whole groups"):
        load_train_config({"domain": "visgen", "optim": {"micro_batch_size": 3},
                           "visgen": {"model": str(tiny_dir), "objective": {"name": "dgpo"}}})


def test_grpo_guard_ratio_norm_hand_computed():
    from shared_rl.losses import GuardSettings, NoSettings, clipped_loss, guard_loss

    # grove's earlier form (relative scale, Flow-GRPO gradient); the reference default is tested in test_losses.py
    cfg, guard = LossConfig(clip_low=0.01), GuardSettings(scale="relative", step_weight="flow_grpo")
    logp = torch.tensor([[0.02, 0.02], [0.0, 0.0]], requires_grad=True)
    old, adv, mask = torch.zeros(2, 2), torch.ones(2), torch.ones(2, 2, dtype=torch.bool)
    terms = StepLogProbs(logp=logp, step_std=torch.tensor([[1.0, 3.0], [1.0, 3.0]]))
    # sigma_mean 2 -> scales 0.5, 1.5; log-ratios 0.01, 0.03 (row 0), 0 (row 1); centred per step column:
    # +-0.005 at the high-noise step, +-0.015 at the low-noise one
    loss, st = guard_loss(logp, old, adv, mask, cfg, guard, terms=terms)
    assert torch.allclose(st["log_ratio"], torch.tensor([[0.005, 0.015], [-0.005, -0.015]]), atol=1e-7)
    # clip range 0.01: only the low-noise step of row 0 clips (exp(0.015) > 1.01); the plain surrogate clips both
    assert st["clipped"].tolist() == [[0.0, 1.0], [0.0, 0.0]]
    assert clipped_loss(logp, old, adv, mask, cfg, NoSettings())[1]["clipped"][0].tolist() == [1.0, 1.0]
    # gradient reweighting: an unclipped step pulls exactly as in the plain surrogate, -A * rho
    loss.sum().backward()
    assert logp.grad[0, 0].item() == pytest.approx(-math.exp(0.005), rel=1e-6)
    assert logp.grad[0, 1].item() == 0.0  # clipped
    # at the first inner step (ratio 1) the normalised ratio is exactly 1 too
    _, st = guard_loss(torch.zeros(2, 2), old, adv, mask, cfg, guard, terms=terms)
    assert (st["ratio"] == 1).all()


def test_grpo_guard_trains_the_visgen_domain_and_logs_clip_frac_per_step(tiny_dir):
    cfg = load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1, "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "advantage": {"weights": {"shapes_strict": 0.0}}, "loss": {"policy_loss": "guard", "clip_low": 1e-4},
        "optim": {"lr": 1e-2, "inner_epochs": 2}, "logging": {"progress": False, "step_clip_frac": True},
        "eval": {"at_start": False},
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "method": {"name": "flow_grpo", "train_fraction": 0.75},
                   "eval": {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}},
    })
    m = Trainer(cfg, None, log=lambda *_: None).iteration(0)
    assert {"clip_frac/step0", "clip_frac/step1", "clip_frac/step2"} <= set(m) and "clip_frac/step3" not in m
    assert m["grad_norm"] > 0 and math.isfinite(m["loss/policy"])
