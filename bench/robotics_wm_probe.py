"""``grove bench robotics-wm-probe``: does the world model rank a keyframe's candidates as MuJoCo would?

The verified two-stage rollout (docs/methods/world_model.md) selects, per keyframe, which of N imagined candidates
the simulator re-executes; that helps only if the imagined score ranks candidates **within** a keyframe as their
real outcomes do. This bench measures it (``robotics.world_model.probe``) and what changes it:

1. **Sibling sets** (collected once, in parts, resumable): with the BC policy and the world model of
   ``configs/robotics/world_model_verified.yaml``, ``TRAIN_KEYS`` keyframes of the first ``SPLIT_STATE`` training
   reset states and ``HELDOUT_KEYS`` keyframes of the others each get ``CANDIDATES`` imagined candidates, and every
   candidate is re-executed in MuJoCo from the keyframe's restored state with its noise stream.
2. **Rows**: each scorer of the imagined candidates, trained (where it learns) on the training sibling sets only,
   probed on the held-out ones: within-keyframe Spearman against the real success and against the real return
   (success + 0.5 x best shaped reward), top-k precision against the base rate, mixed kept groups, scorer steps/s.
   The ceiling row scores the *real* re-executed trajectories (what a perfect world model could give a ranker).
   Per keyframe depth (``DEPTHS``), and at the informative depth a ranker trained on ``SET_SIZES`` candidates per
   keyframe (what cheaper sibling sets cost and teach; ``--by-set-size`` runs only these from the collected sets).

``python -m bench.robotics_wm_probe --out runs/bench-robotics-wm-probe`` (``--quick``: 2 + 2 keyframes x 4
candidates, plumbing only). Results in docs/bench/robotics_wm_probe.md.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bench" / "robotics_wm_probe.md"
CONFIG = ROOT / "configs" / "robotics" / "world_model_verified.yaml"
TRAIN_KEYS = 400
HELDOUT_KEYS = 128
CANDIDATES = 16
SPLIT_STATE = 28  # keyframes of training reset states < 28 train the rankers; >= 28 are held out
PART = 8  # keyframes per saved part (a killed run resumes at the next part)
K = 4
QUICK = {"train": 2, "heldout": 2, "candidates": 4, "part": 2, "ranker_steps": 5, "sibling_wm_keys": 2,
         "sibling_wm_steps": 2}


def _setup(log):
    import torch

    from shared_rl.config import apply_overrides, load_train_config, load_yaml
    from shared_rl.trainer import Trainer

    torch.set_num_threads(1)
    # imagination is never truncated here: the rankers read the whole imagined trajectory (and its disagreement);
    # the recipe's score with truncation is recomputed from the recorded disagreement (``truncated_score``)
    cfg = apply_overrides(load_yaml(CONFIG), ["robotics.eval_states_per_task=1",
                                              "robotics.rollout.world_model.uncertainty_threshold=0"])
    tr = Trainer(load_train_config(cfg), None, log=log)
    return tr.domain


def split_keyframes(keyframes: dict, split_state: int, n_train: int, n_heldout: int, seed: int = 0):
    """Keyframe keys whose trajectories start at training reset states < ``split_state`` (train) and >= (held out),
    the first ``n`` of a seeded permutation of each (a larger ``n`` keeps the smaller one's keyframes)."""
    from robotics.envs.metaworld_env import decode_key

    rng = np.random.default_rng(seed)
    tr = sorted(k for k, kf in keyframes.items() if decode_key(kf.episode_key)[2] < split_state)
    ho = sorted(k for k, kf in keyframes.items() if decode_key(kf.episode_key)[2] >= split_state)
    pick = lambda ks, n: [int(x) for x in rng.permutation(ks)[:n]]  # noqa: E731
    return pick(tr, n_train), pick(ho, n_heldout)


def collect(out: Path, s: dict, log=print):
    """The training and held-out sibling sets, part by part (each part its own file)."""
    import torch

    from robotics.world_model.probe import SiblingSets, collect_sibling_sets
    from robotics.world_model.verified import RestoredEnv

    paths = {"train": out / "train.npz", "heldout": out / "heldout.npz"}
    if all(p.is_file() for p in paths.values()):
        sets = {n: SiblingSets.load(p) for n, p in paths.items()}
        if len(sets["train"].keys) == s["train"] and len(sets["heldout"].keys) == s["heldout"]:
            return sets
    dom = _setup(log)
    st = dom.rollouts
    train, heldout = split_keyframes(st.keyframes, SPLIT_STATE, s["train"], s["heldout"])
    log(f"bench robotics-wm-probe: {len(train)} training and {len(heldout)} held-out keyframes "
        f"(of {len(st.keyframes)})")
    h = dom.cfg.rollout.world_model.horizon
    res = {}
    for name, keys in (("train", train), ("heldout", heldout)):
        parts = []
        for p0 in range(0, len(keys), s["part"]):
            part = out / "parts" / f"{name}-{p0:04d}.npz"
            if not part.is_file():
                t0 = time.perf_counter()
                gen = torch.Generator().manual_seed(1000 * (name == "heldout") + p0)
                ss = collect_sibling_sets(dom.policy, st.imagine, RestoredEnv(dom.venv, st.keyframes),
                                          keys[p0:p0 + s["part"]], s["candidates"], h, dom.sampling, gen, st.task_of)
                ss.save(part)
                log(f"bench robotics-wm-probe: {name} keyframes {p0 + len(ss.keys)}/{len(keys)} "
                    f"({time.perf_counter() - t0:.0f} s, {int(ss.real_steps.sum())} real env steps)")
            parts.append(SiblingSets.load(part))
        res[name] = SiblingSets.concat(parts)
        res[name].save(paths[name])
    dom.close()
    return res


RANKERS = {  # row name -> (RankerConfig overrides, fit_ranker overrides); every row trains on the training sets only
    "sibling ranker, all inputs, target return": ({}, {}),
    "sibling ranker, all inputs, target success": ({}, {"target": "success"}),
    "sibling ranker, no latent (proprio, actions, P(success), disagreement)": (
        {"inputs": ["proprio", "actions", "prob", "uncertainty"]}, {}),
    "sibling ranker, latent only": ({"inputs": ["latent"]}, {}),
    "sibling ranker, actions only (no world-model output)": ({"inputs": ["actions"]}, {}),
    "sibling ranker, first chunk only": ({"first_chunks": 1}, {}),
}
RANKER_SEEDS = (0, 1, 2)
ENSEMBLE = list(RANKERS)[:4]  # the rankers that read the imagined trajectory in full (not actions / first chunk only)


def truncated_score(sets, threshold: float, uncertainty_threshold: float = 1.0) -> np.ndarray:
    """The verified recipe's score from an untruncated imagination: the best P(success) over the steps before the
    first one whose disagreement exceeds ``uncertainty_threshold`` without an imagined success (that step excluded,
    as ``probe.imagined_scores`` scores a truncated slot)."""
    prob = np.where(sets.valid, sets.prob, -np.inf)
    cut = sets.valid & (sets.uncertainty > uncertainty_threshold) & (sets.prob <= threshold)
    t = sets.valid.shape[-1]
    first = np.where(cut.any(-1), cut.argmax(-1), t)
    keep = np.arange(t)[None, None, :] < first[..., None]
    best = np.where(keep, prob, -np.inf).max(-1)
    return np.where(np.isfinite(best), best, 0.0)


def probe_row(name: str, score: np.ndarray, heldout, extra: dict | None = None) -> dict:
    from robotics.world_model.probe import ranking_metrics
    from robotics.world_model.ranker import outcome

    m = ranking_metrics(score, heldout.real_success.astype(float), K)
    r = ranking_metrics(score, outcome(heldout, "return"), K)
    row = {"variant": name, "spearman_within_success": m["spearman_within"],
           "keyframes_defined": int(m["spearman_within_defined"]),
           "spearman_within_of_max": m["spearman_within_of_max"],
           "spearman_within_spread": m["spearman_within_spread"], "keyframes_spread": int(m["keyframes_spread"]),
           "spearman_within_return": r["spearman_within"],
           "top_k_precision": m["top_k_precision"], "base_rate": m["base_rate"], "top_k_lift": m["top_k_lift"],
           "mixed_selected": m["mixed_selected"], "mixed_random": m["mixed_random"],
           "spearman_across_success": m["spearman_across"]}
    row.update(extra or {})
    return row


DEPTHS = ((0, 0), (2, 6), (8, 20))  # keyframe windows (chunk boundaries): the reset, early, late


def depth_rows(heldout, scores: dict[str, list[np.ndarray]]) -> list[dict]:
    """The probe per keyframe depth: with an 80-step horizon the outcome from the reset is nearly always a failure and
    from a late keyframe nearly always decided, so where a scorer ranks depends on where the keyframes are."""
    rows = []
    for lo, hi in DEPTHS:
        sel = np.where((heldout.chunk >= lo) & (heldout.chunk <= hi))[0]
        if not len(sel):
            continue
        sub = heldout.subset(sel)
        mixed = float((sub.real_success.max(1) != sub.real_success.min(1)).mean())
        for name, per_seed in scores.items():
            ms = [probe_row(name, sc[sel], sub) for sc in per_seed]
            row = {"variant": f"keyframes at chunks {lo}-{hi}: {name}", "keyframes": len(sel), "real_mixed": mixed,
                   "real_success": float(sub.real_success.mean())}
            for k, v in ms[0].items():
                if isinstance(v, float):
                    row[k] = float(np.nanmean([m[k] for m in ms])) if any(np.isfinite(m[k]) for m in ms) else float("nan")
            row["keyframes_defined"], row["keyframes_spread"] = ms[0]["keyframes_defined"], ms[0]["keyframes_spread"]
            rows.append(row)
    return rows


def depth_trained_row(train, heldout, lo: int, hi: int, s: dict, candidates: int = 0) -> dict:
    """The recipe's ranker trained on the training keyframes at chunks ``lo``-``hi`` only (with ``candidates`` > 0:
    only the first that many candidates of each), probed on the held-out ones there with all their candidates: what a
    ranker costs in real steps (its sets' re-executions) when only the informative depth is collected."""
    from robotics.world_model.ranker import RankerConfig, fit_ranker, rank_scores, trajectories

    tr = train.subset(np.where((train.chunk >= lo) & (train.chunk <= hi))[0])
    if candidates:
        tr = tr.first_candidates(candidates)
    ho = heldout.subset(np.where((heldout.chunk >= lo) & (heldout.chunk <= hi))[0])
    cfg_over, fit_over = RANKERS[RANKER_RECIPE]
    t = trajectories(tr)
    cfg = RankerConfig(latent_dim=t.z.shape[-1], proprio_dim=t.proprio.shape[-1], action_dim=t.actions.shape[-1],
                       horizon_chunks=t.z.shape[1], **cfg_over)
    per_seed = [probe_row("", rank_scores(fit_ranker(tr, cfg, steps=s["ranker_steps"], seed=seed, **fit_over), ho), ho)
                for seed in s["ranker_seeds"]]
    row = {"variant": f"keyframes at chunks {lo}-{hi}: {RANKER_RECIPE}, trained on the {len(tr.keys)} training "
                      f"keyframes there only x {tr.shape[1]} candidates ({int(tr.real_steps.sum())} real env steps "
                      f"of sets)",
           "keyframes": len(ho.keys), "seeds": len(per_seed), "train_candidates": tr.shape[1],
           "train_real_steps": int(tr.real_steps.sum())}
    for k, v in per_seed[0].items():
        if isinstance(v, float):
            row[k] = float(np.nanmean([p[k] for p in per_seed]))
    vals = [p["spearman_within_success"] for p in per_seed]
    row["spearman_within_success_range"] = f"{np.nanmin(vals):.2f}..{np.nanmax(vals):.2f}"
    return row


SET_SIZES = (4, 8, 16)  # candidates per training keyframe: 4 is what the explorer re-executes of each keyframe


def candidate_rows(train, heldout, s: dict) -> list[dict]:
    """Cheaper sibling sets: the recipe's ranker trained at the informative depth (``DEPTHS[1]``) on ``SET_SIZES``
    candidates per keyframe. A set of 4 costs what the explorer's own verified groups cost (nothing beyond its run),
    so this row says whether a ranker could be learned from the explorer's re-executions alone."""
    lo, hi = DEPTHS[1]
    n = train.shape[1]
    return [depth_trained_row(train, heldout, lo, hi, s, candidates=c if c < n else 0)
            for c in s.get("set_sizes", SET_SIZES) if c <= n]


def analyse(sets: dict, s: dict, log=print) -> list[dict]:
    import torch

    from robotics.world_model.ranker import RankerConfig, fit_ranker, rank_scores, trajectories
    from robotics.world_model.reward import SuccessModel

    torch.set_num_threads(1)
    train, heldout = sets["train"], sets["heldout"]
    thr = SuccessModel.load(ROOT / "assets" / "metaworld-wm-tiny").cfg.threshold
    recipe_score = truncated_score(heldout, thr)
    rows = [probe_row("success model: best imagined P(success), truncated at disagreement x1 (the verified recipe)",
                      recipe_score, heldout),
            probe_row("success model: best imagined P(success), untruncated", heldout.score, heldout),
            probe_row("imagined success (0/1)", heldout.imagined_success.astype(float), heldout)]
    g, n = heldout.score.shape
    variants = list(RANKERS.items()) + [("ceiling: sibling ranker on the REAL re-executed trajectories", ({}, {"real": True}))]
    if s.get("only"):
        variants = [(name, v) for name, v in variants if name in s["only"]]
    scores: dict[str, list[np.ndarray]] = {}
    for name, (cfg_over, fit_over) in variants:
        per_seed = []
        for seed in s["ranker_seeds"]:
            t0 = time.perf_counter()

            tr = trajectories(train, real=fit_over.get("real", False))
            cfg = RankerConfig(latent_dim=tr.z.shape[-1], proprio_dim=tr.proprio.shape[-1],
                               action_dim=tr.actions.shape[-1], horizon_chunks=tr.z.shape[1], **cfg_over)
            model = fit_ranker(train, cfg, steps=s["ranker_steps"], seed=seed, **fit_over)
            fit_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            sc = rank_scores(model, heldout, real=fit_over.get("real", False))
            per_seed.append((probe_row(name, sc, heldout), fit_s, g * n / max(time.perf_counter() - t0, 1e-9)))
            scores.setdefault(name, []).append(sc)
        keys = [k for k, v in per_seed[0][0].items() if isinstance(v, float)]
        row = {"variant": name, "seeds": len(per_seed)}
        for k in keys:
            vals = [p[0][k] for p in per_seed]
            row[k] = float(np.nanmean(vals))
            if k == "spearman_within_success":
                row["spearman_within_success_range"] = f"{np.nanmin(vals):.2f}..{np.nanmax(vals):.2f}"
        row["keyframes_defined"] = per_seed[0][0]["keyframes_defined"]
        row["keyframes_spread"] = per_seed[0][0]["keyframes_spread"]
        row["fit_s"] = round(float(np.mean([p[1] for p in per_seed])), 1)
        row["ranker_candidates_per_s"] = round(float(np.mean([p[2] for p in per_seed])))
        rows.append(row)
        log(f"bench robotics-wm-probe: {name}: within-keyframe spearman {row['spearman_within_success']:.3f} "
            f"({row['spearman_within_success_range']}), top-{K} precision {row['top_k_precision']:.3f} "
            f"vs base {row['base_rate']:.3f}")
    if RANKER_RECIPE in scores:
        rows += depth_rows(heldout, {RANKER_RECIPE: scores[RANKER_RECIPE],
                                     "success model (the verified recipe)": [recipe_score]})
        lo, hi = DEPTHS[1]
        if ((train.chunk >= lo) & (train.chunk <= hi)).sum() >= 5 and ((heldout.chunk >= lo) & (heldout.chunk <= hi)).any():
            rows += candidate_rows(train, heldout, s)
    # the ensemble: every imagined-input ranker of ENSEMBLE and seed, scores standardised per keyframe and averaged
    z = lambda x: (x - x.mean(1, keepdims=True)) / (x.std(1, keepdims=True) + 1e-9)  # noqa: E731
    members = [z(x) for name in ENSEMBLE if name in scores for x in scores[name]]
    if sum(name in scores for name in ENSEMBLE) > 1:
        rows.append(probe_row(f"ensemble of the {len(members)} rankers of {len(ENSEMBLE)} rows above (scores "
                              f"standardised per keyframe)", np.mean(members, 0), heldout, {"seeds": len(members)}))
    return rows


def run(out_dir: Path = Path("runs/bench-robotics-wm-probe"), quick: bool = False, log=print) -> dict:
    from shared_rl.bench import write_results

    out = Path(out_dir)
    s = {"train": TRAIN_KEYS, "heldout": HELDOUT_KEYS, "candidates": CANDIDATES, "part": PART, "ranker_steps": 600,
         "ranker_seeds": RANKER_SEEDS}
    if quick:
        s.update(QUICK, ranker_seeds=(0,))
    t0 = time.perf_counter()
    sets = collect(out, s, log)
    collect_s = time.perf_counter() - t0
    rows = analyse(sets, s, log)
    tr, ho = sets["train"], sets["heldout"]
    from robotics.world_model.probe import ranking_metrics

    best = ranking_metrics(ho.real_success.astype(float), ho.real_success.astype(float), K)["spearman_within_max"]
    notes = (f"door-open, the BC policy (assets/metaworld-vla-tiny, sde_one_step as GRPO samples) and the world model "
             f"assets/metaworld-wm-tiny of {CONFIG.relative_to(ROOT)}; {len(tr.keys)} training and {len(ho.keys)} "
             f"held-out keyframes (reset states < / >= {SPLIT_STATE}) x {tr.score.shape[1]} candidates imagined "
             f"{int(tr.valid.shape[-1])} chunks and every one re-executed in MuJoCo "
             f"({int(tr.real_steps.sum() + ho.real_steps.sum())} real env steps, collected in {collect_s:.0f} s "
             f"this run). Held-out real success {ho.real_success.mean():.3f}; keyframes with mixed real outcomes "
             f"{(ho.real_success.max(1) != ho.real_success.min(1)).mean():.2f} (held out), "
             f"{(tr.real_success.max(1) != tr.real_success.min(1)).mean():.2f} (training). spearman_within_*: mean "
             f"over held-out keyframes where both vary (the best any scorer can reach on these keyframes, a strict order "
             f"consistent with the tied binary outcomes: {best:.3f}); top_k_precision / base_rate over keyframes with mixed real "
             f"success, k={K}; rankers: mean over seeds {list(s['ranker_seeds'])}, each {s['ranker_steps']} steps "
             f"with its step chosen on the last 20% of the TRAINING keyframes.")
    # written now and again after each further part: a killed run keeps the rows it measured
    result = write_results(out, "robotics-wm-probe", rows, notes, doc_path=None if quick else DOC)
    if s.get("sibling_wm", True):
        from robotics.world_model.reward import SuccessModel

        again = sibling_world_model(out, sets, s, log)
        thr = SuccessModel.load(out / "sibling-wm").cfg.threshold
        n_sib = min(s.get("sibling_wm_keys", SIBLING_WM_KEYS), len(sets["train"].keys))
        label = f"[world model + success model fine-tuned on the siblings of {n_sib} keyframes] "
        rows.append(probe_row(label + "success model: best imagined P(success), truncated at disagreement x1",
                              truncated_score(again["heldout"], thr), again["heldout"]))
        sub = analyse(again, {**s, "only": ENSEMBLE}, log)  # the full-input rankers and their ensemble
        rows += [{**r, "variant": label + r["variant"]} for r in sub if not r["variant"].startswith(("success", "imagined"))]
        result = write_results(out, "robotics-wm-probe", rows, notes, doc_path=None if quick else DOC)
    return result


SIBLING_WM_KEYS = 96  # training keyframes whose re-executed siblings fine-tune the world model
SIBLING_WM_STEPS = 600


def sibling_world_model(out: Path, sets: dict, s: dict, log=print) -> dict:
    """The direction "train the world model on sibling sets": the real re-executions of the first
    ``SIBLING_WM_KEYS`` training keyframes' candidates (reproduced exactly from their noise streams, now with their
    frames) join the world model's real data (weighted as co-evolution weighs recent data), the world model and its
    success model are fine-tuned on them, and every candidate of both halves is imagined again with the same streams
    in the new model (the real outcomes do not change). Returns the re-imagined sets."""
    import dataclasses

    import torch

    from robotics.episodes import run_episodes
    from robotics.world_model.data import RecordingEnv
    from robotics.world_model.env import WorldModelEnv
    from robotics.world_model.probe import SiblingSets, imagine_candidates
    from robotics.world_model.reward import fit_success_model
    from robotics.world_model.train import calibrate_uncertainty, fit_world_model
    from robotics.world_model.verified import RestoredEnv

    paths = {n: out / f"{n}-sibling-wm.npz" for n in sets}
    if all(p.is_file() for p in paths.values()):
        return {n: SiblingSets.load(p) for n, p in paths.items()}
    dom = _setup(log)
    st = dom.rollouts
    w = dom.cfg.rollout.world_model
    train = sets["train"]
    n_keys = min(s.get("sibling_wm_keys", SIBLING_WM_KEYS), len(train.keys))
    eps = []
    t0 = time.perf_counter()
    for p0 in range(0, n_keys, 4):  # the real re-executions again, recorded with their frames
        ks = [int(k) for k in train.keys[p0:p0 + 4]]
        cand = [k for k in ks for _ in range(train.shape[1])]
        rec = RecordingEnv(RestoredEnv(dom.venv, st.keyframes))
        real = run_episodes(dom.policy, rec, cand, [st.task_of(k) for k in cand], dom.sampling, w.horizon,
                            torch.Generator().manual_seed(0), noise_seeds=train.seeds[p0:p0 + 4].flatten().tolist())
        assert np.array_equal(real.success_once, train.real_success[p0:p0 + 4].flatten()), "re-execution is exact"
        eps += rec.episodes(source="verified")
    log(f"bench robotics-wm-probe: {len(eps)} sibling episodes of {n_keys} keyframes re-recorded "
        f"({time.perf_counter() - t0:.0f} s)")
    wm, success = st.wm, st.success
    mix = st.real_data + eps * max(0, w.recent_weight - 1) + eps
    t0 = time.perf_counter()
    fit_world_model(wm, mix, s.get("sibling_wm_steps", SIBLING_WM_STEPS), w.refit_batch, 3, w.refit_lr, seed=0)
    wm.cfg.uncertainty_ref = calibrate_uncertainty(wm, eps)
    st.success = fit_success_model(wm, mix, 300, seed=0, model=success)
    log(f"bench robotics-wm-probe: world model fine-tuned on sibling sets ({time.perf_counter() - t0:.0f} s)")
    imagine = WorldModelEnv(wm, st.keyframes, w.horizon, success=st.success, success_mode=dom.cfg.env.success_mode,
                            uncertainty_threshold=0.0, pessimistic=w.pessimistic)
    res = {}
    for name, ss in sets.items():
        parts = []
        for p0 in range(0, len(ss.keys), 8):
            sub = ss.subset(np.arange(p0, min(p0 + 8, len(ss.keys))))
            im = imagine_candidates(dom.policy, imagine, [int(k) for k in sub.keys], torch.from_numpy(sub.seeds),
                                    w.horizon, dom.sampling, torch.Generator().manual_seed(0), st.task_of)
            parts.append(dataclasses.replace(sub, **im))
        res[name] = SiblingSets.concat(parts)
        res[name].save(paths[name])
    wm.save(out / "sibling-wm")
    st.success.save(out / "sibling-wm")
    dom.close()
    return res


RANKER_RECIPE = "sibling ranker, all inputs, target return"  # the row --save-ranker trains (training sets only)


def save_ranker(out_dir: Path, target_dir: Path, steps: int = 600, seed: int = 0, log=print) -> Path:
    """Train the ``RANKER_RECIPE`` ranker on the collected training sibling sets and save it (``ranker.json`` +
    weights) where ``robotics.rollout.verify.ranker`` reads it."""
    import torch

    from robotics.world_model.probe import SiblingSets
    from robotics.world_model.ranker import RankerConfig, fit_ranker, trajectories

    torch.set_num_threads(1)
    train = SiblingSets.load(Path(out_dir) / "train.npz")
    cfg_over, fit_over = RANKERS[RANKER_RECIPE]
    tr = trajectories(train)
    cfg = RankerConfig(latent_dim=tr.z.shape[-1], proprio_dim=tr.proprio.shape[-1], action_dim=tr.actions.shape[-1],
                       horizon_chunks=tr.z.shape[1], trained_real_steps=int(train.real_steps.sum()), **cfg_over)
    fit_ranker(train, cfg, steps=steps, seed=seed, **fit_over).save(target_dir)
    log(f"bench robotics-wm-probe: {RANKER_RECIPE!r} trained on {len(train.keys)} keyframes -> {target_dir}")
    return Path(target_dir)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="grove bench robotics-wm-probe")
    p.add_argument("--out", default="runs/bench-robotics-wm-probe")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--collect-only", action="store_true")
    p.add_argument("--save-ranker", metavar="DIR", help="train the recipe's ranker on the collected sets, save it in DIR")
    p.add_argument("--by-set-size", action="store_true", help="rankers trained at the informative depth on 4, 8 and "
                                                                  "16 candidates per keyframe, from the collected sets "
                                                                  "(minutes; rows printed and saved to set_sizes.json)")
    p.add_argument("--by-depth", metavar="DIR", help="the probe per keyframe depth of the saved ranker in DIR on the "
                                                     "collected held-out sets (seconds; no training)")
    a = p.parse_args()
    if a.by_depth:
        from robotics.world_model.probe import SiblingSets
        from robotics.world_model.ranker import SiblingRanker, rank_scores

        ho = SiblingSets.load(Path(a.out) / "heldout.npz")
        for r in depth_rows(ho, {f"ranker of {a.by_depth}": [rank_scores(SiblingRanker.load(a.by_depth), ho)]}):
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    elif a.by_set_size:
        import torch

        from robotics.world_model.probe import SiblingSets

        torch.set_num_threads(1)
        out = Path(a.out)
        rows = candidate_rows(SiblingSets.load(out / "train.npz"), SiblingSets.load(out / "heldout.npz"),
                              {"ranker_steps": 600, "ranker_seeds": RANKER_SEEDS})
        for r in rows:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
        tmp = out / "set_sizes.json.tmp"
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(out / "set_sizes.json")
    elif a.save_ranker:
        save_ranker(Path(a.out), Path(a.save_ranker))
    elif a.collect_only:
        s = {"train": TRAIN_KEYS, "heldout": HELDOUT_KEYS, "candidates": CANDIDATES, "part": PART}
        collect(Path(a.out), s if not a.quick else {**s, **QUICK})
    else:
        run(Path(a.out), a.quick)
