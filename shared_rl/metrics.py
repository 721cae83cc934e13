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
import time
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


def duration(seconds: float) -> str:
    """``seconds`` the way a person reads a wait: ``8 s``, ``3 min 20 s``, ``1 h 05 min``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def eta(elapsed: float, done: int, total: int) -> str:
    """``12.3 s/it, ETA 4 min 10 s``: the mean time per unit so far and what the remaining units take at that
    rate ("" before the first unit)."""
    if done <= 0:
        return ""
    per = elapsed / done
    return f"{per:.3g} s/it, ETA {duration(per * max(0, total - done))}"


class Progress:
    """``what: done/total unit, elapsed, ETA`` lines for a step that takes a while (an evaluation), through
    ``log``: at most one every ``every`` seconds, and none at all for a step that finishes within ``every`` of
    its start (fast evaluations stay quiet)."""

    def __init__(self, log, what: str, total: int, unit: str = "", every: float = 10.0) -> None:
        self.log, self.what, self.total, self.unit, self.every = log, what, total, unit, every
        self.start = self.last = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every or done <= 0:
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / done * max(0, self.total - done)
        unit = f" {self.unit}" if self.unit else ""
        tail = f"ETA {duration(left)}" if done < self.total else "done"
        self.log(f"{self.what}: {done}/{self.total}{unit}, {duration(elapsed)} elapsed, {tail}")


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
    return "length" in key


# (panel title, which metric names go on it): each kind of quantity gets its own axis, since their scales differ by
# orders of magnitude (a KL of 1e-4 is invisible next to a loss of 0.3 or a grad norm of 40); a panel holds one
# unit only: fractions on the rates panel (counts become fractions first: ``_derived``), tokens or steps per
# completion / episode on the lengths panel (never a batch's total)
PANELS: list[tuple[str, Any]] = [
    ("held-out evaluation", lambda k: k.startswith("eval/") and not _is_length(k) and "_se" not in k),
    ("rollout success per task (stratum)", lambda k: k.startswith("selection/success/")),
    ("validation (per-task early stopping)", lambda k: k.startswith("select/val/")),
    ("rates (fraction of groups / completions)", lambda k: k in RATES),
    ("lengths (per completion / episode)", _is_length),
    ("losses", lambda k: k.startswith("loss/") and k != "loss/kl"),
    ("KL", lambda k: k in ("loss/kl", "approx_kl")),
    ("clip fraction", lambda k: k == "clip_frac"),
    ("importance ratio", lambda k: k.startswith("ratio/")),
    ("grad norm", lambda k: k == "grad_norm"),
    ("entropy", lambda k: k == "entropy"),
]
RATES = ("frac_zero_std", "completion/truncated_fraction", "groups/kept_fraction")
# panels whose series are drawn even when they never change (an unchanged evaluation is a result, as is any
# eval/ series elsewhere); on the others a constant series (two points or more) is one the configuration cannot move (KL 0 with kl_coef 0, ratio 1 and clip fraction 0
# with one optimizer step per batch, the entropy of a fixed-noise SDE): it is named under the figure, not drawn
ALWAYS_DRAWN = ("training reward", "held-out evaluation", "rollout success per task (stratum)",
                "validation (per-task early stopping)")


def _derived(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with counts turned into what a reader compares across runs: the kept share of drawn groups,
    the truncated share of completions and tokens per completion (``completion/tokens`` is a batch total)."""
    records = [dict(r) for r in records]

    def ratio(r: dict[str, Any], num: str, den: str) -> float | None:
        a, b = r.get(num), r.get(den)
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
        return a / b if ok and b else None

    for r in records:
        for key, num, den in (("groups/kept_fraction", "groups/kept", "groups/drawn"),
                              ("completion/truncated_fraction", "completion/truncated", "completion/count"),
                              ("completion/mean_length", "completion/tokens", "completion/count")):
            value = ratio(r, num, den)
            if value is not None:
                r[key] = value
    return records


def _constant(values: list[float]) -> bool:
    return bool(values) and max(values) - min(values) <= 1e-6 * max(1.0, max(abs(v) for v in values))


def curve_panels(records: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(panel title, metric names) of ``curves.png``: the training reward, then each kind of ``PANELS`` the
    records hold a moving number for (``constant_series`` lists the ones left out)."""
    return _layout(records)[0]


def constant_series(records: list[dict[str, Any]]) -> dict[str, float]:
    """The series ``curves.png`` leaves out because they never change in this run, with their value."""
    return _layout(records)[1]


def _layout(records: list[dict[str, Any]]) -> tuple[list[tuple[str, list[str]]], dict[str, float]]:
    records = _derived(records)
    keys = sorted({k for r in records for k in r if k != "step"})
    panels: list[tuple[str, list[str]]] = []
    left_out: dict[str, float] = {}
    if any(isinstance(r.get("reward/mean"), (int, float)) for r in records):
        total = _numeric(records, "reward/mean")
        # a named reward equal to the total (the only reward, weight 1) would be drawn twice
        panels.append(("training reward", [k for k in keys if k.startswith("reward/") and k.endswith("/mean")
                                           and (k == "reward/mean" or _numeric(records, k) != total)]))
    for name, wants in PANELS:
        chosen = [k for k in keys if wants(k) and _numeric(records, k)[0]]
        if name not in ALWAYS_DRAWN:
            for k in list(chosen):
                values = _numeric(records, k)[1]
                if not k.startswith("eval/") and len(values) >= 2 and _constant(values):
                    chosen.remove(k)
                    left_out[k] = values[0]
        if chosen:
            panels.append((name, chosen[:8]))
    return panels, left_out


def _se_key(key: str) -> str:
    """Where a standard error of ``key`` is recorded: ``eval/success`` -> ``eval/success_se``, ``eval/success/push``
    -> ``eval/success_se/push`` (``robotics.evaluation.outcome_metrics``)."""
    head, _, rest = key.partition("/")
    name, _, tail = rest.partition("/")
    return f"{head}/{name}_se" + (f"/{tail}" if tail else "")


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(records: list[dict[str, Any]], out_png: Path, title: str = "") -> Path | None:
    """``curves.png``: the training reward (each iteration's mean, thin, and its moving average), then one axis
    per kind of quantity that moved in this run (``curve_panels``: evaluation, rates, lengths, losses, KL, clip
    fraction, ratio, grad norm, entropy), each against the iteration; the series left out for never changing are
    named under the figure with their value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = _derived(records)
    panels, left_out = _layout(records)
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.1 * rows + (0.35 if left_out else 0)),
                             squeeze=False)
    for ax, (name, chosen) in zip(axes.flat, panels):
        for k in chosen:
            s, v = _numeric(records, k)
            if name == "training reward" and len(v) >= 8:
                # the per-iteration mean is noisy; its moving average shows the trend (the batch's std is the
                # spread of single samples, far wider than the trend, so it is not drawn)
                line, = ax.plot(s, v, linewidth=0.8, alpha=0.35)
                ax.plot(s, _moving_average(v, max(2, len(v) // 10)), color=line.get_color(), linewidth=1.8,
                        label=f"{k} (moving average)")
                continue
            line, = ax.plot(s, v, marker="o" if len(s) < 12 else None, markersize=3, label=k)
            se = _numeric(records, _se_key(k)) if name == "held-out evaluation" else None
            if se and se[0] == s:  # a standard error recorded beside the metric: a band of +-1 SE
                ax.fill_between(s, [a - b for a, b in zip(v, se[1])], [a + b for a, b in zip(v, se[1])],
                                color=line.get_color(), alpha=0.15)
        values = [v for k in chosen for v in _numeric(records, k)[1]]
        if name.startswith("rates"):
            ax.set_ylim(-0.02, 1.02)
        elif name in ("KL", "grad norm") and values and min(values) > 0 and max(values) > 100 * min(values):
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # near-constant series read as values, not offsets
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers (no 1.5 ticks)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    bottom = 0.08
    if left_out:
        text = ", ".join(f"{k} = {v:.3g}" for k, v in sorted(left_out.items()))
        fig.text(0.01, 0.01, f"constant in this run, not drawn: {text}", fontsize=7, wrap=True)
        bottom = 0.08 + 0.35 / fig.get_figheight()
    # fixed margins: tight_layout costs about a second per call on a busy CPU, at the end of every run
    # the top margin in inches (the title, then the panels' own titles): a fraction overlapped them in one row
    top = 1 - (0.62 if title else 0.3) / fig.get_figheight()
    fig.subplots_adjust(left=0.07, right=0.98, bottom=bottom, top=top, wspace=0.28, hspace=0.45)
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
    return out_png
