"""Advantage estimators: ONE registry (verl ``core_algos`` style), one call shape, each with its formula and its own
settings. Pure tensor functions.

``ESTIMATORS[name]`` is an :class:`Estimator`; every one is called the same way::

    out = ESTIMATORS[name](AdvantageInputs(rewards, group_ids, weights, parent, ..., values, value_mask), cfg)
    out.advantages   # [N] one per sequence (flat, tree), or [N, C] one per decision (step: a critic)
    out.returns      # [N, C] value targets (step), else None

Three kinds, by what they read: ``flat`` (rewards within groups of the same key: grpo, rloo, …), ``tree`` (the
parent array of a forest and its leaf rewards: depth_zscore, treerl, …) and ``step`` (a critic's values per
decision: gae). Flat and tree estimators are registered kernels ``fn(r, g | parent, eps) -> [N]`` wrapped with the
shared multi-reward combination (``advantage.multi_reward``) and clip; a step estimator is registered whole.
Settings shared by every estimator live in ``AdvantageConfig`` (clip, eps, weights, multi_reward); an estimator's
own (gae's gamma, lam, …) in its settings dataclass, written beside its name
(``advantage.estimator: {name: gae, gamma: 0.99}``). ``tests/core/test_advantages.py`` and ``tests/test_gae.py``
check each against hand-computed numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .part_index import GAESettings, NoSettings  # noqa: F401  (torch-free: the config loader reads them)
from .tree import is_leaf, leaf_counts, tree_depth, tree_roots


@dataclass
class AdvantageInputs:
    """What an estimator may read. ``rewards``: name -> ``[N]`` per sequence (NaN: missing, or an internal tree
    node); ``group_ids`` ``[N]``; ``weights``: reward name -> weight (missing names weigh 1, 0 = logged only);
    ``parent`` ``[N]`` (trees; −1 for roots) and ``fusion_logit`` (BranchGRPO's weighted fusion); for a critic
    ``values`` / ``value_mask`` / ``step_rewards`` ``[N, C]`` (see ``shared_rl.domain``) and ``all_reduce``, which
    sums a tensor over processes in place (identity with one process; batch statistics span every rank)."""

    rewards: dict[str, torch.Tensor]
    group_ids: torch.Tensor
    weights: dict[str, float] = field(default_factory=dict)
    parent: torch.Tensor | None = None
    fusion_logit: torch.Tensor | None = None
    values: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None
    step_rewards: torch.Tensor | None = None
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor  # [N] (flat, tree) or [N, C] (step)
    returns: torch.Tensor | None = None  # [N, C] value targets (step)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Estimator:
    """A registered advantage estimator: ``kind`` flat | tree | step, its kernel, its settings class."""

    name: str
    kind: str
    kernel: Callable[..., Any]
    settings_class: type = NoSettings

    def __call__(self, inputs: AdvantageInputs, cfg, settings: Any = None) -> AdvantageOutput:
        """``cfg``: the ``AdvantageConfig`` (clip, eps, weights' combination); ``settings``: this estimator's own
        (default: ``cfg.estimator.settings`` when ``cfg`` chose this estimator, else the defaults)."""
        if settings is None:
            settings = cfg.estimator.settings if cfg.estimator.name == self.name else self.settings_class()
        if self.kind == "step":
            return self.kernel(inputs, cfg, settings)
        adv = combined_advantages(self, inputs, cfg.multi_reward, cfg.eps)
        if cfg.clip is not None:
            adv = adv.clamp(-cfg.clip, cfg.clip)
        return AdvantageOutput(adv, metrics={"advantage/abs_mean": float(adv.abs().mean())})


ESTIMATORS: dict[str, Estimator] = {}


def register(name: str, kind: str = "flat", settings: type = NoSettings):
    """Decorator: register a flat kernel ``fn(r [N], group_ids [N], eps) -> [N]``, a tree kernel
    ``fn(parent [N], leaf_reward [N], eps, fusion_logit=None) -> [N]`` or a whole step estimator
    ``fn(inputs, cfg, settings) -> AdvantageOutput`` as ``advantage.estimator: name``."""
    if kind not in ("flat", "tree", "step"):
        raise ValueError(f"estimator kind must be flat, tree or step, got {kind!r}")

    def deco(fn):
        if name in ESTIMATORS and ESTIMATORS[name].kernel is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = Estimator(name, kind, fn, settings)
        return fn

    return deco


def estimator_names(kind: str) -> list[str]:
    """The registered estimators of one kind, sorted."""
    return sorted(n for n, e in ESTIMATORS.items() if e.kind == kind)


def _get(name: str, kind: str) -> Estimator:
    est = ESTIMATORS.get(name)
    if est is None or est.kind != kind:
        raise KeyError(f"unknown {kind} advantage estimator {name!r}; known: {estimator_names(kind)}")
    return est


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


@register("grpo_population")
def grpo_population(r: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO with the population std (``np.std``, ddof 0), Flow-GRPO / DGPO's ``PerPromptStatTracker``:
    A_i = (r_i − mean_g) / (std_g,pop + eps) (their eps 1e-4: ``advantage.eps``); zero-spread groups → 0."""
    mean, std, count = _group_stats(r, g)
    std = std * ((count - 1).clamp(min=0) / count).sqrt()  # unbiased -> population
    adv = (r.double() - mean) / (std + eps)
    return torch.where(std > 0, adv, torch.zeros_like(adv)).to(r.dtype)


@register("batch_std_population")
def batch_std_population(r: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Flow-GRPO / DGPO ``global_std`` as their ``PerPromptStatTracker`` computes it: A_i = (r_i − mean_g) /
    (std_batch,pop + eps), the population std (``np.std``) of every reward in the batch (their eps 1e-4)."""
    mean, _, _ = _group_stats(r, g)
    std = r.double().std(correction=0) if r.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
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
    kernel = _get(method, "flat").kernel
    rewards = torch.as_tensor(rewards)
    group_ids = torch.as_tensor(group_ids)
    ok = torch.isfinite(rewards)
    out = torch.zeros_like(rewards, dtype=torch.float32)
    if ok.any():
        out[ok] = kernel(rewards[ok].float(), group_ids[ok], eps=eps).float()
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


# BranchGRPO's cut-off (Fredreic1849/BranchGRPO compute_hierarchical_advantages_by_depth): a depth whose values
# spread less than this is a tie, its advantages 0 (dividing would blow float noise up to unit advantages)
MIN_DEPTH_STD = 1e-6


def _tree_zscore(parent: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    depth, root = tree_depth(parent), tree_roots(parent)
    adv = torch.zeros_like(v, dtype=torch.float64)
    key = root * (int(depth.max()) + 1 if depth.numel() else 1) + depth
    valid = (parent >= 0) & torch.isfinite(v)
    for k in torch.unique(key[valid]):
        idx = torch.nonzero((key == k) & valid).flatten()
        vals = v[idx].double()
        std = vals.std() if idx.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        if std >= MIN_DEPTH_STD:
            adv[idx] = (vals - vals.mean()) / (std + eps)
    return adv.float()


@register("depth_zscore", kind="tree")
def depth_zscore(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6,
                 fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """BranchGRPO (Li et al. 2025): A(i) = (v(i) − mean_d) / (std_d + eps) over the nodes at i's depth d in i's
    tree (std_d unbiased); roots 0; a depth whose std is below ``MIN_DEPTH_STD`` (1e-6, the reference's cut-off)
    gives 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    return _tree_zscore(parent, tree_values(parent, leaf_reward, fusion_logit), eps)


@register("sibling", kind="tree")
def sibling(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6,
            fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """TreeRL local advantage (Hou et al. 2025): A(i) = v(i) − v(parent(i)); roots 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    v = tree_values(parent, leaf_reward, fusion_logit)
    adv = v - v[parent.clamp(min=0)]
    return torch.where((parent >= 0) & torch.isfinite(adv), adv, torch.zeros_like(adv))


@register("leaf_global", kind="tree")
def leaf_global(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6,
                fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """TreeRL global advantage: A(i) = v(i) − v(root(i)); roots 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    v = tree_values(parent, leaf_reward, fusion_logit)
    adv = v - v[tree_roots(parent)]
    return torch.where((parent >= 0) & torch.isfinite(adv), adv, torch.zeros_like(adv))


@register("treerl", kind="tree")
def treerl(parent: torch.Tensor, leaf_reward: torch.Tensor, eps: float = 1e-6,
           fusion_logit: torch.Tensor | None = None) -> torch.Tensor:
    """TreeRL combined: A(i) = [(v(i) − v(root)) + (v(i) − v(parent))] / sqrt(#leaves below i); roots 0."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    cnt = leaf_counts(parent).double()
    adv = (leaf_global(parent, leaf_reward, fusion_logit=fusion_logit)
           + sibling(parent, leaf_reward, fusion_logit=fusion_logit)).double() / cnt.clamp(min=1).sqrt()
    return adv.float()


@register("tree_leaf_zscore", kind="tree")
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
    kernel = _get(method, "tree").kernel
    if fusion_logit is None:
        return kernel(parent, leaf_reward, eps=eps).float()
    return kernel(parent, leaf_reward, eps=eps, fusion_logit=fusion_logit).float()


# ---------------------------------------------------------------------------------------------------------------
# Several rewards, one advantage.


def combined_advantages(est: Estimator, inputs: AdvantageInputs, mode: str = "sum_then_normalize",
                        eps: float = 1e-6) -> torch.Tensor:
    """A flat or tree estimator's advantages from several named rewards (unclipped).

    ``sum_then_normalize``: A = adv(Σ_k w_k r_k).  ``normalize_then_sum`` (GDPO; DanceGRPO/MixGRPO multi-reward
    aggregation): A = Σ_k w_k adv(r_k). Weights default to 1 for every reward; weight 0 leaves a reward out."""
    rewards, weights = inputs.rewards, inputs.weights or {}
    if not rewards:
        raise ValueError("no rewards to compute advantages from")
    unknown = set(weights) - set(rewards)
    if unknown:
        raise KeyError(f"advantage weights name unknown rewards {sorted(unknown)}; rewards are {sorted(rewards)}")
    names = [k for k in rewards if weights.get(k, 1.0) != 0]

    def adv_of(r: torch.Tensor) -> torch.Tensor:
        if est.kind == "tree":
            if inputs.parent is None:
                raise ValueError(f"tree estimator {est.name!r} needs a tree rollout (parent array)")
            return tree_advantages(inputs.parent, r, est.name, eps, inputs.fusion_logit)
        return group_advantages(r, inputs.group_ids, est.name, eps)

    if mode == "sum_then_normalize":
        return adv_of(sum(weights.get(k, 1.0) * rewards[k].float() for k in names))
    if mode == "normalize_then_sum":
        return sum(weights.get(k, 1.0) * adv_of(rewards[k].float()) for k in names)
    raise ValueError(f"unknown multi-reward mode {mode!r}")


# ---------------------------------------------------------------------------------------------------------------
# Per-decision estimators with a critic (PPO). A sequence is a chain of C *decisions* (robotics: action chunks;
# each decision owns T / C consecutive log-prob steps); the domain supplies the critic's value of the state at
# each decision (``Rollout.payload["values"]`` [N, C]) and which decisions were taken (``payload["value_mask"]``
# [N, C] bool, a prefix of each row); the sequence's (weighted) outcome reward is the reward of its last decision,
# plus the optional per-decision rewards ``payload["step_rewards"]`` [N, C]. The value after the last decision is
# 0 (the episode ended: success, or the horizon). These estimators use no groups.

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


@register("gae", kind="step", settings=GAESettings)
def gae_estimator(inputs: AdvantageInputs, cfg, settings: GAESettings) -> AdvantageOutput:
    """Per-decision advantages and value targets (:func:`gae`) of each sequence from the critic's values
    (``inputs.values``, ``value_mask``) and its weighted outcome reward as the reward of its last taken decision
    (plus ``step_rewards``). ``normalize: batch`` z-scores them over the taken decisions of every process
    (``inputs.all_reduce``); then ``cfg.clip``. Decisions not taken get 0."""
    w = inputs.weights or {}
    values, vmask = inputs.values.float(), inputs.value_mask.bool()
    if values.shape != vmask.shape:
        raise ValueError(f"values {tuple(values.shape)} and value_mask {tuple(vmask.shape)} must have one entry per "
                         f"decision, [N, C]")
    outcome = sum(w.get(k, 1.0) * r.float() for k, r in inputs.rewards.items() if w.get(k, 1.0) != 0)
    if not torch.is_tensor(outcome):
        outcome = torch.zeros(values.shape[0])
    step_r = inputs.step_rewards.float() if inputs.step_rewards is not None else None
    adv, returns = gae(terminal_rewards(outcome, vmask, step_r), values, vmask, gamma=settings.gamma, lam=settings.lam)
    if settings.normalize == "batch":  # every rank takes part, also one with no rows
        x = adv[vmask].double()
        st = inputs.all_reduce(torch.stack([x.new_tensor(float(x.numel())), x.sum(), (x * x).sum()]))
        cnt = max(float(st[0]), 1.0)
        mean = float(st[1]) / cnt
        std = math.sqrt(max(float(st[2]) / cnt - mean * mean, 0.0))
        adv = torch.where(vmask, (adv - mean) / (std + cfg.eps), torch.zeros_like(adv))
    if cfg.clip is not None:
        adv = adv.clamp(-cfg.clip, cfg.clip)
    metrics = {}
    if vmask.any():
        v, r = values[vmask], returns[vmask]
        metrics["advantage/abs_mean"] = float(adv[vmask].abs().mean())
        metrics["value/mean"] = float(v.mean())
        var = float(r.var()) if r.numel() > 1 else 0.0
        metrics["value/explained_variance"] = 1.0 - float((r - v).var()) / var if var > 0 else 0.0
    else:
        metrics["advantage/abs_mean"] = 0.0
    return AdvantageOutput(adv, returns, metrics)
