"""Exact resume, checked the same way for any config: ``resume_mismatches(config, tmp)``.

Three runs of the same config, each in its own directory under ``tmp``:

- ``full``: ``n`` iterations uninterrupted (a checkpoint after every iteration);
- ``killed``: the same, stopped *inside* iteration ``at`` (after its rollout, before its update: the state a
  SIGKILL leaves — the process's memory is gone, the checkpoint written after iteration ``at - 1`` is on disk);
- ``killed`` again, resumed by a fresh ``Trainer`` from that checkpoint to ``n``.

The resumed run must equal the full one: every non-timing metric record, every tensor of the domain's final
``state_dict`` and every file the run exported (``final/``). A part whose state is not in the checkpoint makes the
resumed run diverge, so a missing ``state_dict`` / ``extra_state`` entry shows as a mismatch here.
"""
from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path

import torch

TIMING = ("time/", "samples_per_s", "env_steps_per_s", "throughput")


class Killed(BaseException):
    """Stands for a SIGKILL inside an iteration (BaseException: nothing in the trainer may catch it)."""


def _is_timing(key: str) -> bool:
    return key.startswith(TIMING) or "/time" in key or key.endswith("_per_s") or key.endswith("/seconds") \
        or key.startswith("resume/") or key.startswith("memory/")


def _records(run: Path) -> list[dict]:
    from shared_rl.metrics import read_metrics

    return [{k: v for k, v in r.items() if not _is_timing(k)} for r in read_metrics(run / "metrics.jsonl")]


def _digest(path: Path) -> str:
    """A file's sha256; a safetensors file's over its tensors and its metadata as a dict (the writer serialises
    the metadata map in a random order per call: the same content, other bytes)."""
    raw = path.read_bytes()
    if path.suffix == ".safetensors":
        import json
        import struct

        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        raw = json.dumps(header, sort_keys=True).encode() + raw[8 + n:]
    return hashlib.sha256(raw).hexdigest()


def _files(root: Path) -> dict[str, str]:
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): _digest(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _config(data: dict, n: int):
    from shared_rl.config import load_train_config

    data = copy.deepcopy(data)
    data["iterations"] = n
    data["checkpoint"] = {**data.get("checkpoint", {}), "every": 1, "keep_last": n + 1}
    data.setdefault("logging", {})["progress"] = False
    return load_train_config(data)


def resume_mismatches(data: dict, tmp: Path, n: int = 3, at: int | None = None, kill_in: str = "rollout") -> list[str]:
    """What differs between the uninterrupted run of ``data`` (``n`` iterations) and the one killed in iteration
    ``at`` (0-based; default ``n - 1``) and resumed (empty: nothing). ``kill_in``: the domain hook that dies (after
    doing its work) in that iteration. The default kills in the third of three: state that only moves after a first
    update (an old copy synced with decay 0 at iteration 0, a history refit at the second round) has moved by then.
    The end-of-run curves and HTML report are not drawn (they read only metrics.jsonl, compared here, and drawing
    them is most of a tiny run's time)."""
    from unittest import mock

    from shared_rl import report, trainer

    with mock.patch.object(trainer, "plot_metrics", lambda *a, **k: None), \
            mock.patch.object(report, "write_report", lambda run_dir, *a, **k: run_dir / "report.html"):
        return _mismatches(data, tmp, n, n - 1 if at is None else at, kill_in)


def _mismatches(data: dict, tmp: Path, n: int, at: int, kill_in: str) -> list[str]:
    from shared_rl.trainer import Trainer

    quiet = lambda *_: None  # noqa: E731
    full = Trainer(_config(data, n), tmp / "full", log=quiet)
    full.fit()
    want_state = {k: v.detach().clone() for k, v in full.domain.state_dict().items()}

    killed = Trainer(_config(data, n), tmp / "killed", log=quiet)
    hook = getattr(killed.domain, kill_in)

    def dies(*args, **kwargs):
        out = hook(*args, **kwargs)
        if killed_iteration[0] >= at:
            raise Killed
        return out

    killed_iteration = [0]
    real_iteration = killed.iteration

    def counting(it):
        killed_iteration[0] = it
        return real_iteration(it)

    killed.iteration = counting
    setattr(killed.domain, kill_in, dies)
    try:
        killed.fit()
    except Killed:
        pass
    else:
        return [f"the run was never killed in iteration {at} (domain.{kill_in} not called)"]
    del killed
    resumed = Trainer(_config(data, n), tmp / "killed", log=quiet)
    resumed.fit(resume=True)
    bad = []
    if resumed.start_iteration != at:
        bad.append(f"resumed at iteration {resumed.start_iteration}, expected {at}")
    a, b = _records(tmp / "full"), _records(tmp / "killed")
    if len(a) != len(b):
        bad.append(f"{len(b)} metric records after the resume, {len(a)} uninterrupted")
    for ra, rb in zip(a, b):
        for k in sorted(set(ra) | set(rb)):
            if not _same(ra.get(k), rb.get(k)):
                bad.append(f"step {ra.get('step')}: {k} = {rb.get(k)!r} resumed, {ra.get(k)!r} uninterrupted")
    got_state = resumed.domain.state_dict()
    for k in sorted(set(want_state) | set(got_state)):
        if k not in want_state or k not in got_state:
            bad.append(f"state_dict key {k} only in the {'resumed' if k in got_state else 'uninterrupted'} run")
        elif not torch.equal(want_state[k], got_state[k].detach()):
            bad.append(f"state_dict {k} differs")
    fa, fb = _files(tmp / "full" / "final"), _files(tmp / "killed" / "final")
    for k in sorted(set(fa) | set(fb)):
        if fa.get(k) != fb.get(k):
            bad.append(f"exported final/{k} differs")
    for t in (full, resumed):
        close = getattr(t.domain, "close", None)
        if close is not None:
            close()
    return bad
