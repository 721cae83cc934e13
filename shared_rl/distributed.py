"""Process layout: one process, or several launched by ``accelerate launch`` / ``torchrun`` (gloo on CPU, NCCL on
GPUs). Only tensors cross processes (no pickle over the network).

The trainer makes every decision (filters, refills, advantages, minibatch composition, loss normalisers) on a
*global light view* of the rollout — rewards, group ids, masks and behaviour log-probs gathered from every rank,
ordered by (round, chunk, position) — so the same global batch gives the same result whatever the number of
processes. Each rank computes log-probs only for the sequences it sampled; gradients are summed across ranks
(the loss is already normalised by global counts).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


class Dist:
    """Rank/world helpers; every collective is a no-op with one process."""

    def __init__(self, device: torch.device | None = None) -> None:
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
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
        """Sum gradients over ranks in one flat buffer (missing grads count as zeros)."""
        if not self.enabled:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.all_reduce_(flat)
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off: off + n].view_as(p).to(p.dtype).clone()
            off += n


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

