"""Issue 63: online Diffusion-DPO (yifan123/flow_grpo ``scripts/train_sd3_dpo.py`` and ``flow_grpo/stat_tracking.py``,
verl-omni ``DPOLoss``) — the pair of each group's best and worst sample, the loss and its gradient worked out by hand
from −log σ(−β/2·[(err_w − err_ref,w) − (err_l − err_ref,l)]), the logit-normal timesteps and the shared noise, the
first step (policy = reference: log 2), a split of the timesteps or of the groups over calls = the same gradient,
one-line config errors (exit 2), and the shapes and SD3.5-M recipes on the tiny pipeline."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared_rl.config import ConfigError, LossConfig, load_train_config, load_yaml
from shared_rl.domain import StepLogProbs
from shared_rl.losses import DPOSettings, Normalizer, aggregate, dpo_loss, dpo_pairs
from shared_rl.trainer import Trainer
from visgen.objectives import DPOSettings as DPOObjSettings, logit_normal_sigmas

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
QUIET = {"logging": {"progress": False}, "eval": {"at_start": False}}
TINY_EVAL = {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}


def _cfg(tiny_dir, objective=None, **over):
    optim = {"lr": 1e-2, "minibatches_per_epoch": 1, "micro_batch_size": 0, **over.pop("optim", {})}
    return load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "advantage": {"estimator": "grpo", "weights": {"shapes_strict": 0.0}},
        "loss": {"kl_coef": 0.0}, "optim": optim, **QUIET,
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "objective": objective or {"name": "dpo"}, "eval": TINY_EVAL, **over},
    })


def _loss(err, ref, adv, group, beta, mask=None):
    mask = torch.ones_like(err, dtype=torch.bool) if mask is None else mask
    terms = StepLogProbs(logp=torch.zeros_like(err), objective_pos=err, objective_neg=ref, group=group)
    return dpo_loss(torch.zeros_like(err), torch.zeros_like(err), adv, mask, LossConfig(), DPOSettings(beta),
                    terms=terms)


# ------------------------------------------------------------------------------------------------ pairs and loss
def test_pairs_are_each_groups_best_and_worst_and_a_tie_trains_its_first_two():
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0, 0.0, 0.0, 3.0])
    group = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    chosen, rejected = dpo_pairs(adv, group)
    # group 0: best row 2, worst row 1; group 1 all equal: the reference's max_idx 1, min_idx 0; group 2 alone: none
    assert chosen.tolist() == [2, 4] and rejected.tolist() == [1, 3]


def test_rollout_selection_keeps_each_groups_best_and_worst_leaf():
    from visgen.objectives import DPOObjective

    obj = DPOObjective(DPOObjSettings())
    scores = torch.tensor([0.2, 0.9, float("nan"), 0.1, 0.5, 0.5, 0.5])  # row 2: an inner node / a failed reward
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    assert obj.select_rows(scores, groups).tolist() == [False, True, False, True, True, True, False]


def test_loss_and_gradient_hand_computed():
    """β 2, group 0 (rows 0-2): chosen row 2, rejected row 1; inside = −1·((0.2 − 0.4) − (0.5 − 0.4)) = 0.3,
    L = log(1 + e^−0.3) = 0.554355; ∂L/∂err_w = β/2·σ(−0.3) = 0.425558, ∂L/∂err_l = −0.425558, row 0 none.
    Group 1 (rows 3-5): chosen 5, rejected 3; inside = −1·((0.1 − 0.1) − (0.6 − 0.2)) = 0.4,
    L = log(1 + e^−0.4) = 0.513015. token-mean over the call = the mean over pairs."""
    err = torch.tensor([[0.3], [0.5], [0.2], [0.6], [0.9], [0.1]], requires_grad=True)
    ref = torch.tensor([[0.3], [0.4], [0.4], [0.2], [0.9], [0.1]])
    adv = torch.tensor([0.5, -1.0, 2.0, -0.7, 0.1, 0.6])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    per_step, st = _loss(err, ref, adv, group, beta=2.0)
    mask = torch.ones(6, 1, dtype=torch.bool)
    total = aggregate(per_step, mask, "token-mean", Normalizer.from_mask(mask))
    l0, l1 = math.log1p(math.exp(-0.3)), math.log1p(math.exp(-0.4))
    assert l0 == pytest.approx(0.554355, abs=1e-6) and l1 == pytest.approx(0.513015, abs=1e-6)
    assert total.item() == pytest.approx((l0 + l1) / 2, rel=1e-6)
    total.backward()
    s0, s1 = 1 / (1 + math.exp(0.3)), 1 / (1 + math.exp(0.4))  # σ(−inside)
    expected = [0.0, -s0 / 2, s0 / 2, -s1 / 2, 0.0, s1 / 2]  # β/2·σ(−inside), halved by the mean over 2 pairs
    assert err.grad.flatten().tolist() == pytest.approx(expected, rel=1e-5)
    assert st["ratio"].eq(1).all()
    assert st["clipped"].flatten().tolist() == [0, 1, 1, 1, 0, 1]  # implicit accuracy: both pairs ordered (inside > 0)


def test_reference_term_carries_no_gradient_and_the_policy_equal_to_it_gives_log_2():
    err = torch.tensor([[0.3, 0.2], [0.5, 0.1]], requires_grad=True)
    ref = err.detach().clone().requires_grad_(True)
    per_step, _ = _loss(err, ref, torch.tensor([1.0, -1.0]), torch.tensor([0, 0]), beta=100.0)
    mask = torch.ones(2, 2, dtype=torch.bool)
    total = aggregate(per_step, mask, "token-mean", Normalizer.from_mask(mask))
    assert total.item() == pytest.approx(math.log(2), rel=1e-6)
    total.backward()
    assert ref.grad is None or (ref.grad == 0).all()
    # at equality σ(0) = 1/2: ∂L/∂err_w = β/2·1/2 = 25 per slot, −25 for err_l, each halved by the mean over 2 slots
    assert err.grad.flatten().tolist() == pytest.approx([12.5, 12.5, -12.5, -12.5], rel=1e-6)


def test_groups_split_over_calls_and_timesteps_split_give_the_same_gradient():
    """A minibatch's calls, each holding whole groups and normalised by the minibatch's global counts, sum to the
    one-call gradient; so do the timestep columns taken one at a time (optim.backward_steps)."""
    g = torch.Generator().manual_seed(0)
    err0 = torch.rand(8, 3, generator=g)
    ref = torch.rand(8, 3, generator=g)
    adv = torch.randn(8, generator=g)
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(8, 3, dtype=torch.bool)
    norm = Normalizer.from_mask(mask)

    def grad(parts):
        err = err0.clone().requires_grad_(True)
        for rows, cols in parts:
            m = torch.zeros_like(mask)
            m[rows[:, None], cols[None, :]] = True
            e = err[rows]
            per_step, _ = _loss(e, ref[rows], adv[rows], group[rows], 50.0, m[rows])
            aggregate(per_step, m[rows], "token-mean", norm).backward()
        return err.grad

    every, cols = torch.arange(8), torch.arange(3)
    one = grad([(every, cols)])
    by_group = grad([(torch.arange(4), cols), (torch.arange(4, 8), cols)])
    by_step = grad([(every, torch.tensor([k])) for k in range(3)])
    assert torch.allclose(one, by_group, atol=1e-7) and torch.allclose(one, by_step, atol=1e-7)
    assert (one.abs().sum(1) > 0).sum() == 4  # two pairs train, the other four rows carry no gradient


# ------------------------------------------------------------------------------------------------ timesteps, noise
def test_logit_normal_timesteps_follow_the_reference_density():
    """u = sigmoid(N(0, 1)), index = int(1000 u), s = (1000 − index)/1000, sigma = 3s / (1 + 2s), by hand from the
    same normal draws."""
    z = torch.randn(5, generator=torch.Generator().manual_seed(7))
    got = logit_normal_sigmas(5, 0.0, 1.0, 3.0, 1000, torch.Generator().manual_seed(7))
    for zi, si in zip(z.tolist(), got.tolist()):
        u = 1 / (1 + math.exp(-zi))
        s = (1000 - int(u * 1000)) / 1000
        assert si == pytest.approx(3 * s / (1 + 2 * s), rel=1e-6)
    assert DPOObjSettings().beta == 100.0 and DPOObjSettings().timestep_fraction == 0.99


def test_domain_pairs_share_noise_and_timestep_and_the_first_step_is_log_2(tiny_dir):
    tr = Trainer(_cfg(tiny_dir), None, log=lambda *_: None)
    ro = tr.domain.rollout([0, 1], 4, torch.Generator().manual_seed(0), 0)
    p, g = ro.payload, ro.group_ids
    K = int(4 * 0.99)
    assert p["obj_sigma"].shape == (8, K) and ro.mask.sum() == 2 * 2 * K  # 2 groups x 2 rows x K slots
    for grp in (0, 1):
        rows = torch.nonzero(g == grp).flatten()
        assert (p["obj_sigma"][rows] == p["obj_sigma"][rows[0]]).all()
        assert all(torch.equal(p["obj_noise"][r], p["obj_noise"][rows[0]]) for r in rows.tolist())
    assert not torch.equal(p["obj_sigma"][g == 0][0], p["obj_sigma"][g == 1][0])
    assert torch.allclose(p["obj_timestep"], p["obj_sigma"] * 1000)  # SD3: the model timestep is sigma x 1000
    # only each group's best and worst (by the trained reward, the checker's score here) train: the others are never forwarded
    r = ro.rewards["shapes"]
    for grp in (0, 1):
        rows = torch.nonzero(g == grp).flatten()
        trained = rows[ro.mask[rows].any(1)]
        assert sorted(trained.tolist()) == sorted([int(rows[r[rows].argmax()]), int(rows[r[rows].argmin()])])
    m = tr.iteration(0)
    assert m["loss/policy"] == pytest.approx(math.log(2), abs=1e-6)  # LoRA starts at the base: policy = reference
    assert m["nfe/train"] == 2 * 2 * K * 2 and m["grad_norm"] > 0  # 2 groups x 2 rows x K slots x (policy + ref)


def test_a_timestep_split_trains_the_same_update(tiny_dir):
    def weights(**optim):
        tr = Trainer(_cfg(tiny_dir, optim=optim), None, log=lambda *_: None)
        tr.iteration(0)
        return {n: p.detach().clone() for n, p in tr.domain.policy._named_trainable()}

    whole, split = weights(backward_steps=0), weights(backward_steps=1)
    assert all(torch.allclose(whole[n], split[n], atol=1e-6) for n in whole)


@pytest.mark.parametrize("over, message", [
    ({"name": "dpo", "beta": 0.0}, "beta must be > 0"),
    ({"name": "dpo", "beta": -5.0}, "beta must be > 0"),
    ({"name": "dpo", "logit_std": 0.0}, "logit_std"),
])
def test_bad_settings_are_one_line_config_errors(tiny_dir, over, message):
    with pytest.raises(ConfigError, match=message) as info:
        _cfg(tiny_dir, over)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="whole groups"):
        _cfg(tiny_dir, optim={"micro_batch_size": 2})
    with pytest.raises(ConfigError, match="contradicts"):
        load_train_config({**load_yaml(REPO / "configs/visgen/shapes_dpo.yaml"), "loss": {"policy_loss": "clipped"}})


def test_cli_dry_run_exits_2_on_beta_0():
    out = subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", "configs/visgen/shapes_dpo.yaml",
                          "--dry-run", "visgen.objective.beta=0"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "beta must be > 0" in out.stderr and len(out.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ recipes
def _tiny_run(data, tiny_dir, reward):
    data.update(device="cpu", iterations=2, **QUIET)
    data["rollout"] = {"groups_per_iteration": 2, "group_size": 4}
    data["checkpoint"] = {"every": 0}
    data["advantage"].pop("weights", None)
    data["visgen"].update(model=str(tiny_dir), dtype="float32", num_inference_steps=4, rewards=[reward],
                          eval=TINY_EVAL, task="shapes")
    for key in ("train_prompts", "eval_prompts", "resolution", "max_sequence_length", "rollout_micro_batch"):
        data["visgen"].pop(key, None)
    data["rollout"].pop("groups_per_call", None)
    return Trainer(load_train_config(data), None, log=lambda *_: None)


@pytest.mark.parametrize("name", ["shapes_dpo", "sd35_dpo"])
def test_recipes_parse_and_run_two_iterations_on_the_tiny_pipeline(name, tiny_dir):
    data = load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml")
    recipe = load_train_config(load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml"))  # parses as shipped
    s = recipe.domain_config.training_objective().settings
    assert recipe.policy_loss_choice().name == "dpo" and s.beta == 100.0 and s.timestep_shift == 3.0
    assert recipe.domain_config.rollout_method().name == "flow_grpo" and recipe.optim.micro_batch_size == 0
    tr = _tiny_run(data, tiny_dir, {"name": "shapes_soft"} if name.startswith("shapes") else
                   {"name": "jpeg_compressibility"})
    ms = [tr.iteration(it) for it in range(2)]
    assert ms[0]["loss/policy"] == pytest.approx(math.log(2), abs=1e-5) and ms[1]["loss/policy"] != ms[0]["loss/policy"]
    assert all(math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 for m in ms)
