"""Metrics: JSONL always, TensorBoard and wandb when asked for (``shared_rl.preflight`` checks they are installed);
``curves.png`` with one axis per kind of metric.

One JSON object per line with ``step`` and the metric names of DESIGN.md §4 (``reward/mean``, ``loss/policy``,
``eval/<metric>``, ...). Step 0 holds the evaluation before the first update.

Crash tolerance: records are appended and flushed one line at a time; ``shared_rl.checkpoint.save_checkpoint``
fsyncs the file before each checkpoint, so every record up to a checkpoint survives a power cut. A kill or a full
disk during an append can leave a *torn* last line (no newline, not JSON): ``read_history`` drops it loudly, and
``truncate_after`` (at every start and resume) rewrites the file without it, through a temporary file and a
rename. A line that is not JSON anywhere else is not a crash artefact; ``check_history`` refuses to resume over it.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .rundir import atomic_path, check_run_dir


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; None reads as "missing"
    return v


class MetricsLogger:
    def __init__(self, run_dir: Path | None, tensorboard: bool = False, wandb: bool = False, project: str = "grove",
                 config: dict | None = None, log=None) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl" if run_dir else None
        self.log_fn = log or _stderr
        self.tb = None
        self.wandb = None
        if run_dir and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                pass
        if wandb:
            import wandb as wb  # asked for explicitly: an ImportError here is the right message

            self.wandb = wb.init(project=project, config=config or {}, dir=str(run_dir) if run_dir else None)

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (written after the checkpoint a resumed run restarts from) and a torn last
        line (loudly); the file is replaced through a temporary file and a rename."""
        if not self.path or not self.path.is_file():
            return
        check_run_dir(self.run_dir)
        keep = [text for text, record in _history_lines(self.path, self.log_fn) if record["step"] <= step]
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(text + "\n" for text in keep))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        if self.path:
            check_run_dir(self.run_dir)  # never append into a recreated folder: the run stops instead
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
        if self.tb:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(record, step=step)

    def close(self) -> None:
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def _parse(path: Path) -> tuple[list[tuple[int, str, dict[str, Any] | None]], int]:
    """([(line number, text, the record or None when the line is not one)], the last non-empty line's number)."""
    rows, last = [], 0
    for n, line in enumerate(Path(path).read_bytes().decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        last = n
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        ok = isinstance(record, dict) and isinstance(record.get("step"), int)
        rows.append((n, line, record if ok else None))
    return rows, last


def check_history(path: Path) -> None:
    """ConfigError when ``metrics.jsonl`` has a line that is not a record anywhere but at its end (a torn last
    line is what a crash leaves and is dropped at resume; damage in the middle is not, and is never dropped
    silently). ``grove train --resume`` calls it before anything is written."""
    path = Path(path)
    if not path.is_file():
        return
    rows, last = _parse(path)
    inner = [(n, text) for n, text, record in rows if record is None and n != last]
    if inner:
        n, text = inner[0]
        raise ConfigError(f"{path}: line {n} is not a metrics record ({text[:60]!r}); the history is damaged in "
                          f"the middle, not torn at its end: repair or delete that line, then resume")


def _history_lines(path: Path, log) -> list[tuple[str, dict[str, Any]]]:
    rows, last = _parse(path)
    for n, text, record in rows:
        if record is None:
            what = "its torn last line" if n == last else f"line {n} (not a metrics record)"
            log(f"WARNING: {path}: dropped {what}: {text[:60]!r}")
    return [(text, record) for _, text, record in rows if record is not None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_history(path: Path, log=_stderr) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``. A torn last line (a crash or a full disk during the append) is dropped
    with a warning through ``log``; so are other lines that are not records (``check_history`` refuses those
    before a resume)."""
    return [record for _, record in _history_lines(path, log)]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (a torn last line dropped, see ``read_history``)."""
    return read_history(path)


def _numeric(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _is_length(key: str) -> bool:
    return "length" in key or key in ("completion/tokens",)


# (panel title, which metric names go on it): each kind of metric gets its own axis, since their scales differ by
# orders of magnitude (a KL of 1e-4 is invisible next to a loss of 0.3 or a grad norm of 40)
PANELS: list[tuple[str, Any]] = [
    ("held-out evaluation", lambda k: k.startswith("eval/") and not _is_length(k)),
    ("rollout success per task (stratum)", lambda k: k.startswith("selection/success/")),
    ("validation (per-task early stopping)", lambda k: k.startswith("select/val/")),
    ("rates (fractions of groups / completions)", lambda k: k in ("frac_zero_std", "completion/truncated",
                                                                  "groups/kept_fraction")),
    ("lengths", _is_length),
    ("losses", lambda k: k.startswith("loss/") and k != "loss/kl"),
    ("KL", lambda k: k in ("loss/kl", "approx_kl")),
    ("clip fraction", lambda k: k == "clip_frac"),
    ("importance ratio", lambda k: k.startswith("ratio/")),
    ("grad norm", lambda k: k == "grad_norm"),
    ("entropy", lambda k: k == "entropy"),
]


def _with_rates(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    records = [dict(r) for r in records]
    for r in records:  # the kept share of drawn groups is a rate; the raw counts are not
        if isinstance(r.get("groups/kept"), (int, float)) and r.get("groups/drawn"):
            r["groups/kept_fraction"] = r["groups/kept"] / r["groups/drawn"]
    return records


def curve_panels(records: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(panel title, metric names) of ``curves.png``: the training reward, then each kind of ``PANELS`` the
    records hold a number for."""
    records = _with_rates(records)
    keys = sorted({k for r in records for k in r if k != "step"})
    panels: list[tuple[str, list[str]]] = []
    if any(isinstance(r.get("reward/mean"), (int, float)) for r in records):
        panels.append(("training reward", [k for k in keys if k.startswith("reward/") and k.endswith("/mean")]))
    for name, wants in PANELS:
        chosen = [k for k in keys if wants(k) and _numeric(records, k)[0]]
        if chosen:
            panels.append((name, chosen[:8]))
    return panels


def plot_metrics(records: list[dict[str, Any]], out_png: Path, title: str = "") -> Path | None:
    """``curves.png``: the training reward (mean ± std and each named reward), then one axis per kind of metric
    that the records hold (``curve_panels``: evaluation, rates, lengths, losses, KL, clip fraction, ratio, grad
    norm, entropy), each against the iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _with_rates(records)
    train = [r for r in records if isinstance(r.get("reward/mean"), (int, float))]
    panels = curve_panels(records)
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.1 * rows), squeeze=False)
    for ax, (name, chosen) in zip(axes.flat, panels):
        for k in chosen:
            s, v = _numeric(records, k)
            ax.plot(s, v, marker="o" if len(s) < 12 else None, markersize=3, label=k)
        if name == "training reward":
            s = [r["step"] for r in train]
            m = [r["reward/mean"] for r in train]
            sd = [r.get("reward/std") or 0.0 for r in train]
            ax.fill_between(s, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)], alpha=0.2)
        if name == "KL" and all(v > 0 for k in chosen for v in _numeric(records, k)[1]):
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # near-constant series (a ratio of 1) read as values
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("iteration")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    # fixed margins: tight_layout costs about a second per call on a busy CPU, at the end of every run
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.9 if title else 0.95, wspace=0.28, hspace=0.45)
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
    return out_png
