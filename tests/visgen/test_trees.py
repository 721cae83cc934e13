"""Tree methods (BranchGRPO, TreeGRPO, E-GRPO) on the one engine over tiny random stock pipelines: bookkeeping, NFE,
advantages, pruning, exact log-prob recomputation, the E-GRPO merge schedule, batched == node-by-node, the trainer."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from .conftest import CALL_OPTIONS, SIZES

from shared_rl.advantages import tree_advantages, tree_values
from shared_rl.config import ConfigError
from shared_rl.domain import DomainBase, DomainConfig
from shared_rl.advantages import tree_leaf_zscore
from shared_rl.flow_kernels import flow_step
from visgen.engine import StepSegment, grow_forest
from visgen.methods import KernelSettings, method_from_config
from visgen.methods.egrpo import EGRPOSettings, grid_entropies, merge_schedule, step_entropy
from visgen.pipelines import as_adapter
from visgen.rollout import VisgenRollouts
from visgen.tasks.shapes import vocabulary as shapes_vocabulary

PROMPTS = ["a red square", "blue circle on the left", "a green star"]


def brightness(images, prompts, metas):
    return {"bright": images.mean((1, 2, 3)), "dark": -images.mean((1, 2, 3))}


def rollouts(pipe, method: dict, family="sd3", steps=10, micro_batch=0) -> VisgenRollouts:
    size = SIZES[family]
    return VisgenRollouts(as_adapter(pipe), method_from_config(method), KernelSettings("sde", 0.7, "mean", micro_batch),
                          PROMPTS, [{} for _ in PROMPTS], brightness, steps,
                          sample_kwargs={**CALL_OPTIONS[family], "height": size, "width": size})


def default_group_size(method: dict) -> int:
    m = method_from_config(method)
    return m.settings.leaves() if hasattr(m.settings, "leaves") else 4


def run(pipe, method: dict, keys=(0, 1), seed=0, family="sd3", iteration=0, group_size=None, **kw):
    r = rollouts(pipe, method, family, **kw)
    return r, r.rollout(list(keys), group_size or default_group_size(method), torch.Generator().manual_seed(seed),
                        iteration)


def branch(mix: bool = False, **kw) -> dict:
    return {"name": "branch_grpo_mix" if mix else "branch_grpo", **kw}


def tree_grpo(**kw) -> dict:
    return {"name": "tree_grpo", **kw}


def egrpo(**kw) -> dict:
    return {"name": "egrpo", **kw}


# ----------------------------------------------------------------------------------------------- bookkeeping / NFE
def test_branch_tree_node_counts_and_nfe(sd3_pipe):
    _, ro = run(sd3_pipe, branch(split_steps=[0, 2, 4, 6], factor=[2]))
    # per prompt 1 + 2 + 4 + 8 + 16 nodes; 16 leaves
    assert len(ro) == 2 * 31 and ro.info["tree/leaves"] == 32
    depth_counts = torch.bincount(torch.tensor([len(_path(ro.parent, i)) - 1 for i in range(len(ro))]))
    assert depth_counts.tolist() == [2, 4, 8, 16, 32]
    # NFE per prompt: each level = one forward per parent (shared step 0) + one per child per further step:
    # (1 + 2) + (2 + 4) + (4 + 8) + (8 + 16 * 3) = 77, vs 16 * 10 = 160 for 16 flat samples
    assert ro.nfe == 2 * 77 and ro.info["nfe/rollout_per_leaf"] == pytest.approx(77 / 16)
    leaf = torch.isfinite(ro.rewards["bright"])
    assert int(leaf.sum()) == 32 and not torch.isfinite(ro.rewards["bright"][ro.parent < 0]).any()
    assert not ro.mask[ro.parent < 0].any()  # roots carry no edge
    # the final grid step is never trained; the leaf edges hold steps 6..9 -> 3 trained
    assert ro.mask.shape[1] == 4 and ro.mask[leaf].sum(1).eq(3).all()
    assert ro.keys == [0, 1] and torch.equal(torch.unique(ro.group_ids), torch.tensor([0, 1]))


def _path(parent, i):
    out = [i]
    while parent[out[-1]] >= 0:
        out.append(int(parent[out[-1]]))
    return out


def test_prefix_level_when_first_split_is_late_and_mix(sd3_pipe):
    _, ro = run(sd3_pipe, branch(split_steps=[3, 5], factor=[2, 3], mix=True, sde_windows=[[6, 7]]), keys=[0])
    # root -> one prefix child (steps 0..2, ODE in mix mode) -> 2 -> 6 leaves
    assert len(ro) == 1 + 1 + 2 + 6 and ro.info["tree/leaves"] == 6
    # NFE: prefix 3, level 2: 1 + 2 (steps 3, 4), level 3: 2 + 6 * 4 (steps 5..9)
    assert ro.nfe == 3 + 3 + 26
    sde = ro.payload["sde"]
    prefix = 1
    assert not sde[prefix].any() and not ro.mask[prefix].any()
    leaf = torch.isfinite(ro.rewards["bright"])
    # leaf edges: steps 5 (split, SDE), 6 (window, SDE), 7..9 ODE
    assert sde[leaf][0].tolist() == [True, True, False, False, False]
    assert ro.mask[leaf][0].tolist() == [True, True, False, False, False]


def test_treegrpo_window_and_nfe(sd3_pipe):
    s = tree_grpo(branch=[2, 2, 2], window_start=2)
    _, ro = run(sd3_pipe, s, keys=[0])
    # root -> ODE prefix (steps 0,1) -> 2 -> 4 -> 8 leaves (last edges: SDE step 4 + ODE tail 5..9)
    assert len(ro) == 1 + 1 + 2 + 4 + 8
    assert ro.nfe == 2 + (1 + 2 + 4) + 8 * 5
    assert int(ro.mask.sum()) == 2 + 4 + 8  # one trained SDE step per branching edge
    assert ro.payload["sigma"].shape[1] == 6
    # window drawn from the generator inside [0, T/2 - 3] when not fixed
    starts = set()
    for seed in range(12):
        _, r = run(sd3_pipe, tree_grpo(branch=[2, 2]), keys=[0], seed=seed)
        starts.add(int(r.info["tree/window_start"]))
    assert starts <= {0, 1, 2, 3} and len(starts) > 1


# ----------------------------------------------------------------------------------------------- exact recompute
@pytest.mark.parametrize("settings", [
    branch(split_steps=[0, 2, 4, 6], factor=[2], split_noise_scale=4.0),
    branch(split_steps=[1, 5], factor=[3, 2], mix=True),
    tree_grpo(branch=[3, 2], window_start=1),
    egrpo(),
], ids=["branch", "branch-mix", "tree", "egrpo"])
def test_recompute_reproduces_stored_log_probs_exactly(sd3_pipe, settings):
    engine, ro = run(sd3_pipe, settings, micro_batch=5)
    out = engine.log_probs(ro, torch.arange(len(ro)), need_kl=False)
    assert torch.equal(out.logp[ro.mask], ro.logp_old[ro.mask])  # ratio exactly 1 for the same layout
    assert out.logp[~ro.mask].abs().sum() == 0 and ro.logp_old[ro.mask].abs().min() > 0
    # siblings share their parent's step-0 forward during training too: fewer forwards than trained steps
    if settings["name"] != "egrpo":
        assert out.nfe < int(ro.mask.sum())
    # a subset (other layout) still matches to float tolerance
    sub = torch.arange(0, len(ro), 2)
    part = engine.log_probs(ro, sub, need_kl=False)
    assert torch.allclose(part.logp[ro.mask[sub]], ro.logp_old[sub][ro.mask[sub]], atol=1e-4)


def test_scaled_split_noise_stores_the_log_prob_of_the_scaled_gaussian(sd3_pipe):
    scale = 4.0
    engine, ro = run(sd3_pipe, branch(split_steps=[0, 3], factor=[2], split_noise_scale=scale), keys=[0])
    p = ro.payload
    first_level = torch.nonzero(ro.parent == 0).flatten()  # children of the root: step 0 is the split step
    assert torch.allclose(p["noise_level"][first_level, 0], torch.tensor(0.7 * scale))
    assert torch.allclose(p["noise_level"][first_level, 1], torch.tensor(0.7))  # non-split steps unscaled
    # re-score the stored transition by hand under both stds: only the scaled one matches the stored log-prob
    adapter = engine.adapter
    from visgen.pipelines import Conditioning

    cond = Conditioning({k: v[first_level] for k, v in p["cond"].items()}, **engine._cond_meta)
    x, x_next = p["latents"][first_level, 0], p["latents"][first_level, 1]
    with torch.no_grad():
        v = adapter.velocity(x, p["timestep"][first_level, 0], cond)
    args = (x, v, p["sigma"][first_level, 0], p["sigma_next"][first_level, 0])
    scaled = flow_step("sde", *args, 0.7 * scale, next_sample=x_next).log_prob
    unscaled = flow_step("sde", *args, 0.7, next_sample=x_next).log_prob
    stored = ro.logp_old[first_level, 0]
    assert torch.allclose(stored, scaled, atol=1e-5)
    assert (stored - unscaled).abs().min() > 0.1
    # the std used is 4x the unscaled one (Flow-GRPO SDE std is linear in the noise level)
    std_scaled = flow_step("sde", *args, 0.7 * scale, next_sample=x_next).std.flatten()
    std_plain = flow_step("sde", *args, 0.7, next_sample=x_next).std.flatten()
    assert torch.allclose(std_scaled, scale * std_plain)


# ----------------------------------------------------------------------------------------------- batched == node by node
@pytest.mark.parametrize("method", ["branch", "egrpo"])
def test_batched_expansion_equals_node_by_node(sd3_pipe, method):
    s = branch(split_steps=[0, 2, 4, 6], factor=[2]) if method == "branch" else egrpo()
    e1, batched = run(sd3_pipe, s, seed=5)
    e2, single = run(sd3_pipe, s, seed=5, micro_batch=1)  # one node per forward
    assert torch.equal(batched.parent, single.parent) and batched.nfe == single.nfe
    assert torch.allclose(batched.payload["latents"], single.payload["latents"], atol=1e-5)
    assert torch.allclose(batched.logp_old, single.logp_old, atol=1e-5)
    assert torch.allclose(batched.rewards["bright"].nan_to_num(), single.rewards["bright"].nan_to_num(), atol=1e-5)
    # node by node runs one transformer call per node and step; batched one per level and step
    assert single.payload["fwd_id"].max() > 5 * batched.payload["fwd_id"].max()


def test_one_forward_per_depth_and_step(sd3_pipe):
    _, ro = run(sd3_pipe, branch(split_steps=[0, 2, 4, 6], factor=[2]), keys=[0, 1, 2])
    fid = ro.payload["fwd_id"]
    # 10 grid steps -> 10 batched calls for three 16-leaf trees; every node of a depth shares the call
    assert torch.unique(fid[fid >= 0]).numel() == 10
    depth = torch.tensor([len(_path(ro.parent, i)) - 1 for i in range(len(ro))])
    for d in range(1, 5):
        assert torch.unique(fid[depth == d, 0]).numel() == 1


# ----------------------------------------------------------------------------------------------- advantages
def test_tree_leaf_zscore_hand_computed():
    # root 0 -> 1, 2 ; 1 -> 3, 4 ; 2 -> 5, 6 ; leaf rewards 1, 3, 5, 7
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    r = torch.tensor([float("nan")] * 3 + [1.0, 3.0, 5.0, 7.0])
    mu, sd = 4.0, math.sqrt(((9 + 1 + 1 + 9) / 3))
    expected = torch.tensor([0.0, (2 - mu) / sd, (6 - mu) / sd, (1 - mu) / sd, (3 - mu) / sd, (5 - mu) / sd,
                             (7 - mu) / sd])
    assert torch.allclose(tree_leaf_zscore(parent, r), expected, atol=1e-5)
    # equals the mean of the children's advantages (reward backup)
    a = tree_leaf_zscore(parent, r)
    assert torch.isclose(a[1], (a[3] + a[4]) / 2) and torch.isclose(a[2], (a[5] + a[6]) / 2)
    # it differs from BranchGRPO's depth z-score at depth 1 (there: +-1/sqrt(2)*... of two values)
    dz = tree_advantages(parent, r, "depth_zscore")
    assert torch.allclose(dz[1:3], torch.tensor([-1, 1]) / math.sqrt(2), atol=1e-5)
    assert not torch.allclose(dz[1:3], a[1:3])
    # all-equal leaves: zero advantage
    assert tree_leaf_zscore(parent, torch.tensor([float("nan")] * 3 + [2.0] * 4)).abs().sum() == 0


def test_fused_values_mean_and_logp_softmax():
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    r = torch.tensor([float("nan")] * 3 + [1.0, 3.0, 5.0, 7.0])
    assert torch.allclose(tree_values(parent, r), torch.tensor([4.0, 2.0, 6.0, 1.0, 3.0, 5.0, 7.0]))
    logp = torch.tensor([0.0, 0.0, math.log(3.0), 0.0, math.log(3.0), 0.0, 0.0])
    v = tree_values(parent, r, fusion_logit=logp)
    # node 1: weights softmax(0, log 3) = (1/4, 3/4) -> 1/4 + 9/4 = 2.5 ; node 2: 6 ; root: (2.5 + 3 * 6) / 4
    assert torch.allclose(v, torch.tensor([(2.5 + 18) / 4, 2.5, 6.0, 1.0, 3.0, 5.0, 7.0]))
    # equal logits = the mean of the children's values (= the leaf mean on this balanced tree)
    assert torch.allclose(tree_values(parent, r, fusion_logit=torch.full((7,), 2.0)), tree_values(parent, r))
    # a NaN leaf drops out of its parent's softmax
    r2 = r.clone()
    r2[4] = float("nan")
    assert torch.allclose(tree_values(parent, r2, fusion_logit=logp)[1], torch.tensor(1.0))
    # the estimators see the fused values: sibling advantage of node 2 = v(2) - v(0)
    adv = tree_advantages(parent, r, "sibling", fusion_logit=logp)
    assert torch.isclose(adv[2], torch.tensor(6.0 - (2.5 + 18) / 4))


def test_branch_logp_softmax_fusion_reaches_the_trainer(sd3_pipe):
    """fusion: logp_softmax puts the edge log-probs / temperature on the Rollout; the trainer's advantages differ
    from the mean fusion; take() and cat() carry it."""
    from shared_rl.rollout import Rollout

    s = {"name": "branch_grpo", "split_steps": [0, 1], "factor": [2], "fusion": "logp_softmax",
         "fusion_temperature": 50.0}
    _, ro = run(sd3_pipe, s, keys=[0], group_size=4)
    assert ro.fusion_logit is not None and ro.fusion_logit.shape == (len(ro),)
    assert ro.fusion_logit[ro.parent < 0].abs().sum() == 0  # roots: no steps
    assert ro.fusion_logit[ro.parent >= 0].abs().min() > 0
    name = next(iter(ro.rewards))
    fused = tree_advantages(ro.parent, ro.rewards[name], "sibling", fusion_logit=ro.fusion_logit)
    plain = tree_advantages(ro.parent, ro.rewards[name], "sibling")
    assert not torch.allclose(fused, plain)
    both = Rollout.cat([ro, ro.take(torch.arange(len(ro)))])
    assert torch.equal(both.fusion_logit, torch.cat([ro.fusion_logit, ro.fusion_logit]))
    _, ro_mean = run(sd3_pipe, {**s, "fusion": "mean"}, keys=[0], group_size=4)
    assert ro_mean.fusion_logit is None


def test_egrpo_groups_share_a_consolidated_step_and_normalise_within_it(sd3_pipe):
    s = egrpo(schedule=[[0, 1], [2, 2], [4, 3]], granularities=[1])  # one granularity (the tails at stride 2 and
    r, ro = run(sd3_pipe, s, keys=[0, 1], group_size=3)            # their rewards: test_reference_parity.py)
    # one tree per (prompt, consolidated step): root = anchor latent, 3 members
    assert ro.keys == [0, 0, 0, 1, 1, 1] and len(ro) == 6 + 18
    # anchor 5 forwards (steps 0..4; its forward at each consolidated step is the members' step 0) + tails
    assert ro.nfe == 2 * (5 + 3 * 9 + 3 * 6 + 3 * 3)
    members = torch.nonzero(ro.parent >= 0).flatten()
    # every member trains exactly its one merged SDE step sigma_i -> sigma_{i+k}
    assert ro.mask[members].sum(1).eq(1).all() and ro.mask[members, 0].all()
    p = ro.payload
    sigmas = r.adapter.schedule(10, r.adapter.encode_prompts(["a"], **r.sample_kwargs))[0]
    g1 = members[ro.group_ids[members] == 1]
    assert torch.allclose(p["sigma"][g1, 0], sigmas[2].expand(3)) and torch.allclose(p["sigma_next"][g1, 0], sigmas[4].expand(3))
    # all members of a group start from the same anchor latent
    assert torch.equal(p["latents"][g1, 0], p["latents"][g1[:1], 0].expand_as(p["latents"][g1, 0]))
    # depth_zscore on these trees is GRPO within each group
    r = ro.rewards["bright"]
    adv = tree_advantages(ro.parent, r, "depth_zscore")
    for g in range(6):
        m = members[ro.group_ids[members] == g]
        vals = r[m].double()
        assert torch.allclose(adv[m].double(), (vals - vals.mean()) / (vals.std() + 1e-6), atol=1e-4)


# ----------------------------------------------------------------------------------------------- pruning
def test_width_pruning_best_worst_and_ratio(sd3_pipe):
    _, ro = run(sd3_pipe, branch(split_steps=[0, 2, 4, 6], factor=[2], width_prune="best_worst"))
    leaf = torch.isfinite(ro.rewards["bright"])
    trained_leaves = ro.mask.any(1) & leaf
    adv = tree_advantages(ro.parent, ro.rewards["bright"], "depth_zscore")
    for g in (0, 1):
        idx = torch.nonzero(leaf & (ro.group_ids == g)).flatten()
        kept = idx[trained_leaves[idx]]
        assert set(kept.tolist()) == {int(idx[adv[idx].argmax()]), int(idx[adv[idx].argmin()])}
    assert ro.mask[~leaf & (ro.parent >= 0)].any(1).all()  # internal edges still train
    _, ro2 = run(sd3_pipe, branch(split_steps=[0, 2, 4, 6], factor=[2], width_prune="ratio", width_keep=0.25))
    leaf2 = torch.isfinite(ro2.rewards["bright"])
    assert int((ro2.mask.any(1) & leaf2).sum()) == 2 * 4
    adv2 = tree_advantages(ro2.parent, ro2.rewards["bright"], "depth_zscore")
    kept, dropped = adv2[ro2.mask.any(1) & leaf2].abs(), adv2[~ro2.mask.any(1) & leaf2].abs()
    assert kept.min() >= dropped.max()


def test_depth_pruning_fixed_and_sliding(sd3_pipe):
    s = branch(split_steps=[0, 2, 4, 6], factor=[2], depth_prune=[2, 4])
    _, ro = run(sd3_pipe, s, keys=[0])
    depth = torch.tensor([len(_path(ro.parent, i)) - 1 for i in range(len(ro))])
    trained = ro.mask.any(1)
    assert trained[depth == 1].all() and not trained[(depth == 2) | (depth == 3)].any() and trained[depth == 4].all()
    s["depth_prune_slide_every"] = 2
    _, ro = run(sd3_pipe, s, keys=[0], iteration=5)  # shifted by 5 // 2 = 2 depths: window [4, 6) -> depth 4
    trained = ro.mask.any(1)
    assert trained[(depth >= 1) & (depth <= 3)].all() and not trained[depth == 4].any()


# ----------------------------------------------------------------------------------------------- E-GRPO schedule
def _sde_std(s, s_next, a=0.7):
    denom = s_next if s >= 1 else s
    return a * math.sqrt(s / (1 - denom)) * math.sqrt(s - s_next)


def test_egrpo_merge_schedule_on_a_known_sigma_grid():
    sigmas = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    H = lambda s, n: 0.5 * math.log(2 * math.pi * math.e * _sde_std(s, n) ** 2)  # noqa: E731
    ent = grid_entropies(sigmas, "sde", 0.7)
    assert torch.allclose(ent[:-1], torch.tensor([H(sigmas[i].item(), sigmas[i + 1].item()) for i in range(9)]), atol=1e-5)
    assert float(step_entropy(0.8, 0.5, "sde", 0.7)) == pytest.approx(H(0.8, 0.5), abs=1e-5)
    # auto threshold = entropy of step 0 (std 0.7 * sqrt(1/0.1) * sqrt(0.1) = 0.7)
    sched, tau = merge_schedule(sigmas, "sde", 0.7, EGRPOSettings(train_fraction=0.5))
    assert tau == pytest.approx(H(1.0, 0.9), abs=1e-5)
    # hand walk: step 0 meets tau alone; std(0.9->0.8) = 0.7*3*0.316 = 0.66 < 0.7 -> merge 0.9->0.7 (0.94);
    # from 0.7: 0.7*sqrt(7/3) = 1.069 times sqrt(0.1, 0.2, 0.3, 0.4) = 0.34, 0.48, 0.59, 0.68 < 0.7 -> capped at
    # max_merge = 4: (3, 4); next start 7 >= stop 5
    assert sched == [(0, 1), (1, 2), (3, 4)]
    # explicit threshold and merge cap
    sched, _ = merge_schedule(sigmas, "sde", 0.7, EGRPOSettings(threshold=H(1.0, 0.9) - 1e-3, max_merge=2, train_fraction=0.5))
    assert sched == [(0, 1), (1, 2), (3, 2)]
    # a high threshold merges up to the cap but never reaches the final step
    sched, _ = merge_schedule(sigmas, "sde", 0.7, EGRPOSettings(threshold=10.0, max_merge=20, train_fraction=1.0))
    assert sched == [(0, 9)]
    # manual override
    sched, _ = merge_schedule(sigmas, "sde", 0.7, EGRPOSettings(schedule=[[1, 3], [6, 2]]))
    assert sched == [(1, 3), (6, 2)]


# ----------------------------------------------------------------------------------------------- config
def test_settings_validation():
    m = method_from_config(branch(split_steps=[0, 3, 6, 9], factor=[2]))
    m.check(20, 16, "visgen.method")
    assert m.settings.leaves() == 16
    with pytest.raises(ConfigError, match="final step cannot branch"):
        m.check(10, 16, "visgen.method")
    with pytest.raises(ConfigError, match="rollout.group_size: 16"):  # the one group-size knob must agree
        m.check(20, 8, "visgen.method")
    with pytest.raises(ConfigError, match="strictly increasing"):
        method_from_config(branch(split_steps=[3, 1]))
    with pytest.raises(ConfigError, match="one number or one per split"):
        method_from_config(branch(factor=[2, 2]))
    with pytest.raises(ConfigError, match="fusion_temperature must be > 0"):
        method_from_config(branch(fusion="logp_softmax", fusion_temperature=0.0))
    with pytest.raises(ConfigError, match="unknown config key"):
        method_from_config(egrpo(groupsize=4))
    with pytest.raises(ConfigError, match="unknown config key.*sde_windows"):  # only -Mix has SDE windows
        method_from_config(branch(sde_windows=[[0, 2]]))
    with pytest.raises(ConfigError, match="unknown config key.*split_steps"):  # another method's field
        method_from_config(tree_grpo(split_steps=[0, 2]))
    with pytest.raises(ConfigError, match="final grid step"):
        method_from_config(egrpo(schedule=[[6, 4]])).check(10, 4, "visgen.method")
    with pytest.raises(ConfigError, match="does not fit"):
        method_from_config(tree_grpo(branch=[2] * 10)).check(10, 2 ** 10, "visgen.method")
    with pytest.raises(ConfigError, match="is now 'branch_grpo'"):
        method_from_config({"name": "branch"})
    with pytest.raises(ConfigError, match="did you mean 'tree_grpo'"):
        method_from_config({"name": "tree_grp"})


def test_branching_on_an_ode_step_is_refused(sd3_pipe):
    adapter = as_adapter(sd3_pipe)
    cond = adapter.encode_prompts(["a red square"], max_sequence_length=4, height=16, width=16)
    sigmas, timesteps = adapter.schedule(4, cond)
    seg = StepSegment.from_grid(sigmas, timesteps, [(0, 1)], [False], [False], [0.0])
    with pytest.raises(ValueError, match="SDE step"):
        grow_forest(adapter, cond, adapter.prepare_latents(1, cond, None), [(2, seg)], None, "sde")


# ----------------------------------------------------------------------------------------------- other models
def test_flux_tree_recompute_exact(flux_pipe):
    engine, ro = run(flux_pipe, branch(split_steps=[0, 2], factor=[2]), family="flux", steps=4)
    out = engine.log_probs(ro, torch.arange(len(ro)), need_kl=False)
    assert torch.equal(out.logp[ro.mask], ro.logp_old[ro.mask]) and ro.nfe == 2 * ((1 + 2) + (2 + 4))


# ----------------------------------------------------------------------------------------------- trainer
@dataclass
class _TinyCfg(DomainConfig):
    method: str = "branch"

    def rollout_structure(self, train_cfg) -> str:
        return "tree"


class _TinyTreeDomain(DomainBase):
    """A visgen-like domain around the rollouts glue (full fine-tuning of a tiny SD3 transformer)."""

    config_class = _TinyCfg
    pipe = None

    def __init__(self, cfg, ctx):
        method = {"branch": branch(split_steps=[0, 2], factor=[2]),
                  "tree": tree_grpo(branch=[2, 2], window_start=0),
                  "egrpo": egrpo(schedule=[[0, 1], [2, 1]]),
                  }[cfg.method]
        self.group_size = 2 if cfg.method == "egrpo" else 4
        self.engine = rollouts(self.pipe, method, steps=4)
        self.params = [p for p in self.pipe.transformer.parameters()]

    def train_keys(self):
        return [0, 1, 2]

    def rollout(self, keys, group_size, generator, iteration):
        return self.engine.rollout(keys, self.group_size, generator, iteration)

    def log_probs(self, rollout, idx, need_kl):
        return self.engine.log_probs(rollout, idx, need_kl)

    def parameters(self):
        return self.params

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _tiny_trainer(pipe, monkeypatch, method, estimator, lr=1e-3, groups=2, selection=None):
    import copy

    from shared_rl import registry
    from shared_rl.config import load_train_config
    from shared_rl.trainer import Trainer

    _TinyTreeDomain.pipe = copy.deepcopy(pipe)
    monkeypatch.setattr(registry, "resolve_domain", lambda name: _TinyTreeDomain)
    monkeypatch.setattr("shared_rl.trainer.resolve_domain", lambda name: _TinyTreeDomain)
    cfg = load_train_config({
        "domain": "tiny_tree", "iterations": 1, "seed": 1, "device": "cpu",
        "rollout": {"groups_per_iteration": groups, "group_size": 4},
        "advantage": {"estimator": estimator, "weights": {"dark": 0.0}},
        "optim": {"lr": lr, "minibatches_per_epoch": 1, "inner_epochs": 1},
        "logging": {"progress": False}, "eval": {"at_start": False},
        "tiny_tree": {"method": method},
        **({"selection": selection} if selection else {}),
    })
    return Trainer(cfg, None, log=lambda *_: None)


@pytest.mark.parametrize("method,estimator", [("branch", "depth_zscore"), ("egrpo", "depth_zscore")])
def test_trainer_runs_tree_rollouts_with_ratio_one(sd3_pipe, monkeypatch, method, estimator):
    tr = _tiny_trainer(sd3_pipe, monkeypatch, method, estimator)
    m = tr.iteration(0)
    assert m["ratio/mean"] == pytest.approx(1.0, abs=1e-6) and m["ratio/max"] == pytest.approx(1.0, abs=1e-6)
    assert m["nfe/rollout"] > 0 and m["nfe/train"] > 0 and math.isfinite(m["loss/policy"])
    assert m["tree/leaves"] == 8 and m["grad_norm"] > 0


def test_egrpo_groups_survive_a_selection_filter_and_vade_counts_each_key_once(sd3_pipe, monkeypatch):
    """E-GRPO grows two groups per key (one per consolidated step). With dynamic sampling on, the trainer keeps every
    group of the kept keys (it used to trim to groups_per_iteration *groups*, dropping half) and VADE updates each
    drawn key once with all its images."""
    tr = _tiny_trainer(sd3_pipe, monkeypatch, "egrpo", "depth_zscore", groups=3,
                       selection={"filter": "zero_std", "sampler": "vade", "max_refill_rounds": 1})
    m = tr.iteration(0)
    assert m["groups/drawn"] >= 6 and m["groups/kept"] == 6, m  # 3 keys x 2 consolidated steps
    counts = tr.sampler.counts
    assert len(counts) == len(set(counts)) and 3 <= len(counts) <= 6
    # one update: each key's pseudo-counts hold its 2 groups x 2 members (no decay applied between its groups)
    first_round_keys = [k for k, c in counts.items() if c[0] + c[1] > 0]
    assert all(counts[k][0] + counts[k][1] == pytest.approx(4.0) for k in first_round_keys)


@pytest.mark.parametrize("method,estimator", [("branch", "depth_zscore"), ("tree", "tree_leaf_zscore"),
                                              ("egrpo", "depth_zscore")])
def test_tree_methods_learn_a_brightness_reward(sd3_pipe, monkeypatch, method, estimator):
    """Full fine-tuning of the tiny SD3 transformer on "image brightness": every tree method raises it."""
    tr = _tiny_trainer(sd3_pipe, monkeypatch, method, estimator, lr=1e-2, groups=3)
    rewards = [tr.iteration(i)["reward/mean"] for i in range(15)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.02, rewards


# ----------------------------------------------------------------------------------------------- the visgen domain
@pytest.fixture(scope="module")
def tiny_asset(tmp_path_factory):
    from visgen import tiny

    path = tmp_path_factory.mktemp("visgen-trees") / "tiny-sd3"
    pipe = tiny.build_pipeline(shapes_vocabulary(), seed=0, sample_size=16, vae_channels=(8, 16), num_layers=1, num_heads=2, head_dim=8,
                               text_hidden=16)
    tiny.save_pipeline(pipe, path)
    return path


@pytest.mark.parametrize("method,estimator,group_size,leaves", [
    (branch(split_steps=[0, 2], factor=[2], split_noise_scale=2.0), "depth_zscore", 4, 4),
    (tree_grpo(branch=[2, 2], window_start=1), "tree_leaf_zscore", 4, 4),
    (egrpo(schedule=[[0, 1], [1, 2]]), "depth_zscore", 2, 4),
], ids=["branch", "tree", "egrpo"])
def test_visgen_domain_runs_tree_methods(tiny_asset, method, estimator, group_size, leaves):
    """``visgen.method`` picks the tree method on the one engine; LoRA training starts at ratio 1."""
    from shared_rl.config import load_train_config
    from shared_rl.trainer import Trainer

    cfg = load_train_config({
        "domain": "visgen", "seed": 1, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": group_size},
        # normalize_then_sum: E-GRPO's granularities each z-scored, then summed (one trained output otherwise)
        "advantage": {"estimator": estimator, "weights": {"shapes_strict": 0.0}, "multi_reward": "normalize_then_sum"},
        "loss": {"clip_low": 1e-3}, "optim": {"lr": 1e-2, "minibatches_per_epoch": 1, "inner_epochs": 1},
        "logging": {"progress": False}, "eval": {"at_start": False},
        "visgen": {"model": str(tiny_asset), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8}, "method": method,
                   "eval": {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}},
    })
    tr = Trainer(cfg, None, log=lambda *_: None)
    m = tr.iteration(0)
    assert m["tree/leaves"] == 2 * leaves
    assert m["ratio/mean"] == pytest.approx(1.0, abs=1e-7) and m["ratio/max"] == pytest.approx(1.0, abs=1e-7)
    assert m["nfe/rollout"] > 0 and m["grad_norm"] > 0 and math.isfinite(m["loss/policy"])


def test_tree_recipes_parse_without_loading_models():
    from pathlib import Path

    from shared_rl.config import load_train_config, load_yaml

    root = Path(__file__).resolve().parents[2] / "configs" / "visgen"
    methods = {}
    for name in ("shapes_branch", "shapes_branch_prune", "shapes_branch_mix", "shapes_tree", "shapes_egrpo"):
        cfg = load_train_config(load_yaml(root / f"{name}.yaml"))
        methods[name] = cfg.domain_config.method["name"]
    assert methods == {"shapes_branch": "branch_grpo", "shapes_branch_prune": "branch_grpo",
                       "shapes_branch_mix": "branch_grpo_mix", "shapes_tree": "tree_grpo", "shapes_egrpo": "egrpo"}
