"""Checkpoints: atomic, checksummed, keep-last-N, safetensors for weights.

Layout of ``RUN/checkpoints/step_000010/``::

    model.safetensors   the domain's trainable weights (``Domain.state_dict``)
    optimizer.pt        optimizer state (tensors + numbers only; loaded with ``weights_only=True``)
    state.json          iteration, LR schedule, selector/VADE state, domain extra state, RNG states
    manifest.json       sha256 of every file above — written last: a checkpoint without a valid manifest is
                        partial or corrupt and is skipped (loudly) in favour of the previous one

A *sharded* checkpoint (``distributed.checkpoint: sharded``, the default under FSDP2 with several processes) holds
``shards/`` instead of the two weight files: a ``torch.distributed.checkpoint`` (DCP) directory where every process
wrote its own shards (``__<rank>_0.distcp``) and process 0 the ``.metadata`` index. Its keys are ``model/<domain
key>`` (``Domain.state_dict``, EMA tensors included) and ``optim/<parameter id>/<name>`` (AdamW's tensors); the
optimizer's parameter groups (numbers) are in ``state.json``. DCP reshards on load, so a checkpoint written by N
processes resumes on M (1 included, with no process group), and ``manifest.json`` checksums every shard file.
``export_full_checkpoint`` turns one into the one-process layout.

A checkpoint is written into ``.tmp-step_xxx`` and renamed into place, so a kill at any moment leaves either
the old set or the new one, never half a checkpoint under a final name.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .errors import ConfigError
from .rundir import check_run_dir


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _fsync_file(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    except OSError:  # no such file yet (a run without records)
        pass


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as JSON-serialisable values."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save_checkpoint(
    ckpt_root: Path,
    iteration: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write checkpoint ``step_{iteration:06d}`` atomically; prune to the newest ``keep_last``. The run directory
    (``ckpt_root``'s parent) must exist: one that vanished is never recreated (``RunDirectoryLost``). Its
    ``metrics.jsonl`` is fsynced first, so the records up to a checkpoint are on disk whenever the checkpoint is."""
    final, tmp = _begin(ckpt_root, iteration)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model_state.items()}
    save_file(tensors, str(tmp / "model.safetensors"))
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    manifest = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
    return _commit(ckpt_root, final, tmp, manifest, keep_last)


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Final-named checkpoint dirs, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("step_"))


SHARDS = "shards"  # the DCP directory of a sharded checkpoint


def _begin(ckpt_root: Path, iteration: int) -> tuple[Path, Path]:
    """(final dir, fresh temporary dir) of checkpoint ``iteration``; the run directory must still exist."""
    check_run_dir(ckpt_root.parent)
    ckpt_root.mkdir(exist_ok=True)
    _fsync_file(ckpt_root.parent / "metrics.jsonl")
    for leftover in ckpt_root.glob(".trash-*"):  # what a kill during an earlier rotation left half deleted
        shutil.rmtree(leftover, ignore_errors=True)
    final = ckpt_root / f"step_{iteration:06d}"
    tmp = ckpt_root / f".tmp-step_{iteration:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return final, tmp


def _commit(ckpt_root: Path, final: Path, tmp: Path, manifest: dict[str, str], keep_last: int) -> Path:
    """Write the manifest last, fsync, rename ``tmp`` to ``final`` and prune to the newest ``keep_last``."""
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for p in tmp.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    # rename before delete: a kill (or a second Ctrl-C) during a slow rmtree must never leave half a checkpoint
    # under a final name; a half-deleted ``.trash-*`` is ignored by readers and removed by the next save
    if final.exists():
        os.replace(final, ckpt_root / f".trash-{final.name}")
    os.replace(tmp, final)
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        os.replace(old, ckpt_root / f".trash-{old.name}")
    _fsync_dir(ckpt_root)
    for trash in ckpt_root.glob(".trash-*"):
        shutil.rmtree(trash, ignore_errors=True)
    return final


def is_sharded_checkpoint(path: Path) -> bool:
    return (Path(path) / SHARDS).is_dir()


def _flat_dcp_state(model_state: dict[str, torch.Tensor], opt_state: dict[str, Any] | None) -> dict[str, Any]:
    """The tensors of a checkpoint under DCP keys (flat: no nested dicts, nothing but tensors, so nothing is
    pickled into the shards). The keys are the domain's ``state_dict`` keys and AdamW's integer parameter ids, the
    one-process layout's, rather than ``get_state_dict``'s module FQNs: a domain's trained state is not one module's
    (LoRA adapters only, parts' packed state, several modules), and both layouts then resume each other."""
    flat: dict[str, Any] = {f"model/{k}": v.detach() for k, v in model_state.items()}
    for pid, st in (opt_state or {}).get("state", {}).items():
        flat.update({f"optim/{int(pid)}/{name}": v for name, v in st.items() if torch.is_tensor(v)})
    return flat


def save_sharded_checkpoint(ckpt_root: Path, iteration: int, model_state: dict[str, torch.Tensor],
                            optimizer_state: dict[str, Any] | None, state: dict[str, Any], dist,
                            keep_last: int = 2) -> Path | None:
    """Write checkpoint ``step_{iteration:06d}`` with ``torch.distributed.checkpoint``: a collective, every process
    writes its own shards of the DTensor values (plain tensors are written once, process 0's).
    Process 0 prepares the temporary directory, the processes checksum the shard files between them (file i by
    process i mod N; the digests cross as tensors), and process 0 writes ``state.json`` and the manifest and renames
    the directory into place, as ``save_checkpoint`` does. Returns the path on process 0, else None."""
    import torch.distributed.checkpoint as dcp

    final, tmp = _begin(ckpt_root, iteration) if dist.is_main else (None, ckpt_root / f".tmp-step_{iteration:06d}")
    dist.barrier()  # the temporary directory exists before anyone writes into it
    flat = _flat_dcp_state(model_state, optimizer_state)
    # a plain tensor (not a DTensor) is written once, by process 0: what the one-process layout saves, also where
    # processes hold different values (a part's per-process history, packed) — DCP would otherwise pick any one
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    with warnings.catch_warnings():  # one process: DCP says it assumes a single process, which it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(tmp / SHARDS)), planner=planner)
    dist.barrier()  # the metadata (process 0) and every shard file are written
    files = sorted(str(p.relative_to(tmp)) for p in (tmp / SHARDS).rglob("*") if p.is_file())
    seen = dist.all_reduce_(torch.tensor([len(files), -len(files)]), "max")
    if int(seen[0]) != -int(seen[1]):  # the split of the hashing below needs one list on every process
        raise RuntimeError(f"checkpoint {tmp}: the processes see different shard files ({int(-seen[1])} to "
                           f"{int(seen[0])}); run_dir must be one shared file system for every process")
    digests = torch.zeros(len(files), 32, dtype=torch.int64)
    for i in range(dist.rank, len(files), dist.world):
        digests[i] = torch.tensor(list(bytes.fromhex(_sha256(tmp / files[i]))), dtype=torch.int64)
    dist.all_reduce_(digests)  # each row is filled by exactly one process
    if not dist.is_main:
        dist.barrier()  # process 0 renames
        return None
    if optimizer_state is not None:  # the parameter groups (numbers and parameter ids) travel as JSON
        state = {**state, "optimizer_param_groups": optimizer_state["param_groups"]}
    (tmp / "state.json").write_text(json.dumps(state))
    manifest = {f: bytes(d.tolist()).hex() for f, d in zip(files, digests)}
    manifest["state.json"] = _sha256(tmp / "state.json")
    out = _commit(ckpt_root, final, tmp, dict(sorted(manifest.items())), keep_last)
    dist.barrier()
    return out


def _dcp_metadata(path: Path):
    """The ``.metadata`` index of a sharded checkpoint (a pickle in torch's DCP format: read only after the
    manifest verified it)."""
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(path / SHARDS)).read_metadata().state_dict_metadata


def load_sharded_checkpoint(path: Path, like_model: dict[str, Any], params: list[torch.nn.Parameter]
                            ) -> tuple[dict[str, Any], dict | None, dict]:
    """(model state, optimizer state, state.json) of a verified sharded checkpoint, laid out like the live objects:
    a value whose live tensor (``like_model[key]``, or for AdamW's moments the parameter ``params[id]``) is a DTensor
    comes back as a DTensor with the same mesh and placements (this process reads only its shards), anything else
    as a full tensor. A collective when a process group exists (every process calls it); one process needs none.
    Fresh buffers are filled, never the live tensors, so a refusal after this leaves the run untouched."""
    import torch.distributed.checkpoint as dcp

    meta = _dcp_metadata(path)
    target: dict[str, torch.Tensor] = {}
    for key, md in meta.items():
        if not hasattr(md, "size"):  # not a tensor: grove writes none
            continue
        live = None
        if key.startswith("model/"):
            live = like_model.get(key[len("model/"):])
        elif key.startswith("optim/"):
            pid = int(key.split("/")[1])
            p = params[pid] if pid < len(params) else None
            live = p if p is not None and tuple(md.size) == tuple(p.shape) and len(md.size) else None
        if live is not None and tuple(live.shape) == tuple(md.size):
            target[key] = torch.empty_like(live, dtype=md.properties.dtype)
        else:
            target[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(path / SHARDS)))
    state = json.loads((path / "state.json").read_text())
    return (*_unflatten(target, state.pop("optimizer_param_groups", None)), state)


def _unflatten(flat: dict[str, torch.Tensor], groups: list | None) -> tuple[dict[str, Any], dict | None]:
    """Inverse of ``_flat_dcp_state``: (model state, optimizer state with integer parameter ids or None)."""
    model_state = {k[len("model/"):]: v for k, v in flat.items() if k.startswith("model/")}
    if groups is None:
        return model_state, None
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in flat.items():
        if k.startswith("optim/"):
            _, pid, name = k.split("/", 2)
            per_param.setdefault(int(pid), {})[name] = v
    # JSON turned AdamW's betas tuple into a list: give the groups back their own types
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]
    return model_state, {"state": dict(sorted(per_param.items())), "param_groups": groups}


def export_full_checkpoint(src: Path, ckpt_root: Path, keep_last: int = 2) -> Path:
    """A one-process copy of sharded checkpoint ``src`` under ``ckpt_root`` (``model.safetensors``, ``optimizer.pt``
    with integer parameter ids, ``state.json``, a fresh manifest; the same step name): what ``replicate`` writes,
    for tools that read that layout. One process, no process group: DCP's ``dcp_to_torch_save`` gathers every
    shard. ``src`` must pass its checksums (ConfigError naming what is wrong)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = Path(src)
    problem = verify_checkpoint(src)
    if problem is not None:
        raise ConfigError(f"checkpoint {src} is unusable ({problem}); nothing was exported")
    if not is_sharded_checkpoint(src):
        raise ConfigError(f"checkpoint {src} is already in the one-process layout (it has no {SHARDS}/)")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(src / SHARDS), str(Path(tmp) / "full.pt"))
        flat = torch.load(Path(tmp) / "full.pt", weights_only=True)
    state = json.loads((src / "state.json").read_text())
    model_state, opt_state = _unflatten(flat, state.pop("optimizer_param_groups", None))
    Path(ckpt_root).parent.mkdir(parents=True, exist_ok=True)
    return save_checkpoint(Path(ckpt_root), int(state["iteration"]), model_state, opt_state, state, keep_last)


def verify_checkpoint(path: Path) -> str | None:
    """None when every file matches the manifest, else what is wrong."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        return "no manifest.json (partial write)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return "manifest.json is not valid JSON"
    for name, digest in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if _sha256(f) != digest:
            return f"{name} fails its checksum"
    return None


def newest_usable_checkpoint(ckpt_root: Path) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint that passes its checksums or None, what is wrong with each newer one), without
    loading anything: what ``--resume`` and ``grove eval`` check before a model loads."""
    problems = []
    for path in reversed(list_checkpoints(ckpt_root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path, problems
        problems.append(f"{path.name}: {problem}")
    return None, problems


def checkpoint_iteration(path: Path) -> int:
    """The iteration a (verified) checkpoint was written after."""
    return int(json.loads((path / "state.json").read_text())["iteration"])


def load_latest_checkpoint(ckpt_root: Path, log=print, like_model=None, params: list[torch.nn.Parameter] | None = None
                           ) -> tuple[Path, dict[str, torch.Tensor], dict | None, dict] | None:
    """Newest valid checkpoint as (path, model_state, optimizer_state, state); corrupt ones are skipped loudly. A
    sharded one is read laid out like ``like_model()`` (called only then: the live state dict) and ``params``
    (``load_sharded_checkpoint``: a collective)."""
    candidates = list(reversed(list_checkpoints(ckpt_root)))
    for n, path in enumerate(candidates):
        problem = verify_checkpoint(path)
        if problem:
            older = candidates[n + 1:]
            then = f"trying the previous one, {older[0].name}" if older else "no older checkpoint is left"
            msg = f"checkpoint {path} is unusable ({problem}); {then}"
            warnings.warn(msg)
            log(f"WARNING: {msg}")
            continue
        if is_sharded_checkpoint(path):
            return (path, *load_sharded_checkpoint(path, like_model() if like_model else {}, params or []))
        model_state = load_file(str(path / "model.safetensors"))
        opt_path = path / "optimizer.pt"
        optimizer_state = torch.load(opt_path, weights_only=True) if opt_path.is_file() else None
        state = json.loads((path / "state.json").read_text())
        return path, model_state, optimizer_state, state
    return None


# ---------------------------------------------------------------------------------------------------------------
# A training run's state: what ``Trainer.save`` writes and ``Trainer.resume`` restores (exact resume: the weights,
# AdamW, the schedule, the weight average, the key sampler, the domain's extra state and every RNG).


def run_state(iteration: int, optim, sampler, domain) -> dict[str, Any]:
    """The JSON part of a checkpoint (``state.json``)."""
    opt = optim.state()
    return {
        "iteration": iteration,
        "scheduler": opt.pop("scheduler"),
        "sampler": sampler.state_dict(),
        "domain": domain.extra_state(),
        "rng": rng_state(),
        **opt,
    }


def checkpoint_sharded(cfg, fsdp) -> bool:
    """Whether this run writes the sharded layout: ``distributed.checkpoint`` (``auto``: under FSDP2 with several
    processes, where the one-process layout would gather every shard on process 0)."""
    choice = cfg.distributed.checkpoint
    return choice == "sharded" or (choice == "auto" and fsdp is not None)


def save_run(ckpt_root: Path, iteration: int, domain, optim, sampler, dist, fsdp, keep_last: int,
             sharded: bool = False) -> Path | None:
    """Write the run's checkpoint at ``iteration``. ``sharded``: every process writes its own shards (DCP; a
    collective). Otherwise the one-process layout, written by rank 0 (under FSDP2 a collective: every rank
    gathers the shards first). Returns its path on the main process, else None."""
    if sharded:
        model_state = domain.state_dict()
        if optim.ema is not None:
            model_state = {**model_state, **optim.ema.tensors()}
        return save_sharded_checkpoint(ckpt_root, iteration, model_state, optim.adamw.state_dict(),
                                       run_state(iteration, optim, sampler, domain), dist, keep_last)
    if fsdp is not None:
        from .distributed import full_optimizer_state, full_tensors

        model_state = full_tensors(domain.state_dict())
        opt_state = full_optimizer_state(optim.adamw.state_dict())
    elif dist.is_main:
        model_state, opt_state = domain.state_dict(), optim.adamw.state_dict()
        if optim.ema is not None:
            model_state = {**model_state, **optim.ema.tensors()}
    path = save_checkpoint(ckpt_root, iteration, model_state, opt_state, run_state(iteration, optim, sampler, domain),
                           keep_last) if dist.is_main else None
    dist.barrier()  # on every process the checkpoint exists once this returns (as after a sharded save)
    return path


def missing_state(domain, sampler, model_state: dict[str, torch.Tensor], state: dict[str, Any]) -> list[str]:
    """What the domain and the key sampler save now but the checkpoint lacks (one entry per tensor group or extra-
    state key): a checkpoint written before a part learned to save its state. Read from the live objects' own
    ``state_dict`` / ``extra_state``, so a part that starts saving something is checked without being named here."""
    groups: dict[str, int] = {}
    for k in domain.state_dict():
        if k not in model_state:
            head = k.split(".")[0] + (".*" if "." in k else "")
            groups[head] = groups.get(head, 0) + 1
    out = [f"tensors {head} ({n})" for head, n in groups.items()]
    saved = state.get("domain", {})
    out += [f"domain state {k!r}" for k in domain.extra_state() if k not in saved]
    out += [f"sampler state {k!r}" for k in sampler.state_dict() if k not in state.get("sampler", {})]
    return out


def restore_run(ckpt_root: Path, domain, optim, sampler, fsdp, log=print,
                allow_inexact: bool | None = None) -> tuple[Path, int, list[str]] | None:
    """Restore the newest valid checkpoint under ``ckpt_root`` into the domain, optimiser, sampler and the RNGs;
    returns (its path, its iteration, what it lacked), or None when there is none. A checkpoint that lacks some
    part's state (``missing_state``) would not resume exactly: with ``allow_inexact`` False that is a ConfigError
    (one line, nothing loaded), True a warning; None (``grove eval``: only the weights matter) checks nothing."""
    found = load_latest_checkpoint(ckpt_root, log, domain.state_dict, optim.params)
    if found is None:
        return None
    path, model_state, opt_state, state = found
    sharded = is_sharded_checkpoint(path)  # already laid out like the live tensors
    ema_prefix = "_ema/"  # optim.WeightEMA.PREFIX
    ema_state = {k: model_state.pop(k) for k in [k for k in model_state if k.startswith(ema_prefix)]}
    missing = missing_state(domain, sampler, model_state, state) if allow_inexact is not None else []
    if missing:
        what = f"checkpoint {path} lacks the state of {', '.join(missing[:6])}" + (
            f" and {len(missing) - 6} more" if len(missing) > 6 else "") + \
            " (written before those parts saved it): a resume from it would not be exact"
        if not allow_inexact:
            raise ConfigError(f"{what}; nothing was changed. Pass resume.allow_inexact=true to continue anyway (the "
                              f"gap is recorded in metrics.jsonl)")
        warnings.warn(what)
        log(f"WARNING: {what}; continuing (resume.allow_inexact)")
    if fsdp is not None and not sharded:  # full tensors -> this rank's shards, laid out like the live parameters
        from .distributed import shard_like, shard_optimizer_state

        current = domain.state_dict()
        model_state = {k: shard_like(v, current[k]) if k in current else v for k, v in sorted(model_state.items())}
        if opt_state is not None:
            opt_state = shard_optimizer_state(opt_state, optim.adamw)
    domain.load_state_dict(model_state)
    optim.load(opt_state, state, ema_state)
    sampler.load_state_dict(state["sampler"])
    domain.load_extra_state(state.get("domain", {}))
    set_rng_state(state["rng"])
    return path, int(state["iteration"]), missing


def main(argv: list[str] | None = None) -> int:
    """``python -m shared_rl.checkpoint export STEP_DIR OUT_ROOT``: ``export_full_checkpoint`` from the shell (one
    process, no launcher); a checkpoint that fails its checksums is one line on stderr and exit code 2."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m shared_rl.checkpoint",
                                     description="turn a sharded (DCP) grove checkpoint into the one-process layout")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="write STEP_DIR's one-process copy as OUT_ROOT/step_NNNNNN")
    export.add_argument("step_dir", type=Path, help="a sharded checkpoint, e.g. RUN/checkpoints/step_000010")
    export.add_argument("out_root", type=Path, help="the checkpoints folder to write it into (created if needed)")
    args = parser.parse_args(argv)
    try:
        out = export_full_checkpoint(args.step_dir, args.out_root)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
