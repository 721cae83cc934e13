"""Batched tree rollouts over stock flow-matching pipelines: BranchGRPO, TreeGRPO and E-GRPO (engine + methods).

A rollout is a forest grown level by level with ``shared_rl.tree.RolloutTree``. Node ``i`` is a latent; the
*edge* into node ``i`` is a segment of executed denoising steps that starts at the parent's latent. One level
expands **every frontier node of every tree in one batched forward per step** (split into rollout micro-batches
only when asked), and each node's latent is computed exactly once (prefix sharing):

- step 0 of a level starts at the parent's latent, so its velocity is computed **once per parent** and shared by
  the parent's ``b`` children, which differ only by their noise (TreeGRPO's "several children per forward");
- steps 1.. run over the children's own latents.

An executed step goes ``sigma -> sigma_next`` with the model timestep of ``sigma``; ordinarily that is one step of
the scheduler's grid, E-GRPO's merged step spans several grid steps (``sigma_i -> sigma_{i+k}``). Each executed
step is SDE (the domain's kernel, ``shared_rl.flow_kernels.flow_step``) or ODE, trained or not, with its own noise level:
a split step whose noise is scaled stores the log-prob **of the scaled Gaussian it was actually drawn from**
(the public BranchGRPO code scales split noise x4 but scores it with the unscaled std; we do not).

The result is a ``shared_rl.rollout.Rollout`` where sequence ``i`` is the edge into node ``i``: its steps are the
executed steps of that segment padded to a fixed length ``L`` (mask False on padding), ``parent`` is the tree
parent (roots: -1, all-False mask), rewards sit on leaves (NaN elsewhere) and ``payload`` holds what recomputing
the log-probs needs (edge latents, per-step sigmas/timesteps/noise levels/SDE flags, prompt embeddings and
*which rollout forward, at which row*, computed each step). :func:`recompute_forest` re-forms those forwards, so
for the same layout the recomputed log-probs equal the stored ones bit for bit (importance ratio exactly 1).

Methods (configured by :class:`TreeSettings`, the ``visgen.tree`` YAML section):

- **BranchGRPO** (Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion
  Models", 2025): split steps with factors, SDE everywhere (or, *Mix*, SDE only at split steps and given windows,
  ODE elsewhere and untrained); depth-wise z-scored node values (``shared_rl`` ``depth_zscore``); width pruning
  (top ratio / best+worst leaf edges) and depth pruning (fixed or sliding window). See docs/methods/branch_grpo.md.
- **TreeGRPO** (Ding & Ye, "TreeGRPO: Tree-Advantage GRPO for Online RL Post-Training of Diffusion Models",
  2025): one shared initial noise per prompt, ODE outside a (random) SDE window, branching at every window step,
  leaf advantages backed up the tree (``tree_leaf_zscore`` below). See docs/methods/tree_grpo.md.
- **E-GRPO** (Zhang et al., "E-GRPO: High Entropy Steps Drive Effective Reinforcement Learning for Flow Models",
  2026): merged high-entropy SDE steps branching from one ODE anchor path; see ``visgen/egrpo.py``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Literal, Optional, Sequence

import torch

from shared_rl.advantages import tree_advantages, tree_leaf_zscore, tree_values  # noqa: F401 (re-exported)
from shared_rl.config import ConfigError
from shared_rl.domain import StepLogProbs
from shared_rl.rollout import Rollout
from shared_rl.tree import RolloutTree, is_leaf, tree_depth, tree_roots

from .egrpo import EGRPOSettings

__all__ = [
    "StepSegment", "Level", "Forest", "grow_forest", "recompute_forest", "forest_payload",
    "BranchSettings", "TreeGRPOSettings", "EGRPOSettings", "TreeSettings",
    "branch_levels", "treegrpo_levels", "fused_values", "tree_leaf_zscore",
    "TreeContext", "TreeRolloutEngine",
]


# ================================================================================================ advantages
def fused_values(parent: torch.Tensor, leaf_reward: torch.Tensor, edge_logp: torch.Tensor | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
    """BranchGRPO reward fusion: a node's value from its children's, bottom-up.

    ``edge_logp`` None: ``v(i) = mean of the leaf rewards below i`` (uniform fusion = ``shared_rl`` ``tree_values``).
    Given (``[N]``, the log-prob of the edge into each node), children are weighted by a softmax of their edge
    log-probs: ``v(i) = sum_c softmax_c(logp_c / temperature) v(c)`` (the weighted variant of the paper). Leaves with
    NaN reward are left out (a node with no finite child value is NaN).
    """
    parent = torch.as_tensor(parent, dtype=torch.long)
    r = torch.as_tensor(leaf_reward, dtype=torch.float64)
    if edge_logp is None:
        return tree_values(parent, r)
    logp = torch.as_tensor(edge_logp, dtype=torch.float64)
    depth = tree_depth(parent)
    value = torch.where(is_leaf(parent), r, torch.full_like(r, float("nan")))
    for d in range(int(depth.max()) if depth.numel() else 0, 0, -1):
        kids = torch.nonzero((depth == d) & torch.isfinite(value)).flatten()
        for p in torch.unique(parent[kids]).tolist():
            c = kids[parent[kids] == p]
            w = torch.softmax(logp[c] / temperature, 0)
            value[p] = (w * value[c]).sum()
    return value.float()


# ================================================================================================ engine
@dataclass
class StepSegment:
    """Executed steps shared by every parent of a level: ``[L]`` arrays (see the module docstring)."""

    sigma: torch.Tensor
    sigma_next: torch.Tensor
    timestep: torch.Tensor
    sde: torch.Tensor
    train: torch.Tensor
    noise_level: torch.Tensor
    grid_steps: list[tuple[int, int]] = field(default_factory=list)  # (first grid step, grid steps spanned)

    def __len__(self) -> int:
        return int(self.sigma.numel())

    @staticmethod
    def from_grid(sigmas: torch.Tensor, timesteps: torch.Tensor, steps: Sequence[tuple[int, int]],
                  sde: Sequence[bool], train: Sequence[bool], noise_level: Sequence[float]) -> "StepSegment":
        """Steps ``(i, k)`` of the scheduler grid: ``sigmas[i] -> sigmas[i + k]`` at model timestep ``timesteps[i]``."""
        sig = sigmas.detach().float().cpu()
        ts = timesteps.detach().float().cpu()
        first = torch.tensor([i for i, _ in steps], dtype=torch.long)
        last = torch.tensor([i + k for i, k in steps], dtype=torch.long)
        num = int(ts.numel())
        if bool((first < 0).any()) or bool((last > num).any()) or any(k < 1 for _, k in steps):
            raise ValueError(f"grid steps {list(steps)} do not fit a schedule of {num} steps")
        train_t = torch.tensor(list(train), dtype=torch.bool)
        sde_t = torch.tensor(list(sde), dtype=torch.bool)
        if bool((train_t & ~sde_t).any()):
            raise ValueError("a trained step must be an SDE step")
        if bool((train_t & (last >= num)).any()):
            raise ValueError("the final denoising step is never trained (its near-zero noise makes the density explode)")
        return StepSegment(sig[first], sig[last], ts[first], sde_t, train_t,
                           torch.tensor(list(noise_level), dtype=torch.float32), list(steps))


@dataclass
class Level:
    """How the ``P`` frontier nodes of one depth expand: ``branch[p]`` children per parent, each running executed
    steps ``0..length[p]-1`` of its parent's ``[P, L]`` rows (padding beyond ``length`` is ignored)."""

    branch: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    timestep: torch.Tensor
    sde: torch.Tensor
    train: torch.Tensor
    noise_level: torch.Tensor
    length: torch.Tensor

    @staticmethod
    def uniform(num_parents: int, branch: int, seg: StepSegment) -> "Level":
        def rows(x: torch.Tensor) -> torch.Tensor:
            return x.unsqueeze(0).expand(num_parents, -1).clone()

        return Level(torch.full((num_parents,), int(branch), dtype=torch.long), rows(seg.sigma), rows(seg.sigma_next),
                     rows(seg.timestep), rows(seg.sde), rows(seg.train), rows(seg.noise_level),
                     torch.full((num_parents,), len(seg), dtype=torch.long))

    @staticmethod
    def stack(branches: Sequence[int], segments: Sequence[StepSegment]) -> "Level":
        """One row per parent, each with its own segment (E-GRPO: every tree starts at its own merged step)."""
        L = max(len(s) for s in segments)

        def pad(x: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((L,), fill, dtype=x.dtype)
            out[: x.numel()] = x
            return out

        return Level(
            torch.tensor(list(branches), dtype=torch.long),
            torch.stack([pad(s.sigma, 0.0) for s in segments]),
            torch.stack([pad(s.sigma_next, 0.0) for s in segments]),
            torch.stack([pad(s.timestep, 0.0) for s in segments]),
            torch.stack([pad(s.sde, False) for s in segments]),
            torch.stack([pad(s.train, False) for s in segments]),
            torch.stack([pad(s.noise_level, 0.0) for s in segments]),
            torch.tensor([len(s) for s in segments], dtype=torch.long),
        )


@dataclass
class Forest:
    """A grown forest; every ``[N, ...]`` array is indexed by node id (row ``i`` = the edge into node ``i``)."""

    tree: RolloutTree
    latents: torch.Tensor  # [N, L+1, *latent]: column j = input of executed step j, column length = node latent
    node_latent: torch.Tensor  # [N, *latent]
    sigma: torch.Tensor  # [N, L]
    sigma_next: torch.Tensor
    timestep: torch.Tensor
    noise_level: torch.Tensor
    sde: torch.Tensor  # [N, L] bool
    train: torch.Tensor  # [N, L] bool (the method's trained steps, before pruning)
    length: torch.Tensor  # [N] long
    logp: torch.Tensor  # [N, L]
    std: torch.Tensor  # [N, L]
    fwd_id: torch.Tensor  # [N, L] long: which rollout forward computed the velocity of the step (-1: none)
    fwd_slot: torch.Tensor  # [N, L] long: the row of that forward
    nfe: int  # model evaluations per sample (CFG counts 2)
    forwards: int  # transformer calls
    level_nodes: list[torch.Tensor] = field(default_factory=list)

    def leaves(self) -> torch.Tensor:
        return self.tree.leaves()


class _Forwarder:
    """Runs batched velocity calls in chunks and names each call (fwd id) so recomputation can re-form it."""

    def __init__(self, adapter, micro_batch: int, next_id: int = 0) -> None:
        self.adapter = adapter
        self.micro_batch = micro_batch
        self.next_id = next_id
        self.nfe = 0
        self.calls = 0

    def __call__(self, x: torch.Tensor, t: torch.Tensor, cond) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        size = self.micro_batch if 0 < self.micro_batch < n else n
        vs, ids, slots = [], [], []
        for start in range(0, n, size):
            sl = slice(start, min(start + size, n))
            c = cond[torch.arange(sl.start, sl.stop)]
            vs.append(self.adapter.velocity(x[sl], t[sl], c))
            m = sl.stop - sl.start
            ids.append(torch.full((m,), self.next_id, dtype=torch.long))
            slots.append(torch.arange(m))
            self.next_id += 1
            self.calls += 1
            self.nfe += self.adapter.forwards_per_step(c) * m
        return torch.cat(vs), torch.cat(ids), torch.cat(slots)


@torch.no_grad()
def grow_forest(
    adapter,
    root_cond,
    root_latents: torch.Tensor,
    levels: Sequence[Level | tuple[int, StepSegment]],
    generator: torch.Generator | None,
    kernel: str,
    reduction: str = "mean",
    micro_batch: int = 0,
    first_forward_id: int = 0,
    first_velocity: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> Forest:
    """Grow one tree per root, level by level; each level is one batched forward per executed step.

    Args:
        adapter: a ``visgen.pipelines`` adapter (``as_adapter(pipe)``).
        root_cond: ``Conditioning`` with one row per root. root_latents: ``[R, *latent]`` float32.
        levels: per depth, a :class:`Level` (per-parent rows) or ``(branch, StepSegment)`` shared by all parents.
        generator: the noise source. Per level and executed step one ``[children, *latent]`` standard-normal tensor
            is drawn on the CPU (whatever the batching), so ``micro_batch`` (1 = node by node) changes nothing but
            float rounding.
        first_velocity: ``(v [R, ...], fwd ids [R], slots [R])`` of the roots at the first level's step 0 when the
            caller already computed it in a named forward (E-GRPO's anchor path); those forwards are not re-run.
        kernel: ``sde`` / ``cps`` / ``dance`` for SDE steps (ODE steps use the Euler formula); ``reduction``: how
            log-probs reduce over latent elements.
    """
    from shared_rl.flow_kernels import flow_step

    R = root_latents.shape[0]
    device = root_latents.device
    lat_shape = tuple(root_latents.shape[1:])
    tree = RolloutTree.roots(R)
    fwd = _Forwarder(adapter, micro_batch, first_forward_id)
    built = [lv if isinstance(lv, Level) else None for lv in levels]
    L = 0
    for lv in levels:
        L = max(L, int(lv.sigma.shape[1]) if isinstance(lv, Level) else len(lv[1]))
    # per-node storage, grown as nodes appear
    node_latent = [root_latents.float()]
    cols = {k: [] for k in ("latents", "sigma", "sigma_next", "timestep", "noise_level", "sde", "train", "length",
                            "logp", "std", "fwd_id", "fwd_slot")}

    def add_rows(n: int, **given) -> None:
        defaults = {
            "latents": lambda: torch.zeros((n, L + 1, *lat_shape), device=device),
            "sigma": lambda: torch.zeros(n, L), "sigma_next": lambda: torch.zeros(n, L),
            "timestep": lambda: torch.zeros(n, L), "noise_level": lambda: torch.zeros(n, L),
            "sde": lambda: torch.zeros(n, L, dtype=torch.bool), "train": lambda: torch.zeros(n, L, dtype=torch.bool),
            "length": lambda: torch.zeros(n, dtype=torch.long), "logp": lambda: torch.zeros(n, L),
            "std": lambda: torch.zeros(n, L),
            "fwd_id": lambda: torch.full((n, L), -1, dtype=torch.long),
            "fwd_slot": lambda: torch.full((n, L), -1, dtype=torch.long),
        }
        for k in cols:
            cols[k].append(given[k] if k in given else defaults[k]())

    roots_lat = torch.zeros((R, L + 1, *lat_shape), device=device)
    roots_lat[:, 0] = root_latents.float()
    add_rows(R, latents=roots_lat)
    level_nodes = []
    for d, spec in enumerate(levels):
        parents = tree.frontier()
        P = parents.numel()
        lv = built[d] if built[d] is not None else Level.uniform(P, spec[0], spec[1])
        if lv.branch.numel() != P:
            raise ValueError(f"level {d} describes {lv.branch.numel()} parents, the frontier has {P}")
        if bool((lv.length < 1).any()):
            raise ValueError(f"level {d}: every edge needs at least one executed step")
        if bool(((lv.branch > 1) & ~lv.sde[:, 0]).any()):
            raise ValueError(f"level {d}: a node that branches must branch on an SDE step (an ODE step would give "
                             "identical children)")
        Lv = int(lv.sigma.shape[1])

        def widen(x: torch.Tensor, fill) -> torch.Tensor:
            if x.shape[1] == L:
                return x
            out = torch.full((x.shape[0], L), fill, dtype=x.dtype)
            out[:, :Lv] = x
            return out

        children = tree.expand(parents, lv.branch)
        level_nodes.append(children)
        rep = torch.repeat_interleave(torch.arange(P), lv.branch)
        C = children.numel()
        par_lat = torch.cat(node_latent)[parents]
        cond_par = root_cond[tree.group[parents]]
        cond_ch = cond_par[rep]
        sig, sig_n, ts = widen(lv.sigma, 0.0)[rep], widen(lv.sigma_next, 0.0)[rep], widen(lv.timestep, 0.0)[rep]
        sde, train, lvl = widen(lv.sde, False)[rep], widen(lv.train, False)[rep], widen(lv.noise_level, 0.0)[rep]
        length = lv.length[rep]
        lat = torch.zeros((C, L + 1, *lat_shape), device=device)
        logp, std = torch.zeros(C, L), torch.zeros(C, L)
        fid, fslot = torch.full((C, L), -1, dtype=torch.long), torch.full((C, L), -1, dtype=torch.long)
        x = par_lat[rep].clone()
        lat[:, 0] = x
        for j in range(int(length.max())):
            noise = None
            if kernel != "ode":
                noise = torch.randn((C, *lat_shape), generator=generator).to(device)
            rows = torch.nonzero(length > j).flatten()
            if j == 0:  # shared by siblings: one forward per parent
                if d == 0 and first_velocity is not None:  # computed by the caller (E-GRPO's anchor pass)
                    v_par, ids, slots = first_velocity
                else:
                    v_par, ids, slots = fwd(par_lat, lv.timestep[:, 0].to(device), cond_par)
                v = v_par[rep]
                fid[:, 0], fslot[:, 0] = ids[rep], slots[rep]
            else:
                v, ids, slots = fwd(x[rows], ts[rows, j].to(device), cond_ch[rows.to(device)])
                fid[rows, j], fslot[rows, j] = ids, slots
            dev_rows = rows.to(device)
            out = flow_step(kernel, x[dev_rows], v, sig[rows, j].to(device), sig_n[rows, j].to(device),
                            lvl[rows, j].to(device), noise=None if noise is None else noise[dev_rows],
                            stochastic=sde[rows, j].to(device), reduction=reduction)
            x[dev_rows] = out.next_sample
            lat[dev_rows, j + 1] = out.next_sample
            logp[rows, j] = out.log_prob.float().cpu()
            std[rows, j] = out.std.reshape(-1).float().cpu()
        tree.set_edge_logp(children, logp.sum(1))
        node_latent.append(x)
        add_rows(C, latents=lat, sigma=sig, sigma_next=sig_n, timestep=ts, noise_level=lvl, sde=sde, train=train,
                 length=length, logp=logp, std=std, fwd_id=fid, fwd_slot=fslot)
    cat = {k: torch.cat(v) for k, v in cols.items()}
    tree.trainable = (tree.parent >= 0) & cat["train"].any(1)
    return Forest(tree=tree, latents=cat["latents"], node_latent=torch.cat(node_latent), sigma=cat["sigma"],
                  sigma_next=cat["sigma_next"], timestep=cat["timestep"], noise_level=cat["noise_level"],
                  sde=cat["sde"], train=cat["train"], length=cat["length"], logp=cat["logp"], std=cat["std"],
                  fwd_id=cat["fwd_id"], fwd_slot=cat["fwd_slot"], nfe=fwd.nfe, forwards=fwd.calls,
                  level_nodes=level_nodes)


def forest_payload(forest: Forest, cond_tensors_per_node: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The Rollout payload of a forest: everything :func:`recompute_forest` reads, indexed by node."""
    return {
        "latents": forest.latents, "sigma": forest.sigma, "sigma_next": forest.sigma_next,
        "timestep": forest.timestep, "noise_level": forest.noise_level, "sde": forest.sde,
        "fwd_id": forest.fwd_id, "fwd_slot": forest.fwd_slot, "cond": cond_tensors_per_node,
    }


@dataclass
class RecomputedEdges:
    logp: torch.Tensor  # [n, L] with grad (0 where not recomputed)
    kl: torch.Tensor | None
    entropy: torch.Tensor  # [n, L]
    nfe: int


def recompute_forest(
    adapter,
    payload: dict[str, Any],
    steps: torch.Tensor,
    cond,
    kernel: str,
    reduction: str = "mean",
    reference: Callable[[], ContextManager] | None = None,
    kl_type: str = "mean",
) -> RecomputedEdges:
    """Log-probs (with grad) of the stored executed steps ``steps[i, j]`` of edges ``i`` (rows of a forest payload).

    Rows are grouped by the rollout forward that computed each step (``fwd_id``); within a group the distinct
    inputs (``fwd_slot``: siblings share their parent's slot at step 0) are forwarded once, in rollout order, and
    scattered back. When a call holds every row of those rollout forwards, each forward sees exactly its rollout
    batch and the log-probs equal ``logp_old`` bit for bit. ``reference`` (a context-manager factory switching to
    the reference model) adds the Flow-GRPO KL: ``kl_type="mean"`` ``||mu - mu_ref||^2 / (2 std^2)`` or
    ``"velocity"`` ``||v - v_ref||^2`` (mean over latent elements).
    """
    from shared_rl.flow_kernels import flow_step, gaussian_entropy, sde_mean_kl

    steps = steps.bool().cpu()
    n, L = steps.shape
    lat = payload["latents"]
    device = lat.device
    numel = int(lat[0, 0].numel())
    fid, fslot = payload["fwd_id"].cpu(), payload["fwd_slot"].cpu()
    per_forward = adapter.forwards_per_step(cond)
    work = []
    for j in range(L):
        rows = torch.nonzero(steps[:, j]).flatten()
        if rows.numel() == 0:
            continue
        if bool((fid[rows, j] < 0).any()):
            raise ValueError("asked to recompute a padding step (no rollout forward)")
        for key in torch.unique(fid[rows, j]).tolist():
            members = rows[fid[rows, j] == key]
            slots = fslot[members, j]
            uniq, inverse = torch.unique(slots, sorted=True, return_inverse=True)
            first = torch.full((uniq.numel(),), -1, dtype=torch.long)
            first.scatter_reduce_(0, inverse, torch.arange(members.numel()), "amin", include_self=False)
            work.append((j, members, members[first], inverse))

    def run(j, members, reps, inverse):
        d_m, d_r = members.to(device), reps.to(device)
        v_u = adapter.velocity(lat[d_r, j], payload["timestep"][reps, j].to(device), cond[d_r])
        v = v_u[inverse.to(device)]
        out = flow_step(kernel, lat[d_m, j], v, payload["sigma"][members, j].to(device),
                        payload["sigma_next"][members, j].to(device), payload["noise_level"][members, j].to(device),
                        next_sample=lat[d_m, j + 1], stochastic=payload["sde"][members, j].to(device),
                        reduction=reduction)
        return v, out

    nfe = 0
    refs = []
    if reference is not None:
        with torch.no_grad(), reference():
            for item in work:
                v_ref, out_ref = run(*item)
                refs.append((v_ref, out_ref.mean))
                nfe += per_forward * item[2].numel()
    logp = torch.zeros(n, L, device=device)
    kl = torch.zeros(n, L, device=device) if reference is not None else None
    entropy = torch.zeros(n, L, device=device)
    for w, item in enumerate(work):
        j, members = item[0], item[1]
        v, out = run(*item)
        nfe += per_forward * item[2].numel()
        d_m = members.to(device)
        col = torch.full_like(d_m, j)
        logp = logp.index_put((d_m, col), out.log_prob)
        entropy[d_m, j] = gaussian_entropy(out.std.detach().reshape(-1), numel, reduction)
        if kl is not None:
            v_ref, mean_ref = refs[w]
            if kl_type == "mean":
                value = sde_mean_kl(out.mean, mean_ref, out.std, reduction="mean")
            else:
                value = ((v - v_ref.float()) ** 2).flatten(1).mean(1)
            kl = kl.index_put((d_m, col), value)
    return RecomputedEdges(logp, kl, entropy, nfe)


# ================================================================================================ settings
def _err(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class BranchSettings:
    """BranchGRPO. ``split_steps`` (grid step indices) branch ``factor`` ways (one number for all, or one per
    split); 10 steps with splits [0, 2, 4, 6] and factor 2 give 16 leaves per prompt."""

    split_steps: list[int] = field(default_factory=lambda: [0, 2, 4, 6])
    factor: list[int] = field(default_factory=lambda: [2])
    split_noise_scale: float = 1.0  # noise level multiplier on split steps (stored log-probs use the scaled std)
    mix: bool = False  # BranchGRPO-Mix: SDE (trained) only at split steps and in sde_windows; ODE elsewhere
    sde_windows: list[list[int]] = field(default_factory=list)  # [[lo, hi), ...] extra SDE steps in mix mode
    fusion: Literal["mean", "logp_softmax"] = "mean"
    width_prune: Literal["none", "ratio", "best_worst"] = "none"  # on the leaf edges (after the last split)
    width_keep: float = 0.5  # fraction of leaf edges trained per tree with width_prune: ratio (by |advantage|)
    depth_prune: list[int] = field(default_factory=list)  # [lo, hi): edges into depths lo..hi-1 are not trained
    depth_prune_slide_every: int = 0  # > 0: the window moves one depth deeper every this many iterations

    def factors(self) -> list[int]:
        f = list(self.factor)
        return f * len(self.split_steps) if len(f) == 1 else f

    def check(self, where: str) -> None:
        _err(len(self.split_steps) >= 1, f"{where}.split_steps must list at least one grid step, e.g. [0, 2, 4, 6]")
        _err(sorted(set(self.split_steps)) == list(self.split_steps),
             f"{where}.split_steps must be strictly increasing, got {self.split_steps}")
        _err(len(self.factor) in (1, len(self.split_steps)),
             f"{where}.factor must be one number or one per split step ({len(self.split_steps)}), got {self.factor}")
        _err(all(f >= 1 for f in self.factor), f"{where}.factor values must be >= 1, got {self.factor}")
        _err(self.split_noise_scale > 0, f"{where}.split_noise_scale must be > 0, got {self.split_noise_scale}")
        _err(0 < self.width_keep <= 1, f"{where}.width_keep must be in (0, 1], got {self.width_keep}")
        _err(len(self.depth_prune) in (0, 2), f"{where}.depth_prune must be [] or [lo, hi), got {self.depth_prune}")
        if self.depth_prune:
            _err(1 <= self.depth_prune[0] < self.depth_prune[1],
                 f"{where}.depth_prune must be [lo, hi) with 1 <= lo < hi (depth 1 = the first edges), got {self.depth_prune}")
        for w in self.sde_windows:
            _err(len(w) == 2 and 0 <= w[0] < w[1], f"{where}.sde_windows entries must be [lo, hi), got {w}")
        _err(self.fusion == "mean", f"{where}.fusion: 'logp_softmax' needs log-probs inside the shared trainer's tree "
             "estimator, which it does not pass yet; use 'mean' (visgen.trees.fused_values offers the weighted form)")

    def leaves(self) -> int:
        return math.prod(self.factors())


@dataclass
class TreeGRPOSettings:
    """TreeGRPO. ODE outside an SDE window of ``len(branch)`` consecutive grid steps; window step ``w`` branches
    ``branch[w]`` ways (e.g. [2, 2, 2, 2] -> 16 leaves). The window start is drawn per rollout call from
    ``[range_start, range_end - len(branch)]`` (range_end None: the first half of the schedule), or fixed by
    ``window_start``."""

    branch: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
    window_start: Optional[int] = None
    range_start: int = 0
    range_end: Optional[int] = None

    def check(self, where: str) -> None:
        _err(len(self.branch) >= 1 and all(b >= 1 for b in self.branch),
             f"{where}.branch must list factors >= 1 (one per window step), got {self.branch}")
        _err(self.range_start >= 0, f"{where}.range_start must be >= 0, got {self.range_start}")

    def leaves(self) -> int:
        return math.prod(self.branch)

    def bounds(self, num_steps: int) -> tuple[int, int]:
        size = len(self.branch)
        end = self.range_end if self.range_end is not None else max(num_steps // 2, self.range_start + size)
        end = min(end, num_steps - 1)
        _err(end - self.range_start >= size, f"tree.tree: a window of {size} steps does not fit in grid steps "
             f"[{self.range_start}, {end}) of {num_steps} (the final step is never trained)")
        return self.range_start, end


@dataclass
class TreeSettings:
    """The ``visgen.tree`` section: ``method: none`` is the flat rollout of the domain; otherwise one of
    ``branch`` (BranchGRPO, also -Mix and pruning), ``tree`` (TreeGRPO), ``egrpo`` (E-GRPO)."""

    method: Literal["none", "branch", "tree", "egrpo"] = "none"
    branch: BranchSettings = field(default_factory=BranchSettings)
    tree: TreeGRPOSettings = field(default_factory=TreeGRPOSettings)
    egrpo: EGRPOSettings = field(default_factory=EGRPOSettings)
    prune_reward: Optional[str] = None  # reward output that width pruning ranks by (None: the first)
    node_by_node: bool = False  # expand one node per forward (the slow baseline of the benchmark)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def check(self, where: str) -> None:
        pass

    def check_steps(self, num_steps: int, where: str = "visgen.tree") -> None:
        """Checks that need the number of denoising steps (run from the domain config's check)."""
        if self.method == "branch":
            b = self.branch
            _err(all(0 <= s < num_steps - 1 for s in b.split_steps),
                 f"{where}.branch.split_steps must lie in 0..{num_steps - 2} (the final step cannot branch), got "
                 f"{b.split_steps}")
        elif self.method == "tree":
            self.tree.bounds(num_steps)
            if self.tree.window_start is not None:
                lo = self.tree.window_start
                _err(0 <= lo and lo + len(self.tree.branch) <= num_steps - 1,
                     f"{where}.tree.window_start {lo} + {len(self.tree.branch)} steps must end before the final step")
        elif self.method == "egrpo":
            self.egrpo.check_steps(num_steps, where + ".egrpo")



# ================================================================================================ method levels
def branch_levels(s: BranchSettings, sigmas: torch.Tensor, timesteps: torch.Tensor, base_noise: float,
                  iteration: int = 0) -> list[tuple[int, StepSegment]]:
    """BranchGRPO levels: segments between split steps (a factor-1 prefix when the first split is not step 0).

    Non-mix: every grid step SDE and trained except the final one. Mix: SDE (trained) only at split steps and
    inside ``sde_windows``; ODE (untrained) elsewhere. Split steps use ``base_noise * split_noise_scale``.
    """
    T = int(timesteps.numel())
    splits = list(s.split_steps)
    factor = dict(zip(splits, s.factors()))
    bounds = sorted(set([0] + splits + [T]))
    in_window = torch.zeros(T, dtype=torch.bool)
    for lo, hi in s.sde_windows:
        in_window[lo:min(hi, T)] = True
    levels = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        steps = [(i, 1) for i in range(a, b)]
        sde = [(not s.mix) or (i in factor) or bool(in_window[i]) for i in range(a, b)]
        train = [sd and i < T - 1 for sd, i in zip(sde, range(a, b))]
        noise = [base_noise * (s.split_noise_scale if i in factor else 1.0) for i in range(a, b)]
        levels.append((factor.get(a, 1), StepSegment.from_grid(sigmas, timesteps, steps, sde, train, noise)))
    return levels


def treegrpo_window(s: TreeGRPOSettings, num_steps: int, generator: torch.Generator | None) -> int:
    if s.window_start is not None:
        return int(s.window_start)
    lo, hi = s.bounds(num_steps)
    return int(torch.randint(lo, hi - len(s.branch) + 1, (1,), generator=generator))


def treegrpo_levels(s: TreeGRPOSettings, sigmas: torch.Tensor, timesteps: torch.Tensor, base_noise: float,
                    start: int) -> list[tuple[int, StepSegment]]:
    """TreeGRPO levels: an ODE prefix (factor 1, untrained) to the window, one SDE step per window level branching
    ``branch[w]`` ways; the last window level carries the ODE tail to the end of the schedule."""
    T = int(timesteps.numel())
    W = len(s.branch)
    levels = []
    if start > 0:
        levels.append((1, StepSegment.from_grid(sigmas, timesteps, [(i, 1) for i in range(start)],
                                                [False] * start, [False] * start, [0.0] * start)))
    for w in range(W):
        i = start + w
        tail = list(range(i + 1, T)) if w == W - 1 else []
        steps = [(i, 1)] + [(t, 1) for t in tail]
        sde = [True] + [False] * len(tail)
        train = [i < T - 1] + [False] * len(tail)
        noise = [base_noise] + [0.0] * len(tail)
        levels.append((s.branch[w], StepSegment.from_grid(sigmas, timesteps, steps, sde, train, noise)))
    return levels


# ================================================================================================ domain engine
@dataclass
class TreeContext:
    """What the engine needs from a visgen domain (or a test): the model, prompts, rewards and sampling settings."""

    adapter: Any
    prompts: list[str]
    metas: list[dict]
    score: Callable[[torch.Tensor, list[str], list[dict]], dict[str, torch.Tensor]]
    num_inference_steps: int = 10
    guidance_scale: float = 1.0
    kernel: str = "sde"
    noise_level: float = 0.7
    reduction: str = "mean"
    micro_batch: int = 0
    sample_kwargs: dict[str, Any] = field(default_factory=dict)
    reference: Callable[[], ContextManager] | None = None
    kl_type: str = "mean"

    @staticmethod
    def from_domain(domain) -> "TreeContext":
        cfg = domain.cfg
        return TreeContext(
            adapter=domain.adapter, prompts=domain.train_prompts, metas=domain.train_meta, score=domain.score,
            num_inference_steps=cfg.num_inference_steps, guidance_scale=cfg.guidance_scale, kernel=cfg.sampler,
            noise_level=domain._noise_level(), reduction=cfg.reduction, micro_batch=cfg.rollout_micro_batch,
            sample_kwargs=domain._sample_kwargs(), reference=domain.policy.reference, kl_type=cfg.kl_type,
        )


class TreeRolloutEngine:
    """``rollout`` / ``log_probs`` of the visgen domain for tree methods (see the module docstring)."""

    def __init__(self, ctx: TreeContext, settings: TreeSettings) -> None:
        if not settings.enabled:
            raise ValueError("TreeRolloutEngine needs tree.method branch, tree or egrpo")
        self.ctx = ctx
        self.s = settings
        self._next_forward = 0
        self._cond_meta: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------------ helpers
    def encode(self, prompts: list[str]):
        c = self.ctx
        return c.adapter.encode_prompts(prompts, num_images_per_prompt=1, guidance_scale=c.guidance_scale,
                                        **c.sample_kwargs)

    def _remember_cond(self, cond) -> None:
        self._cond_meta = {"guidance_scale": cond.guidance_scale, "do_cfg": cond.do_cfg, "height": cond.height,
                           "width": cond.width, "shared": cond.shared, "options": cond.options}

    def grow(self, keys: list[int], generator: torch.Generator, iteration: int) -> tuple[Forest, Any, list[int], dict]:
        """Sample the forest for prompt ids ``keys``; returns (forest, root conditioning, root keys, info)."""
        c = self.ctx
        prompts = [c.prompts[k] for k in keys]
        cond = self.encode(prompts)
        sigmas, timesteps = c.adapter.schedule(c.num_inference_steps, cond)
        micro = 1 if self.s.node_by_node else c.micro_batch
        info: dict[str, float] = {}
        if self.s.method == "egrpo":
            from .egrpo import egrpo_forest

            forest, root_cond, root_keys, info = egrpo_forest(
                c.adapter, cond, list(keys), sigmas, timesteps, self.s.egrpo, generator, c.kernel, c.noise_level,
                c.reduction, micro, self._next_forward)
        else:
            x0 = c.adapter.prepare_latents(len(keys), cond, generator)
            if self.s.method == "branch":
                levels = branch_levels(self.s.branch, sigmas, timesteps, c.noise_level, iteration)
            else:
                start = treegrpo_window(self.s.tree, int(timesteps.numel()), generator)
                levels = treegrpo_levels(self.s.tree, sigmas, timesteps, c.noise_level, start)
                info["tree/window_start"] = float(start)
            forest = grow_forest(c.adapter, cond, x0, levels, generator, c.kernel, c.reduction, micro,
                                 self._next_forward)
            root_cond, root_keys = cond, list(keys)
        self._next_forward += forest.forwards + 1
        return forest, root_cond, root_keys, info

    def decode_leaves(self, forest: Forest, root_cond) -> tuple[torch.Tensor, torch.Tensor]:
        leaves = forest.leaves()
        cond = root_cond[forest.tree.group[leaves]]
        x = forest.node_latent[leaves.to(forest.node_latent.device)]
        size = self.ctx.micro_batch or x.shape[0]
        imgs = [self.ctx.adapter.decode(x[i:i + size], cond[torch.arange(i, min(i + size, x.shape[0]))])
                for i in range(0, x.shape[0], size)]
        return leaves, torch.cat(imgs)

    def _prune(self, forest: Forest, rewards: dict[str, torch.Tensor], iteration: int) -> None:
        """BranchGRPO width / depth pruning: edges whose steps are not trained this iteration."""
        b = self.s.branch
        tree = forest.tree
        if b.depth_prune:
            lo, hi = b.depth_prune
            if b.depth_prune_slide_every:
                D = int(tree.depth.max())
                shift = iteration // b.depth_prune_slide_every
                lo = 1 + (lo - 1 + shift) % D
                hi = lo + (b.depth_prune[1] - b.depth_prune[0])
            tree.mask_depth_window(lo, hi)
        if b.width_prune != "none":
            name = self.s.prune_reward or next(iter(rewards))
            adv = tree_advantages(tree.parent, rewards[name], "depth_zscore")
            keep = "best_worst" if b.width_prune == "best_worst" else b.width_keep
            tree.mask_width(adv, int(tree.depth.max()), keep)

    # ------------------------------------------------------------------------------------------------ protocol
    @torch.no_grad()
    def rollout(self, keys: list[int], generator: torch.Generator, iteration: int) -> Rollout:
        c = self.ctx
        t0 = time.perf_counter()
        forest, root_cond, root_keys, info = self.grow(keys, generator, iteration)
        leaves, images = self.decode_leaves(forest, root_cond)
        t1 = time.perf_counter()
        tree = forest.tree
        group_prompt = [c.prompts[k] for k in root_keys]
        group_meta = [c.metas[k] for k in root_keys]
        lg = tree.group[leaves].tolist()
        scores = c.score(images, [group_prompt[g] for g in lg], [group_meta[g] for g in lg])
        for name, value in scores.items():
            tree.set_leaf_rewards(name, leaves, torch.as_tensor(value).float().reshape(-1))
        t2 = time.perf_counter()
        if self.s.method == "branch":
            self._prune(forest, tree.rewards, iteration)
        mask = forest.train & tree.trainable[:, None] & forest.sde
        self._remember_cond(root_cond)
        node_cond = {k: v[tree.group.to(v.device)] for k, v in root_cond.tensors.items()}
        n_leaves = int(leaves.numel())
        info.update({
            "time/sample": t1 - t0, "time/reward": t2 - t1,
            "tree/nodes": float(len(tree)), "tree/leaves": float(n_leaves),
            "tree/trained_edges": float(mask.any(1).sum()),
            "nfe/rollout_per_leaf": forest.nfe / max(n_leaves, 1),
        })
        return Rollout(keys=root_keys, group_ids=tree.group.clone(), rewards=dict(tree.rewards),
                       logp_old=forest.logp.clone(), mask=mask, parent=tree.parent.clone(),
                       payload=forest_payload(forest, node_cond), nfe=forest.nfe, info=info)

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool) -> StepLogProbs:
        from .pipelines import Conditioning

        if self._cond_meta is None:
            raise RuntimeError("log_probs before any rollout: the prompt-conditioning settings are unknown")
        c = self.ctx
        p = rollout.index_payload(idx)
        cond = Conditioning(p["cond"], **self._cond_meta)
        rec = recompute_forest(c.adapter, p, rollout.mask[idx], cond, c.kernel, c.reduction,
                               reference=c.reference if need_kl else None, kl_type=c.kl_type)
        dev = rollout.logp_old.device
        return StepLogProbs(logp=rec.logp.to(dev), kl=None if rec.kl is None else rec.kl.to(dev),
                            entropy=rec.entropy.to(dev), nfe=rec.nfe)
