"""Advantage estimators, registered by name (verl ``core_algos`` style). Pure tensor functions.

Flat estimators take per-sample rewards ``r[N]`` and group ids ``g[N]``; tree estimators take the parent array
of a forest and leaf rewards. Every estimator documents its formula; ``tests/core/test_advantages.py`` checks
each against hand-computed numbers.
"""
from __future__ import annotations

from typing import Callable

import torch

from .tree import is_leaf, leaf_counts, tree_depth, tree_roots

ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}
TREE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}


def register(name: str, tree: bool = False):
    def deco(fn):
        (TREE_ESTIMATORS if tree else ESTIMATORS)[name] = fn
        return fn

    return deco


def _group_stats(r: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std (0 for singleton groups) and group size."""
    _, inv = torch.unique(g, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    r = r.double()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, r)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, (r - mean[inv]) ** 2)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
    return mean[inv], var.sqrt()[inv], count[inv]


@register("grpo")
def grpo(r: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (DeepSeekMath, Shao et al. 2024): A_i = (r_i − mean_g) / (std_g + eps); zero-std groups → 0."""
    mean, std, _ = _group_stats(r, g)
    adv = (r.double() - mean) / (std + eps)
    return torch.where(std > 0, adv, torch.zeros_like(adv)).to(r.dtype)


@register("batch_std")
def batch_std(r: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Flow-GRPO ``global_std``: A_i = (r_i − mean_g) / (std_batch + eps)."""
    mean, _, _ = _group_stats(r, g)
    std = r.double().std() if r.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    return ((r.double() - mean) / (std + eps)).to(r.dtype)


@register("dr_grpo")
def dr_grpo(r: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): A_i = r_i − mean_g (no std)."""
    mean, _, _ = _group_stats(r, g)
    return (r.double() - mean).to(r.dtype)


@register("rloo")
def rloo(r: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024; RIPT-VLA): A_i = r_i − mean of the other G−1 = G/(G−1)·(r_i − mean_g)."""
    mean, _, count = _group_stats(r, g)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return (scale * (r.double() - mean)).to(r.dtype)


@register("mc_median")
def mc_median(r: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """MC-GRPO: A_i = r_i − median_g (sample G+1 so the median is a sample); the median sample gets 0.

    Ties: exactly one sample (the first one at the lower median position) is the baseline and gets 0; other
    samples equal to the median also get 0 since r_i − median = 0.
    """
    out = torch.zeros_like(r, dtype=torch.float64)
    for gid in torch.unique(g):
        idx = torch.nonzero(g == gid).flatten()
        vals = r[idx].double()
        med = vals.sort().values[(vals.numel() - 1) // 2]
        out[idx] = vals - med
    return out.to(r.dtype)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, method: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages of ``rewards`` within groups ``group_ids`` by registered ``method``.

    NaN rewards (failed reward calls, internal tree nodes) are excluded from group statistics and get 0.
    """
    if method not in ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {method!r}; known: {sorted(ESTIMATORS)}")
    rewards = torch.as_tensor(rewards)
    group_ids = torch.as_tensor(group_ids)
    ok = torch.isfinite(rewards)
    out = torch.zeros_like(rewards, dtype=torch.float32)
    if ok.any():
        out[ok] = ESTIMATORS[method](rewards[ok].float(), group_ids[ok], eps=eps).float()
    return out


# ---------------------------------------------------------------------------------------------------------------
# Trees: sequence/node i has parent[i] (−1 for a root); leaves carry rewards, internal nodes NaN.


def tree_values(parent: torch.Tensor, leaf_reward: torch.Tensor) -> torch.Tensor:
    """Monte-Carlo node values: v(i) = mean of the rewards of the leaves below i (a leaf's value is its reward).

    BranchGRPO "reward fusion" / TreeGRPO "reward backpropagation". Values given for internal nodes are
    ignored; leaves with NaN reward are excluded (a node with no finite leaf gets NaN).
    """
    parent = torch.as_tensor(parent, dtype=torch.long)
    r = torch.as_tensor(leaf_reward, dtype=torch.float64)
    n = parent.numel()
    leaf = is_leaf(parent) & torch.isfinite(r)
    total = torch.where(leaf, r, torch.zeros_like(r))
    count = leaf.double()
    # push each leaf's reward to every ancestor: walk up the chains in lock step
    node = torch.arange(n)[leaf]
    val, cnt = total[leaf], count[leaf]
    total_acc, count_acc = total.clone(), count.clone()
    cur = parent[node]
    while (cur >= 0).any():
        live = cur >= 0
        total_acc.index_add_(0, cur[live], val[live])
        count_acc.index_add_(0, cur[live], cnt[live])
        cur = torch.where(live, parent[cur.clamp(min=0)], cur)
    out = total_acc / count_acc
    return out.float()


def _tree_zscore(parent: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    depth, root = tree_depth(parent), tree_roots(parent)
    adv = torch.zeros_like(v, dtype=torch.float64)
    key = root * (int(depth.max()) + 1 if depth.numel() else 1) + depth
    valid = (parent >= 0) & torch.isfinite(v)
    for k in torch.unique(key[valid]):
        idx = torch.nonzero((key == k) & valid).flatten()
        vals = v[idx].double()
        std = vals.std() if idx.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        if std > 0:
            adv[idx] = (vals - vals.mean()) / (std + eps)
    return adv.float()


@register("depth_zscore", tree=True)
def depth_zscore(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """BranchGRPO (Li et al. 2025): A(i) = (v(i) − mean_d) / (std_d + eps) over the nodes at i's depth d in i's
    tree; roots 0; a depth level with zero std gives 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    return _tree_zscore(parent, tree_values(parent, leaf_reward), eps)


@register("sibling", tree=True)
def sibling(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """TreeRL local advantage (Hou et al. 2025): A(i) = v(i) − v(parent(i)); roots 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    v = tree_values(parent, leaf_reward)
    adv = v - v[parent.clamp(min=0)]
    return torch.where((parent >= 0) & torch.isfinite(adv), adv, torch.zeros_like(adv))


@register("leaf_global", tree=True)
def leaf_global(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """TreeRL global advantage: A(i) = v(i) − v(root(i)); roots 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    v = tree_values(parent, leaf_reward)
    adv = v - v[tree_roots(parent)]
    return torch.where((parent >= 0) & torch.isfinite(adv), adv, torch.zeros_like(adv))


@register("treerl", tree=True)
def treerl(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """TreeRL combined: A(i) = [(v(i) − v(root)) + (v(i) − v(parent))] / sqrt(#leaves below i); roots 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    cnt = leaf_counts(parent).double()
    adv = (leaf_global(parent, leaf_reward) + sibling(parent, leaf_reward)).double() / cnt.clamp(min=1).sqrt()
    return adv.float()


@register("tree_leaf_zscore", tree=True)
def tree_leaf_zscore(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """TreeGRPO reward backup (Ding & Ye 2025), as implemented here.

    Leaf advantages are GRPO z-scores among the leaves of the tree, ``A(l) = (r_l - mu_T) / (sigma_T + eps)``
    (``sigma_T`` the unbiased std of the tree's leaf rewards); an internal node's advantage is the mean of its
    children's, backed up leaf to root. For trees whose every node at a depth has the same number of children this
    equals ``A(i) = (v(i) - mu_T) / (sigma_T + eps)`` with ``v(i)`` the mean leaf reward below ``i``, which is what
    is computed. The edge parent -> i gets ``A(i)``; roots 0; a tree whose leaves all tie gets 0.
    """
    parent = torch.as_tensor(parent, dtype=torch.long)
    r = torch.as_tensor(leaf_reward, dtype=torch.float64)
    v = tree_values(parent, r).double()
    root = tree_roots(parent)
    leaf = is_leaf(parent) & torch.isfinite(r)
    adv = torch.zeros_like(v)
    for g in torch.unique(root):
        members = root == g
        vals = r[members & leaf]
        if vals.numel() < 2:
            continue
        std = vals.std()
        if std > 0:
            idx = torch.nonzero(members & (parent >= 0) & torch.isfinite(v)).flatten()
            adv[idx] = (v[idx] - vals.mean()) / (std + eps)
    return adv.float()


def tree_advantages(parent: torch.Tensor, leaf_reward: torch.Tensor, method: str = "depth_zscore", eps: float = 1e-6) -> torch.Tensor:
    """Advantage of the edge parent(i) → i for every node i (0 for roots) by registered tree ``method``."""
    if method not in TREE_ESTIMATORS:
        raise KeyError(f"unknown tree advantage estimator {method!r}; known: {sorted(TREE_ESTIMATORS)}")
    return TREE_ESTIMATORS[method](parent, leaf_reward, eps=eps).float()


# ---------------------------------------------------------------------------------------------------------------
# Several rewards, one advantage.


def combine_rewards(
    rewards: dict[str, torch.Tensor],
    group_ids: torch.Tensor,
    method: str = "grpo",
    weights: dict[str, float] | None = None,
    mode: str = "sum_then_normalize",
    parent: torch.Tensor | None = None,
    clip: float | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages from several named rewards.

    ``sum_then_normalize``: A = adv(Σ_k w_k r_k).  ``normalize_then_sum`` (GDPO; DanceGRPO/MixGRPO multi-reward
    aggregation): A = Σ_k w_k adv(r_k). Weights default to 1 for every reward. A tree estimator is used when
    ``method`` is a tree method (then ``parent`` is required). Result clipped to ±``clip`` (Flow-GRPO uses 5).
    """
    if not rewards:
        raise ValueError("no rewards to compute advantages from")
    weights = weights or {}
    unknown = set(weights) - set(rewards)
    if unknown:
        raise KeyError(f"advantage weights name unknown rewards {sorted(unknown)}; rewards are {sorted(rewards)}")
    names = [k for k in rewards if weights.get(k, 1.0) != 0]

    def adv_of(r: torch.Tensor) -> torch.Tensor:
        if method in TREE_ESTIMATORS:
            if parent is None:
                raise ValueError(f"tree estimator {method!r} needs a tree rollout (parent array)")
            return tree_advantages(parent, r, method, eps)
        return group_advantages(r, group_ids, method, eps)

    if mode == "sum_then_normalize":
        total = sum(weights.get(k, 1.0) * rewards[k].float() for k in names)
        adv = adv_of(total)
    elif mode == "normalize_then_sum":
        adv = sum(weights.get(k, 1.0) * adv_of(rewards[k].float()) for k in names)
    else:
        raise ValueError(f"unknown multi-reward mode {mode!r}")
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv
