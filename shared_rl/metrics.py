"""Metrics: JSONL always, TensorBoard when installed and asked for, wandb when asked; plots of the curves.

One JSON object per line with ``step`` and the metric names of DESIGN.md §4 (``reward/mean``, ``loss/policy``,
``eval/<metric>``, ...). Step 0 holds the evaluation before the first update.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; None reads as "missing"
    return v


class MetricsLogger:
    def __init__(self, run_dir: Path | None, tensorboard: bool = False, wandb: bool = False, project: str = "grove",
                 config: dict | None = None) -> None:
        self.path = run_dir / "metrics.jsonl" if run_dir else None
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
        """Drop records past ``step`` (written after the checkpoint a resumed run restarts from)."""
        if not self.path or not self.path.is_file():
            return
        keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        if self.path:
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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def plot_metrics(records: list[dict[str, Any]], out_png: Path, title: str = "") -> Path | None:
    """Reward curve (mean ± std) and every ``eval/*`` metric against the iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("reward/mean") is not None]
    evals = sorted({k for r in records for k in r if k.startswith("eval/") and isinstance(r[k], (int, float))})
    if not train and not evals:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    if train:
        s = [r["step"] for r in train]
        m = [r["reward/mean"] for r in train]
        sd = [r.get("reward/std") or 0.0 for r in train]
        axes[0].plot(s, m, label="reward/mean")
        axes[0].fill_between(s, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)], alpha=0.2)
        axes[0].set_xlabel("iteration")
        axes[0].set_title("training reward")
        axes[0].legend()
    for k in evals[:8]:
        pts = [(r["step"], r[k]) for r in records if isinstance(r.get(k), (int, float))]
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
    axes[1].set_xlabel("iteration")
    axes[1].set_title("evaluation (held out)")
    if evals:
        axes[1].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
