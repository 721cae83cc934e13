"""``grove bench robotics-world-model``: GRPO in the simulator vs three ways of using the learned world model.

Same task (door-open), same BC starting policy (``assets/metaworld-vla-tiny``), the same world model
(``assets/metaworld-wm-tiny``) and the same evaluation: the ODE policy in MuJoCo on 100 held-out door-open reset
states (``robotics.eval_states_per_task=100``, the first 40 are the earlier 40), every success with its binomial
standard error, evaluated every 5 iterations so each row has a curve of held-out success against real env steps.

Rows (``variant``), each per seed and as a mean over its seeds:

1. ``sim GRPO``: ``metaworld_grpo_door.yaml`` (25 iterations of 8 x 8 episodes in MuJoCo) — the reference;
2. ``imagined GRPO``: ``world_model_grpo.yaml`` — rewards from the world model's success model (kept as an option;
   its measured harm is the reason for the next two rows); rank agreement = its audit's ``rank_spearman``;
3. ``verified two-stage``: ``world_model_verified.yaml`` — 16 imagined candidates per keyframe, the shared selector
   keeps 4, those are re-executed in MuJoCo with the same noise streams and trained on their real rewards; rank
   agreement = ``verify/rank_spearman``;
3b. ``verified-ranker``: ``world_model_verified_ranker.yaml`` — the same with a sibling ranker's scores (learned
   from the run's own re-executed groups; or trained on sibling sets, ``bench/robotics_wm_probe.py``); rank
   agreement = the in-training probe's ``probe/spearman_within`` on held-out keyframes;
4. ``short-horizon``: ``world_model_short_horizon.yaml`` — imagined branches of 3 chunks from real states, their
   return the critic's value (critic trained on real returns); rank agreement = ``short/rank_spearman``.

Columns: ``before`` / ``after`` (± ``*_se``), ``real_env_steps`` (for the world-model rows: the world model's real
data, 13,747 steps, plus every real step taken during training — verified re-executions, fresh rollouts; audit
replays that only measure are not counted), ``steps_to_sim_final`` (real env steps at the first evaluation whose
held-out success reaches the sim GRPO mean final success; empty when never) and ``fraction_of_sim_steps`` (that
÷ sim GRPO's real env steps to its own final: the issue's target is ≤ 1/3 in every seed), rank agreement, wall time.

A row whose run directory already holds a finished run (``final/``) is read, not re-run: a long benchmark can be
run a row at a time (``python bench/robotics_world_model.py --only verified --seeds 0 1 2``) and assembled by
``grove bench robotics-world-model --out <the same directory>``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bench" / "robotics_world_model.md"
CFG = ROOT / "configs" / "robotics"
VARIANTS = {  # name -> (recipe, label, the metric of imagined-vs-real rank agreement)
    "sim": ("metaworld_grpo_door.yaml", "sim GRPO (metaworld_grpo_door.yaml)", None),
    "imagined": ("world_model_grpo.yaml", "imagined GRPO (world_model_grpo.yaml)", "audit/rank_spearman"),
    "verified": ("world_model_verified.yaml", "verified two-stage (world_model_verified.yaml)", "verify/rank_spearman"),
    "verified-ranker": ("world_model_verified_ranker.yaml",
                        "verified two-stage, sibling-ranker scores (world_model_verified_ranker.yaml)", "probe/spearman_within"),
    "short": ("world_model_short_horizon.yaml", "short-horizon + critic (world_model_short_horizon.yaml)",
              "short/rank_spearman"),
}
EVAL = ["robotics.eval_states_per_task=100", "robotics.eval_standard_error=true", "robotics.gifs=false", "eval.every=5"]
QUICK = ["robotics.eval_states_per_task=2", "robotics.eval_standard_error=true", "robotics.gifs=false", "iterations=1",
         "rollout.groups_per_iteration=2", "eval.every=0"]


def _nanmean(vals) -> float:
    v = [x for x in vals if x is not None and np.isfinite(x)]
    return float(np.mean(v)) if v else float("nan")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def curve(hist: list[dict]) -> list[dict]:
    """The evaluations of a run: iteration, held-out success and its standard error, real env steps so far (the
    world-model rollouts report theirs as ``eval/real_env_steps``; in the simulator they are the summed
    ``env/steps``)."""
    out, steps = [], 0
    for h in hist:
        steps += int(h.get("env/steps", 0) or 0)
        if "eval/success" in h:
            real = h.get("eval/real_env_steps")
            out.append({"step": int(h.get("step", 0)), "success": float(h["eval/success"]),
                        "se": float(h.get("eval/success_se", float("nan"))),
                        "real_env_steps": int(real) if real is not None else steps})
    return out


def steps_to(points: list[dict], target: float) -> int | None:
    """Real env steps at the first evaluation after the start whose success reaches ``target`` (None: never)."""
    for p in points[1:]:
        if p["success"] >= target - 1e-9:
            return p["real_env_steps"]
    return None


def _train(variant: str, seed: int, run_dir: Path, quick: bool, log) -> tuple[list[dict], float]:
    """Train one (variant, seed) unless ``run_dir`` holds a finished run; returns its metrics and wall time."""
    if (run_dir / "final").is_dir() and (run_dir / "metrics.jsonl").is_file():
        log(f"bench robotics-world-model: {variant} seed {seed}: reusing the finished run in {run_dir}")
        wall = json.loads((run_dir / "bench_wall.json").read_text())["wall_s"] if (run_dir / "bench_wall.json").is_file() \
            else float("nan")
        return read_metrics(run_dir), wall
    from shared_rl.cli import main as grove

    overrides = (QUICK if quick else EVAL) + [f"seed={seed}"]
    if quick and variant != "sim":
        wm = "robotics.rollout.world_model"
        overrides += [f"{wm}.refit_steps=2", f"{wm}.refit_success_steps=2"]
    # as `grove train` (run-directory lock, config.yaml, checkpoints, final/): a stopped row resumes where it stopped
    resume = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    argv = ["train", "--resume", str(run_dir)] if resume else ["train", str(CFG / VARIANTS[variant][0]), "--out",
                                                                str(run_dir), *overrides]
    log(f"bench robotics-world-model: {variant} seed {seed} -> {run_dir}{' (resumed)' if resume else ''}")
    t = time.perf_counter()
    code = grove(argv)
    if code != 0:
        raise RuntimeError(f"bench robotics-world-model: `grove {' '.join(argv)}` exited {code}")
    wall = time.perf_counter() - t
    (run_dir / "bench_wall.json").write_text(json.dumps({"wall_s": wall}))
    return read_metrics(run_dir), wall


def row(variant: str, seed: int, hist: list[dict], wall: float, sim_final: float | None,
        sim_steps: float | None) -> dict:
    pts = curve(hist)
    first, last = pts[0], pts[-1]
    metric = VARIANTS[variant][2]
    its = [h for h in hist if "groups/kept" in h]
    r = {"variant": VARIANTS[variant][1], "seed": seed, "before": first["success"], "before_se": first["se"],
         "after": last["success"], "after_se": last["se"], "gain": last["success"] - first["success"],
         "real_env_steps": last["real_env_steps"]}
    if sim_final is not None:
        reach = steps_to(pts, sim_final)
        r["steps_to_sim_final"] = reach
        r["fraction_of_sim_steps"] = reach / sim_steps if (reach is not None and sim_steps) else None
    if metric is not None:
        r["rank_spearman"] = _nanmean([h.get(metric) for h in its])
    if variant.startswith("verified"):
        r["kept_agreement"] = _nanmean([h.get("verify/kept_agreement") for h in its])
        r["hallucinated_success_rate"] = _nanmean([h.get("verify/hallucinated_success_rate") for h in its])
        r["mixed_groups_real"] = _nanmean([h.get("verify/mixed_groups_real") for h in its])
    if variant == "imagined":
        r["hallucinated_success_rate"] = _nanmean([h.get("audit/hallucinated_success_rate") for h in its])
    if variant != "sim":
        r["imagined_steps"] = int(sum(h.get("wm/imagined_steps", 0) or 0 for h in its)) or None
    r["curve"] = " ".join(f"{p['success']:.2f}@{p['real_env_steps'] // 1000}k" for p in pts)
    r["wall_s"] = wall
    return r


def mean_row(rows: list[dict]) -> dict:
    """The mean over a variant's seeds (``steps_to_sim_final``: the mean over the seeds that reached it, and how many)."""
    out = {"variant": rows[0]["variant"] + f", mean of {len(rows)} seed(s)", "seed": "all"}
    for k in ("before", "after", "gain", "real_env_steps", "rank_spearman", "kept_agreement",
              "hallucinated_success_rate", "mixed_groups_real", "wall_s"):
        if k in rows[0]:
            out[k] = _nanmean([r.get(k) for r in rows])
    # the standard error of a mean of independent evaluations (same states, different training seeds)
    for k in ("before_se", "after_se"):
        out[k] = float(np.sqrt(np.nansum([r[k] ** 2 for r in rows])) / len(rows))
    if "steps_to_sim_final" in rows[0]:
        reached = [r["steps_to_sim_final"] for r in rows if r["steps_to_sim_final"] is not None]
        out["steps_to_sim_final"] = _nanmean(reached) if reached else None
        out["seeds_reaching_sim_final"] = f"{len(reached)}/{len(rows)}"
        fr = [r["fraction_of_sim_steps"] for r in rows if r.get("fraction_of_sim_steps") is not None]
        out["fraction_of_sim_steps"] = _nanmean(fr) if fr else None
    return out


def run(out_dir: Path, quick: bool = False, log=print, only: list[str] | None = None,
        seeds: list[int] | None = None) -> dict:
    """Train (or read) every (variant, seed) under ``out_dir/<variant>_s<seed>`` and write the table."""
    import torch

    from shared_rl.bench import write_results

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds = seeds if seeds is not None else ([0] if quick else [0, 1, 2])
    names = only or list(VARIANTS)
    runs: dict[str, list[tuple[int, list[dict], float]]] = {}
    for v in names:
        per_seed = [0] if v == "imagined" and not quick else seeds  # its harm is measured; one seed shows it
        for s in per_seed:
            runs.setdefault(v, []).append((s, *_train(v, s, out_dir / f"{v}_s{s}", quick, log)))
    # sim GRPO's target: its mean final success over the seeds run, and the real steps it took to get there
    sim = runs.get("sim") or [(s, read_metrics(out_dir / f"sim_s{s}"), float("nan")) for s in seeds
                              if (out_dir / f"sim_s{s}" / "metrics.jsonl").is_file()]
    sim_final = sim_steps = None
    if sim:
        sim_final = float(np.mean([curve(h)[-1]["success"] for _, h, _ in sim]))
        sim_steps = float(np.mean([curve(h)[-1]["real_env_steps"] for _, h, _ in sim]))
    rows = []
    for v, rs in runs.items():
        vr = [row(v, s, h, w, sim_final, sim_steps) for s, h, w in rs]
        rows += vr + ([mean_row(vr)] if len(vr) > 1 else [])
    notes = (
        f"Door-open, BC asset, world model assets/metaworld-wm-tiny, 100 held-out reset states (eval split), ODE "
        f"evaluation in MuJoCo (MUJOCO_GL={os.environ.get('MUJOCO_GL')}, Mesa llvmpipe CPU rendering, tuned 64x64 "
        f"scene); torch threads 1; 2 CPU cores shared with other jobs (wall times are indicative). Sim GRPO's target: "
        f"mean final held-out success {sim_final if sim_final is None else round(sim_final, 4)} with "
        f"{sim_steps if sim_steps is None else int(sim_steps)} real env steps. `curve`: held-out success @ real env "
        f"steps (thousands) at every evaluation (every 5 iterations)."
        + (" QUICK MODE: plumbing check only." if quick else "")
    )
    full = not quick and only is None
    return write_results(out_dir, "robotics-world-model", rows, notes, doc_path=DOC if full else None)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/bench-robotics-world-model")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="*", choices=list(VARIANTS), help="train / read only these variants")
    p.add_argument("--seeds", nargs="*", type=int)
    a = p.parse_args()
    print(json.dumps(run(Path(a.out), a.quick, only=a.only, seeds=a.seeds)["rows"], indent=1, default=float))
