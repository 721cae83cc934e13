"""Issue 63: Centered Reward Distillation (arXiv 2603.14128; X-GenGroup/Flow-Factory ``trainers/crd.py``) — the
centred regression (mse and bce) and its gradient, the reward-adaptive KL, worked out by hand; on the tiny pipeline
the implicit reward from the normalised velocity errors against the "old" snapshot (0 while it equals the live
weights), the KL to the CFG-guided reference (the empty prompt as its negative), the two snapshots on their own decay
schedules (and in checkpoints), the same update with ``backward_steps: 1``, one-line errors (exit 2), the recipes."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared_rl.config import ConfigError, LossConfig, load_train_config, load_yaml
from shared_rl.domain import StepLogProbs
from shared_rl.losses import CRDSettings, crd_loss, crd_targets
from shared_rl.trainer import Trainer

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
QUIET = {"logging": {"progress": False}, "eval": {"at_start": False}}
TINY_EVAL = {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}


def _cfg(tiny_dir, objective=None, **over):
    optim = {"lr": 1e-2, "minibatches_per_epoch": 1, **over.pop("optim", {})}
    return load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "advantage": {"estimator": "grpo", "weights": {"shapes_strict": 0.0}},
        "loss": {"kl_coef": 0.0, **over.pop("loss", {})}, "optim": optim, **QUIET,
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "objective": {"name": "crd", "timesteps_per_sample": 3, **(objective or {})},
                   "eval": TINY_EVAL, **over},
    })


# ------------------------------------------------------------------------------------------------ the loss
def _call(r, adv, group, settings, kl=None):
    r = r.clone().requires_grad_(True)
    mask = torch.ones_like(r, dtype=torch.bool)
    terms = StepLogProbs(logp=torch.zeros_like(r), objective_pos=r, objective_neg=kl, group=group)
    loss, st = crd_loss(torch.zeros_like(r), torch.zeros_like(r), adv, mask, LossConfig(), settings, terms)
    (loss.sum() / loss.numel()).backward()  # token-mean
    return loss, r.grad, st


def test_centred_regression_by_hand():
    """One group of two, one slot: A = (1, −1) → a = A/5/2 + 1/2 = (0.6, 0.4), R_c = (0.1, −0.1); r_θ = (0.3, −0.1)
    → R_θ,c = (0.2, −0.2) (the mean 0.1 detached). β 1: L = 5·(0.2 − 0.1)² = 0.05 each, ∂L/∂r = 2·5·0.1 = ±1,
    halved by the mean over two rows. β 2: L = 2.5·(0.4 − 0.1)² = 0.225, ∂L/∂r = 2·2.5·2·0.3 = 3."""
    r, adv, group = torch.tensor([[0.3], [-0.1]]), torch.tensor([1.0, -1.0]), torch.tensor([0, 0])
    assert crd_targets(adv, 5.0).tolist() == pytest.approx([0.6, 0.4])
    loss, grad, st = _call(r, adv, group, CRDSettings(kl_beta=0.0))
    assert loss.flatten().tolist() == pytest.approx([0.05, 0.05])
    assert grad.flatten().tolist() == pytest.approx([0.5, -0.5])
    assert st["ratio"].eq(1).all() and st["clipped"].eq(0).all()  # no ratio
    loss, grad, _ = _call(r, adv, group, CRDSettings(beta=2.0, kl_beta=0.0))
    assert loss.flatten().tolist() == pytest.approx([0.225, 0.225])
    assert grad.flatten().tolist() == pytest.approx([1.5, -1.5])
    # centring is per group: the same rows split into two groups of one are centred to 0 (L = 0 for r and a alike)
    loss, grad, _ = _call(r, adv, torch.tensor([0, 1]), CRDSettings(kl_beta=0.0))
    assert loss.abs().max() == 0 and grad.abs().max() == 0
    # A beyond ±A_max is clipped: A = (9, −9) maps to (1, 0)
    assert crd_targets(torch.tensor([9.0, -9.0]), 5.0).tolist() == [1.0, 0.0]


def test_bce_and_the_reward_adaptive_kl_by_hand():
    r, adv, group = torch.tensor([[0.3], [-0.1]]), torch.tensor([1.0, -1.0]), torch.tensor([0, 0])
    loss, _grad, _ = _call(r, adv, group, CRDSettings(loss_type="bce", kl_beta=0.0))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    bce = lambda x, y: -(y * math.log(sig(x)) + (1 - y) * math.log(1 - sig(x)))  # noqa: E731
    assert loss.flatten().tolist() == pytest.approx([5 * bce(0.2, sig(0.1)), 5 * bce(-0.2, sig(-0.1))])
    # KL 0.5 and 0.2, kl_beta 0.1: c = 1e-4/0.1 = 1e-3, weights c + a(1 − c) = 0.6004, 0.4006
    kl = torch.tensor([[0.5], [0.2]], requires_grad=True)
    out, _grad, _ = _call(r, adv, group, CRDSettings(), kl=kl)
    assert (out.flatten() - torch.tensor([0.05, 0.05])).tolist() == pytest.approx([0.1 * 0.6004 * 0.5,
                                                                                    0.1 * 0.4006 * 0.2], rel=1e-5)
    assert kl.grad.flatten().tolist() == pytest.approx([0.1 * 0.6004 / 2, 0.1 * 0.4006 / 2], rel=1e-5)
    plain, _grad, _ = _call(r, adv, group, CRDSettings(reward_adaptive_kl=False), kl=kl.detach())
    assert (plain.flatten() - 0.05).tolist() == pytest.approx([0.05, 0.02], rel=1e-5)


# ------------------------------------------------------------------------------------------------ the domain
def test_implicit_reward_and_cfg_kl_on_the_tiny_pipeline(tiny_dir):
    """At the first step the old snapshot is the live weights: r_θ = 0. After a change of the live weights, r_θ is
    −mean[(v − u)²/w − (v_old − u)²/w_old] recomputed here by hand from the velocities, and the KL is ‖v − v_ref‖²
    with v_ref the base model at CFG 4.5, its negative the empty prompt as the pipeline encodes it."""
    tr = Trainer(_cfg(tiny_dir), None, log=lambda *_: None)
    dom, policy = tr.domain, tr.domain.policy
    ro = dom.rollout([0, 1], 4, torch.Generator().manual_seed(0), 0)
    idx = torch.arange(len(ro.mask))
    out = dom.log_probs(ro, idx, False)
    assert out.objective_pos[ro.mask].abs().max() == 0
    with torch.no_grad():
        for _n, p in policy._named_trainable():
            p.add_(0.05 * torch.randn_like(p))
    out = dom.log_probs(ro, idx, False)
    assert out.objective_pos.requires_grad and out.objective_neg.requires_grad
    r = dom.rollouts
    p = ro.index_payload(idx)
    from visgen.pipelines.base import Conditioning

    cond = Conditioning(p["cond"], **r._cond_meta)
    k, rows = 1, torch.arange(3)
    x0, eps, sig, t = p["x0"][rows], p["obj_noise"][rows, k], p["obj_sigma"][rows, k], p["obj_timestep"][rows, k]
    x_t = (1 - sig.reshape(-1, 1, 1, 1)) * x0 + sig.reshape(-1, 1, 1, 1) * eps
    u = eps - x0
    with torch.no_grad():
        v = r.adapter.velocity(x_t, t, cond[rows])
        with policy.snapshot_weights("crd_old"):
            v_old = r.adapter.velocity(x_t, t, cond[rows])
        prompts = [r.prompts[key] for key in (ro.keys[g] for g in ro.group_ids[rows].tolist())]
        guided = r.adapter.encode_prompts(prompts, num_images_per_prompt=1, guidance_scale=4.5, **r.sample_kwargs)
        with policy.reference():
            v_ref = r.adapter.velocity(x_t, t, guided)
    w = (v - u).abs().flatten(1).mean(1).clamp(min=1e-5)[:, None, None, None]
    w_old = (v_old - u).abs().flatten(1).mean(1).clamp(min=1e-5)[:, None, None, None]
    r_hand = -((v - u) ** 2 / w - (v_old - u) ** 2 / w_old).flatten(1).mean(1)
    assert torch.allclose(out.objective_pos.detach()[rows, k], r_hand, rtol=1e-4, atol=1e-6)
    assert torch.allclose(out.objective_neg.detach()[rows, k], ((v - v_ref) ** 2).flatten(1).mean(1), rtol=1e-4)
    assert out.nfe == 8 * 3 * 4  # 8 rows x 3 slots x (policy + old + the reference's two CFG branches)
    # the group's rows share each slot's timestep
    for g in ro.group_ids.unique():
        sel = ro.group_ids == g
        assert (p["obj_sigma"][sel] == p["obj_sigma"][sel][0]).all()


def test_two_snapshots_on_their_own_schedules(tiny_dir):
    """Old: d = min(0.999, 0.25 + 0.005·k); sampling: d = 0 before 75 steps (a copy of the live weights), then
    min(0.999, 0.0075·(k − 75)); each applied once per iteration before its rollout; both in checkpoints."""
    from visgen.policy import old_decay

    assert old_decay(0, 0.999, 0.005, 0, 0.25) == 0.25 and old_decay(100, 0.999, 0.005, 0, 0.25) == 0.75
    assert old_decay(74, 0.999, 0.0075, 75, 0.0) == 0.0 and old_decay(95, 0.999, 0.0075, 75) == pytest.approx(0.15)
    tr = Trainer(_cfg(tiny_dir), None, log=lambda *_: None)
    policy = tr.domain.policy
    assert set(policy.snapshots) == {"crd_old"}
    live0 = {n: p.detach().clone() for n, p in policy._named_trainable()}
    with torch.no_grad():
        for _n, p in policy._named_trainable():
            p.add_(torch.randn_like(p))
    for _ in range(10):
        policy.old_policy_step()
    live = {n: p.detach().clone() for n, p in policy._named_trainable()}
    assert policy.sync_old_policy(1)
    d = 0.25 + 0.005 * 10
    for n in live:
        assert torch.allclose(policy.snapshots["crd_old"][0][n], d * live0[n] + (1 - d) * live[n], atol=1e-6)
        assert torch.equal(policy.old[n], live[n])  # the sampling snapshot: a copy before 75 steps
    state = policy.state_dict()
    assert any(k.startswith("snap.crd_old.") for k in state) and any(k.startswith("old.") for k in state)
    assert int(state[policy.OLD_SYNCED]) == 1
    policy.load_state_dict(state)


def test_backward_steps_give_the_same_update_and_a_split_group_is_one_line(tiny_dir):
    def weights(**optim):
        tr = Trainer(_cfg(tiny_dir, optim=optim), None, log=lambda *_: None)
        m = tr.iteration(0)
        assert math.isfinite(m["loss/policy"]) and m["loss/policy"] > 0
        return {n: p.detach().clone() for n, p in tr.domain.policy._named_trainable()}

    whole, steps = weights(), weights(backward_steps=1)
    assert all(torch.allclose(whole[n], steps[n], atol=1e-6) for n in whole)
    with pytest.raises(ConfigError, match="crd centres each group's implicit rewards.*whole groups") as info:
        _cfg(tiny_dir, optim={"micro_batch_size": 3})  # refused by the config's check, before any weight loads
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("objective, message", [
    ({"beta": 0.0}, "beta must be > 0"),
    ({"weight_temp": 1.0}, "only uniform centring"),
    ({"loss_type": "l1"}, "loss_type"),
    ({"old_decay_start": 0.5, "old_decay_max": 0.2}, "old_decay_"),
])
def test_bad_settings_are_one_line(tiny_dir, objective, message):
    with pytest.raises(ConfigError, match=message) as info:
        _cfg(tiny_dir, objective)
    assert "\n" not in str(info.value)


def test_cli_dry_run_exits_2_on_beta_0():
    out = subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", "configs/visgen/shapes_crd.yaml", "--dry-run",
                          "visgen.objective.beta=0"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "beta must be > 0" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ recipes
@pytest.mark.parametrize("name", ["shapes_crd", "sd35_crd"])
def test_recipes_parse_and_run_two_iterations_on_the_tiny_pipeline(name, tiny_dir):
    data = load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml")
    recipe = load_train_config(load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml"))
    choice = recipe.policy_loss_choice()
    assert choice.name == "crd" and choice.settings.beta == 1.0 and choice.settings.kl_beta == 0.1
    assert recipe.optim.minibatches_per_epoch == 1 and recipe.advantage.estimator.name == "batch_std"
    data.update(device="cpu", iterations=2, **QUIET)
    data["rollout"] = {"groups_per_iteration": 2, "group_size": 4}
    data["checkpoint"] = {"every": 0}
    data["advantage"].pop("weights", None)
    data["optim"]["micro_batch_size"] = 0
    reward = {"name": "shapes_soft"} if name.startswith("shapes") else {"name": "jpeg_compressibility"}
    data["visgen"].update(model=str(tiny_dir), dtype="float32", num_inference_steps=4, rewards=[reward],
                          eval=TINY_EVAL, task="shapes")
    data["visgen"]["objective"]["timesteps_per_sample"] = 2
    for key in ("train_prompts", "eval_prompts", "resolution", "max_sequence_length", "rollout_micro_batch"):
        data["visgen"].pop(key, None)
    tr = Trainer(load_train_config(data), None, log=lambda *_: None)
    ms = [tr.iteration(it) for it in range(2)]
    assert all(math.isfinite(m["loss/policy"]) and m["grad_norm"] > 0 for m in ms)


def test_resume_equals_the_uninterrupted_run(tmp_path):
    """Killed in the third iteration and resumed: both snapshots (the sampling copy and ``snap.crd_old``) and their
    step counts come back, so the records and the weights equal the uninterrupted run's."""
    from tests.resume_harness import resume_mismatches

    data = load_yaml(REPO / "configs" / "visgen" / "shapes_crd.yaml")
    data.update(eval={"at_start": False, "every": 0}, rollout={"groups_per_iteration": 2, "group_size": 2})
    data["optim"]["backward_steps"] = 0
    data["visgen"].update(num_threads=1, num_inference_steps=4,
                          eval={"max_prompts": 1, "samples_per_prompt": 1, "grid_prompts": 0})
    data["visgen"]["objective"].update(timesteps_per_sample=2, old_decay_start=0.5, sampling_decay_flat=1)
    bad = resume_mismatches(data, tmp_path)
    assert not bad, "\n".join(bad[:20])
