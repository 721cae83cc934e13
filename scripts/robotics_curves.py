"""Per-task held-out success curves of several robotics runs side by side, one panel per task plus the overall
mean (used for docs/methods/robotics.md, "Per-task adapters, 50 iterations").

    python scripts/robotics_curves.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Runs sharing a label (e.g. seeds of one recipe) are drawn in one colour.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def evaluations(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "eval/success" in r]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__.strip().splitlines()[-3])
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    labels = list(dict.fromkeys(lbl for lbl, _ in runs))
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    tasks = sorted({k[len("eval/success/"):] for _, d in runs for r in evaluations(Path(d)) for k in r
                    if k.startswith("eval/success/")})
    names = ["overall"] + tasks
    fig, axes = plt.subplots(1, len(names), figsize=(3.0 * len(names), 3.0), sharey=True)
    legend: set[str] = set()
    for label, d in runs:
        ev = evaluations(Path(d))
        steps = [r["step"] for r in ev]
        for ax, name in zip(axes, names):
            key = "eval/success" if name == "overall" else f"eval/success/{name}"
            first = name == "overall" and label not in legend  # one legend entry per label
            ax.plot(steps, [r[key] for r in ev], color=colours[labels.index(label) % len(colours)], alpha=0.8,
                    marker="o", ms=3, label=label if first else None)
        legend.add(label)
    for ax, name in zip(axes, names):
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out success")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
