"""``grove bench robotics-demos``: what RL buys in demonstrations — BC fitted at every demo count vs RL from few demos.

The claim robot-RL papers make (SimpleVLA-RL: LIBERO-Long 17% -> 91% from one demo per task; RIPT-VLA) is about
demonstrations, which are what costs on a real robot. This bench measures it on the five Meta-World tasks:

1. **The BC curve**: for K in ``KS`` demonstrations per task (DART labels, the object-observing proprio of
   ``configs/robotics/metaworld_bc_dart_object.yaml``), the tiny VLA behaviour-cloned with its model chosen on
   ``VAL_DEMOS`` held-out validation demos per task (``bc.val_demos_per_task``: the lowest validation loss over
   ``BC_STEPS`` steps; never on the evaluation states), held-out success on ``EVAL_STATES`` states per task with
   binomial standard errors. The validation demos are the same for every K and not counted in it (BC's best chance).
2. **RL from few demos**: ``configs/robotics/metaworld_mt5_rl.yaml`` (GRPO, per-task adapters) from the K-demo clones
   at ``RL_KS``, in the variants of ``RL_VARIANTS`` (the recipe; + replay of the K demos; + KL to the clone; + per-task
   keep-best on validation states; RLOO advantages; dynamic sampling; full fine-tuning instead of per-task LoRA; a
   cosine step size; PPO with a value head, ``metaworld_mt5_ppo.yaml``, the same rollouts and budget); held-out
   success before -> after, env steps and wall time. The recipe's init-state curriculum is its history sampler (a reset
   state whose group all succeeded or all failed sits out 4 iterations) with need-weighted task groups.
3. **The table**: for each RL row, K' = the demo count at which the BC curve (log-K, linearly interpolated over the
   seed means) reaches RL's final success: "RL from K demos ≈ BC from K' demos", on the five-task mean and per task
   (each task's success read off its own BC curve); the picture (``plot_curve``) beside the table.

Every row is its own ``grove train`` process writing its own run directory under the output directory; a finished row
is read back, not re-run, so the bench resumes across sittings (run it again with the same ``--out``) and
``python -m bench.robotics_demos --out DIR --only bc`` (or ``rl``) runs a part. ``--quick``: two tiny rows of each
kind (plumbing only). Results in docs/bench/robotics_demos.md.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bench" / "robotics_demos.md"
BC_RECIPE = "configs/robotics/metaworld_bc_dart_object.yaml"
RL_RECIPE = "configs/robotics/metaworld_mt5_rl.yaml"
TASKS = ["reach-v3", "push-v3", "door-open-v3", "button-press-topdown-v3", "drawer-close-v3"]
KS = (1, 2, 5, 10, 20, 40)
BC_SEEDS = (0, 1)
RL_KS = (2, 5)
RL_SEEDS = (0, 1, 2)
EVAL_BATCH = 100  # envs held at once by an evaluation (the same episodes; 500 at once held ~7.7 GB in one process)
RL_EVAL_EVERY = 50  # one evaluation, at the end (each 500-episode evaluation costs ~5 min of a ~20 min row)
VAL_DEMOS = 5
EVAL_STATES = 100
BC_STEPS = 6000
PPO_RECIPE = "configs/robotics/metaworld_mt5_ppo.yaml"  # the same rollouts and budget with a value head (GAE)
RL_VARIANTS = {  # name -> (recipe, overrides)
    "grpo": (RL_RECIPE, []),
    "grpo+demo-replay": (RL_RECIPE, ["robotics.replay.coef=1.0"]),  # the BC loss on the K demos beside the policy
                                                                   # gradient (DAPG)
    "ppo": (PPO_RECIPE, []),
    "grpo+kl": (RL_RECIPE, ["loss.kl_coef=0.04"]),  # Flow-GRPO's mean KL to the clone (its beta 0.04): keeps the
                                                    # tasks the reward does not favour near their start
    # per-task early stopping on validation reset states (never rollout or held-out states), as BC's stop is chosen
    # on validation demos: each task ends with its adapter from the evaluation (every 10 iterations) it scored best
    "grpo+keep-best": (RL_RECIPE, ["robotics.adapters.keep_best=true", "eval.every=10"]),
    # twice the budget with the validation stop: keep-best chose reach's last adapter (iteration 50) in seed 0, so
    # reach was still climbing; the stop guards the tasks that fall on the way
    "grpo+keep-best+100it": (RL_RECIPE, ["iterations=100", "robotics.adapters.keep_best=true", "eval.every=10"]),
    # a step size decaying to 0 by the last iteration: the training curves give part of reach's climb back late
    "grpo+cosine": (RL_RECIPE, ["optim.schedule=cosine"]),
    "grpo+rloo": (RL_RECIPE, ["advantage.estimator=rloo"]),  # RIPT-VLA's leave-one-out baseline, no std division
    # SimpleVLA-RL's dynamic sampling (DAPO): a group whose episodes all succeed or all fail is dropped and another
    # reset state drawn in its place (up to 2 refill rounds); the recipe keeps such groups for their dense reward
    "grpo+dynamic": (RL_RECIPE, ["selection.filter=band", "selection.band=[0.1,0.9]", "selection.max_refill_rounds=2"]),
    # full fine-tuning (SimpleVLA-RL) instead of per-task LoRA (RIPT-VLA): no adapters, every weight trained. Step size
    # 1e-5 (SimpleVLA-RL's is 5e-6): at the recipe's 3e-4 one iteration clipped 30% of the ratios (3e-5: 4%, 1e-5:
    # 0.3%, the zero-initialised adapters at 3e-4: 0%; the recipe's first iterations clip ~0.1-0.2%)
    "grpo+full": (RL_RECIPE, ["robotics.adapters.rank=0", "robotics.train_encoder=true", "optim.lr=1e-5"]),
}
QUICK = {"ks": (1, 2), "bc_seeds": (0,), "rl_ks": (1,), "rl_seeds": (0,), "val": 1, "eval": 2, "bc_steps": 6,
         "variants": {"grpo": (RL_RECIPE, [])}}


def _grove(args: list[str], log_path: Path) -> None:
    """One row: ``grove ARGS`` in its own process (its output in ``log_path``); raises if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as f:
        code = subprocess.run([sys.executable, "-m", "shared_rl.cli", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}).returncode
    if code != 0:
        tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"grove {' '.join(args[:2])} failed ({code}): {tail[0]} (log: {log_path})")


def demo_pool(out: Path, per_task: int, val: int) -> Path:
    """``per_task + val`` DART demos per task (collected once; the last ``val`` of each task validate)."""
    path = out / "demos.npz"
    if not path.is_file():
        args = ["robotics", "collect", "--out", str(path), "--tasks", *TASKS, "--demos-per-task", str(per_task + val),
                "--noise", "0.3", "--labels", "expert", "--include-goal", "--include-object", "--seed", "0"]
        _grove(args, out / "logs" / "collect.log")
    return path


def demo_subset(pool: Path, k: int, val: int, out: Path) -> Path:
    """The first ``k`` training demos and the ``val`` validation demos (the pool's last) of each task (``val`` 0: the
    K demos alone, what RL's demo replay may use)."""
    from robotics.data import load_episodes, save_episodes

    path = out / (f"demos-K{k}.npz" if val else f"demos-K{k}-only.npz")
    if path.is_file():
        return path
    eps = load_episodes(pool)
    chosen = []
    for task in TASKS:
        mine = [e for e in eps if e.task == task]
        if len(mine) < k + val:
            raise ValueError(f"{pool}: {task} has {len(mine)} demos, K={k} + {val} validation needs more")
        chosen += mine[:k] + mine[len(mine) - val:]
    save_episodes(chosen, path)
    return path


def _last_eval(run_dir: Path) -> dict | None:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return None
    recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    evals = [r for r in recs if "eval/success" in r]
    return evals[-1] if evals else None


def bc_row(out: Path, pool: Path, k: int, seed: int, s: dict) -> dict | None:
    run_dir = out / f"bc-K{k}-s{seed}"
    if not (run_dir / "model" / "model.safetensors").is_file() or _last_eval(run_dir) is None:
        if s.get("assemble"):
            return None  # not run yet: --assemble reads finished rows only
        data = demo_subset(pool, k, s["val"], out)
        _grove(["train", BC_RECIPE, "--out", str(run_dir), f"data={data}", "export_dir=''", f"seed={seed}",
                f"val_demos_per_task={s['val']}", f"train_steps={s['bc_steps']}", "val_every=250" if not s["quick"]
                else "val_every=2", f"eval_states_per_task={s['eval']}", f"env.eval_batch={EVAL_BATCH}", "gifs=false"],
               out / "logs" / f"bc-K{k}-s{seed}.log")
    rec = _last_eval(run_dir)
    row = {"variant": f"BC, K={k}", "kind": "bc", "K": k, "seed": seed, "success": rec["eval/success"],
           "success_se": rec.get("eval/success_se", _se(rec, s["eval"])), "best_step": rec.get("bc/best_step")}
    row.update({t: rec.get(f"eval/success/{t}") for t in TASKS})
    return row


def _se(rec: dict, n: int) -> float:
    """The stratified binomial standard error of a five-task mean (for records written without it)."""
    ps = [rec[f"eval/success/{t}"] for t in TASKS if f"eval/success/{t}" in rec]
    return math.sqrt(sum(p * (1 - p) / n for p in ps)) / max(1, len(ps))


def rl_row(out: Path, k: int, seed: int, variant: str, recipe_overrides: tuple[str, list[str]], s: dict) -> dict | None:
    from shared_rl.metrics import read_metrics

    clone = out / f"bc-K{k}-s0" / "model"  # every RL seed starts from the seed-0 clone of K demos
    run_dir = out / f"rl-{variant}-K{k}-s{seed}"
    recipe, overrides = recipe_overrides
    if not (run_dir / "summary.txt").is_file():
        if s.get("assemble"):
            return None
        # the replay sees the K demos only: the validation demos chose BC's stopping step and are not RL's to imitate
        pool = out / "demos.npz"
        extra = ([f"robotics.replay.data={demo_subset(pool, k, 0, out)}"] if any("replay" in o for o in overrides)
                 else [])
        quick = ["iterations=1", "rollout.groups_per_iteration=5", "rollout.group_size=2", "robotics.env.horizon=16",
                 "eval.every=1"] if s["quick"] else [f"eval.every={RL_EVAL_EVERY}"]
        # no evaluation at the start: the clone's own BC row evaluated it on the same states with the same per-episode
        # ODE noise (identical per-task numbers), so the row reads its "before" from there and saves ~5 min
        _grove(["train", recipe, "--out", str(run_dir), f"robotics.checkpoint={clone}", f"seed={seed}",
                "eval.at_start=false", f"robotics.eval_states_per_task={s['eval']}",
                f"robotics.env.eval_batch={EVAL_BATCH}", "robotics.gifs=false", *quick, *overrides, *extra],
               out / "logs" / f"rl-{variant}-K{k}-s{seed}.log")
    recs = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in recs if "eval/success" in r]
    first, last = _last_eval(clone.parent), evals[-1]
    row = {"variant": f"RL {variant}, K={k}", "kind": "rl", "K": k, "seed": seed,
           "success_before": first["eval/success"], "success": last["eval/success"],
           # + keep-best's validation episodes: real env steps too (BC's validation costs demos, counted apart)
           "env_steps": int(sum(r.get("env/steps", 0) + r.get("select/env_steps", 0) for r in recs)),
           "wall_min": round(sum(r.get("time/iteration", 0) + r.get("time/eval", 0) for r in recs) / 60, 1),
           "worst_task_change": min(last[f"eval/success/{t}"] - first[f"eval/success/{t}"] for t in TASKS
                                    if f"eval/success/{t}" in last)}
    row.update({t: f"{first.get(f'eval/success/{t}', 0):.2f} -> {last.get(f'eval/success/{t}', 0):.2f}" for t in TASKS})
    return row


def equivalent_demos(curve: dict[int, float], success: float) -> float | None:
    """K' at which the BC curve (mean success per K, linear in log K between measured points) reaches ``success``;
    None above the curve's best (RL beats BC at every measured K), the smallest K below its first point."""
    ks = sorted(curve)
    if success <= curve[ks[0]]:
        return float(ks[0])
    for a, b in zip(ks, ks[1:]):
        lo, hi = curve[a], curve[b]
        if lo < success <= hi and hi > lo:
            t = (success - lo) / (hi - lo)
            return float(math.exp(math.log(a) + t * (math.log(b) - math.log(a))))
        if success <= max(lo, hi):
            return float(b)
    return None


def run(out_dir: Path, quick: bool = False, only: str = "", assemble: bool = False, ks: tuple[int, ...] = (),
        seeds: tuple[int, ...] = (), variants: tuple[str, ...] = ()) -> dict:
    """All rows (or ``only`` bc / rl); ``assemble``: run nothing, write the table of the rows finished so far.
    ``ks`` / ``seeds`` / ``variants`` restrict the rows run (two processes on different rows share the machine's cores;
    the table is assembled from every finished row either way)."""
    from shared_rl.bench import write_results

    out = Path(out_dir)
    s = {"quick": quick, "ks": KS, "bc_seeds": BC_SEEDS, "rl_ks": RL_KS, "rl_seeds": RL_SEEDS, "val": VAL_DEMOS,
         "eval": EVAL_STATES, "bc_steps": BC_STEPS, "variants": RL_VARIANTS, "assemble": assemble}
    if quick:
        s.update(QUICK)
    unknown = set(variants) - set(s["variants"])
    if unknown:
        raise ValueError(f"unknown variant(s) {sorted(unknown)}; choose from {sorted(s['variants'])}")

    def chosen(k: int, seed: int, variant: str = "") -> bool:
        return (not ks or k in ks) and (not seeds or seed in seeds) and (not variants or not variant or variant in variants)
    t0 = time.perf_counter()
    pool = out / "demos.npz" if assemble else demo_pool(out, max(s["ks"]), s["val"])
    rows, missing = [], []
    if only in ("", "bc"):
        for k in s["ks"]:
            for seed in s["bc_seeds"]:
                row = bc_row(out, pool, k, seed, s if chosen(k, seed) else {**s, "assemble": True})
                if row is None:
                    missing.append(f"BC K={k} seed {seed}")
                    continue
                rows.append(row)
                print(f"bench robotics-demos: BC K={k} seed {seed}: {rows[-1]['success']:.3f} "
                      f"({(time.perf_counter() - t0) / 60:.0f} min so far)", flush=True)
    if only in ("", "rl"):
        for k in s["rl_ks"]:
            if only == "rl" and chosen(k, 0) and any(chosen(k, sd, v) for v in s["variants"] for sd in s["rl_seeds"]):
                bc_row(out, pool, k, 0, s)  # the clone RL starts from
            for variant, recipe_overrides in s["variants"].items():
                for seed in s["rl_seeds"]:
                    row = rl_row(out, k, seed, variant, recipe_overrides,
                                 s if chosen(k, seed, variant) else {**s, "assemble": True})
                    if row is None:
                        missing.append(f"RL {variant} K={k} seed {seed}")
                        continue
                    rows.append(row)
                    print(f"bench robotics-demos: RL {variant} K={k} seed {seed}: {rows[-1]['success_before']:.3f} -> "
                          f"{rows[-1]['success']:.3f}", flush=True)
    curve, task_curves = bc_curves(rows)
    for r in rows:
        if r["kind"] == "rl" and curve:
            kp = equivalent_demos(curve, r["success"])
            r["bc_equivalent_K"] = round(kp, 1) if kp is not None else "above the BC curve"
            r["demo_multiplier"] = round(kp / r["K"], 1) if kp is not None else None
            for t in TASKS:  # per task: "before -> after (K' on that task's own BC curve)"
                if t in r and t in task_curves and "(" not in str(r[t]):
                    kt = equivalent_demos(task_curves[t], _after(r[t]))
                    r[t] = f"{r[t]} (K' {kt:.1f})" if kt is not None else f"{r[t]} (K' > {max(task_curves[t])})"
    notes = (f"Five Meta-World tasks, DART demos (noise 0.3, expert labels), the object-observing proprio. BC: "
             f"{s['bc_steps']} steps, the model of the lowest validation loss on {s['val']} held-out demos per task "
             f"(the same for every K, not counted in K); evaluation: ODE on {s['eval']} held-out states per task, "
             f"standard errors binomial, stratified over tasks. RL: {RL_RECIPE} (ppo: {PPO_RECIPE}) from the seed-0 clone of K demos "
             f"(its 'before' is that clone's BC evaluation: the same states, the same per-episode noise), "
             f"{s['eval']} held-out states per task at the end; "
             f"bc_equivalent_K reads RL's final success off the BC curve of seed means (linear in log K). Each row "
             f"its own process; a finished row is read back." + (" QUICK MODE: plumbing check only." if quick else "")
             + (f" Not run yet ({len(missing)} rows): {'; '.join(missing)}." if missing else ""))
    a_part = bool(only or ks or seeds or variants) and not assemble  # a part never writes the docs page
    if curve:
        plot_curve(rows, out / "robotics_demos.png")
        if not (quick or a_part):
            plot_curve(rows, DOC.with_suffix(".png"))  # docs/bench/robotics_demos.png beside the table
    return write_results(out, "robotics-demos", rows, notes, doc_path=None if quick or a_part else DOC)


def bc_curves(rows: list[dict]) -> tuple[dict[int, float], dict[str, dict[int, float]]]:
    """The BC curve (mean success over seeds at each K) on the five-task mean and per task."""
    bc = [r for r in rows if r["kind"] == "bc"]
    ks = sorted({r["K"] for r in bc})
    curve = {k: float(np.mean([r["success"] for r in bc if r["K"] == k])) for k in ks}
    per_task = {t: {k: float(np.mean([r[t] for r in bc if r["K"] == k])) for k in ks}
                for t in TASKS if bc and all(isinstance(r.get(t), (int, float)) for r in bc)}
    return curve, per_task


def plot_curve(rows: list[dict], path: Path) -> Path:
    """The picture of the table: BC's success against demos per task (each seed and their mean, log K) with every
    RL row at its K and a dotted line to the K' it is worth on the curve; right, the same per task for GRPO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve, per_task = bc_curves(rows)
    ks = sorted(curve)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    bc = [r for r in rows if r["kind"] == "bc"]
    ax.plot(ks, [curve[k] for k in ks], "k-o", lw=2, label="BC (mean over seeds)")
    ax.plot([r["K"] for r in bc], [r["success"] for r in bc], "k.", alpha=0.4, label="BC, each seed")
    rl = [r for r in rows if r["kind"] == "rl"]
    variants = list(dict.fromkeys(r["variant"].split(",")[0].removeprefix("RL ") for r in rl))
    tab10 = plt.get_cmap("tab10")
    colours = [tab10(i) for i in range(10) if i != 7]  # no grey: BC's seeds are grey
    for i, v in enumerate(variants):
        mine = [r for r in rl if r["variant"].startswith(f"RL {v},")]
        c = colours[i % len(colours)]
        xs = []
        for r in mine:  # the variants measured at a K side by side around it (log axis)
            here = [w for w in variants if any(q["K"] == r["K"] and q["variant"].startswith(f"RL {w},") for q in rl)]
            xs.append(r["K"] * (1 + 0.025 * (here.index(v) - (len(here) - 1) / 2)))
        ax.plot(xs, [r["success"] for r in mine], "o", color=c, ms=5, label=f"RL {v}")
        for x, r in zip(xs, mine):
            kp = r.get("bc_equivalent_K")
            if isinstance(kp, (int, float)):
                ax.plot([x, kp], [r["success"]] * 2, ":", color=c, lw=0.8)
    for k in sorted({r["K"] for r in rl}):  # where the target sits: BC at 4K
        if 4 * k <= ks[-1]:
            target = equivalent_success(curve, 4 * k)
            ax.plot([4 * k], [target], "r*", ms=12, label="target: BC at 4K" if k == min(r["K"] for r in rl) else None)
    _log_k_axes(ax, ks, "held-out success, five-task mean", "RL from K demos against BC fitted at every K")
    for j, t in enumerate(per_task):
        c = colours[j]
        bx.plot(ks, [per_task[t][k] for k in ks], "-o", color=c, ms=3, label=t.removesuffix("-v3"))
        for k in sorted({r["K"] for r in rl}):
            after = [_after(r[t]) for r in rl if r["variant"] == f"RL grpo, K={k}" and t in r]
            if after:
                bx.plot([k * 1.06], [np.mean(after)], "^", color=c, ms=8)
    _log_k_axes(bx, ks, "held-out success", "per task: BC curves (lines), GRPO from K demos (triangles, seed mean)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _log_k_axes(ax, ks: list[int], ylabel: str, title: str) -> None:
    ax.set_xscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("demonstrations per task (K)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def _after(cell: str) -> float:
    """The final success of a per-task cell "before -> after" or "before -> after (K' ...)"."""
    return float(str(cell).split("->")[1].split("(")[0])


def equivalent_success(curve: dict[int, float], k: float) -> float:
    """BC's success at ``k`` demos per task on the curve (linear in log K between measured points; clamped)."""
    ks = sorted(curve)
    if k <= ks[0]:
        return curve[ks[0]]
    for a, b in zip(ks, ks[1:]):
        if a <= k <= b:
            t = (math.log(k) - math.log(a)) / (math.log(b) - math.log(a))
            return curve[a] + t * (curve[b] - curve[a])
    return curve[ks[-1]]


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="grove bench robotics-demos, in parts (rows resume from --out)")
    p.add_argument("--out", default="runs/bench-robotics-demos")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["", "bc", "rl"], default="")
    p.add_argument("--assemble", action="store_true", help="run nothing: the table (and docs page) of the finished rows")
    p.add_argument("--ks", type=int, nargs="*", default=[], help="run only these demo counts (the rest read back if finished)")
    p.add_argument("--seeds", type=int, nargs="*", default=[], help="run only these seeds")
    p.add_argument("--variants", nargs="*", default=[], help=f"run only these RL variants ({', '.join(RL_VARIANTS)})")
    a = p.parse_args()
    print(json.dumps(run(Path(a.out), a.quick, a.only, a.assemble, tuple(a.ks), tuple(a.seeds), tuple(a.variants))["rows"],
                     indent=1))
