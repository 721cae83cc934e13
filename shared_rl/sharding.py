"""The trainer's FSDP2 set-up (``distributed.strategy: fsdp2``): the settings checked against the process layout
before any model loads, the domain's ``fsdp_modules()`` sharded with torch's ``fully_shard`` (on a 1-D mesh, or a
2-D replicate x shard mesh for HSDP), the units rollouts and evaluation gather (``fsdp_sampling_modules()``),
FSDP2's ``MixedPrecisionPolicy`` / ``CPUOffloadPolicy`` from ``distributed.mixed_precision`` /
``distributed.cpu_offload``, and the per-process memory line. The sharded modules themselves (gathering,
state-dict helpers, the global gradient norm) are ``shared_rl.distributed.FSDPShards`` and its neighbours;
docs/scaling.md describes the whole.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .errors import ConfigError

FSDP2_ONLY = ("mixed_precision", "cpu_offload", "replicate")  # settings of fully_shard: nothing to apply otherwise


def check_settings(cfg, world: int, device: torch.device) -> None:
    """The ``distributed`` settings against the launch (process count, device, launcher), before any model loads:
    one-line ConfigErrors for what cannot run."""
    dc = cfg.distributed
    if dc.strategy != "fsdp2":
        changed = [f"distributed.{k}" for k in FSDP2_ONLY
                   if getattr(dc, k) != {"mixed_precision": "none", "cpu_offload": False, "replicate": 1}[k]]
        if changed:
            raise ConfigError(f"{', '.join(changed)}: FSDP2 settings, but distributed.strategy is {dc.strategy}; set "
                              f"distributed.strategy: fsdp2 or drop them")
        return
    if dc.replicate < 1:
        raise ConfigError(f"distributed.replicate={dc.replicate}: the number of replica groups must be >= 1 (1 = "
                          f"shard over every process)")
    if world < 2:  # one process shards nothing, so mesh and policies do not apply (grove eval, a 1-process resume)
        return
    if world % dc.replicate:
        raise ConfigError(f"distributed.replicate={dc.replicate} does not divide the {world} processes (HSDP's mesh is "
                          f"replicate x shard = processes); use a divisor of {world}, e.g. the number of nodes")
    if dc.cpu_offload and device.type != "cuda":
        raise ConfigError(f"distributed.cpu_offload: the run is on {device.type}, so there is no accelerator to "
                          f"offload from (the weights already live in CPU memory); set distributed.cpu_offload: false")
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launcher not in ("no", "") and launcher != dc.mixed_precision:
        raise ConfigError(f"launched with accelerate mixed_precision: {launcher}, but under fsdp2 grove reads the "
                          f"precision policy from distributed.mixed_precision (now {dc.mixed_precision}); add "
                          f"distributed.mixed_precision=bf16 or launch with mixed_precision: 'no'")


def policies(cfg) -> dict:
    """``fully_shard`` keyword arguments for the configured precision and offload policies."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    dc, out = cfg.distributed, {}
    if dc.mixed_precision == "bf16":
        # bf16 all-gathers, forwards and backwards; fp32 shards (so AdamW steps in fp32) and fp32 gradient reductions
        out["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if dc.cpu_offload:
        out["offload_policy"] = CPUOffloadPolicy()
    return out


def setup_fsdp(cfg, domain, d, device: torch.device, log):
    """Shard the domain's ``fsdp_modules()`` with FSDP2 (several processes) after checking the layout; None with
    one process, where there is nothing to shard."""
    modules = list(domain.fsdp_modules())
    if not modules:
        raise ConfigError(f"distributed.strategy: fsdp2 is not supported by domain {cfg.domain!r} (its "
                          f"fsdp_modules() lists no modules to shard); use distributed.strategy: replicate")
    if not d.enabled:
        log("fsdp2 with one process: nothing to shard, the policy stays whole (same result as replicate; the "
            "precision/offload policies apply only when sharded)")
        return None
    # every rank pads its training micro-batches with forwards on its own sequences: each needs a rollout chunk
    groups = cfg.rollout.groups_per_iteration
    per_call = cfg.rollout.groups_per_call or -(-groups // d.world)
    chunks = -(-groups // per_call)
    if chunks < d.world:
        fix = (f"raise rollout.groups_per_iteration to >= {d.world}" if groups < d.world else
               f"set rollout.groups_per_call <= {groups // d.world}")
        raise ConfigError(f"distributed.strategy: fsdp2 needs a rollout chunk on each of the {d.world} processes, "
                          f"but {groups} groups in calls of {per_call} make {chunks} chunks; {fix}")
    dc = cfg.distributed
    roots = list(domain.fsdp_roots())
    shards = shard_from_rank0(modules, d, device, dc.reshard_after_forward, replicate=dc.replicate, roots=roots,
                              **policies(cfg))
    gather_for_sampling(shards, domain.fsdp_sampling_modules())
    local, full = shards.local_parameter_bytes()
    mesh = f"a {dc.replicate} x {d.world // dc.replicate} (replicate x shard) mesh" if dc.replicate > 1 else \
        f"{d.world} processes"
    log(f"fsdp2: {len(modules)} modules sharded over {mesh}; process {d.rank} holds {local:,} of their {full:,} "
        f"parameter bytes" + ("; loaded by process 0 alone (the others built on the meta device and received "
                              "their shards)" if shards.from_rank0 else ""))
    return shards


def gather_for_sampling(shards, sampling: list[torch.nn.Module] | None) -> None:
    """Make ``shards.gathered()`` (rollouts, evaluation, ``on_train_end``) all-gather only the units sampling needs:
    those inside one of ``sampling`` (the domain's ``fsdp_sampling_modules()``) or holding one; ``None``: every unit.
    The others (a frozen KL reference copy, whose forwards are the paired training ones) stay sharded, so a rollout
    round holds one whole model per process instead of two. A forward of such a unit inside ``gathered()`` would
    all-gather on one process alone (and hang the others): it raises instead, naming the hook."""
    if sampling is None:
        return
    inside = {id(sub) for m in sampling for sub in m.modules()}
    chosen = {id(m) for m in sampling}
    shards.sampling = [u for u in shards.modules
                       if id(u) in inside or any(id(sub) in chosen for sub in u.modules())]
    kept = {id(u) for u in shards.sampling}
    for unit in shards.modules:
        if id(unit) not in kept:
            unit.register_forward_pre_hook(_not_gathered, prepend=True)  # before FSDP2's own (its all-gather)


def _not_gathered(module: torch.nn.Module, _args) -> None:
    from .distributed import shards_gathered

    if shards_gathered():
        raise RuntimeError(f"FSDP2: a forward of {type(module).__name__}, an FSDP2 unit the domain's "
                           f"fsdp_sampling_modules() leaves out, ran inside FSDPShards.gathered() (a rollout or "
                           f"evaluation), where it stays sharded; name its model in fsdp_sampling_modules()")


@contextlib.contextmanager
def meta_unless_rank0(rank: int):
    """Build a model inside this block on the meta device on every process but process 0 (which builds / loads it
    as usual): no process other than 0 ever holds the full weights. ``shard_from_rank0`` (``setup_fsdp``) then
    gives every process its shards of process 0's weights. With one process (rank 0) a no-op."""
    if rank == 0:
        yield
        return
    with torch.device("meta"):
        yield


def loads_on_meta(ctx) -> bool:
    """Whether this process of the run builds its model on the meta device (``meta_unless_rank0``): under
    ``distributed.strategy: fsdp2`` with several processes, on every process but 0 (``setup_fsdp`` then fills the
    shards from process 0). A domain's loader wraps its model's construction in
    ``meta_unless_rank0(ctx.process_index if loads_on_meta(ctx) else 0)`` (equivalently ``rank0_build(ctx)``)."""
    cfg = getattr(ctx, "train_cfg", None)
    return bool(cfg is not None and cfg.distributed.strategy == "fsdp2" and ctx.num_processes > 1
                and ctx.process_index != 0)


def rank0_build(ctx):
    """``meta_unless_rank0`` for a run's context: the meta device on processes > 0 of an FSDP2 run with several
    processes (``loads_on_meta``), a no-op otherwise."""
    return meta_unless_rank0(ctx.process_index if loads_on_meta(ctx) else 0)


def _top_units(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The units no other unit contains (the LLM's transformers model; each of the tiny VLA's units)."""
    inside = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inside]


def shard_from_rank0(modules: list[torch.nn.Module], d, device: torch.device, reshard_after_forward: bool = True,
                     replicate: int = 1, roots: list[torch.nn.Module] = (), **fsdp_policies):
    """``FSDPShards(modules, ...)``, where the modules may be on the meta device on processes other than 0
    (``meta_unless_rank0``): process 0's full tensors are then broadcast with torch's
    ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`` after sharding, each process
    keeping only its shards (``to_empty`` allocates them), and the buffers a state dict leaves out (rotary
    frequencies, ...) are broadcast from process 0 too, as is every tensor of ``roots`` (the domain's models:
    ``DomainBase.fsdp_roots``) outside every unit — e.g. the tiny VLA flow head's noise levels (parameters tied
    within a root stay tied). A frozen reference copy that a domain lists among its units (visgen, robotics, the
    LLM's ``keep_reference``) is one more top unit: sharded and filled like the policy. When no process has a meta
    tensor this is plain ``FSDPShards`` (one all-reduce to agree)."""
    from .distributed import FSDPShards

    in_units = {id(sub) for m in modules for sub in m.modules()}
    outside = [(module, name, t) for root in roots for module in root.modules() if id(module) not in in_units
               for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
    meta = torch.tensor([float(any(p.is_meta for m in modules for p in m.parameters())
                               or any(t.is_meta for _, _, t in outside))])
    if d.enabled:
        d.all_reduce_(meta, "max")
    if not meta.item():
        shards = FSDPShards(modules, d, device, reshard_after_forward, replicate=replicate, **fsdp_policies)
        shards.from_rank0 = False
        return shards
    if d.rank == 0 and (any(p.is_meta for m in modules for p in m.parameters()) or
                        any(t.is_meta for _, _, t in outside)):
        raise RuntimeError("shard_from_rank0: process 0 must hold the real weights (build with meta_unless_rank0)")
    tops = _top_units(modules)
    _same_layout_as_rank0(tops, outside, d)
    # process 0's full state before sharding (fully_shard copies each parameter's own slice; these stay whole on 0)
    full = [t.state_dict() if d.rank == 0 else {} for t in tops]
    shards = FSDPShards(modules, d, device, reshard_after_forward, replicate=replicate, **fsdp_policies)
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    for top, state in zip(tops, full):
        if d.rank != 0:
            top.to_empty(device=device)  # the local shards (DTensors) and the buffers, uninitialised
        set_model_state_dict(top, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for module in top.modules():  # non-persistent buffers: not in a state dict, but part of the model
            for name, buf in module.named_buffers(recurse=False):
                if name in module._non_persistent_buffers_set:
                    dist.broadcast(buf.data, src=0)
    del full
    done: dict[int, torch.Tensor] = {}  # a tensor met twice (tied weights): allocated and broadcast once
    for module, name, t in outside:
        if id(t) not in done:
            new = t
            if t.is_meta:
                new = torch.empty_like(t, device=device)
                if isinstance(t, torch.nn.Parameter):
                    new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            dist.broadcast(new.data, src=0)
            done[id(t)] = new
        slot = module._parameters if name in module._parameters else module._buffers
        slot[name] = done[id(t)]
    shards.from_rank0 = True  # the weights came from process 0 (setup_fsdp's log line says so)
    return shards


def _same_layout_as_rank0(tops: list[torch.nn.Module], outside: list, d) -> None:
    """Every process built the same tensors as process 0 (names, shapes, dtypes): a meta skeleton that differs (a
    dtype the loader sets, a layer count) would otherwise receive process 0's values cast or sliced silently, and
    FSDP2's all-gathers would mix shapes. One broadcast of process 0's sha256 of that list."""
    import hashlib

    import torch.distributed as dist

    rows = [f"{i}.{n}:{tuple(t.shape)}:{t.dtype}" for i, top in enumerate(tops)
            for n, t in [*top.named_parameters(), *top.named_buffers()]]
    rows += [f"out.{n}:{tuple(t.shape)}:{t.dtype}" for _, n, t in outside]
    mine = torch.tensor(list(hashlib.sha256("\n".join(rows).encode()).digest()), dtype=torch.uint8)
    theirs = mine.clone()
    dist.broadcast(theirs, src=0)
    bad = torch.tensor([float(not torch.equal(mine, theirs))])
    d.all_reduce_(bad, "max")  # every process raises, none waits in a collective the others left
    if bad.item():
        raise RuntimeError("shard_from_rank0: a process built its model (on the meta device) with other parameter "
                           "names, shapes or dtypes than process 0 loaded; its loader must build the same module tree")


def memory_line(strategy: str, rank: int, params, optimizer: torch.optim.Optimizer, fsdp) -> str:
    """What this process holds of the trained state (bytes of its local shards under FSDP2)."""
    from .distributed import is_dtensor

    def local_bytes(t: torch.Tensor) -> int:
        return (t.to_local() if is_dtensor(t) else t).numel() * t.element_size()

    opt = sum(local_bytes(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    line = (f"memory ({strategy}): process {rank} holds {sum(local_bytes(p) for p in params):,} trainable-parameter "
            f"bytes, {opt:,} optimizer-state bytes")
    if fsdp is not None:
        local, full = fsdp.local_parameter_bytes()
        line += f", {local:,} of the sharded modules' {full:,} parameter bytes"
    return line
