import math

import pytest
import torch

from shared_rl.advantages import ESTIMATORS, AdvantageInputs, group_advantages, tree_advantages, tree_values
from shared_rl.config import AdvantageConfig, ConfigError, EstimatorChoice, from_dict

R = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
G = torch.tensor([0, 0, 0, 1, 1, 1])


def test_grpo_hand_computed():
    # group 0: mean 2, unbiased std 1 -> (-1, 0, 1); group 1 has zero std -> 0, never NaN
    adv = group_advantages(R, G, "grpo", eps=0.0)
    assert torch.allclose(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))


def test_grpo_eps_damps_groups_whose_rewards_barely_differ():
    # advantage.eps as a soft std floor (robotics five-task recipe, eps 0.1): success 1 + dense 0.5 * d per episode.
    # An all-success group whose dense terms differ by 0.02 (std 0.01) is scaled by 0.01 / 0.11 instead of to unit
    # size; a mixed group (1 of 4 failing, std 0.5) keeps 0.5 / 0.6 of its size.
    solved = torch.tensor([1.49, 1.50, 1.51])  # mean 1.50, unbiased std 0.01
    mixed = torch.tensor([1.5, 1.5, 1.5, 0.5])  # mean 1.25, unbiased std 0.5
    r, g = torch.cat([solved, mixed]), torch.tensor([0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(r, g, "grpo", eps=0.1)
    expected = torch.tensor([-0.01 / 0.11, 0.0, 0.01 / 0.11, 0.25 / 0.6, 0.25 / 0.6, 0.25 / 0.6, -0.75 / 0.6])
    assert torch.allclose(adv, expected, atol=1e-4)
    unit = group_advantages(r, g, "grpo", eps=0.0)  # without the floor both groups are unit size
    assert torch.allclose(unit[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-4)


def test_batch_std_hand_computed():
    std = torch.tensor([1.0, 2, 3, 5, 5, 5]).std().item()  # 1.7224...
    adv = group_advantages(R, G, "batch_std", eps=0.0)
    assert torch.allclose(adv, torch.tensor([-1 / std, 0, 1 / std, 0, 0, 0]), atol=1e-6)


def test_dr_grpo_and_rloo():
    assert torch.allclose(group_advantages(R, G, "dr_grpo"), torch.tensor([-1.0, 0, 1, 0, 0, 0]))
    # rloo: r - mean(others): 1-(2+3)/2=-1.5, 2-2=0, 3-1.5=1.5
    assert torch.allclose(group_advantages(R, G, "rloo"), torch.tensor([-1.5, 0, 1.5, 0, 0, 0]))


def test_mc_median():
    r = torch.tensor([0.0, 4.0, 1.0, 10.0, 2.0])  # one group of 5: median 2
    adv = group_advantages(r, torch.zeros(5, dtype=torch.long), "mc_median")
    assert torch.allclose(adv, torch.tensor([-2.0, 2.0, -1.0, 8.0, 0.0]))


def test_nan_rewards_are_excluded_and_get_zero():
    r = torch.tensor([1.0, float("nan"), 3.0])
    adv = group_advantages(r, torch.zeros(3, dtype=torch.long), "grpo", eps=0.0)
    s = math.sqrt(2.0)  # std of (1, 3)
    assert torch.allclose(adv, torch.tensor([-1 / s, 0.0, 1 / s]), atol=1e-6)


def test_group_ids_need_not_be_contiguous():
    a = group_advantages(R, G * 7 + 3, "grpo")
    b = group_advantages(R, G, "grpo")
    assert torch.equal(a, b)


# tree:      0
#          /   \
#         1     2
#        / \   / \
#       3   4 5   6      leaf rewards 1, 2, 3, 5
PARENT = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
LEAF = torch.tensor([99.0, 99, 99, 1, 2, 3, 5])  # internal values must be ignored


def test_tree_values_hand_computed():
    assert torch.allclose(tree_values(PARENT, LEAF), torch.tensor([2.75, 1.5, 4.0, 1, 2, 3, 5]))


def test_tree_advantages_hand_computed():
    sib = tree_advantages(PARENT, LEAF, "sibling")
    assert torch.allclose(sib, torch.tensor([0.0, 1.5 - 2.75, 4 - 2.75, -0.5, 0.5, -1, 1]))
    glob = tree_advantages(PARENT, LEAF, "leaf_global")
    assert torch.allclose(glob, torch.tensor([0.0, -1.25, 1.25, -1.75, -0.75, 0.25, 2.25]))
    dz = tree_advantages(PARENT, LEAF, "depth_zscore", eps=0.0)
    # depth 1: values (1.5, 4), std = 2.5/sqrt2 -> -+1/sqrt2; depth 2: (1,2,3,5) mean 2.75 std 1.7078
    s2 = torch.tensor([1.0, 2, 3, 5]).std()
    exp = torch.tensor([0.0, -1 / math.sqrt(2), 1 / math.sqrt(2), *((torch.tensor([1.0, 2, 3, 5]) - 2.75) / s2).tolist()])
    assert torch.allclose(dz, exp, atol=1e-5)


def test_treerl_divides_by_sqrt_leaves():
    t = tree_advantages(PARENT, LEAF, "treerl")
    g = tree_advantages(PARENT, LEAF, "leaf_global")
    s = tree_advantages(PARENT, LEAF, "sibling")
    n = torch.tensor([4.0, 2, 2, 1, 1, 1, 1])
    assert torch.allclose(t, (g + s) / n.sqrt())


def test_depth_zscore_separates_trees():
    # two identical trees side by side must give identical advantages (stats are per tree)
    parent = torch.cat([PARENT, torch.where(PARENT >= 0, PARENT + 7, PARENT)])
    leaf = torch.cat([LEAF, LEAF + 100])
    dz = tree_advantages(parent, leaf, "depth_zscore")
    assert torch.allclose(dz[:7], dz[7:], atol=1e-6)


def test_flat_group_is_depth_one_tree():
    parent = torch.tensor([-1, 0, 0, 0])
    leaf = torch.tensor([0.0, 1, 2, 3])
    dz = tree_advantages(parent, leaf, "depth_zscore")
    flat = group_advantages(torch.tensor([1.0, 2, 3]), torch.zeros(3, dtype=torch.long), "grpo")
    assert torch.allclose(dz[1:], flat, atol=1e-6)


def _adv(rewards, g, name, weights=None, mode="sum_then_normalize", clip=None, parent=None):
    """Every estimator is called the same way: ESTIMATORS[name](inputs, advantage config)."""
    cfg = AdvantageConfig(estimator=EstimatorChoice(name), clip=clip, multi_reward=mode)
    return ESTIMATORS[name](AdvantageInputs(rewards, g, weights or {}, parent), cfg).advantages


def test_multi_reward_modes_and_clip():
    rewards = {"a": torch.tensor([0.0, 1.0, 0.0, 1.0]), "b": torch.tensor([0.0, 0.0, 10.0, 10.0])}
    g = torch.zeros(4, dtype=torch.long)
    w = {"a": 1.0, "b": 0.5}
    sum_first = _adv(rewards, g, "dr_grpo", w, "sum_then_normalize")
    assert torch.allclose(sum_first, torch.tensor([0.0, 1, 5, 6]) - 3.0)
    norm_first = _adv(rewards, g, "dr_grpo", w, "normalize_then_sum")
    assert torch.allclose(norm_first, torch.tensor([-0.5, 0.5, -0.5, 0.5]) + 0.5 * torch.tensor([-5.0, -5, 5, 5]))
    clipped = _adv(rewards, g, "dr_grpo", w, "normalize_then_sum", clip=2.0)
    assert clipped.abs().max() == 2.0
    with pytest.raises(KeyError):
        _adv(rewards, g, "grpo", {"c": 1.0})
    with pytest.raises(ValueError):
        _adv(rewards, g, "depth_zscore")  # tree estimator without a tree
    tree = _adv({"r": LEAF}, torch.zeros(len(LEAF), dtype=torch.long), "sibling", parent=PARENT)
    assert torch.equal(tree, tree_advantages(PARENT, LEAF, "sibling"))


def test_one_registry_one_call_shape_with_own_settings():
    kinds = {e.kind for e in ESTIMATORS.values()}
    assert kinds == {"flat", "tree", "step"}
    cfg = from_dict(AdvantageConfig, {"estimator": {"name": "gae", "gamma": 0.9, "lam": 0.5}})
    assert (cfg.estimator.name, cfg.estimator.settings.gamma, cfg.estimator.settings.lam) == ("gae", 0.9, 0.5)
    assert cfg.kind == "step" and from_dict(AdvantageConfig, {"estimator": "rloo"}).kind == "flat"
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        from_dict(AdvantageConfig, {"estimator": "grpp"})
    with pytest.raises(ConfigError, match="unknown config key 'advantage.estimator.gama'"):
        from_dict(AdvantageConfig, {"estimator": {"name": "gae", "gama": 0.9}}, "advantage")
    with pytest.raises(ConfigError, match="advantage.estimator.gamma must be in"):
        from_dict(AdvantageConfig, {"estimator": {"name": "gae", "gamma": 0.0}}, "advantage")
    with pytest.raises(ConfigError, match="was replaced: the critic's settings belong to its estimator"):
        from_dict(AdvantageConfig, {"lam": 0.9}, "advantage")


def test_tree_leaf_zscore_hand_computed():
    # leaves 1,2,3,5: mean 2.75, std 1.7078; node 1 value 1.5, node 2 value 4
    s = torch.tensor([1.0, 2, 3, 5]).std()
    adv = tree_advantages(PARENT, LEAF, "tree_leaf_zscore", eps=0.0)
    exp = torch.tensor([0.0, (1.5 - 2.75) / s, (4 - 2.75) / s, *((torch.tensor([1.0, 2, 3, 5]) - 2.75) / s).tolist()])
    assert torch.allclose(adv, exp, atol=1e-5)


def test_population_std_estimators_hand_computed():
    """grpo_population / batch_std_population: Flow-GRPO / DGPO's PerPromptStatTracker (np.std, ddof 0, + eps).
    Group {1, 3}: mean 2, population std 1 -> A = ∓1/(1 + eps); the batch {1, 3, 5, 5}: population std
    sqrt(((1-3.5)^2 + (3-3.5)^2 + 2*(5-3.5)^2)/4) = sqrt(2.75)."""
    import math

    R = torch.tensor([1.0, 3.0, 5.0, 5.0])
    G = torch.tensor([0, 0, 1, 1])
    eps = 1e-4
    adv = group_advantages(R, G, "grpo_population", eps=eps)
    assert torch.allclose(adv, torch.tensor([-1 / (1 + eps), 1 / (1 + eps), 0.0, 0.0]))
    assert not torch.allclose(adv, group_advantages(R, G, "grpo", eps=eps)), "unbiased std is sqrt(2) larger"
    std = math.sqrt(2.75)
    adv = group_advantages(R, G, "batch_std_population", eps=eps)
    assert torch.allclose(adv, torch.tensor([-1 / (std + eps), 1 / (std + eps), 0.0, 0.0]))
