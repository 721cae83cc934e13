"""Issue 63: Flow-DPPO (arXiv 2606.11025; Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py``) — the KL mask in
place of the ratio clip worked out by hand (a term dropped only when the step-mean KL to the old policy reaches τ AND
the ratio moved in the advantage's direction), its gradient, the old means frozen once per batch (ratio 1 and KL 0 at
the first inner step, the KL equal to the Gaussian-mean formula after an update), a micro-batch split = the same
gradient, one-line config errors (exit 2), and the shapes and SD3.5-M recipes on the tiny pipeline."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared_rl.config import ConfigError, LossConfig, load_train_config, load_yaml
from shared_rl.domain import StepLogProbs
from shared_rl.losses import FlowDPPOSettings, flow_dppo_loss
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
                   "method": {"name": "flow_grpo", "train_fraction": 0.5},
                   "objective": objective or {"name": "flow_dppo"}, "eval": TINY_EVAL, **over},
    })


# ------------------------------------------------------------------------------------------------ the mask
def test_mask_drops_only_far_steps_whose_ratio_moved_with_the_advantage():
    """τ = 0.01. Rows: (KL, log ratio, A) →
    0 (0.02, +0.1, +1): far, ρ > 1 with A > 0 → dropped;   1 (0.02, −0.1, +1): far but against A → kept;
    2 (0.005, +0.1, +1): near → kept;                      3 (0.02, −0.1, −2): far, ρ < 1 with A < 0 → dropped;
    4 (0.02, +0.1, −2): far but against A → kept;          5 (0.01, +0.1, +1): KL = τ counts as reached → dropped.
    Kept: L = −A·ρ (no clip), ∂L/∂logp = −A·ρ; dropped: 0 and no gradient."""
    kl = torch.tensor([[0.02], [0.02], [0.005], [0.02], [0.02], [0.01]])
    lr = torch.tensor([[0.1], [-0.1], [0.1], [-0.1], [0.1], [0.1]])
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0, 1.0])
    logp_old = torch.full((6, 1), -3.0)
    logp = (logp_old + lr).requires_grad_(True)
    terms = StepLogProbs(logp=logp, old_kl=kl)
    mask = torch.ones(6, 1, dtype=torch.bool)
    loss, st = flow_dppo_loss(logp, logp_old, adv, mask, LossConfig(), FlowDPPOSettings(kl_threshold=0.01), terms)
    e, ei = math.exp(0.1), math.exp(-0.1)
    expected = [0.0, -ei, -e, 0.0, 2 * e, 0.0]
    assert loss.flatten().tolist() == pytest.approx(expected, rel=1e-6)
    assert st["clipped"].flatten().tolist() == [1, 0, 0, 1, 0, 1]
    loss.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx(expected, rel=1e-6)  # d(−Aρ)/dlogp = −Aρ
    # an overflowing ratio on a dropped step is 0, not nan (torch.where, not a product)
    big = torch.tensor([[100.0]], requires_grad=True)
    out, _ = flow_dppo_loss(big, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                            LossConfig(), FlowDPPOSettings(1e-5), StepLogProbs(logp=big, old_kl=torch.ones(1, 1)))
    out.sum().backward()
    assert out.item() == 0.0 and big.grad.item() == 0.0


def test_first_inner_step_has_ratio_1_and_no_mask():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    terms = StepLogProbs(logp=logp, old_kl=torch.zeros(1, 2))
    loss, st = flow_dppo_loss(logp, logp.detach(), torch.tensor([0.7]), torch.ones(1, 2, dtype=torch.bool),
                              LossConfig(), FlowDPPOSettings(), terms)
    assert st["ratio"].eq(1).all() and st["clipped"].eq(0).all()
    assert loss.flatten().tolist() == pytest.approx([-0.7, -0.7])
    with pytest.raises(ConfigError, match="old_kl"):
        flow_dppo_loss(logp, logp.detach(), torch.tensor([0.7]), torch.ones(1, 2, dtype=torch.bool), LossConfig(),
                       FlowDPPOSettings(), StepLogProbs(logp=logp))


# ------------------------------------------------------------------------------------------------ the domain
def test_old_means_are_the_batchs_sampling_weights_frozen_for_it(tiny_dir):
    """Before any update the recompute gives ratio 1 and KL 0 (the old copy = the weights that sampled); after an
    optimizer step the old copy has not moved, and ``old_kl`` is ‖μ − μ_old‖²/(2σ²): the same number as the
    Flow-GRPO KL with the old copy as the reference. The next iteration's rollout re-freezes it at the new weights."""
    tr = Trainer(_cfg(tiny_dir), None, log=lambda *_: None)
    dom, policy = tr.domain, tr.domain.policy
    ro = dom.rollout([0, 1], 4, torch.Generator().manual_seed(0), 0)
    idx = torch.arange(len(ro.mask))
    out = dom.log_probs(ro, idx, False)
    assert torch.equal(out.logp[ro.mask], ro.logp_old[ro.mask])
    assert out.old_kl is not None and (out.old_kl[ro.mask] == 0).all()
    frozen = {n: t.clone() for n, t in policy.old.items()}
    with torch.no_grad():  # an update, as an optimizer step would make
        for _n, p in policy._named_trainable():
            p.add_(0.01 * torch.randn_like(p))
    dom.after_optimizer_step()
    assert all(torch.equal(policy.old[n], frozen[n]) for n in frozen)  # frozen within the batch
    out = dom.log_probs(ro, idx, False)
    assert (out.old_kl[ro.mask] > 0).all()
    from visgen.recompute import recompute_edges
    from visgen.pipelines.base import Conditioning

    rollouts = dom.rollouts
    p = ro.index_payload(idx)
    rec = recompute_edges(rollouts.adapter, p, ro.mask, Conditioning(p["cond"], **rollouts._cond_meta),
                          rollouts.kernel.kernel, rollouts.kernel.reduction, reference=policy.old_weights,
                          kl_type="mean")
    assert torch.allclose(rec.kl.detach()[ro.mask], out.old_kl[ro.mask], rtol=1e-5, atol=1e-12)
    live = {n: p.detach().clone() for n, p in policy._named_trainable()}
    dom.rollout([0, 1], 4, torch.Generator().manual_seed(1), 1)
    assert all(torch.equal(policy.old[n], live[n]) for n in live)


def test_the_mask_acts_from_the_second_optimizer_step_on_a_batch(tiny_dir):
    """Two minibatches per batch (the reference's num_updates_per_batch 2): the first step sees ratio 1 and KL 0;
    the second, after an update at lr 1e-2 with τ tiny, drops terms. The old copy's forward is one more per step."""
    cfg = _cfg(tiny_dir, {"name": "flow_dppo", "kl_threshold": 1e-12}, optim={"minibatches_per_epoch": 2})
    tr = Trainer(cfg, None, log=lambda *_: None)
    steps = []
    orig = tr._optimizer_step

    def spy(*args, **kw):
        before = len(steps)
        nfe = orig(*args, **kw)
        steps.append((before, nfe))
        return nfe

    tr._optimizer_step = spy
    m = tr.iteration(0)
    assert len(steps) == 2 and m["clip_frac"] > 0
    assert m["nfe/train"] == 8 * 2 * 2  # 8 samples x 2 trained steps x (policy + old copy)
    tr2 = Trainer(_cfg(tiny_dir, {"name": "flow_dppo", "kl_threshold": 1e-12}), None, log=lambda *_: None)
    m1 = tr2.iteration(0)
    assert m1["clip_frac"] == 0.0 and m1["ratio/mean"] == 1.0  # one step per batch: nothing to mask


def test_a_micro_batch_split_trains_the_same_update(tiny_dir):
    def weights(**optim):
        tr = Trainer(_cfg(tiny_dir, optim=optim), None, log=lambda *_: None)
        tr.iteration(0)
        return {n: p.detach().clone() for n, p in tr.domain.policy._named_trainable()}

    whole, split, steps = weights(micro_batch_size=0), weights(micro_batch_size=3), weights(backward_steps=1)
    assert all(torch.allclose(whole[n], split[n], atol=1e-6) for n in whole)
    assert all(torch.allclose(whole[n], steps[n], atol=1e-6) for n in whole)


@pytest.mark.parametrize("value", [0.0, -1e-5])
def test_bad_tau_is_a_one_line_config_error(tiny_dir, value):
    with pytest.raises(ConfigError, match="kl_threshold must be > 0") as info:
        _cfg(tiny_dir, {"name": "flow_dppo", "kl_threshold": value})
    assert "\n" not in str(info.value)


def test_its_loss_needs_its_objective_and_the_objective_its_loss(tiny_dir):
    with pytest.raises(ConfigError, match="needs visgen.objective"):
        _cfg(tiny_dir, {"name": "log_prob"}, loss={"policy_loss": "flow_dppo"})
    with pytest.raises(ConfigError, match="contradicts"):
        _cfg(tiny_dir, loss={"policy_loss": "clipped"})


def test_cli_dry_run_exits_2_on_tau_0():
    out = subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", "configs/visgen/shapes_flowdppo.yaml",
                          "--dry-run", "visgen.objective.kl_threshold=0"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "kl_threshold must be > 0" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ recipes
@pytest.mark.parametrize("name", ["shapes_flowdppo", "sd35_flowdppo"])
def test_recipes_parse_and_run_two_iterations_on_the_tiny_pipeline(name, tiny_dir):
    data = load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml")
    recipe = load_train_config(load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml"))  # parses as shipped
    choice = recipe.policy_loss_choice()
    assert choice.name == "flow_dppo" and choice.settings.kl_threshold == 1e-5
    assert recipe.optim.minibatches_per_epoch == 2 and recipe.loss.aggregation == "token-mean"
    assert recipe.advantage.estimator.name == "batch_std" and recipe.loss.kl_coef == 0.0
    data.update(device="cpu", iterations=2, **QUIET)
    data["rollout"] = {"groups_per_iteration": 2, "group_size": 4}
    data["checkpoint"] = {"every": 0}
    data["advantage"].pop("weights", None)
    data["optim"]["micro_batch_size"] = 0
    reward = {"name": "shapes_soft"} if name.startswith("shapes") else {"name": "jpeg_compressibility"}
    data["visgen"].update(model=str(tiny_dir), dtype="float32", num_inference_steps=4, rewards=[reward],
                          eval=TINY_EVAL, task="shapes")
    for key in ("train_prompts", "eval_prompts", "resolution", "max_sequence_length", "rollout_micro_batch"):
        data["visgen"].pop(key, None)
    tr = Trainer(load_train_config(data), None, log=lambda *_: None)
    ms = [tr.iteration(it) for it in range(2)]
    assert all(math.isfinite(m["loss/policy"]) and m["grad_norm"] > 0 for m in ms)
