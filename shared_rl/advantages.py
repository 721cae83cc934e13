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


def tree_values(parent: torch.Tensor, leaf_reward: torch.Tensor,
                fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """Monte-Carlo node values: v(i) = mean of the rewards of the leaves below i (a leaf's value is its reward).

    BranchGRPO "reward fusion" / TreeGRPO "reward backpropagation". Values given for internal nodes are
    ignored; leaves with NaN reward are excluded (a node with no finite leaf gets NaN).

    ``fusion_logit`` ``[N]`` (BranchGRPO's log-prob-weighted fusion; the domain sets ``Rollout.fusion_logit``, e.g.
    the edge log-prob into each node over a temperature): bottom-up, a node's value is the softmax-weighted mean of
    its children's, ``v(i) = Σ_c softmax_c(ℓ_c) v(c)`` over the children c with a finite value. Equal logits give
    the mean of the children's values (= the leaf mean for trees whose siblings have equally many leaves).
    """
    parent = torch.as_tensor(parent, dtype=torch.long)
    r = torch.as_tensor(leaf_reward, dtype=torch.float64)
    if fusion_logit is not None:
        return _fused_values(parent, r, torch.as_tensor(fusion_logit, dtype=torch.float64))
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


def _fused_values(parent: torch.Tensor, r: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    if logit.shape != parent.shape:
        raise ValueError(f"fusion_logit has shape {tuple(logit.shape)}, expected {tuple(parent.shape)}")
    depth = tree_depth(parent)
    value = torch.where(is_leaf(parent), r, torch.full_like(r, float("nan")))
    for d in range(int(depth.max()) if depth.numel() else 0, 0, -1):
        kids = torch.nonzero((depth == d) & torch.isfinite(value)).flatten()
        if kids.numel() == 0:
            continue
        par = parent[kids]
        # a softmax per parent: subtract each parent's max logit, then normalise by segment sums
        m = torch.full_like(r, -float("inf")).scatter_reduce(0, par, logit[kids], "amax")
        w = torch.exp(logit[kids] - m[par])
        z = torch.zeros_like(r).index_add_(0, par, w)
        num = torch.zeros_like(r).index_add_(0, par, w * value[kids])
        has = z > 0
        value = torch.where(has, num / torch.where(has, z, torch.ones_like(z)), value)
    return value.float()


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
def depth_zscore(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6,
                 fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """BranchGRPO (Li et al. 2025): A(i) = (v(i) − mean_d) / (std_d + eps) over the nodes at i's depth d in i's
    tree; roots 0; a depth level with zero std gives 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    return _tree_zscore(parent, tree_values(parent, leaf_reward, fusion_logit), eps)


@register("sibling", tree=True)
def sibling(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6,
            fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """TreeRL local advantage (Hou et al. 2025): A(i) = v(i) − v(parent(i)); roots 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    v = tree_values(parent, leaf_reward, fusion_logit)
    adv = v - v[parent.clamp(min=0)]
    return torch.where((parent >= 0) & torch.isfinite(adv), adv, torch.zeros_like(adv))


@register("leaf_global", tree=True)
def leaf_global(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6,
                fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """TreeRL global advantage: A(i) = v(i) − v(root(i)); roots 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    v = tree_values(parent, leaf_reward, fusion_logit)
    adv = v - v[tree_roots(parent)]
    return torch.where((parent >= 0) & torch.isfinite(adv), adv, torch.zeros_like(adv))


@register("treerl", tree=True)
def treerl(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6,
           fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """TreeRL combined: A(i) = [(v(i) − v(root)) + (v(i) − v(parent))] / sqrt(#leaves below i); roots 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    cnt = leaf_counts(parent).double()
    adv = (leaf_global(parent, leaf_reward, fusion_logit=fusion_logit)
           + sibling(parent, leaf_reward, fusion_logit=fusion_logit)).double() / cnt.clamp(min=1).sqrt()
    return adv.float()


@register("tree_leaf_zscore", tree=True)
def tree_leaf_zscore(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6,
                     fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """TreeGRPO reward backup (Ding & Ye 2025), as implemented here.

    Leaf advantages are GRPO z-scores among the leaves of the tree, ``A(l) = (r_l - mu_T) / (sigma_T + eps)``
    (``sigma_T`` the unbiased std of the tree's leaf rewards); an internal node's advantage is the mean of its
    children's, backed up leaf to root. For trees whose every node at a depth has the same number of children this
    equals ``A(i) = (v(i) - mu_T) / (sigma_T + eps)`` with ``v(i)`` the mean leaf reward below ``i``, which is what
    is computed. The edge parent -> i gets ``A(i)``; roots 0; a tree whose leaves all tie gets 0.
    """
    parent = torch.as_tensor(parent, dtype=torch.long)
    r = torch.as_tensor(leaf_reward, dtype=torch.float64)
    v = tree_values(parent, r, fusion_logit).double()
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


def tree_advantages(parent: torch.Tensor, leaf_reward: torch.Tensor, method: str = "depth_zscore", eps: float = 1e-6,
                    fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """Advantage of the edge parent(i) → i for every node i (0 for roots) by registered tree ``method``; node values
    by :func:`tree_values` (``fusion_logit``: BranchGRPO's log-prob-weighted fusion, None = leaf mean)."""
    if method not in TREE_ESTIMATORS:
        raise KeyError(f"unknown tree advantage estimator {method!r}; known: {sorted(TREE_ESTIMATORS)}")
    if fusion_logit is None:
        return TREE_ESTIMATORS[method](parent, leaf_reward, eps=eps).float()
    return TREE_ESTIMATORS[method](parent, leaf_reward, eps=eps, fusion_logit=fusion_logit).float()


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
    fusion_logit: torch.Tensor | None = None,
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
            return tree_advantages(parent, r, method, eps, fusion_logit)
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


# ---------------------------------------------------------------------------------------------------------------
# Per-decision estimators with a critic (PPO). A sequence is a chain of C *decisions* (robotics: action chunks;
# each decision owns T / C consecutive log-prob steps); the domain supplies the critic's value of the state at
# each decision (``Rollout.payload["values"]`` [N, C]) and which decisions were taken (``payload["value_mask"]``
# [N, C] bool, a prefix of each row); the sequence's (weighted) outcome reward is the reward of its last decision,
# plus the optional per-decision rewards ``payload["step_rewards"]`` [N, C]. The value after the last decision is
# 0 (the episode ended: success, or the horizon). These estimators use no groups.

STEP_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def register_step(name: str):
    def deco(fn):
        STEP_ESTIMATORS[name] = fn
        return fn

    return deco


@register_step("gae")
def gae(rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation"),
    as PPO for VLAs (RL4VLA; πRL's critic over action chunks):

    δ_c = r_c + γ·V_{c+1}·[c+1 taken] − V_c,   A_c = δ_c + γλ·A_{c+1}·[c+1 taken],   R_c = A_c + V_c,

    over each row's taken decisions (``valid``, a prefix); 0 elsewhere. ``rewards``, ``values`` ``[N, C]``.
    Returns (advantages A, value targets R), both ``[N, C]`` float32. λ = 1 gives A_c = Σ_{k≥c} γ^{k−c} r_k − V_c
    (Monte-Carlo return minus the baseline); λ = 0 gives the one-step TD error δ_c.
    """
    r, v, m = rewards.double(), values.double(), valid.bool()
    n, c = r.shape
    adv = torch.zeros(n, c, dtype=torch.float64)
    nxt_adv = torch.zeros(n, dtype=torch.float64)
    nxt_val = torch.zeros(n, dtype=torch.float64)
    nxt_ok = torch.zeros(n, dtype=torch.bool)
    for t in range(c - 1, -1, -1):
        ok = m[:, t]
        cont = nxt_ok.double()
        delta = r[:, t] + gamma * nxt_val * cont - v[:, t]
        a_t = torch.where(ok, delta + gamma * lam * nxt_adv * cont, torch.zeros_like(delta))
        adv[:, t] = a_t
        nxt_adv, nxt_val, nxt_ok = a_t, torch.where(ok, v[:, t], torch.zeros_like(delta)), ok
    ret = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv.float(), ret.float()


def terminal_rewards(outcome: torch.Tensor, valid: torch.Tensor, step_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, C]`` per-decision rewards: each row's ``outcome[N]`` at its last taken decision (``valid`` prefix),
    plus ``step_rewards`` where given. A row with no taken decision gets nothing."""
    m = valid.bool()
    out = torch.zeros(m.shape, dtype=torch.float32)
    last = m.long().sum(1) - 1
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = outcome.float()[rows]
    if step_rewards is not None:
        out = out + torch.where(m, step_rewards.float(), torch.zeros_like(out))
    return out


def step_advantages(method: str, outcome: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                    gamma: float, lam: float, step_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-decision advantages and value targets of registered step estimator ``method`` (see ``gae``)."""
    if method not in STEP_ESTIMATORS:
        raise KeyError(f"unknown step advantage estimator {method!r}; known: {sorted(STEP_ESTIMATORS)}")
    if values.shape != valid.shape:
        raise ValueError(f"values {tuple(values.shape)} and value_mask {tuple(valid.shape)} must have one entry per "
                         f"decision, [N, C]")
    return STEP_ESTIMATORS[method](terminal_rewards(outcome, valid, step_rewards), values, valid, gamma=gamma, lam=lam)
