"""Reward-hacking guards: held-out "gold" rewards, evaluated but never trained on.

A policy optimised against one reward model learns that model's blind spots: Flow-GRPO reports PickScore/OCR
training that raises the trained score while image quality measured by other models falls (its #233; Pref-GRPO
#2 — "reward hacking"), and GenEval/OCR training in DanceGRPO and Flow-GRPO is checked against other rewards for
the same reason. grove makes the check part of every run: ``visgen.gold_rewards`` lists rewards (any registered
name with kwargs) that score the *evaluation* images only — held-out prompts, ODE, fixed seeds — and never enter
the advantages. Each gives ``eval/gold/<output>`` (mean) and ``gold_sem/<output>`` (its standard error).

At the end of the run (``hacking_report``): for each trained output ``T`` (``eval/T``; the outputs with a
non-zero ``advantage.weights`` entry) and gold output ``G``, the change from the first to the last evaluation;
a **warning** when some ``T`` rose while ``G`` fell by more than twice the standard error of the difference
(``2 * sqrt(sem_first^2 + sem_last^2)``, so evaluation noise alone rarely triggers it). The warning goes to the
log, ``visgen_summary.txt`` and the title of ``curves.png``, whose third panel plots every trained and gold
evaluation metric as its change since the first evaluation (the trainer's ``summary.txt`` lists the
``eval/gold/*`` values beside the trained ones).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

# the config-time check is torch-free (visgen.rewards.gold.check_gold_rewards as before)
from ..part_settings import check_gold_rewards  # noqa: F401

GOLD_PREFIX = "eval/gold/"
SEM_PREFIX = "gold_sem/"


def gold_metrics(scores: dict[str, torch.Tensor]) -> dict[str, float]:
    """``eval/gold/<name>`` (mean over finite values) and ``gold_sem/<name>`` (standard error) per output."""
    out: dict[str, float] = {}
    for name, values in scores.items():
        ok = values[torch.isfinite(values)].double()
        n = int(ok.numel())
        out[GOLD_PREFIX + name] = float(ok.mean()) if n else math.nan
        out[SEM_PREFIX + name] = float(ok.std(unbiased=True) / math.sqrt(n)) if n > 1 else math.nan
    return out


def _evals(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in history if any(k.startswith(GOLD_PREFIX) for k in r)]


def hacking_warnings(history: list[dict[str, Any]], trained: list[str]) -> tuple[list[str], list[str]]:
    """(summary lines, warning lines) comparing the first and last evaluation of trained and gold outputs."""
    evals = _evals(history)
    if len(evals) < 2:
        return ["gold rewards: fewer than two evaluations, no comparison"], []
    first, last = evals[0], evals[-1]
    lines, warnings = [], []
    rising = []
    for name in trained:
        key = f"eval/{name}"
        if isinstance(first.get(key), (int, float)) and isinstance(last.get(key), (int, float)):
            delta = last[key] - first[key]
            lines.append(f"trained {name}: {first[key]:.4g} -> {last[key]:.4g} ({delta:+.3g})")
            if delta > 0:
                rising.append((name, delta))
    gold_names = sorted(k[len(GOLD_PREFIX):] for k in last if k.startswith(GOLD_PREFIX))
    for name in gold_names:
        a, b = first.get(GOLD_PREFIX + name), last.get(GOLD_PREFIX + name)
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float))) or math.isnan(a) or math.isnan(b):
            continue
        sa, sb = first.get(SEM_PREFIX + name, math.nan), last.get(SEM_PREFIX + name, math.nan)
        noise = 2 * math.sqrt(sa**2 + sb**2) if not (math.isnan(sa) or math.isnan(sb)) else 0.0
        lines.append(f"gold {name}: {a:.4g} -> {b:.4g} ({b - a:+.3g}; 2 s.e. {noise:.2g}) [held out, never trained]")
        if rising and b - a < -noise:
            up = ", ".join(f"{n} {d:+.3g}" for n, d in rising)
            warnings.append(f"WARNING: possible reward hacking: trained {up} rose while gold {name} fell "
                            f"{b - a:+.3g} (beyond 2 s.e. = {noise:.2g}, steps {first['step']} -> {last['step']})")
    return lines, warnings


def plot_with_gold(history: list[dict[str, Any]], trained: list[str], out_png: Path, title: str = "") -> None:
    """curves.png with a third panel: trained and gold evaluation metrics as changes since the first evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in history if isinstance(r.get("reward/mean"), (int, float))]
    evals = sorted({k for r in history for k in r if k.startswith("eval/") and not k.startswith(GOLD_PREFIX)
                    and isinstance(r[k], (int, float))})
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    if train:
        s = [r["step"] for r in train]
        m = [r["reward/mean"] for r in train]
        sd = [r.get("reward/std") or 0.0 for r in train]
        axes[0].plot(s, m, label="reward/mean")
        axes[0].fill_between(s, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)], alpha=0.2)
        axes[0].legend()
    axes[0].set_title("training reward")
    for k in evals[:8]:
        pts = [(r["step"], r[k]) for r in history if isinstance(r.get(k), (int, float))]
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
    axes[1].set_title("evaluation (held out)")
    if evals:
        axes[1].legend(fontsize=7)
    gold = sorted({k for r in history for k in r if k.startswith(GOLD_PREFIX)})
    for keys, style in (([f"eval/{t}" for t in trained], "-"), (gold, "--")):
        for k in keys:
            pts = [(r["step"], r[k]) for r in history if isinstance(r.get(k), (int, float)) and not math.isnan(r[k])]
            if pts:
                axes[2].plot([p[0] for p in pts], [p[1] - pts[0][1] for p in pts], style, marker="o",
                             label=("gold " if k in gold else "trained ") + k.split("/", 2)[-1])
    axes[2].axhline(0.0, color="grey", linewidth=0.5)
    axes[2].set_title("trained (solid) vs gold (dashed): change since step 0")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("iteration")
    if title:
        fig.suptitle(title, color="red" if title.startswith("WARNING") else "black", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def hacking_report(run_dir: Path, history: list[dict[str, Any]], trained: list[str], log=print) -> list[str]:
    """The summary lines (warnings first), logged; curves.png redrawn with the trained-vs-gold panel."""
    lines, warnings = hacking_warnings(history, trained)
    for w in warnings:
        log(w)
    title = warnings[0] if warnings else "no reward-hacking warning (no gold reward fell beyond 2 s.e. while a trained one rose)"
    plot_with_gold(history, trained, Path(run_dir) / "curves.png", title[:160])
    return warnings + lines
