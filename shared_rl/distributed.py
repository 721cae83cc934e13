"""Process layout: one process, or several launched by ``accelerate launch`` / ``torchrun`` (gloo on CPU, NCCL on
GPUs). Only tensors cross processes (no pickle over the network).

The trainer makes every decision (filters, refills, advantages, minibatch composition, loss normalisers) on a
*global light view* of the rollout — rewards, group ids, masks and behaviour log-probs gathered from every rank,
ordered by (round, chunk, position) — so the same global batch gives the same result whatever the number of
processes. Each rank computes log-probs only for the sequences it sampled; gradients are summed across ranks
(the loss is already normalised by global counts).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist


class Dist:
    """Rank/world helpers; every collective is a no-op with one process."""

    def __init__(self, device: torch.device | None = None) -> None:
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
            if backend == "nccl":  # one GPU per local rank: NCCL, the device mesh and FSDP2 use the current device
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend)
        self.enabled = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.enabled else 0
        self.world = dist.get_world_size() if self.enabled else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.comm_device = torch.device("cuda", torch.cuda.current_device()) if (
            self.enabled and dist.get_backend() == "nccl") else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def gather_cat(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate along dim 0 the tensors of all ranks (rank order); sizes may differ."""
        if not self.enabled:
            return t
        t = t.contiguous()
        dev = self.comm_device
        n = torch.tensor([t.shape[0]], device=dev)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n)
        sizes = [int(s) for s in sizes]
        m = max(sizes)
        padded = torch.zeros((m, *t.shape[1:]), dtype=t.dtype, device=dev)
        padded[: t.shape[0]] = t.to(dev)
        out = [torch.zeros_like(padded) for _ in range(self.world)]
        dist.all_gather(out, padded)
        return torch.cat([o[:s] for o, s in zip(out, sizes)]).to(t.device)

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.enabled:
            buf = t.to(self.comm_device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
            t.copy_(buf.to(t.device))
        return t

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks in one flat buffer (missing grads count as zeros). FSDP2-sharded parameters
        (DTensors) are skipped: their gradients were already summed by FSDP's reduce-scatter."""
        params = [p for p in params if not is_dtensor(p)]
        if not self.enabled or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.all_reduce_(flat)
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off: off + n].view_as(p).to(p.dtype).clone()
            off += n


def free_port() -> int:
    """A TCP port free on this host now (for MASTER_PORT / --main_process_port of a local launch)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_distributed(code: int) -> None:
    """End a multi-process run: barrier, destroy the process group, then leave with ``os._exit``.

    Why ``os._exit``: with gloo (torch 2.14), a worker thread of the destroyed group can still be joinable when the
    interpreter finalises, and the process then dies with SIGABRT ("terminate called without an active exception")
    after all the work is done — a non-zero exit code for a successful run. Nothing is left to flush after the
    barrier, so skipping the interpreter's teardown loses nothing. No-op when no process group exists.
    """
    import sys

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 (``distributed.strategy: fsdp2``). grove's losses are normalised by *global* counts, so the per-rank
# gradients must be summed, never averaged: every sharded module gets a gradient divide factor of 1 with plain SUM
# reductions. Rollouts, evaluation and the deferred behaviour log-prob pass run inside ``FSDPShards.gathered()``
# (the sampling units all-gathered once, no collective per forward), because their number of forwards differs per rank;
# training forwards are collectives, and the trainer runs the same number of them on every rank.


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


_GATHERED = 0  # depth of FSDPShards.gathered() blocks open in this process (see shards_gathered)


def shards_gathered() -> bool:
    """Whether this process is inside ``FSDPShards.gathered()``: forwards there issue no collective, so a domain that
    pads its training forwards to a count agreed over ranks (an all-reduce per call) must not do so there — inside,
    ranks run different numbers of calls (the deferred log-prob pass, rank-0 evaluation)."""
    return _GATHERED > 0


class FSDPShards:
    """The FSDP2-wrapped modules of a domain (``fsdp_modules()`` order: blocks first, the root last)."""

    def __init__(self, modules: list[torch.nn.Module], d: Dist, device: torch.device,
                 reshard_after_forward: bool = True, replicate: int = 1, **policies) -> None:
        """``replicate`` > 1: HSDP, a 2-D mesh (replicate, shard) — parameters sharded within each group of
        ``world / replicate`` processes and replicated across groups (gradients all-reduced across them).
        ``policies``: ``fully_shard``'s ``mp_policy`` / ``offload_policy`` (``shared_rl.sharding.policies``)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.dist = d
        self.reshard_after_forward = reshard_after_forward
        self.mesh = (init_device_mesh(device.type, (replicate, d.world // replicate),
                                      mesh_dim_names=("replicate", "shard")) if replicate > 1
                     else init_device_mesh(device.type, (d.world,)))
        self.modules = []
        for m in modules:
            # explicit reshard_after_forward (also for the root) so that ``gathered`` can restore it exactly
            fully_shard(m, mesh=self.mesh, reshard_after_forward=reshard_after_forward, **policies)
            m.set_gradient_divide_factor(1.0)  # sum over ranks: the loss already divides by global counts
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM); dividing by 1 is exact
            self.modules.append(m)
        # the units ``gathered`` all-gathers: all unless the domain names fewer (``sharding.gather_for_sampling``)
        self.sampling = list(self.modules)

    @contextlib.contextmanager
    def gathered(self):
        """All-gather the ``sampling`` units' shards once (collective: call on every rank), run forwards locally,
        then free. The other units (a frozen KL reference copy) stay sharded, and must not run a forward inside.

        For work whose number of forwards differs per rank (rollouts, evaluation on rank 0): inside, forward hooks
        find the parameters already unsharded and do not reshard, so no forward issues a collective. Do not call
        ``Module.state_dict()`` of a sharded module inside (FSDP2's state-dict hook swaps the shards back in)."""
        global _GATHERED
        for m in self.sampling:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        _GATHERED += 1
        try:
            yield
        finally:
            _GATHERED -= 1
            for m in self.sampling:
                m.reshard()
                m.set_reshard_after_forward(self.reshard_after_forward, recurse=False)

    def local_parameter_bytes(self) -> tuple[int, int]:
        """(bytes of parameters this rank holds, bytes of the full parameters) over the sharded modules."""
        seen, local, full = set(), 0, 0
        for m in self.modules:
            for p in m.parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                size = p.element_size()
                local += (p.to_local().numel() if is_dtensor(p) else p.numel()) * size
                full += p.numel() * size
        return local, full


def full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """Replace DTensor values by full CPU tensors (an all-gather per value, in sorted key order: call on every
    rank). Other values pass through."""
    out = dict(state)
    for k in sorted(state, key=str):
        if is_dtensor(state[k]):
            out[k] = state[k].full_tensor().cpu()
    return out


def shard_like(full: torch.Tensor, like) -> Any:
    """``full`` laid out like ``like`` (a DTensor: same mesh and placements; collective) or returned as is."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements)


def full_optimizer_state(opt_state: dict[str, Any]) -> dict[str, Any]:
    """``Optimizer.state_dict()`` with DTensor state gathered to full CPU tensors: exactly the layout of a
    one-process optimizer (integer parameter ids), so either layout resumes the other. Collective."""
    state = {pid: full_tensors(s) for pid, s in sorted(opt_state["state"].items())}
    return {"state": state, "param_groups": opt_state["param_groups"]}


def shard_optimizer_state(opt_state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Inverse of ``full_optimizer_state`` for ``optimizer``'s (possibly DTensor) parameters. Collective."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = {}
    for pid, s in sorted(opt_state["state"].items()):
        p = params[int(pid)]
        out[pid] = {k: shard_like(v, p) if torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape) and v.dim() else v
                    for k, v in sorted(s.items())}
    return {"state": out, "param_groups": opt_state["param_groups"]}


def clip_grad_norm_global_(params: list[torch.nn.Parameter], max_norm: float, d: Dist) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (L2) over parameters whose gradients are partly DTensor shards (summed by
    FSDP) and partly plain tensors (already summed over ranks, identical everywhere): the squared norms of the
    local shards are added over ranks, the replicated ones counted once. Returns the global norm (a plain tensor,
    the same on every rank) and scales the gradients by ``min(1, max_norm / (norm + 1e-6))`` like torch."""
    from torch.distributed.tensor import Replicate

    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        if is_dtensor(g):
            # HSDP: a shard is held by every replica group; count it once (the copies are equal)
            copies = 1
            for dim, placement in enumerate(g.placements):
                if isinstance(placement, Replicate):
                    copies *= g.device_mesh.size(dim)
            sharded += g.to_local().detach().double().pow(2).sum().cpu() / copies
        else:
            replicated += g.detach().double().pow(2).sum().cpu()
    d.all_reduce_(sharded)
    total = (sharded + replicated).sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if torch.isfinite(total):
        for g in grads:
            g.mul_(float(coef))
    return total
