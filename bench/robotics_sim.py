"""``grove bench robotics-sim``: Meta-World simulation throughput with rendering, side by side.

Variants (all on the same tasks, reset states and action sequences):

1. render only, MuJoCo's default scene vs the tuned scene (shadows/reflections/skybox off, offsamples=0) — frames/s;
2. sequential: one env, rendering after every step (the naive gym loop);
3. batched in-process: B envs in lock-step, rendering only when a new chunk of K=4 actions is planned;
4. vectorised over worker processes (2 by default) with the same batching;
5. closed loop with the tiny VLA planning every chunk — env steps/s and the share of time spent in policy inference.

Ratios against the sequential baseline are reported; absolute numbers depend on how busy the CPU is.

Post-training rows (issue 16): GRPO (``configs/robotics/metaworld_mt5_rl.yaml``) and PPO with a value head
(``configs/robotics/metaworld_mt5_ppo.yaml``) side by side at equal env steps (the same rollout budget) — columns
``env_steps``, ``success_before``, ``success_after`` and, per task, before -> after held-out success. The full
bench trains both recipes (seed 0, ~15 min each on 2 cores) unless ``GROVE_BENCH_ROBOTICS_RUNS`` names finished
run directories (``grpo=DIR,ppo=DIR``, e.g. from ``grove train configs/robotics/metaworld_mt5_rl.yaml``);
``--quick`` trains both for 2 tiny iterations (plumbing only).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

TASKS = ["reach-v3", "push-v3", "door-open-v3", "button-press-topdown-v3", "drawer-close-v3"]
DOC = Path(__file__).resolve().parents[1] / "docs" / "bench" / "robotics.md"


def _render_rate(tuned: bool, frames: int) -> float:
    from robotics.envs import MetaWorldTaskEnv, RenderSettings, TaskRenderer, make_key

    env = MetaWorldTaskEnv("push-v3")
    env.reset(make_key(1, "train", 0))
    r = TaskRenderer(env.model, RenderSettings(size=64, cameras=["corner"], tuned=tuned))
    r.render(env.data)  # warm-up (context, textures)
    t = time.perf_counter()
    for _ in range(frames):
        r.render(env.data)
    dt = time.perf_counter() - t
    r.close()
    return frames / dt


def _sequential(steps: int, rng: np.random.Generator) -> float:
    from robotics.envs import MetaWorldTaskEnv, RenderSettings, TaskRenderer, make_key

    envs = {t: MetaWorldTaskEnv(t) for t in TASKS}
    rends = {t: TaskRenderer(envs[t].model, RenderSettings()) for t in TASKS}
    per_task = steps // len(TASKS)
    t0 = time.perf_counter()
    for i, task in enumerate(TASKS):
        envs[task].reset(make_key(i, "train", 0))
        for _ in range(per_task):
            envs[task].step(rng.uniform(-1, 1, 4))
            rends[task].render(envs[task].data)
    dt = time.perf_counter() - t0
    for r in rends.values():
        r.close()
    return per_task * len(TASKS) / dt


def _batched(venv, batch: int, chunks: int, rng: np.random.Generator) -> float:
    from robotics.envs import make_key

    keys = [make_key(i % len(TASKS), "train", i) for i in range(batch)]
    venv.reset(keys)  # builds envs and renderers on first use: not timed
    venv.reset(keys)
    t0 = time.perf_counter()
    steps = 0
    for _ in range(chunks):
        res = venv.step_chunk(rng.uniform(-1, 1, (batch, 4, 4)).astype(np.float32))
        steps += int(res.executed.sum())
    return steps / (time.perf_counter() - t0)


class _TimedEnv:
    """Proxy that accumulates the wall time spent inside the vector env."""

    def __init__(self, venv):
        self.venv, self.seconds = venv, 0.0

    def __getattr__(self, name):
        fn = getattr(self.venv, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t

        return timed


def _closed_loop(batch: int, horizon: int) -> tuple[float, float, str]:
    import torch

    from robotics.envs import EnvConfig, make_key, make_vector_env
    from robotics.episodes import SamplingSettings, run_episodes
    from robotics.policies import TinyVLA, VLAConfig

    asset = Path(__file__).resolve().parents[1] / "assets" / "metaworld-vla-tiny"
    try:
        policy, which = TinyVLA.load_pretrained(asset), "assets/metaworld-vla-tiny"
    except FileNotFoundError:
        torch.manual_seed(0)
        policy, which = TinyVLA(VLAConfig()), "random-init VLA (asset missing)"
    cfg = EnvConfig(tasks=TASKS, horizon=horizon, success_mode="end")  # fixed length: comparable work
    venv = _TimedEnv(make_vector_env(cfg))
    keys = [make_key(i % len(TASKS), "train", i) for i in range(batch)]
    tasks = [TASKS[i % len(TASKS)] for i in range(batch)]
    venv.reset(keys)
    venv.seconds = 0.0
    t0 = time.perf_counter()
    out = run_episodes(policy, venv, keys, tasks, SamplingSettings(mode="flow_sde"), horizon,
                       torch.Generator().manual_seed(0))
    total = time.perf_counter() - t0
    venv.venv.close()
    return float(out.length.sum()) / total, 1.0 - venv.seconds / total, which


# (name, row label, recipe, its own quick overrides: the PPO critic's warm-up iterations are its estimator's setting)
POSTTRAIN = (("grpo", "GRPO, 5 tasks (metaworld_mt5_rl.yaml)", "configs/robotics/metaworld_mt5_rl.yaml", []),
             ("ppo", "PPO + value head, GAE (metaworld_mt5_ppo.yaml)", "configs/robotics/metaworld_mt5_ppo.yaml",
              ["advantage.estimator.warmup=0"]))
QUICK_OVERRIDES = ["iterations=2", "rollout.groups_per_iteration=5", "rollout.group_size=2", "robotics.env.horizon=16",
                   "robotics.eval_states_per_task=1", "eval.every=0", "robotics.gifs=false"]


def posttrain_row(variant: str, run_dir: Path) -> dict:
    """One row from a finished run directory: env steps of all iterations, first and last held-out evaluation."""
    from shared_rl.metrics import read_metrics

    recs = read_metrics(Path(run_dir) / "metrics.jsonl")
    evals = [r for r in recs if "eval/success" in r]
    if len(evals) < 2:
        raise ValueError(f"{run_dir}: needs an evaluation before and after training (found {len(evals)})")
    first, last = evals[0], evals[-1]
    row = {"variant": variant, "iterations": last["step"], "env_steps": int(sum(r.get("env/steps", 0) for r in recs if r["step"] <= last["step"])),
           "success_before": first["eval/success"], "success_after": last["eval/success"]}
    for k in sorted(k for k in last if k.startswith("eval/success/")):
        row[k[len("eval/success/"):]] = f"{first[k]:.3f} -> {last[k]:.3f}"
    return row


def _posttrain_rows(out_dir: Path, quick: bool) -> list[dict]:
    import subprocess
    import sys

    given = dict(x.split("=", 1) for x in os.environ.get("GROVE_BENCH_ROBOTICS_RUNS", "").split(",") if "=" in x)
    root = Path(__file__).resolve().parents[1]
    rows = []
    for name, variant, recipe, quick_own in POSTTRAIN:
        run_dir = Path(given[name]) if name in given and not quick else Path(out_dir) / f"posttrain-{name}"
        if not (run_dir / "summary.txt").is_file():
            cmd = [sys.executable, "-m", "shared_rl.cli", "train", str(root / recipe), "--out", str(run_dir), "seed=0"]
            subprocess.run(cmd + (QUICK_OVERRIDES + quick_own if quick else []), check=True, cwd=root,
                           stdout=subprocess.DEVNULL)
        rows.append(posttrain_row(variant, run_dir))
    return rows


def run(out_dir: Path, quick: bool = False) -> dict:
    import torch

    from robotics.envs import BatchedMetaWorld, EnvConfig, SubprocMetaWorld
    from shared_rl.bench import write_results

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    frames = 30 if quick else 300
    seq_steps = 50 if quick else 500
    batch, chunks = (5, 3) if quick else (20, 25)
    workers = 2
    rows = []
    fps_default = _render_rate(False, max(10, frames // 5))
    fps_tuned = _render_rate(True, frames)
    rows.append({"variant": "render 64x64, default scene", "frames_per_s": fps_default, "env_steps_per_s": None,
                 "speedup_vs_sequential": None})
    rows.append({"variant": "render 64x64, tuned scene", "frames_per_s": fps_tuned, "env_steps_per_s": None,
                 "speedup_vs_sequential": None})
    seq = _sequential(seq_steps, rng)
    rows.append({"variant": "sequential, 1 env, render every step", "env_steps_per_s": seq, "speedup_vs_sequential": 1.0})
    local = BatchedMetaWorld(EnvConfig(tasks=TASKS, horizon=10_000))
    b_in = _batched(local, batch, chunks, rng)
    local.close()
    rows.append({"variant": f"batched in-process, {batch} envs, render per chunk (K=4)", "env_steps_per_s": b_in,
                 "speedup_vs_sequential": b_in / seq})
    remote = SubprocMetaWorld(EnvConfig(tasks=TASKS, horizon=10_000, num_workers=workers))
    b_mp = _batched(remote, batch, chunks, rng)
    remote.close()
    rows.append({"variant": f"{workers} worker processes, {batch} envs, render per chunk", "env_steps_per_s": b_mp,
                 "speedup_vs_sequential": b_mp / seq})
    cl_rate, share, which = _closed_loop(batch, 12 if quick else 100)
    rows.append({"variant": f"closed loop with the VLA (flow_sde, 5 denoising steps), {batch} envs in-process",
                 "env_steps_per_s": cl_rate, "speedup_vs_sequential": cl_rate / seq, "policy_time_share": share})
    rows += _posttrain_rows(Path(out_dir), quick)
    notes = (
        f"Render backend MUJOCO_GL={os.environ.get('MUJOCO_GL')} (Mesa llvmpipe on CPU). Tuned scene = shadows, "
        f"reflections and skybox off, model.vis.quality.offsamples=0 before the renderer is made: "
        f"{fps_tuned / fps_default:.1f}x the default scene's frames/s. Sequential = one env stepping and rendering "
        f"every step; batched = envs in lock-step rendering once per 4-action chunk. Policy share = fraction of the "
        f"closed-loop wall time spent outside the env (encoding + denoising), policy = {which}. torch threads = 1. "
        f"The CPU is shared with other jobs, so compare ratios, not absolute numbers. Post-training rows: held-out "
        f"success (ODE, 40 reset states per task) before -> after, seed 0, at the same rollout budget "
        f"(iterations x groups x episodes); env_steps counts the executed control steps of all rollouts."
        + (" QUICK MODE: plumbing check only." if quick else "")
    )
    result = write_results(out_dir, "robotics-sim", rows, notes, doc_path=None if quick else DOC)
    _plot(rows, Path(out_dir) / "robotics_sim.png")
    if not quick:  # the page's figure is this run's, like its table
        _plot(rows, DOC.parent / "robotics_sim.png")
    return result


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sel = [r for r in rows if r.get("env_steps_per_s")]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["variant"][:48] for r in sel], [r["env_steps_per_s"] for r in sel])
    ax.set_xlabel("env steps / s (with rendering)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    import argparse
    import json

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/bench-robotics-sim")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    print(json.dumps(run(Path(a.out), a.quick)["rows"], indent=1))
