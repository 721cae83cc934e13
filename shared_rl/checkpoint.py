"""Checkpoints: atomic, checksummed, keep-last-N, safetensors for weights.

Layout of ``RUN/checkpoints/step_000010/``::

    model.safetensors   the domain's trainable weights (``Domain.state_dict``)
    optimizer.pt        optimizer state (tensors + numbers only; loaded with ``weights_only=True``)
    state.json          iteration, LR schedule, selector/VADE state, domain extra state, RNG states
    manifest.json       sha256 of every file above — written last: a checkpoint without a valid manifest is
                        partial or corrupt and is skipped (loudly) in favour of the previous one

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
    tensors = {k: v.detach().cpu().contiguous() for k, v in model_state.items()}
    save_file(tensors, str(tmp / "model.safetensors"))
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    manifest = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for p in tmp.iterdir():
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


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Final-named checkpoint dirs, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("step_"))


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


def load_latest_checkpoint(ckpt_root: Path, log=print) -> tuple[Path, dict[str, torch.Tensor], dict | None, dict] | None:
    """Newest valid checkpoint as (path, model_state, optimizer_state, state); corrupt ones are skipped loudly."""
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


def save_run(ckpt_root: Path, iteration: int, domain, optim, sampler, dist, fsdp, keep_last: int) -> Path | None:
    """Write the run's checkpoint at ``iteration`` (a collective under FSDP2: every rank gathers the shards; rank 0
    writes the one-process layout). Returns its path on the main process, else None."""
    if fsdp is not None:
        from .distributed import full_optimizer_state, full_tensors

        model_state = full_tensors(domain.state_dict())
        opt_state = full_optimizer_state(optim.adamw.state_dict())
    elif dist.is_main:
        model_state, opt_state = domain.state_dict(), optim.adamw.state_dict()
        if optim.ema is not None:
            model_state = {**model_state, **optim.ema.tensors()}
    if not dist.is_main:
        return None
    return save_checkpoint(ckpt_root, iteration, model_state, opt_state, run_state(iteration, optim, sampler, domain),
                           keep_last)


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
    found = load_latest_checkpoint(ckpt_root, log)
    if found is None:
        return None
    path, model_state, opt_state, state = found
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
    if fsdp is not None:  # full tensors -> this rank's shards, laid out like the live parameters
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
