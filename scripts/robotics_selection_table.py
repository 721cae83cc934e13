"""Markdown rows of five-task runs with per-task early stopping (``robotics.adapters.keep_best``).

    python scripts/robotics_selection_table.py runs/kb/s0 runs/kb/s1 ...

One row per run directory: held-out success per task at the end (the kept adapters), overall and RL's gain over the
start, the iteration each task's adapter was kept from, the last adapters' held-out success where the run measured
it (``eval_last/success``), the held-out overall at every evaluation, and the env steps (rollouts; validation apart).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from shared_rl.metrics import read_metrics


def row(run: Path) -> str:
    records = read_metrics(run / "metrics.jsonl")
    evals = [r for r in records if "eval/success" in r]
    if not evals or "select/val_best" not in evals[-1]:
        raise SystemExit(f"{run}: no finished run with adapters.keep_best (no select/val_best in its last evaluation)")
    first, last = evals[0], evals[-1]
    tasks = sorted(k[len("eval/success/"):] for k in last if k.startswith("eval/success/"))
    per_task = " | ".join(f"{first[f'eval/success/{t}']:.3g} → {last[f'eval/success/{t}']:.3g} "
                          f"(it {int(last[f'select/best_iteration/{t}'])})" for t in tasks)
    gain = 100 * (last["eval/success"] - first["eval/success"])
    last_adapters = last.get("eval_last/success")
    no_select = f"{last_adapters:.3g} ({100 * (last_adapters - first['eval/success']):+.1f})" if last_adapters is not None else "—"
    curve = " / ".join(f"{r['eval/success']:.3g}" for r in evals[:-1])
    env_steps = sum(r.get("env/steps", 0) for r in records)
    val_steps = sum(r.get("select/env_steps", 0) for r in records)
    return (f"| {run.name} | {per_task} | **{last['eval/success']:.3g}** ({gain:+.1f}) | {no_select} | {curve} | "
            f"{env_steps / 1e3:.0f}k + {val_steps / 1e3:.0f}k |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories of `grove train` with robotics.adapters.keep_best")
    args = ap.parse_args()
    tasks = sorted(k[len("eval/success/"):] for k in read_metrics(args.runs[0] / "metrics.jsonl")[0]
                   if k.startswith("eval/success/"))
    print("| run | " + " | ".join(f"{t} (kept from)" for t in tasks)
          + " | overall, kept (RL's gain) | last adapters, no selection | overall at 0, 10, ... (live) | env steps "
            "(rollouts + validation) |")
    print("|---" * (len(tasks) + 5) + "|")
    for run in args.runs:
        print(row(run))


if __name__ == "__main__":
    main()
