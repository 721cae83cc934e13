"""``grove bench robotics-world-model``: imagined GRPO in a learned world model vs GRPO in the simulator.

Same task (door-open), same BC starting policy (``assets/metaworld-vla-tiny``) and the same 40 held-out reset
states as ``configs/robotics/metaworld_grpo_door.yaml``; every number is a held-out success measured in MuJoCo.

Rows (``variant``):

1. ``sim GRPO, full budget``: ``metaworld_grpo_door.yaml`` as is (25 iterations) — the reference gain;
2. ``sim GRPO, equal real steps``: the same, stopped after the iterations whose env steps match the world-model
   variant's real steps;
3. ``world model: imagined GRPO ...``: ``world_model_grpo.yaml`` from ``assets/metaworld-wm-tiny``. Its real env
   steps = the world-model data (demos + policy rollouts, ``meta.json``) + co-evolution rollouts (+ VLA-RFT
   reference demos when used); audit replays are reported apart. Columns ``gain_fraction_of_sim`` (held-out gain
   ÷ row 1's gain), ``real_step_saving_vs_sim`` (row 1's env steps ÷ this row's), the training-time audit
   (``hallucinated_success_rate``, ``reward_model_precision``/``recall``, image MSE at imagined depths 1/6/12),
   and a final audit with the trained policy where *every* imagined episode is replayed;
4. ``sim flat groups`` vs ``sim branching groups`` (``robotics.rollout.name: tree``, TreeRL estimator) at equal env steps;
5. throughput: imagined env steps/s (world model, decoding frames for the VLA) vs simulator env steps/s with
   rendering, same policy and batch.
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
SIM_CFG = ROOT / "configs" / "robotics" / "metaworld_grpo_door.yaml"
WM_CFG = ROOT / "configs" / "robotics" / "world_model_grpo.yaml"


def _trainer(config: Path | dict, overrides: list[str], run_dir: Path | None, log):
    from shared_rl.config import apply_overrides, load_train_config, load_yaml
    from shared_rl.trainer import Trainer

    data = load_yaml(config) if isinstance(config, Path) else dict(config)
    return Trainer(load_train_config(apply_overrides(data, overrides)), run_dir, log=log)


def _train(config: Path | dict, overrides: list[str], run_dir: Path, log):
    trainer = _trainer(config, overrides, run_dir, log)
    t = time.perf_counter()
    hist = trainer.fit()
    return trainer, hist, time.perf_counter() - t


def _gain(hist) -> tuple[float, float]:
    evals = [h for h in hist if "eval/success" in h]
    return float(evals[0]["eval/success"]), float(evals[-1]["eval/success"])


def _env_steps(hist) -> int:
    return int(sum(h.get("env/steps", 0) for h in hist))


def _nanmean(vals) -> float:
    v = [x for x in vals if x is not None and np.isfinite(x)]
    return float(np.mean(v)) if v else float("nan")


def _throughput(domain, batch: int, horizon: int) -> tuple[float, float]:
    """(imagined steps/s, simulator steps/s with rendering), same policy (ODE), same batch and horizon."""
    import torch

    from robotics.envs.metaworld_env import make_key
    from robotics.episodes import SamplingSettings, run_episodes

    imagination = domain.rollouts  # robotics.rollout.name: world_model
    keys = list(imagination.keyframes)[:batch]
    tasks = [imagination.task_of(k) for k in keys]
    s = SamplingSettings(mode="ode")
    t = time.perf_counter()
    before = imagination.imagine.model_steps
    b = run_episodes(domain.policy, imagination.imagine, keys, tasks, s, horizon, torch.Generator().manual_seed(0))
    imag = float(b.length.sum()) / (time.perf_counter() - t)
    assert imagination.imagine.model_steps > before
    real_keys = [make_key(0, "train", i) for i in range(batch)]
    domain.venv.reset(real_keys)  # envs and renderers built outside the timing
    t = time.perf_counter()
    b = run_episodes(domain.policy, domain.venv, real_keys, tasks, s, horizon, torch.Generator().manual_seed(0))
    sim = float(b.length.sum()) / (time.perf_counter() - t)
    return imag, sim


def _final_audit(domain, n_keys: int, group: int, seed: int = 123) -> dict:
    """Imagine ``n_keys`` x ``group`` rollouts with the trained policy and replay every one of them in MuJoCo."""
    import torch

    w = domain.cfg.rollout.world_model
    old, learn = w.audit_fraction, w.learn_from_audit
    w.audit_fraction, w.learn_from_audit = 1.0, False  # measure only: these replays are not training data
    rng = np.random.default_rng(seed)
    keys = [int(k) for k in rng.choice(list(domain.rollouts.keyframes), n_keys, replace=False)]
    try:
        ro = domain.rollout(keys, group, torch.Generator().manual_seed(seed), 0)
    finally:
        w.audit_fraction, w.learn_from_audit = old, learn
    return {k.removeprefix("audit/"): v for k, v in ro.info.items() if k.startswith("audit/")} | {"last": domain.rollouts.last_audit}


def run(out_dir: Path, quick: bool = False, log=print) -> dict:
    import torch

    from shared_rl.bench import write_results
    from shared_rl.config import load_yaml

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    small = ["eval_states_per_task=4", "iterations=1", "rollout.groups_per_iteration=2", "rollout.group_size=4"] if quick else []
    rows: list[dict] = []
    wm_meta = json.loads((ROOT / "assets" / "metaworld-wm-tiny" / "meta.json").read_text())

    # 1. the world-model variant first (its real steps size the equal-budget sim run)
    wm_over = [o.replace("eval_states_per_task", "robotics.eval_states_per_task") for o in small]
    if quick:
        wm = "robotics.rollout.world_model"
        wm_over += [f"{wm}.coevolve_every=1", f"{wm}.coevolve_episodes=2", f"{wm}.refit_steps=2",
                    f"{wm}.refit_success_steps=2", "iterations=2"]
    log("bench robotics-world-model: imagined GRPO")
    tr, hist, wall = _train(WM_CFG, wm_over, out_dir / "wm-grpo", log)
    dom = tr.domain
    wm_before, wm_after = _gain(hist)
    wm_real = dom.rollouts.real_env_steps
    it_rows = [h for h in hist if "audit/episodes" in h]
    audit_train = {k: _nanmean([h.get(f"audit/{k}") for h in it_rows]) for k in
                   ("hallucinated_success_rate", "reward_model_precision", "reward_model_recall", "imagined_success_rate",
                    "replay_success_rate", "image_mse_step1", "image_mse_step6", "image_mse_step12")}
    final = _final_audit(dom, 4 if quick else 24, 4 if quick else 8)
    imag_sps, sim_sps = _throughput(dom, 8 if quick else 64, 16 if quick else dom.cfg.rollout.world_model.horizon)
    counts = {"coevolve": dom.rollouts.real_steps_coevolve, "replay": dom.rollouts.real_steps_replay,
              "audit": dom.rollouts.audit_steps}
    dom.close()
    del tr, dom  # the real data with MuJoCo states is GBs: free it before the simulator runs (a full run was OOM-killed)
    import gc

    gc.collect()

    # 2. sim GRPO at its full budget and at the world model's real-step budget
    sim_over = [o.replace("eval_states_per_task", "robotics.eval_states_per_task") for o in small]
    log("bench robotics-world-model: sim GRPO, full budget")
    _, sim_hist, sim_wall = _train(SIM_CFG, sim_over, out_dir / "sim-grpo", log)
    sim_before, sim_after = _gain(sim_hist)
    sim_steps = _env_steps(sim_hist)
    sim_gain = sim_after - sim_before
    per_it = sim_steps / max(1, len([h for h in sim_hist if "env/steps" in h]))
    eq_its = max(1, int(round(wm_real / per_it)))
    if quick:
        eq_its = min(eq_its, 2)
    log(f"bench robotics-world-model: sim GRPO, equal real steps ({eq_its} iterations)")
    _, eq_hist, eq_wall = _train(SIM_CFG, sim_over + [f"iterations={eq_its}"], out_dir / "sim-grpo-equal", log)
    eq_before, eq_after = _gain(eq_hist)
    rows.append({"variant": "sim GRPO, full budget (metaworld_grpo_door.yaml)", "before": sim_before, "after": sim_after,
                 "gain": sim_gain, "real_env_steps": sim_steps, "wall_s": sim_wall})
    rows.append({"variant": f"sim GRPO, equal real steps ({eq_its} it)", "before": eq_before, "after": eq_after,
                 "gain": eq_after - eq_before, "real_env_steps": _env_steps(eq_hist), "wall_s": eq_wall})
    gain = wm_after - wm_before
    rows.append({
        "variant": "world model: imagined GRPO, keyframe starts, co-evolution (world_model_grpo.yaml)",
        "before": wm_before, "after": wm_after, "gain": gain, "real_env_steps": wm_real, "wall_s": wall,
        "gain_fraction_of_sim": gain / sim_gain if sim_gain > 0 else float("nan"),
        "real_step_saving_vs_sim": sim_steps / max(1, wm_real),
        "hallucinated_success_rate": audit_train["hallucinated_success_rate"],
        "reward_model_precision": audit_train["reward_model_precision"],
        "reward_model_recall": audit_train["reward_model_recall"],
        "imagined_success_rate": audit_train["imagined_success_rate"],
        "replay_success_rate": audit_train["replay_success_rate"],
        "image_mse_step1": audit_train["image_mse_step1"], "image_mse_step6": audit_train["image_mse_step6"],
        "image_mse_step12": audit_train["image_mse_step12"], "audit_env_steps": counts["audit"],
        "wm_data_env_steps": wm_meta.get("real_env_steps"),
    })
    rows.append({
        "variant": "world model: final audit, trained policy, every imagined episode replayed",
        "hallucinated_success_rate": final.get("hallucinated_success_rate"),
        "reward_model_precision": final.get("reward_model_precision"),
        "reward_model_recall": final.get("reward_model_recall"),
        "imagined_success_rate": final.get("imagined_success_rate"), "replay_success_rate": final.get("replay_success_rate"),
        "image_mse_step1": final.get("image_mse_step1"), "image_mse_step6": final.get("image_mse_step6"),
        "image_mse_step12": final.get("image_mse_step12"),
    })

    # 3. branching vs flat groups in the simulator at equal env steps
    n_it = 2 if quick else 10
    flat_over = sim_over + [f"iterations={n_it}"]
    log("bench robotics-world-model: sim flat groups")
    _, f_hist, f_wall = _train(SIM_CFG, flat_over, out_dir / "sim-flat", log)
    tree_cfg = load_yaml(SIM_CFG)
    tree_cfg["robotics"]["rollout"] = {"name": "tree", "branch": ({"at_chunks": [0, 12], "factors": [2, 2]} if quick else
                                                                  {"at_chunks": [0, 12, 24], "factors": [2, 2, 2]})}
    tree_cfg["advantage"]["estimator"] = "treerl"
    flat_per_group = _env_steps(f_hist) / max(1, n_it * (2 if quick else 8))
    # trees per iteration for equal env steps: the flat run's steps per group / a measured tree's (dry rollout)
    tr_dry = _trainer(tree_cfg, sim_over, None, log)
    ro = tr_dry.domain.rollout(tr_dry.domain.train_keys()[:2], 8, torch.Generator().manual_seed(0), 0)
    tree_per_group = ro.info["env/steps"] / 2
    tr_dry.domain.close()
    groups = max(1, int(round((2 if quick else 8) * flat_per_group / max(1.0, tree_per_group))))
    log(f"bench robotics-world-model: sim branching groups ({groups} trees per iteration)")
    _, t_hist, t_wall = _train(tree_cfg, flat_over + [f"rollout.groups_per_iteration={groups}"], out_dir / "sim-tree",
                               log)
    for name, h, wl, g in (("sim flat groups (8 x 8 episodes), grpo", f_hist, f_wall, 2 if quick else 8),
                           (f"sim branching groups ({groups} trees x 8 leaves, branch at chunks 0/12/24), treerl",
                            t_hist, t_wall, groups)):
        b, a = _gain(h)
        rows.append({"variant": f"{name}, {n_it} it", "before": b, "after": a, "gain": a - b,
                     "real_env_steps": _env_steps(h), "wall_s": wl, "groups_per_iteration": g})
    rows.append({"variant": "throughput: imagined (world model) vs simulator with rendering, 64 envs, ODE policy",
                 "imagined_steps_per_s": imag_sps, "sim_steps_per_s": sim_sps, "imagined_vs_sim_speed": imag_sps / sim_sps})
    notes = (
        f"Door-open, BC asset, 40 held-out reset states (the eval split), ODE evaluation in MuJoCo "
        f"(MUJOCO_GL={os.environ.get('MUJOCO_GL')}, Mesa llvmpipe CPU rendering, tuned 64x64 scene); torch threads 1; "
        f"2 CPU cores shared with other jobs (wall times are indicative). World-model real steps = world-model data "
        f"{wm_meta.get('real_env_steps')} (demos {wm_meta.get('demo_env_steps')}, policy rollouts "
        f"{wm_meta.get('policy_env_steps')}) + co-evolution rollouts {counts['coevolve']} + audit replays fed to "
        f"the refits {counts['replay']} (learn_from_audit); audit replays that only measure: {counts['audit']} "
        f"steps, not counted. Final-audit image MSE by depth: "
        f"{[round(x, 4) for x in final['last'].get('image_mse_by_step', [])]}."
        + (" QUICK MODE: plumbing check only." if quick else "")
    )
    result = write_results(out_dir, "robotics-world-model", rows, notes, doc_path=None if quick else DOC)
    return result


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/bench-robotics-world-model")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    print(json.dumps(run(Path(a.out), a.quick)["rows"], indent=1, default=float))
