"""Files a run writes besides its checkpoints and metrics: ``config.yaml`` for a run started from Python, and
``summary.txt`` at the end (``Trainer.fit``)."""
from __future__ import annotations

from pathlib import Path

from .config import dump_train_config
from .rundir import atomic_write_text


def write_config_for_the_cli(run_dir: Path, cfg, held: list[str]) -> None:
    """A run started from Python (``shared_rl.api``, the domains' trainer classes) writes ``config.yaml`` as
    ``grove train`` does, so ``grove eval RUN`` and ``grove train --resume RUN`` understand its directory. Objects
    the caller held (a model, a pipeline, a policy) are named in its header: their config paths are labels
    (``held/...``); resume such a run from Python with the same objects, or point those paths at saved copies.
    The CLI writes its own config.yaml first, which is left as it is."""
    path = run_dir / "config.yaml"
    if path.exists():
        return
    import yaml

    header = ["# written by a run started from Python (shared_rl.api / a domain's trainer class)"]
    if held:
        header.append(f"# held in memory by the caller, not saved: {', '.join(held)}; their paths below are labels "
                      f"(held/...): resume from Python with the same objects, or set those paths to saved copies")
    atomic_write_text(path, "\n".join(header) + "\n" + yaml.safe_dump(dump_train_config(cfg), sort_keys=False))


def write_summary(run_dir: Path, records: list[dict], log) -> None:
    """``summary.txt``: the last evaluation paired with its baseline when it carries paired changes, else the first
    and last held-out evaluation (or, without any, the first and last training rewards); also logged."""
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    trained = [r for r in records if any(k.startswith("reward/") for k in r)]
    prefix, what = "eval/", "summary"
    from .report import paired_change

    last = evals[-1] if evals else {}
    paired = {k: pc for k in sorted(last) if (pc := paired_change(last, k)) is not None}
    if paired:  # the last evaluation read episode by episode against the baseline (the run's first or a saved one)
        lines = [f"{k}: {last[k]:.4g} (paired change {d:+.4g} ± {se:.3g}{', inside the band' if inside else ''})"
                 for k, (d, se, inside) in paired.items()]
        summary = (f"summary at step {last['step']}, paired with the baseline evaluation (the run's first, or "
                   f"its saved one)\n  " + "\n  ".join(lines))
        atomic_write_text(run_dir / "summary.txt", summary + "\n")
        log(summary)
        evals = []  # written
    if len(evals) < 2 and len(trained) >= 2 and not paired:  # no held-out evaluation: the training rewards
        evals, prefix, what = trained, "reward/", "summary of the training rewards (no held-out evaluation)"
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        lines = [f"{k}: {first[k]:.4g} -> {last[k]:.4g}" for k in sorted(last)
                 if k.startswith(prefix) and k.endswith("mean" if prefix == "reward/" else "")
                 and isinstance(first.get(k), (int, float)) and isinstance(last.get(k), (int, float))]
        summary = f"{what} (step %d -> %d)\n  " % (first["step"], last["step"]) + "\n  ".join(lines)
        atomic_write_text(run_dir / "summary.txt", summary + "\n")
        log(summary)
