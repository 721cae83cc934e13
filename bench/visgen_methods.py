"""visgen methods benchmark: every visgen method side by side at the demo's scale, at flat Flow-GRPO's NFE budget.

``grove bench visgen-methods --out DIR [--quick]`` calls ``run(out_dir, quick)``.

Setup: the ``make demo`` recipe (``configs/visgen/shapes_grpo.yaml``: the tiny SD3 shapes asset, 32 prompts x 16
images = 512 images per optimizer step, the ``shapes_soft`` training reward, LoRA r16, lr 1e-3) for every method,
changed only where the method needs it (its ``visgen.method``/``objective``/``kernel``, its advantage estimator,
its own learning rate from ``LR``). Flat Flow-GRPO runs ``flat_iters`` iterations with several seeds; its mean total
NFE (every transformer forward: rollout, training, old and reference policies) is the budget every other method
runs to. Held-out strict accuracy (the frozen checker: every attribute right; ODE, fixed seeds; the demo's 57
prompts x 4 images) is evaluated before training and every ``eval_every`` iterations.

The noise band is measured, not assumed: the spread (max - min) of flat's strict at the budget over its seeds,
and at least one evaluation's standard error (``MIN_BAND``). "NFE to reach flat's final strict" (and the speedups)
exist only when flat's mean rise exceeds that band; otherwise the cells stay empty and the page says so.

Row fields: ``variant`` (contains the method's short name), ``seed``, ``strict_start``, ``strict_at_budget``,
``nfe_to_flat_final``, ``speedup_nfe_vs_flat``, ``speedup_time_vs_flat``, NFE per image and seconds per iteration.
Wall times are from a shared 2-core CPU: compare ratios, not seconds.
"""
from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .visgen_trees import _interp, _quiet, _smooth

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "visgen" / "shapes_grpo.yaml"
DOC = ROOT / "docs" / "bench" / "visgen_methods.md"
PLOT_DOC = ROOT / "docs" / "bench" / "visgen_methods_strict_vs_nfe.png"
MIN_BAND = 0.03  # one evaluation of 228 images: about +-0.03 standard error on strict accuracy
FLAT = "flat"

BRANCH = {"name": "branch_grpo", "split_steps": [0, 2, 4, 6], "factor": [2]}
# short name -> overrides of the demo recipe (nested sections); every tree method grows 16 leaves per prompt
VARIANTS: dict[str, dict[str, Any]] = {
    "flat": {},
    "dance": {"visgen": {"kernel": "dance", "noise_level": 0.3, "method": {"name": "dance_grpo", "train_fraction": 0.3}}},
    "fast": {"visgen": {"method": {"name": "flow_grpo_fast", "min_window": 1, "max_window": 3, "range_end": 5}}},
    "mix": {"visgen": {"method": {"name": "mix_grpo", "window_size": 3, "shift": 1, "iters_per_shift": 4}}},
    "branch": {"visgen": {"method": BRANCH}, "advantage": {"estimator": "depth_zscore"}},
    "branch-prune": {"visgen": {"method": {**BRANCH, "width_prune": "ratio", "width_keep": 0.5, "depth_prune": [2, 3],
                                           "depth_prune_slide_every": 1}}, "advantage": {"estimator": "depth_zscore"}},
    "branch-mix": {"visgen": {"method": {**BRANCH, "name": "branch_grpo_mix", "sde_windows": [[0, 4]]}},
                   "advantage": {"estimator": "depth_zscore"}},
    "tree": {"visgen": {"method": {"name": "tree_grpo", "branch": [2, 2, 2, 2]}},
             "advantage": {"estimator": "tree_leaf_zscore"}},
    # the auto merge schedule of the 10-step grid has 3 consolidated steps: 3 groups x 5 per prompt; each member
    # scored at ODE strides 1 and 2 (shapes_soft@g2), its advantage the sum of both z-scores (the reference's)
    "egrpo": {"visgen": {"method": {"name": "egrpo"}}, "rollout": {"group_size": 5},
              "advantage": {"estimator": "depth_zscore", "multi_reward": "normalize_then_sum"}},
    # the likelihood-free objectives take 8 optimizer steps of 64 images per rollout batch (the sweep in
    # docs/bench/visgen_methods.md: NFT 0.531 / 0.579 / 0.610 held-out strict after 10 iterations with 1 / 4 / 8
    # steps, AWM 0.548 / 0.566 with 1 / 4): their loss needs no behaviour log-probs, so reusing a batch costs
    # only training forwards
    # (the objective brings its loss and the ODE sampler; method: null drops the demo recipe's flow_grpo)
    # (since issue 37 each objective runs its reference's defaults: NFT sampled by its old policy, 9 of 10
    # timesteps; AWM's clipped ratio, ghuber weighting, advantage_max 1 and EMA-KL; the 8 steps are grove's, measured
    # better than the references' one step per batch)
    # (both references normalise by the batch's std: advantage.estimator batch_std, their sample.global_std)
    "nft": {"visgen": {"method": None, "objective": {"name": "nft"}}, "optim": {"minibatches_per_epoch": 8},
            "advantage": {"estimator": "batch_std"}},
    "awm": {"visgen": {"method": None, "objective": {"name": "awm"}}, "optim": {"minibatches_per_epoch": 8},
            "advantage": {"estimator": "batch_std"}},
    # DGPO as its geneval config: one optimizer step per batch (whole groups per call), KL 0.02 to the reference,
    # the clip against the EMA old policy, per-prompt advantages with the population std + 1e-4, beta_dpo 101
    "dgpo": {"visgen": {"method": None, "objective": {"name": "dgpo", "beta_dpo": 101.0}}, "loss": {"kl_coef": 0.02},
             "advantage": {"estimator": "grpo_population", "eps": 1.0e-4}},
    "guard": {"loss": {"policy_loss": "guard"}},
}
# issue 63's five methods: each row is its own shapes recipe (configs/visgen/shapes_<recipe>.yaml, the authors'
# defaults at the demo's scale) with the bench's fixed settings; no overrides of their own
RECIPES: dict[str, str] = {"dpo": "shapes_dpo.yaml", "flowdppo": "shapes_flowdppo.yaml",
                           "opsd": "shapes_diffusion_opsd.yaml", "opd": "shapes_opd.yaml", "crd": "shapes_crd.yaml"}
VARIANTS.update({name: {} for name in RECIPES})
# on-policy distillation needs a teacher: flat Flow-GRPO's seed-0 run at the budget, its LoRA merged
# (``run`` makes it under OUT/teacher; a stream with --flat-seeds 0 names one with --teacher)
TEACHER_OF = {"opd": "visgen.objective.teacher"}
# per-method learning rates (docs/bench/visgen_methods.md records the sweep); absent: the demo's 1e-3
LR: dict[str, float] = {}


def recipe_of(name: str) -> Path:
    """The recipe a variant starts from: its own (``RECIPES``) or the demo's."""
    return RECIPE.parent / RECIPES[name] if name in RECIPES else RECIPE


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "method" \
            else copy.deepcopy(v)
    return out


def variant_config(name: str, seed: int, iterations: int, quick: bool, model: str | None = None,
                   variants: dict[str, dict] | None = None, overrides: list[str] | None = None) -> dict:
    """The demo recipe with the method's overrides (from ``variants``, default ``VARIANTS``), the bench's fixed
    settings and the quick sizes, then the dotted ``overrides`` (``optim.lr=3e-3``: a sweep point; last, so that
    ``logging.step_clip_frac=true`` survives the bench's own logging section)."""
    from shared_rl.config import apply_overrides, load_yaml

    data = _merge(load_yaml(recipe_of(name)), (variants or VARIANTS)[name])
    data.update(seed=seed, iterations=iterations)
    if name in LR:
        data["optim"]["lr"] = LR[name]
    data["eval"] = {"at_start": False}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"every": 0}
    vis = data["visgen"]
    vis["num_threads"] = 1
    if model:
        vis["model"] = model
    if quick:  # plumbing only: 2 prompts, 4 steps, a 4-prompt evaluation
        data["rollout"]["groups_per_iteration"] = 2
        vis["eval"] = {"samples_per_prompt": 1, "max_prompts": 4, "grid_prompts": 0}
    else:
        vis["eval"] = {**vis.get("eval", {}), "grid_prompts": 0}
    return apply_overrides(data, list(overrides)) if overrides else data


def run_variant(name: str, seed: int, nfe_budget: float | None, max_iters: int, eval_every: int, quick: bool,
                log, model: str | None = None, variants: dict[str, dict] | None = None,
                overrides: list[str] | None = None, save_final: Path | None = None) -> dict[str, Any]:
    """Train until the (full-precision) NFE budget is spent (or ``max_iters``), evaluating every ``eval_every``
    iterations. A two-stage explorer's forwards are counted apart (``explore_nfe``). ``save_final``: the trained
    policy merged into a full pipeline there (a teacher for on-policy distillation, ``visgen.tiny.merge_teacher``)."""
    from shared_rl.config import load_train_config
    from shared_rl.trainer import Trainer

    cfg = load_train_config(variant_config(name, seed, max_iters, quick, model, variants, overrides))
    torch.manual_seed(seed)
    trainer = Trainer(cfg, None, log=lambda s: None)
    with torch.no_grad():
        ev = trainer.domain.evaluate(0)
    points = [{"iteration": 0, "nfe": 0.0, "time": 0.0, "score": ev["eval/strict"]}]
    nfe = wall = explore = 0.0
    images = 0
    spearman: list[float] = []
    clip_by_step: dict[str, list[float]] = {}  # logging.step_clip_frac: true (GRPO-Guard's diagnosis)
    for it in range(max_iters):
        m = trainer.iteration(it)
        for k, v in m.items():
            if k.startswith("clip_frac/step"):
                clip_by_step.setdefault(k[len("clip_frac/"):], []).append(float(v))
        nfe += m["nfe/rollout"] + m["nfe/train"]
        explore += m.get("nfe/explore", 0.0)
        if "two_stage/rank_spearman" in m:
            spearman.append(m["two_stage/rank_spearman"])
        wall += m["time/rollout"] + m["time/train"]
        images += int(m.get("tree/leaves", cfg.rollout.groups_per_iteration * cfg.rollout.group_size))
        done = nfe_budget is not None and nfe >= nfe_budget
        if (it + 1) % eval_every == 0 or done or it + 1 == max_iters:
            with torch.no_grad():
                ev = trainer.domain.evaluate(it + 1)
            points.append({"iteration": it + 1, "nfe": nfe, "time": wall, "score": ev["eval/strict"]})
            log(f"  {name} seed {seed}: it {it + 1} nfe {nfe:.0f} {wall:.0f}s train reward {m['reward/mean']:.3f} "
                f"held-out strict {ev['eval/strict']:.3f}")
        if done:
            break
    if save_final is not None:
        from visgen.tiny import merge_teacher

        trainer.domain.save_pretrained(Path(save_final) / "final")
        merge_teacher(Path(save_final) / "final", Path(save_final) / "teacher")
    out = {"points": points, "iterations": it + 1, "images": images, "nfe": nfe, "time": wall, "explore_nfe": explore,
           "rank_spearman": statistics.mean(spearman) if spearman else None}
    if clip_by_step:  # each denoising step's clipped fraction, averaged over iterations
        out["clip_frac_by_step"] = {k: statistics.mean(v) for k, v in sorted(clip_by_step.items())}
    return out


def first_reach(points: list[dict], target: float) -> tuple[float | None, float | None]:
    """NFE and wall time at which the strict curve first reaches ``target`` (interpolated), else None."""
    for a, b in zip(points[:-1], points[1:]):
        if b["score"] >= target:
            if a["score"] >= target or b["score"] == a["score"]:
                return b["nfe"], b["time"]
            f = (target - a["score"]) / (b["score"] - a["score"])
            return a["nfe"] + f * (b["nfe"] - a["nfe"]), a["time"] + f * (b["time"] - a["time"])
    return None, None


def noise_band(finals: list[float]) -> float:
    """The measured spread of flat's final strict over seeds, never below one evaluation's noise."""
    return max(MIN_BAND, (max(finals) - min(finals)) if len(finals) > 1 else 0.0)


def rows_from(results: dict[str, list[dict]], budget: float) -> tuple[list[dict], dict[str, float]]:
    flat = results[FLAT]
    start = statistics.mean(r["points"][0]["score"] for r in flat)
    finals = [_interp(r["points"], "nfe", budget, "score") for r in flat]
    target, band = statistics.mean(finals), noise_band(finals)
    signal = target - start > band
    flat_time = statistics.mean(r["time"] for r in flat)
    rows = []
    for name, runs in results.items():
        for i, res in enumerate(runs):
            pts = res["points"]
            nfe_r, t_r = first_reach(_smooth(pts, 1), target) if signal else (None, None)
            rows.append({
                "variant": name, "seed": i, "iterations": res["iterations"],
                **({"rank_spearman": res["rank_spearman"], "explore_nfe": res["explore_nfe"]}
                   if res.get("rank_spearman") is not None else {}),
                "nfe_per_image": res["nfe"] / max(res["images"], 1), "s_per_iter": res["time"] / res["iterations"],
                "strict_start": pts[0]["score"], "strict_at_budget": _interp(pts, "nfe", budget, "score"),
                "nfe_to_flat_final": nfe_r, "speedup_nfe_vs_flat": budget / nfe_r if nfe_r else None,
                "speedup_time_vs_flat": flat_time / t_r if t_r else None,
            })
    return rows, {"flat_start": start, "flat_final": target, "band": band, "signal": signal}


def _plot(results: dict[str, list[dict]], path: Path, budget: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    # one colour per method (all its seeds): tab20's dark shades first, then its light ones (13 methods > 10 colours)
    colors = plt.get_cmap("tab20").colors[0::2] + plt.get_cmap("tab20").colors[1::2]
    for v, (name, runs) in enumerate(results.items()):
        for i, res in enumerate(runs):
            pts = res["points"]
            kw = {"label": name if i == 0 else None, "ls": "-" if name == FLAT else "--", "marker": "o", "ms": 3,
                  "color": "black" if name == FLAT else colors[v % len(colors)]}
            axes[0].plot([p["nfe"] for p in pts], [p["score"] for p in pts], **kw)
            axes[1].plot([p["time"] for p in pts], [p["score"] for p in pts], **kw)
    axes[0].axvline(budget, color="gray", ls=":", lw=1)
    axes[0].set_xlabel("transformer forwards (rollout + training + old/reference)")
    axes[1].set_xlabel("wall seconds (rollout + training)")
    for ax in axes:
        ax.set_ylabel("held-out strict accuracy (ODE, fixed seeds)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle("visgen methods at the demo's scale (tiny SD3, shapes, 512 images per step)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_runs(paths: list[Path | str], flat_iters: int, eval_every: int) -> dict[str, list[dict]]:
    """Runs measured earlier (``--reuse``: results.json or partial.json files of this bench or visgen-two-stage, or
    one ``--probe``'s JSON (its one run, e.g. a flat seed run in its own process), the
    same recipe), by variant, so a stopped bench resumes and one flat measurement serves both pages. Every run must
    have been evaluated every ``eval_every`` iterations, and flat's must have run ``flat_iters``; otherwise a
    ConfigError says what was found."""
    import json

    from shared_rl.errors import ConfigError

    out: dict[str, list[dict]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs = data.get("runs") or ({FLAT: data["flat_runs"]} if data.get("flat_runs") else {}) \
            or ({data["variant"]: [data]} if data.get("variant") and data.get("points") else {})  # a --probe's file
        if not runs:
            raise ConfigError(f"--reuse {path}: no runs in it (made by an older version of the bench?)")
        for name, rs in runs.items():
            for r in rs:
                its = [p["iteration"] for p in r["points"]]
                if its[1:2] != [min(eval_every, r["iterations"])] or (name == FLAT and r["iterations"] != flat_iters):
                    raise ConfigError(f"--reuse {path}: its {name} run has {r['iterations']} iterations evaluated at "
                                      f"{its}; this run needs {flat_iters if name == FLAT else 'any number of'} "
                                      f"iterations evaluated every {eval_every}")
                if r not in out.setdefault(name, []):  # a partial.json repeats the runs it reused
                    out[name].append(r)
    return out


def run(out_dir: Path, quick: bool = False, variants: list[str] | None = None, log=print, flat_iters: int | None = None,
        flat_seeds: int | None = None, eval_every: int | None = None, best_seeds: int | None = None,
        write_doc: bool | None = None, model: str | None = None, reuse: list[Path | str] | None = None,
        budget_nfe: float | None = None, variant_seed: int = 0, teacher: Path | str | None = None) -> dict[str, Any]:
    """The benchmark (``variants``, ``flat_iters``, ``flat_seeds``, ``eval_every``, ``best_seeds`` size it).

    ``reuse``: earlier results.json / partial.json files whose runs are taken instead of re-run (``load_runs``).
    ``budget_nfe`` with ``flat_seeds=0``: run only ``variants`` at that budget and keep them in partial.json (a
    second stream next to one running flat; a later call with ``reuse`` of both makes the table). ``variant_seed``:
    the seed of the non-flat variants run here (a stream that runs the best method's second seed while the others
    finish; reuse its partial.json after the seed-0 runs'). ``teacher``: the pipeline on-policy distillation
    (``TEACHER_OF``) distils; by default flat seed 0's policy at the budget, merged into ``out_dir/teacher`` when
    this call runs that seed."""
    from shared_rl.bench import markdown_table, write_results

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    _quiet()
    t0 = time.perf_counter()
    flat_iters = flat_iters or (2 if quick else 30)
    flat_seeds = (1 if quick else 3) if flat_seeds is None else flat_seeds
    eval_every = eval_every or (1 if quick else 5)
    best_seeds = best_seeds or (1 if quick else 2)
    names = [n for n in (variants or list(VARIANTS)) if n != FLAT]
    with tempfile.TemporaryDirectory() as tmp:
        if quick and model is None and not (ROOT / "assets" / "shapes-sd3-tiny" / "model_index.json").is_file():
            from .visgen_trees import _model

            model, _ = _model(True, Path(tmp))
        earlier = load_runs(reuse, flat_iters, eval_every) if reuse else {}
        results: dict[str, list[dict]] = {FLAT: earlier.get(FLAT, [])[:max(flat_seeds, 1)]}
        for seed in range(len(results[FLAT]), flat_seeds):
            log(f"visgen-methods: flat seed {seed} sets the budget")
            save = out_dir if seed == 0 and teacher is None and any(n in TEACHER_OF for n in names) else None
            results[FLAT].append(run_variant(FLAT, seed, None, flat_iters, eval_every, quick, log, model,
                                             save_final=save))
            if save is not None:
                teacher = out_dir / "teacher"
            _save_partial(out_dir, results)
        if not results[FLAT] and budget_nfe is None:
            raise ValueError("no flat runs (flat_seeds=0 and nothing reused): give budget_nfe")
        budget = budget_nfe if budget_nfe is not None else statistics.mean(r["nfe"] for r in results[FLAT])
        for name in names:
            if earlier.get(name):
                results[name] = earlier[name]
                continue
            log(f"visgen-methods: {name}")
            results[name] = [run_variant(name, variant_seed, budget, 3 * flat_iters, eval_every, quick, log, model,
                                         overrides=teacher_overrides(name, teacher))]
            _save_partial(out_dir, results)
        if not results[FLAT]:  # a second stream: its runs wait in partial.json for the call that makes the table
            log(f"visgen-methods: {len(names)} variant(s) at {budget:.0f} NFE kept in {out_dir / 'partial.json'}")
            return {"rows": [], "partial": str(out_dir / "partial.json")}
        rows, summary = rows_from(results, budget)
        others = [r for r in rows if r["variant"] != FLAT]
        if others and best_seeds > 1:  # the best other method gets more seeds: is its edge outside the band?
            best = max(others, key=lambda r: r["strict_at_budget"])["variant"]
            for seed in range(1, best_seeds):
                log(f"visgen-methods: {best} seed {seed} (the best other method)")
                if len(results[best]) <= seed:
                    results[best].append(run_variant(best, seed, budget, 3 * flat_iters, eval_every, quick, log, model,
                                                     overrides=teacher_overrides(best, teacher)))
                    _save_partial(out_dir, results)
            rows, summary = rows_from(results, budget)
    total = time.perf_counter() - t0
    plot = out_dir / "strict_vs_nfe.png"
    _plot(results, plot, budget)
    command = (f"python -m bench.visgen_methods --flat-iters {flat_iters} --flat-seeds {flat_seeds}"
               + (f" --reuse {' '.join(map(str, reuse))}" if reuse else "") if not quick and (flat_iters != 30 or reuse)
               else f"grove bench visgen-methods{' --quick' if quick else ''}")
    notes = (f"Command: `nice -n 5 {command}` ({time_note(results, total, bool(reuse))} "
             f"on this machine, shared with other jobs). Budget: flat's mean {budget:.0f} NFE over {flat_seeds} seed(s) "
             f"of {flat_iters} iterations; flat strict {summary['flat_start']:.3f} -> {summary['flat_final']:.3f}, "
             f"noise band {summary['band']:.3f} ({'a signal: speedups defined' if summary['signal'] else 'NOT above the band: no speedup is defined'}).\n")
    doc = None
    if (not quick) if write_doc is None else write_doc:
        doc = DOC
        _plot(results, PLOT_DOC, budget)
        notes += f"\n![held-out strict vs NFE and wall time]({PLOT_DOC.name})\n"
    result = write_results(out_dir, "visgen-methods", rows, notes=notes,
                           extra={"curves": {k: [r["points"] for r in v] for k, v in results.items()},
                                  "flat_runs": results[FLAT], "runs": results,
                                  "budget_nfe": budget, **summary, "quick": quick, "total_s": total,
                                  "table": markdown_table(rows)}, doc_path=doc)
    log(f"visgen-methods: done in {total:.0f} s")
    return result


def teacher_overrides(name: str, teacher: Path | str | None) -> list[str] | None:
    """The dotted override that names a distilling variant's teacher (none for the others)."""
    if name not in TEACHER_OF:
        return None
    if teacher is None:
        from shared_rl.errors import ConfigError

        raise ConfigError(f"variant {name} distils a teacher: run flat seed 0 in the same call, or give --teacher")
    return [f"{TEACHER_OF[name]}={teacher}"]


def time_note(results: dict[str, list[dict]], total_s: float, reused: bool) -> str:
    """What the page says the bench took: this call's wall time, and with runs reused from earlier calls (which
    this call did not time) the rollout + training seconds its runs recorded, summed."""
    runs = [r for rs in results.values() for r in rs]
    summed = sum(float(r.get("time", 0.0)) for r in runs)
    if not reused:
        return f"total {total_s / 60:.1f} min"
    return (f"{len(runs)} runs, most reused from earlier calls: their rollout + training time sums to "
            f"{summed / 60:.0f} min, evaluations not counted; this call {total_s / 60:.1f} min")


def _save_partial(out_dir: Path, results: dict[str, list[dict]]) -> None:
    """The runs so far (``partial.json``): a long bench that is stopped keeps what it measured."""
    import json

    (Path(out_dir) / "partial.json").write_text(json.dumps({"flat_runs": results.get(FLAT, []), "runs": results},
                                                           indent=1, default=float))


def probe(name: str, overrides: list[str], iterations: int, eval_every: int, out: Path, seed: int = 0,
          log=print, save_final: Path | None = None) -> dict[str, Any]:
    """One sweep point: variant ``name`` of the demo recipe with dotted ``overrides``, ``iterations`` iterations,
    held-out strict every ``eval_every``; the curve is written to ``out`` (JSON) and returned. The page's sweep
    tables are made of these (``python -m bench.visgen_methods --probe nft --set optim.lr=3e-3 ...``)."""
    import json

    torch.set_num_threads(1)
    _quiet()
    res = run_variant(name, seed, None, iterations, eval_every, False, log, overrides=overrides, save_final=save_final)
    res.update(variant=name, overrides=list(overrides), seed=seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/bench-visgen-methods")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--variants", nargs="*")
    p.add_argument("--flat-iters", type=int)
    p.add_argument("--flat-seeds", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--best-seeds", type=int)
    p.add_argument("--no-doc", action="store_true")
    p.add_argument("--reuse", nargs="*", help="earlier results.json / partial.json whose runs are taken, not re-run")
    p.add_argument("--budget-nfe", type=float, help="with --flat-seeds 0: run only --variants at this NFE budget")
    p.add_argument("--probe", help="run ONE variant as a sweep point (with --set, --iters) instead of the bench")
    p.add_argument("--set", nargs="*", default=[], help="dotted overrides of the probe, e.g. optim.lr=3e-3")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--teacher", help="the pipeline the distilling variants (opd) distil; default flat seed 0's, merged")
    p.add_argument("--save-final", help="with --probe: merge the trained policy into SAVE_FINAL/teacher")
    p.add_argument("--seed", type=int, default=0, help="the probe's seed, or with --flat-seeds 0 the variants' seed")
    a = p.parse_args()
    if a.probe:
        probe(a.probe, a.set + (teacher_overrides(a.probe, a.teacher) or []), a.iters, a.eval_every or 5,
              Path(a.out) / f"{a.probe}_{'_'.join(a.set) or 'base'}_s{a.seed}.json", a.seed,
              save_final=Path(a.save_final) if a.save_final else None)
        raise SystemExit(0)
    run(Path(a.out), a.quick, a.variants, flat_iters=a.flat_iters, flat_seeds=a.flat_seeds, eval_every=a.eval_every,
        best_seeds=a.best_seeds, write_doc=False if a.no_doc else None, reuse=a.reuse, budget_nfe=a.budget_nfe,
        variant_seed=a.seed, teacher=a.teacher)
