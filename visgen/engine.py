"""The one visgen rollout engine: batched forests of denoising steps over stock flow-matching pipelines.

Every visgen rollout is a forest grown level by level with ``shared_rl.tree.RolloutTree`` — a flat GRPO group is
a forest of depth one (one unbranched chain per sample, :meth:`Level.from_plan`), BranchGRPO / TreeGRPO / E-GRPO
grow deeper or wider ones (``visgen.methods``). Node ``i`` is a latent; the *edge* into node ``i`` is a segment of
executed denoising steps that starts at the parent's latent. One level expands **every frontier node of every tree
in one batched forward per step** (split into rollout micro-batches only when asked), and each node's latent is
computed exactly once (prefix sharing):

- step 0 of a level starts at the parent's latent, so its velocity is computed **once per parent** and shared by
  the parent's ``b`` children, which differ only by their noise (TreeGRPO's "several children per forward");
- steps 1.. run over the children's own latents.

An executed step goes ``sigma -> sigma_next`` with the model timestep of ``sigma``; ordinarily that is one step of
the scheduler's grid, E-GRPO's merged step spans several grid steps (``sigma_i -> sigma_{i+k}``). Each executed
step is SDE (the configured kernel of ``shared_rl.flow_kernels.flow_step``) or ODE, trained or not, with its own
noise level: a split step whose noise is scaled stores the log-prob **of the scaled Gaussian it was actually drawn
from** (the public BranchGRPO code scales split noise x4 but scores it with the unscaled std; we do not).

Per node and executed step the forest stores what recomputation needs (``forest_payload``): the step's input
latents, sigma, sigma_next, model timestep, noise level, SDE flag, and *which rollout forward, at which row*,
computed its velocity (``fwd_id``/``fwd_slot``). ``visgen.recompute.recompute_edges`` re-forms those forwards, so for
the same layout the recomputed log-probs equal the stored ones bit for bit (importance ratio exactly 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from shared_rl.flow_kernels import StepOutput, dpm2_step, flow_step
from shared_rl.tree import RolloutTree

__all__ = ["StepSegment", "Level", "Forest", "Forwarder", "grow_forest", "forest_payload"]


def stock_randn_tensor(*args, **kwargs) -> torch.Tensor:
    """diffusers' ``randn_tensor`` (the noise the stock pipelines draw), imported on first use: diffusers' import
    costs ~3 s that a config check does not need."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(*args, **kwargs)


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
    def from_plan(sde: torch.Tensor, train: torch.Tensor, sigmas: torch.Tensor, timesteps: torch.Tensor,
                  noise_level: float) -> "Level":
        """A depth-one level of ``B`` unbranched chains over the whole grid, one per row of a step plan
        (``sde``/``train``: ``[B, T]``): the flat rollout of Flow-GRPO, DanceGRPO, Flow-GRPO-Fast and MixGRPO."""
        B, T = sde.shape
        if int(timesteps.numel()) != T:
            raise ValueError(f"step plan has {T} steps, the schedule {int(timesteps.numel())}")
        sig = sigmas.detach().float().cpu()
        ts = timesteps.detach().float().cpu()

        def rows(x: torch.Tensor) -> torch.Tensor:
            return x.unsqueeze(0).expand(B, -1).clone()

        return Level(torch.ones(B, dtype=torch.long), rows(sig[:-1]), rows(sig[1:]), rows(ts), sde.bool().cpu().clone(),
                     train.bool().cpu().clone(), torch.full((B, T), float(noise_level)),
                     torch.full((B,), T, dtype=torch.long))

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
    means: torch.Tensor | None = None  # [N, L, *latent] step means when grown with keep_means

    @property
    def num_nodes(self) -> int:
        return len(self.tree)

    def leaves(self) -> torch.Tensor:
        return self.tree.leaves()


class Forwarder:
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
    keep_means: bool = False,
    ode_solver: str = "euler",
) -> Forest:
    """Grow one tree per root, level by level; each level is one batched forward per executed step.

    Args:
        adapter: a ``visgen.pipelines`` adapter (``as_adapter(pipe)``).
        root_cond: ``Conditioning`` with one row per root. root_latents: ``[R, *latent]`` float32.
        levels: per depth, a :class:`Level` (per-parent rows) or ``(branch, StepSegment)`` shared by all parents.
        generator: the noise source (one generator, or one per child of a single level as the stock pipelines
            accept). Per level and executed step one ``[children, *latent]`` standard-normal tensor is drawn (on the
            generator's device, as ``diffusers.utils.torch_utils.randn_tensor`` does), whatever the batching, so
            ``micro_batch`` (1 = node by node) changes nothing but float rounding.
        first_velocity: ``(v [R, ...], fwd ids [R], slots [R])`` of the roots at the first level's step 0 when the
            caller already computed it in a named forward (E-GRPO's anchor path); those forwards are not re-run.
        kernel: ``sde`` / ``cps`` / ``dance`` for SDE steps (ODE steps use the Euler formula); ``reduction``: how
            log-probs reduce over latent elements. ``keep_means``: also store every executed step's Gaussian mean.
        ode_solver: ``euler`` (every ODE step the Euler formula) or ``dpm2`` (DiffusionOPSD's rollout sampler: the
            multistep DPM-Solver++(2M) of ``shared_rl.flow_kernels.dpm2_step``, for all-ODE chains of one level).
    """
    if ode_solver not in ("euler", "dpm2"):
        raise ValueError(f"ode_solver must be 'euler' or 'dpm2', got {ode_solver!r}")
    if ode_solver == "dpm2" and (len(levels) != 1 or not isinstance(levels[0], Level) or bool(levels[0].sde.any())):
        raise ValueError("the dpm2 solver runs deterministic chains of one level (visgen.method dpm2), no SDE step")

    R = root_latents.shape[0]
    device = root_latents.device
    lat_shape = tuple(root_latents.shape[1:])
    tree = RolloutTree.roots(R)
    fwd = Forwarder(adapter, micro_batch, first_forward_id)
    built = [lv if isinstance(lv, Level) else None for lv in levels]
    L = 0
    for lv in levels:
        L = max(L, int(lv.sigma.shape[1]) if isinstance(lv, Level) else len(lv[1]))
    # per-node storage, grown as nodes appear
    node_latent = [root_latents.float()]
    cols = {k: [] for k in ("latents", "sigma", "sigma_next", "timestep", "noise_level", "sde", "train", "length",
                            "logp", "std", "fwd_id", "fwd_slot") + (("means",) if keep_means else ())}

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
            "means": lambda: torch.zeros((n, L, *lat_shape), device=device),
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
        means = torch.zeros((C, L, *lat_shape), device=device) if keep_means else None
        x = par_lat[rep].clone()
        lat[:, 0] = x
        x0_prev = None  # dpm2: the previous step's clean prediction
        for j in range(int(length.max())):
            noise = None
            if kernel != "ode":
                noise = stock_randn_tensor((C, *lat_shape), generator=generator, device=device, dtype=torch.float32)
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
            if ode_solver == "dpm2":
                prev = sig[rows, j - 1].to(device) if j > 0 else None
                nxt, x0_now = dpm2_step(x[dev_rows], v, sig[rows, j].to(device), sig_n[rows, j].to(device), prev,
                                        None if x0_prev is None else x0_prev[dev_rows])
                x0_prev = torch.zeros_like(x) if x0_prev is None else x0_prev
                x0_prev[dev_rows] = x0_now
                zero = torch.zeros(rows.numel(), device=device)
                out = StepOutput(nxt, nxt, zero, zero)
            else:
                out = flow_step(kernel, x[dev_rows], v, sig[rows, j].to(device), sig_n[rows, j].to(device),
                                lvl[rows, j].to(device), noise=None if noise is None else noise[dev_rows],
                                stochastic=sde[rows, j].to(device), reduction=reduction)
            x[dev_rows] = out.next_sample
            lat[dev_rows, j + 1] = out.next_sample
            logp[rows, j] = out.log_prob.float().cpu()
            std[rows, j] = out.std.reshape(-1).float().cpu()
            if means is not None:
                means[dev_rows, j] = out.mean
        tree.set_edge_logp(children, logp.sum(1))
        node_latent.append(x)
        add_rows(C, latents=lat, sigma=sig, sigma_next=sig_n, timestep=ts, noise_level=lvl, sde=sde, train=train,
                 length=length, logp=logp, std=std, fwd_id=fid, fwd_slot=fslot,
                 **({"means": means} if means is not None else {}))
    cat = {k: torch.cat(v) for k, v in cols.items()}
    tree.trainable = (tree.parent >= 0) & cat["train"].any(1)
    return Forest(tree=tree, latents=cat["latents"], node_latent=torch.cat(node_latent), sigma=cat["sigma"],
                  sigma_next=cat["sigma_next"], timestep=cat["timestep"], noise_level=cat["noise_level"],
                  sde=cat["sde"], train=cat["train"], length=cat["length"], logp=cat["logp"], std=cat["std"],
                  fwd_id=cat["fwd_id"], fwd_slot=cat["fwd_slot"], nfe=fwd.nfe, forwards=fwd.calls,
                  level_nodes=level_nodes, means=cat.get("means"))


def forest_payload(forest: Forest, cond_tensors: dict[str, torch.Tensor], rows: torch.Tensor | None = None
                   ) -> dict[str, Any]:
    """The ``Rollout`` payload of a forest's ``rows`` (all nodes by default): everything
    ``visgen.recompute.recompute_edges`` reads. ``cond_tensors`` holds the prompt embeddings already per row."""
    r = slice(None) if rows is None else rows
    return {
        "latents": forest.latents[r.to(forest.latents.device) if rows is not None else r],
        "sigma": forest.sigma[r], "sigma_next": forest.sigma_next[r], "timestep": forest.timestep[r],
        "noise_level": forest.noise_level[r], "sde": forest.sde[r], "fwd_id": forest.fwd_id[r],
        "fwd_slot": forest.fwd_slot[r], "cond": cond_tensors,
    }


def flat_forest(adapter, cond, latents: torch.Tensor, sde: torch.Tensor, train: torch.Tensor, sigmas: torch.Tensor,
                timesteps: torch.Tensor, generator, kernel: str, noise_level: float, reduction: str = "mean",
                micro_batch: int = 0, first_forward_id: int = 0, keep_means: bool = False,
                ode_solver: str = "euler") -> Forest:
    """A flat rollout: one unbranched chain per row of ``latents`` (``cond`` one row each) under a step plan's
    ``[B, T]`` masks — the depth-one forest of Flow-GRPO and its flat relatives (root ``b``, leaf ``B + b``)."""
    level = Level.from_plan(sde, train, sigmas, timesteps, noise_level)
    return grow_forest(adapter, cond, latents, [level], generator, kernel, reduction, micro_batch, first_forward_id,
                       keep_means=keep_means, ode_solver=ode_solver)
