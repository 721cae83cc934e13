"""Issue 37: every visgen method as its authors wrote it. Small fixed inputs whose expected values are worked out by
hand (or derived here from the reference's formula, never from its code) — DiffusionNFT (old-policy sampling and
schedule, adv_mode, timestep coverage, fresh noise per inner epoch), AWM (the PPO ratio and clip on its likelihood,
the released weightings, advantage_max), DGPO (group preference weights, clipping), BranchGRPO (split-step fusion,
the z-score cut-off) and E-GRPO (multi-granularity tails and rewards). docs/methods/conventions.md lists the
references and commits."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from shared_rl.advantages import ESTIMATORS, AdvantageInputs, depth_zscore, tree_values
from shared_rl.config import AdvantageConfig, ConfigError, LossConfig, load_train_config
from shared_rl.domain import StepLogProbs
from shared_rl.losses import AWMSettings, DGPOSettings, NFTSettings, awm_loss, dgpo_loss, nft_loss
from shared_rl.trainer import Trainer
from visgen.methods.branch import edge_logp_logits
from visgen.methods.egrpo import coarse_tail
from visgen.objectives import AWMObjective, AWMSettings as AWMObjSettings, NFTObjective, NFTSettings as NFTObjSettings
from visgen.objectives import awm_log_likelihood, stratified_steps
from visgen.policy import old_decay

QUIET = {"logging": {"progress": False}, "eval": {"at_start": False}}
TINY_EVAL = {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}


def _visgen_cfg(tiny_dir, objective, **over):
    return load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "advantage": {"estimator": "grpo", "weights": {"shapes_strict": 0.0}},
        "loss": {"kl_coef": over.pop("kl_coef", 0.0)}, "optim": {"lr": 1e-2, **over.pop("optim", {})}, **QUIET,
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "objective": objective, "eval": TINY_EVAL, **over},
    })


# ------------------------------------------------------------------------------------------------ DiffusionNFT
def test_nft_old_policy_decay_is_the_reference_schedule():
    # return_decay type 1 (the default configs): flat 0, uprate 0.001, uphold 0.5
    assert [old_decay(k, 0.5, 0.001) for k in (0, 1, 100, 499, 500, 5000)] == pytest.approx(
        [0.0, 0.001, 0.1, 0.499, 0.5, 0.5])
    # type 2 (the ocr config): flat 75, uprate 0.0075, uphold 0.999
    assert [old_decay(k, 0.999, 0.0075, 75) for k in (0, 74, 75, 100, 300)] == pytest.approx(
        [0.0, 0.0, 0.0, 0.1875, 0.999])
    assert old_decay(7, 0.3, None) == 0.3  # AWM's 'constant' kl_ema_decay
    s = NFTObjSettings()
    assert (s.old_decay_max, s.old_decay_ramp, s.old_decay_flat, s.old_update, s.sample_with) == \
        (0.5, 0.001, 0, "iteration", "old")


def test_nft_adv_mode_reshapes_the_advantage_and_keeps_both_branches():
    zeros = torch.zeros(3, 1)
    terms = StepLogProbs(logp=zeros, objective_pos=torch.ones(3, 1), objective_neg=torch.full((3, 1), 2.0))
    adv = torch.tensor([3.0, -2.0, 0.5])
    # A_max 5: r = a/10 + 1/2 of the reshaped a; P = 1, N = 2 -> L = 5 * (r + 2 (1 - r)) = 5 (2 - r)
    expected_r = {"all": [0.8, 0.3, 0.55], "positive_only": [0.8, 0.5, 0.55], "negative_only": [0.5, 0.3, 0.5],
                  "one_only": [0.6, 0.5, 0.6], "binary": [0.6, 0.4, 0.6]}
    for mode, r in expected_r.items():
        loss, _ = nft_loss(zeros, zeros, adv, torch.ones(3, 1), LossConfig(), NFTSettings(5.0, mode), terms=terms)
        assert loss.flatten().tolist() == pytest.approx([5 * (2 - x) for x in r]), mode


def test_nft_trains_9_of_10_grid_timesteps_and_redraws_them_each_inner_epoch():
    obj = NFTObjective(NFTObjSettings())
    assert obj.num_slots(10) == 9 and obj.num_slots(4) == 3  # int(T * 0.99)
    sigmas = torch.linspace(1.0, 0.0, 11)
    latents = torch.randn(3, 2, 2)
    mask, payload = obj.training_slots(torch.tensor([True, True, False]), latents, 10, sigmas, sigmas[:10] * 1000,
                                       torch.Generator().manual_seed(0))
    assert mask.sum(1).tolist() == [9, 9, 0] and payload["obj_sigma"].shape == (3, 9)
    for row in payload["obj_sigma"]:  # a permutation of the grid: 9 distinct grid sigmas
        assert len(set(row.tolist())) == 9 and set(row.tolist()) <= set(sigmas[:10].tolist())
    assert obj.redraw_slots(payload, 0) is payload  # epoch 0 trains the rollout's own draw
    e1, e2 = obj.redraw_slots(payload, 1), obj.redraw_slots(payload, 2)
    assert not torch.equal(e1["obj_noise"], payload["obj_noise"]) and not torch.equal(e1["obj_noise"], e2["obj_noise"])
    assert torch.equal(e1["obj_timestep"], e1["obj_sigma"] * 1000)
    # per-row seeds: a micro-batch's redraw equals its rows of the whole batch's
    sub = {k: (v[1:] if torch.is_tensor(v) and v.shape[:1] == (3,) else v) for k, v in payload.items()}
    e1_sub = obj.redraw_slots(sub, 1)
    assert torch.equal(e1_sub["obj_noise"], e1["obj_noise"][1:]) and torch.equal(e1_sub["obj_sigma"], e1["obj_sigma"][1:])


def test_nft_rollouts_are_sampled_by_the_old_policy(tiny_dir):
    dom = Trainer(_visgen_cfg(tiny_dir, {"name": "nft", "timesteps_per_sample": 2}), None, log=lambda *_: None).domain
    with torch.no_grad():  # make the old copy differ from the live adapter
        for name, t in dom.policy.old.items():
            t.add_(0.3 * torch.randn(t.shape, generator=torch.Generator().manual_seed(len(name))))
    from_old = dom.rollout([0, 1], 4, torch.Generator().manual_seed(7), 0).payload["x0"]
    dom.rollouts.objective.settings.sample_with = "live"
    live = dom.rollout([0, 1], 4, torch.Generator().manual_seed(7), 0).payload["x0"]
    with dom.policy.old_weights():  # the live sampler with the old weights swapped in: the same images
        swapped = dom.rollout([0, 1], 4, torch.Generator().manual_seed(7), 0).payload["x0"]
    assert torch.equal(from_old, swapped) and not torch.allclose(from_old, live, atol=1e-4)


# ------------------------------------------------------------------------------------------------ AWM
def test_awm_issue_case_clips_off_policy():
    """x0 = 0, eps = 1, t = 0.5, v_old = 0.5, v = 0.8, A = 1, clip 0.2 (uniform weighting): log p = -(v - 1)^2, so
    log p = -0.04, log p_old = -0.25, ratio e^0.21 = 1.234 > 1.2: clipped, gradient 0 (grove before: -0.4)."""
    x0, eps, t = torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([0.5])
    v = torch.tensor([[0.8]], requires_grad=True)
    logp = awm_log_likelihood(x0, eps, v, t, "Uniform")[:, None]
    logp_old = awm_log_likelihood(x0, eps, torch.tensor([[0.5]]), t, "Uniform")[:, None]
    assert logp.item() == pytest.approx(-0.04) and logp_old.item() == pytest.approx(-0.25)
    terms = StepLogProbs(logp=logp, objective_pos=torch.zeros(1, 1))
    settings = AWMSettings(clip_range=0.2, advantage_max=None, ema_beta=0.0)
    loss, st = awm_loss(logp, logp_old, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), LossConfig(),
                        settings, terms=terms)
    assert st["ratio"].item() == pytest.approx(math.exp(0.21), rel=1e-6) and st["clipped"].item() == 1.0
    loss.sum().backward()
    assert v.grad.item() == 0.0
    # the released clip 1 keeps it: d/dv[-A rho] = -rho * d log p/dv = -e^0.21 * (-2 (0.8 - 1))
    v.grad = None
    logp = awm_log_likelihood(x0, eps, v, t, "Uniform")[:, None]
    loss, st = awm_loss(logp, logp_old, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), LossConfig(),
                        AWMSettings(clip_range=1.0, advantage_max=None, ema_beta=0.0), terms=terms)
    loss.sum().backward()
    assert st["clipped"].item() == 0.0 and v.grad.item() == pytest.approx(-math.exp(0.21) * 0.4, rel=1e-6)


def test_awm_released_weightings_and_advantage_max():
    x0, eps, v = torch.zeros(2, 1), torch.ones(2, 1), torch.tensor([[0.8], [0.5]])
    t = torch.tensor([0.5, 0.25])
    e = [0.04, 0.25]  # ||v - (eps - x0)||^2 per row
    expected = {
        "Uniform": [-x for x in e],
        "t": [-x * s for x, s in zip(e, (0.5, 0.25))],
        "t**2": [-x * s * s for x, s in zip(e, (0.5, 0.25))],
        "huber": [-(math.sqrt(x + 1e-10) - 1e-5) * s for x, s in zip(e, (0.5, 0.25))],
        "ghuber": [-((x + 1e-10) ** 0.25 - 1e-10 ** 0.25) * s / 0.25 for x, s in zip(e, (0.5, 0.25))],
    }
    for weighting, want in expected.items():
        got = awm_log_likelihood(x0, eps, v, t, weighting, 0.25)
        assert got.tolist() == pytest.approx(want, rel=1e-6), weighting
    s = AWMObjSettings()
    assert (s.weighting, s.ghuber_power, s.advantage_max, s.adv_clip_max, s.clip_range, s.ema_beta,
            s.ema_decay_max, s.timesteps_per_sample, s.time_type) == \
        ("ghuber", 0.25, 1.0, 5.0, 1.0, 1.0, 0.3, 6, "discrete_wo_init")
    # advantage_max: A clipped to +-5, then x 1/5; at ratio 1 the surrogate is -A'
    ones = torch.ones(3, 1, dtype=torch.bool)
    terms = StepLogProbs(logp=torch.zeros(3, 1), objective_pos=torch.zeros(3, 1))
    loss, _ = awm_loss(torch.zeros(3, 1), torch.zeros(3, 1), torch.tensor([5.0, 10.0, -2.5]), ones, LossConfig(),
                       AWMSettings(), terms=terms)
    assert loss.flatten().tolist() == pytest.approx([-1.0, -1.0, 0.5])


def test_awm_discrete_wo_init_timesteps_one_per_stratum():
    # T = 14, fraction 0.9: hi = 12; linspace(1, 12, 7) truncated = [1, 2, 4, 6, 8, 10, 12]
    idx = stratified_steps(14, 6, 0.9, "discrete_wo_init", 500, torch.Generator().manual_seed(0))
    lower, upper = torch.tensor([1, 2, 4, 6, 8, 10]), torch.tensor([2, 4, 6, 8, 10, 12])
    assert ((idx >= lower) & (idx < upper)).all() and set(idx[:, 1].tolist()) == {2, 3}
    first = stratified_steps(14, 6, 0.9, "discrete", 500, torch.Generator().manual_seed(0))
    assert set(first[:, 0].tolist()) == {0, 1}  # linspace(0, 12, 7) = [0, 2, ...]: step 0 may train
    assert (stratified_steps(14, 3, 0.9, "discrete_with_init", 10, None)[:, 0] == 0).all()


def test_awm_trains_its_ratio_from_the_second_optimizer_step_on_a_batch(tiny_dir):
    cfg = _visgen_cfg(tiny_dir, {"name": "awm", "timesteps_per_sample": 2, "clip_range": 0.2},
                      optim={"minibatches_per_epoch": 2})
    tr = Trainer(cfg, None, log=lambda *_: None)
    ro = tr.domain.rollout([0, 1], 4, torch.Generator().manual_seed(0), 0)
    assert torch.equal(ro.logp_deferred, ro.mask) and ro.logp_old[ro.mask].isnan().all()
    m = tr.iteration(0)
    # the second minibatch sees weights the first step moved: its ratios leave 1 (behaviour log p taken up front)
    assert m["ratio/max"] > 1.0 + 1e-6 and math.isfinite(m["loss/policy"]) and m["grad_norm"] > 0
    # NFE: the up-front behaviour log p (policy only, no EMA copy) + training (policy + EMA copy), 8 images x 2 slots
    assert m["nfe/train"] == 8 * 2 + 8 * 2 * 2


# ------------------------------------------------------------------------------------------------ DGPO
def test_dgpo_group_preference_weights_hand_computed():
    """Two groups of two, one timestep, beta 1: S_g = 1/2 sum A_i (dsm_i - dsm_ref_i), w_g = sigmoid(S_g),
    L_i = w_g A_i dsm_i; the gradient equals that of -log sigmoid(-S_g) with dsm in S, divided by beta/G."""
    dsm = torch.tensor([[0.5], [0.2], [0.3], [0.3]], requires_grad=True)
    ref = torch.tensor([[0.4], [0.4], [0.3], [0.1]])
    adv, group = torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.tensor([0, 0, 1, 1])
    terms = StepLogProbs(logp=-dsm, objective_pos=dsm, objective_neg=ref)
    terms.group = group
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, st = dgpo_loss(-dsm, -dsm.detach(), adv, mask, LossConfig(), DGPOSettings(beta_dpo=1.0), terms=terms)
    s0, s1 = 0.5 * (1 * 0.1 + (-1) * (-0.2)), 0.5 * (0.5 * 0.0 + (-0.5) * 0.2)  # 0.15, -0.05
    w0, w1 = 1 / (1 + math.exp(-s0)), 1 / (1 + math.exp(-s1))
    assert loss.flatten().tolist() == pytest.approx([w0 * 0.5, -w0 * 0.2, w1 * 0.5 * 0.3, -w1 * 0.5 * 0.3], rel=1e-6)
    assert (st["ratio"] == 1).all() and (st["clipped"] == 0).all()
    loss.sum().backward()
    grad = dsm.grad.clone()
    assert grad.flatten().tolist() == pytest.approx([w0, -w0, 0.5 * w1, -0.5 * w1], rel=1e-6)
    # the DPO objective itself: -log sigmoid(-S_g) summed over groups, S with grad through dsm
    d2 = dsm.detach().clone().requires_grad_(True)
    s = torch.stack([(adv[:2] * (d2[:2, 0] - ref[:2, 0])).sum() / 2, (adv[2:] * (d2[2:, 0] - ref[2:, 0])).sum() / 2])
    (-torch.nn.functional.logsigmoid(-s)).sum().backward()
    assert torch.allclose(d2.grad, grad / 2, atol=1e-7)  # beta / G = 1 / 2


def test_dgpo_clip_detaches_the_denoising_loss_outside_the_range():
    dsm = torch.tensor([[0.5], [0.2]], requires_grad=True)
    old = torch.tensor([[0.6], [0.2]])  # row 0 improved: ratio exp(0.6 - 0.5) = 1.105 > 1.01 with A > 0
    terms = StepLogProbs(logp=-dsm, objective_pos=dsm, objective_neg=torch.tensor([[0.4], [0.4]]))
    terms.group = torch.tensor([0, 0])
    loss, st = dgpo_loss(-dsm, -old, torch.tensor([1.0, -1.0]), torch.ones(2, 1, dtype=torch.bool), LossConfig(),
                         DGPOSettings(beta_dpo=1.0, clip_range=0.01), terms=terms)
    assert st["clipped"].flatten().tolist() == [1.0, 0.0]
    assert st["ratio"][0].item() == pytest.approx(math.exp(0.1), rel=1e-6)
    loss.sum().backward()
    assert dsm.grad[0].item() == 0.0 and dsm.grad[1].item() != 0.0


def test_dgpo_trains_on_the_visgen_domain(tiny_dir):
    obj = {"name": "dgpo", "timesteps_per_sample": 2, "trunc_steps": 2, "old_policy": "iteration_start"}
    tr = Trainer(_visgen_cfg(tiny_dir, obj, kl_coef=0.02), None, log=lambda *_: None)
    ro = tr.domain.rollout([0, 1], 4, torch.Generator().manual_seed(0), 0)
    p = ro.payload
    # two timesteps of grid steps 0..2, the same for every sample; one noise per group and timestep
    assert (p["obj_sigma"] == p["obj_sigma"][:1]).all() and p["obj_sigma"][0, 0] != p["obj_sigma"][0, 1]
    g = ro.group_ids
    assert torch.equal(p["obj_noise"][g == 0][0], p["obj_noise"][g == 0][3])
    assert not torch.equal(p["obj_noise"][g == 0][0], p["obj_noise"][g == 1][0])
    assert torch.equal(ro.logp_deferred, ro.mask)
    m = tr.iteration(0)
    assert m["nfe/train"] == 8 * 2 * 2  # policy + reference per sample and timestep (the KL shares the reference)
    assert m["grad_norm"] > 0 and math.isfinite(m["loss/policy"]) and m["loss/kl"] >= 0
    with pytest.raises(ConfigError, match="must hold whole groups"):
        _visgen_cfg(tiny_dir, obj, optim={"minibatches_per_epoch": 2})


def test_dgpo_ema_old_policy_is_the_reference_schedule_and_the_clip_acts(tiny_dir):
    """The reference's ema_ref: after optimizer step k (k = 0, 1, ... steps before it) θ_old ← d·θ_old + (1 − d)·θ
    with d = min(0.3, 0.001·k), computed here by hand from the weights after each step. The clip ratio's old policy
    is that copy (one more forward per timestep): ratio exactly 1 at the first two optimizer steps (the copy starts
    at the weights, and the first update copies them, d = 0), off 1 once the copy lags, where a tight clip acts."""
    obj = {"name": "dgpo", "timesteps_per_sample": 2, "trunc_steps": 2, "clip_range": 1e-9}
    tr = Trainer(_visgen_cfg(tiny_dir, obj), None, log=lambda *_: None)
    policy = tr.domain.policy
    names = [n for n, _ in policy._named_trainable()]
    weights = lambda: {n: p.detach().clone() for n, p in policy._named_trainable()}  # noqa: E731
    expected, metrics = weights(), []
    for it in range(5):
        metrics.append(tr.iteration(it))
        d = min(0.3, 0.001 * it)
        now = weights()
        expected = {n: d * expected[n] + (1 - d) * now[n] for n in names}
        for n in names:
            assert torch.allclose(policy.old[n], expected[n], rtol=1e-6, atol=1e-8), (it, n)
    assert metrics[0]["ratio/mean"] == 1.0 and metrics[1]["ratio/mean"] == 1.0
    # from the third step the copy lags by d·(its last step): a log-prob shift of ~1e-8 at d = 0.001, which float32
    # resolves on some CPUs and rounds away on others (session 30's Xeon), so the clip must act by the fifth (d = 0.003)
    assert any(m["ratio/mean"] != 1.0 and m["clip_frac"] > 0 for m in metrics[2:]), [m["ratio/mean"] for m in metrics]
    assert metrics[0]["clip_frac"] == 0.0
    assert metrics[0]["nfe/train"] == 8 * 2 * 3  # policy + reference + the EMA copy per sample and timestep
    s = tr.cfg.domain_config.training_objective().settings
    assert (s.old_policy, s.old_decay_max, s.old_decay_ramp, s.train_cfg) == ("ema", 0.3, 0.001, False)


def test_dgpo_trains_on_the_conditional_branch_unless_train_cfg(tiny_dir):
    """Rolled out with CFG 3, DGPO's training forwards are the conditional branch alone (the reference's
    predict_v(cfg=False)): one forward per velocity; ``train_cfg: true`` trains on the CFG-combined velocity (two)."""
    obj = {"name": "dgpo", "timesteps_per_sample": 2, "trunc_steps": 2, "old_policy": "iteration_start"}
    nfe = {}
    for train_cfg in (False, True):
        tr = Trainer(_visgen_cfg(tiny_dir, {**obj, "train_cfg": train_cfg}, guidance_scale=3.0), None,
                     log=lambda *_: None)
        nfe[train_cfg] = tr.iteration(0)["nfe/train"]
    assert nfe[False] == 8 * 2 * 2 and nfe[True] == 2 * nfe[False]


# ------------------------------------------------------------------------------------------------ BranchGRPO
def test_branch_fusion_weights_siblings_by_their_split_step_only():
    # root 0 -> children 1, 2 (leaves); the edges hold the split step and one more step
    forest = SimpleNamespace(logp=torch.tensor([[0.0, 0.0], [-1.0, -5.0], [-3.0, 0.0]]),
                             sde=torch.tensor([[False, False], [True, True], [True, True]]))
    logits = edge_logp_logits(forest, 1.0)
    assert logits.tolist() == [0.0, -1.0, -3.0]  # not the edges' sums (-6, -3)
    v = tree_values(torch.tensor([-1, 0, 0]), torch.tensor([float("nan"), 1.0, 0.0]), logits)
    assert v[0].item() == pytest.approx(1 / (1 + math.exp(-2)), rel=1e-6)  # softmax(-1, -3) . (1, 0)


def test_branch_depth_zscore_cuts_off_a_near_tie():
    parent = torch.tensor([-1, 0, 0])
    tie = depth_zscore(parent, torch.tensor([float("nan"), 0.5, 0.5 + 7e-7]))  # std 4.9e-7 < 1e-6: a tie
    assert tie.tolist() == [0.0, 0.0, 0.0]
    r = torch.tensor([float("nan"), 0.5, 0.5 + 3e-6])
    apart = depth_zscore(parent, r)  # std 2.1e-6: z-scored
    d = (r[2] - r[1]).item()  # the float32 gap (about 3e-6)
    std = d / math.sqrt(2)
    assert apart[1:].tolist() == pytest.approx([-d / 2 / (std + 1e-6), d / 2 / (std + 1e-6)], rel=1e-5)


# ------------------------------------------------------------------------------------------------ E-GRPO
def test_egrpo_coarse_tail_follows_the_reference_schedule():
    # sigma[:e+1] + sigma[e+1::g]; the last executed step's x0-prediction is the image (a jump to sigma 0)
    assert coarse_tail(1, 10, 2) == [1, 2, 4, 6, 8, 10]
    assert coarse_tail(2, 10, 2) == [2, 3, 5, 7, 10]
    assert coarse_tail(3, 10, 1) == list(range(3, 11))
    assert coarse_tail(9, 10, 2) == [9, 10]


def test_egrpo_advantage_sums_the_granularities_z_scores():
    # one consolidated step's group of 3 (a one-level tree): r at stride 1 and 2
    parent = torch.tensor([-1, 0, 0, 0])
    nan = float("nan")
    rewards = {"r": torch.tensor([nan, 1.0, 2.0, 3.0]), "r@g2": torch.tensor([nan, 0.0, 0.0, 3.0])}
    cfg = AdvantageConfig(multi_reward="normalize_then_sum", clip=None)
    out = ESTIMATORS["depth_zscore"](AdvantageInputs(rewards, torch.zeros(4, dtype=torch.long), {}, parent), cfg)
    z1 = [-1.0, 0.0, 1.0]  # mean 2, unbiased std 1
    z2 = [-1 / math.sqrt(3), -1 / math.sqrt(3), 2 / math.sqrt(3)]  # mean 1, unbiased std sqrt(3)
    assert out.advantages[1:].tolist() == pytest.approx([a + b for a, b in zip(z1, z2)], rel=1e-5)


def test_egrpo_rollout_scores_each_member_at_both_granularities(tiny_dir):
    cfg = load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1, "rollout": {"groups_per_iteration": 2, "group_size": 3},
        "advantage": {"estimator": "depth_zscore", "multi_reward": "normalize_then_sum",
                      "weights": {"shapes": 1.0, "shapes_strict": 0.0}},
        "optim": {"lr": 1e-2}, **QUIET,
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 6, "lora": {"rank": 4, "alpha": 8},
                   "method": {"name": "egrpo", "schedule": [[0, 1], [2, 2]]}, "eval": TINY_EVAL},
    })
    assert cfg.domain_config.reward_names(cfg) == ["shapes", "shapes_strict", "shapes@g2"]
    tr = Trainer(cfg, None, log=lambda *_: None)
    ro = tr.domain.rollout([0, 1], 3, torch.Generator().manual_seed(0), 0)
    leaf = torch.isfinite(ro.rewards["shapes"])
    assert set(ro.rewards) == {"shapes", "shapes_strict", "shapes@g2"}  # only the trained output twice
    assert torch.isfinite(ro.rewards["shapes@g2"][leaf]).all() and not torch.isfinite(ro.rewards["shapes@g2"][~leaf]).any()
    # NFE per prompt: anchor 3 (steps 0..2), members' tails to the image at stride 1: 3 x 5 and 3 x 2 (after the
    # shared SDE step), at stride 2: from grid 1 [1, 2, 4, 6] 3 forwards, from grid 4 [4, 6] 1 forward
    assert ro.nfe == 2 * (3 + 3 * 5 + 3 * 2 + 3 * 3 + 3 * 1)
    m = tr.iteration(0)
    assert "reward/shapes@g2/mean" in m and m["grad_norm"] > 0
    with pytest.raises(ConfigError, match="normalize_then_sum"):
        load_train_config({"domain": "visgen", "visgen": {"model": str(tiny_dir), "method": {"name": "egrpo"}},
                           "rollout": {"group_size": 3}, "advantage": {"estimator": "depth_zscore"}})


def test_likelihood_free_recipes_run_their_references_defaults():
    from pathlib import Path

    from shared_rl.config import load_yaml

    root = Path(__file__).resolve().parents[2] / "configs" / "visgen"
    cfgs = {n: load_train_config(load_yaml(root / f"shapes_{n}.yaml")) for n in ("nft", "awm", "dgpo")}
    nft = cfgs["nft"].domain_config.training_objective()
    assert nft.settings.timesteps_per_sample is None and nft.num_slots(10) == 9 and nft.samples_with_old
    assert cfgs["awm"].domain_config.training_objective().settings.weighting == "ghuber"
    dgpo = cfgs["dgpo"]
    assert dgpo.policy_loss_choice().name == "dgpo" and dgpo.domain_config.rollout_method().name == "ode"
    assert dgpo.loss.kl_coef == 0.02 and dgpo.optim.micro_batch_size == 0


def test_timesteps_that_do_not_fit_the_grid_are_one_line_config_errors(tiny_dir):
    with pytest.raises(ConfigError, match="trunc_steps 4 must be below the 4 grid steps"):
        _visgen_cfg(tiny_dir, {"name": "dgpo"})
    with pytest.raises(ConfigError, match="6 training timesteps per sample is more than the 4 steps"):
        _visgen_cfg(tiny_dir, {"name": "awm"})
    assert _visgen_cfg(tiny_dir, {"name": "nft"}).domain_config.training_objective().num_slots(4) == 3
