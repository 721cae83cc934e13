import torch

from shared_rl.tree import RolloutTree, is_leaf, leaf_counts, tree_depth, tree_roots


def test_grow_levels_and_bookkeeping():
    t = RolloutTree.roots(2)
    a = t.expand(t.frontier(), 2)
    b = t.expand(t.frontier(), 2)
    assert a.tolist() == [2, 3, 4, 5] and b.tolist() == list(range(6, 14))
    assert len(t) == 14 and t.leaves().tolist() == list(range(6, 14))
    assert t.parent[6:].tolist() == [2, 2, 3, 3, 4, 4, 5, 5]
    assert t.group.tolist() == [0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    assert torch.equal(t.depth, tree_depth(t.parent))
    assert tree_roots(t.parent)[6:].tolist() == [0] * 4 + [1] * 4
    assert leaf_counts(t.parent)[:2].tolist() == [4, 4]
    assert t.edges().numel() == 12
    assert t.path_to_root(9) == [9, 3, 0]
    assert is_leaf(t.parent).sum() == 8


def test_rewards_nan_on_internal_nodes_and_pruning_masks():
    t = RolloutTree.roots(1)
    t.expand(t.frontier(), 2)
    t.set_leaf_rewards("r", t.leaves(), torch.tensor([1.0, 0.0]))
    t.expand(t.frontier(), 2)  # rewards extend with NaN for the new nodes
    assert torch.isnan(t.rewards["r"][3:]).all() and t.rewards["r"][1] == 1.0
    t.mask_depth_window(1, 2)
    assert t.trainable.tolist() == [False, False, False, True, True, True, True]
    adv = torch.tensor([0, 0, 0, 0.5, -2.0, 0.1, 1.0])
    t.mask_width(adv, depth=2, keep=0.5)
    assert t.trainable.tolist() == [False, False, False, False, True, False, True]
    t2 = RolloutTree.roots(1)
    t2.expand(t2.frontier(), 4)
    t2.mask_width(torch.tensor([0, 0.3, -0.1, 0.9, -0.5]), depth=1, keep="best_worst")
    assert t2.trainable.tolist() == [False, False, False, True, True]
