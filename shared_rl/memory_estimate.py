"""The persistent training state a process holds, estimated from parameter counts (no weights are read): what
``grove train --dry-run`` prints and the computed table of docs/scaling.md (``bench.scale.memory_table``) uses.

Per parameter: a trained one holds its weight, its gradient and AdamW's two moments, all in the parameter's dtype
(torch's AdamW keeps its state in the parameter's dtype): 4 x its bytes, 16 B in float32; a frozen one (a LoRA
base, the KL reference copy, an encoder) its weight alone. Under ``distributed.strategy: fsdp2`` the groups the
domain shards are divided over the processes; under ``replicate`` every process holds all of it. Not included:
activations, rollout buffers and KV caches, the allocator's slack and, under fsdp2, the rollout peak (rollouts run
with the shards gathered: the whole model once more in its dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
ADAMW_STATE_COPIES = 2  # exp_avg, exp_avg_sq


@dataclass(frozen=True)
class ParameterGroup:
    """Parameters a domain will hold: ``count`` of them, trained or frozen, ``dtype_bytes`` each, and whether
    ``distributed.strategy: fsdp2`` shards them (the modules of ``fsdp_modules()``)."""

    name: str
    count: int
    trainable: bool
    dtype_bytes: int = 4
    sharded: bool = True

    @property
    def bytes_per_parameter(self) -> int:
        return self.dtype_bytes * (2 + ADAMW_STATE_COPIES if self.trainable else 1)


def per_process_bytes(groups: list[ParameterGroup], strategy: str = "replicate", world: int = 1) -> int:
    """Bytes of persistent training state one of ``world`` processes holds under ``strategy``."""
    total = 0.0
    for g in groups:
        share = world if strategy == "fsdp2" and g.sharded else 1
        total += g.count * g.bytes_per_parameter / share
    return int(total)


def full_finetune_groups(count: int, dtype_bytes: int = 4, reference: bool = True) -> list[ParameterGroup]:
    """A model trained whole (with its frozen KL reference copy when ``reference``), all of it sharded."""
    groups = [ParameterGroup("trained", count, True, dtype_bytes)]
    return groups + [ParameterGroup("reference copy", count, False, dtype_bytes)] if reference else groups


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def describe(groups: list[ParameterGroup], strategy: str, world: int) -> str:
    """One line: the estimate per process and what it is made of."""
    parts = []
    for g in groups:
        share = world if strategy == "fsdp2" and g.sharded else 1
        what = "weights, gradients, AdamW moments" if g.trainable else "weights"
        parts.append(f"{g.name} {g.count:,} x {g.bytes_per_parameter} B ({what}){f' / {share}' if share > 1 else ''}")
    return (f"~{_size(per_process_bytes(groups, strategy, world))} per process ({strategy}, {world} process"
            f"{'es' if world > 1 else ''}) = " + " + ".join(parts))
