"""A dead env worker is a clear stop (issue 65): a Meta-World worker process SIGKILLed mid-run (what the kernel's
out-of-memory killer does) ends ``grove train`` with exit code 1 and ONE ``grove: error:`` line naming the worker,
its task and the signal — never a raw ``EOFError`` traceback, never a hang — and ``--resume`` then continues the run
to the same records as an uninterrupted one.

The end-to-end run (three Meta-World runs, two with a worker process: ~40 s of CPU) is ``slow``; the default suite
checks the same stop on the pool itself with a stand-in worker (a forked process killed with SIGKILL, a fraction of a
second). The waits are on conditions (a checkpoint on disk, the worker's pid), each with a generous bound."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

CFG = {
    "domain": "robotics", "seed": 0, "iterations": 4, "logging": {"progress": False},
    "checkpoint": {"every": 1, "keep_last": 5}, "eval": {"at_start": False, "every": 0},
    "rollout": {"groups_per_iteration": 1, "group_size": 2},
    "advantage": {"estimator": "grpo", "weights": {"success": 1.0, "dense": 1.0}},
    "optim": {"lr": 1e-4, "inner_epochs": 1, "minibatches_per_epoch": 1},
    "robotics": {"checkpoint": "assets/metaworld-vla-tiny", "head_mode": "sde_one_step", "dense_reward": True,
                 "train_states_per_task": 2, "eval_states_per_task": 1, "gifs": False, "threads": 1,
                 "env": {"tasks": ["reach-v3"], "horizon": 8, "cameras": ["corner"], "image_size": 64,
                         "num_workers": 1}},
}


def _grove(args, cwd):
    env = dict(os.environ, PYTHONUNBUFFERED="1", MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    return subprocess.Popen([sys.executable, "-m", "shared_rl", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)


def _workers(pid: int) -> list[int]:
    """The env workers among ``pid``'s children: spawned processes (``spawn_main``), not multiprocessing's
    resource tracker."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                out.append(int(child))
    return out


def _wait(cond, proc, what, timeout=300):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}: "
                                 f"{proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _records(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "resume/"))
             and not k.endswith("_per_s")} for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_dead_worker_is_one_line_naming_it_its_task_and_the_signal():
    """The pool's call on a worker whose process was SIGKILLed raises ``WorkerDied`` (no EOFError), its message the
    worker, its pid, the tasks of its slice and the signal; the CLI maps it to exit 1 and that one line."""
    import multiprocessing as mp

    from shared_rl.errors import WorkerDied

    from robotics.envs.metaworld_env import make_key
    from robotics.envs.vector import EnvConfig, SubprocMetaWorld

    pool = SubprocMetaWorld.__new__(SubprocMetaWorld)  # its workers stood in for: no Meta-World import
    pool.cfg = EnvConfig(tasks=["reach-v3", "push-v3"], num_workers=2)
    ctx = mp.get_context("fork")
    pool._conns, pool._procs = [], []
    for _ in range(2):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=time.sleep, args=(120,), daemon=True)
        proc.start()
        child.close()
        pool._conns.append(parent)
        pool._procs.append(proc)
    pool._keys = [make_key(0, "train", 0), make_key(1, "train", 0), make_key(1, "train", 1)]
    pool._slices = [(0, 1), (1, 3)]
    try:
        os.kill(pool._procs[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerDied) as died:
            pool._call([(1, "step_chunk", ())])
        assert str(died.value) == (f"Meta-World env worker 1 (pid {pool._procs[1].pid}, task push-v3) died during "
                                   f"step_chunk: killed by SIGKILL (the kernel's out-of-memory killer sends it when "
                                   f"memory runs out)")
    finally:
        for proc in pool._procs:
            proc.kill()
            proc.join(10)
        pool._procs = []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker through /proc")
def test_a_killed_env_worker_stops_the_run_in_one_line_and_the_run_resumes_exactly(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    run = tmp_path / "run"
    p = _grove(["train", str(cfg), "--out", str(run)], ROOT)
    try:
        _wait(lambda: (run / "checkpoints" / "step_000001").is_dir(), p, "the first checkpoint")
        workers = _wait(lambda: _workers(p.pid), p, "the env worker")
        os.kill(workers[0], signal.SIGKILL)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert p.returncode == 1, err.decode()[-3000:]
    errors = [line for line in lines if line.startswith("grove: error:")]
    assert len(errors) == 1, lines[-20:]
    assert "Meta-World env worker 0" in errors[0] and "task reach-v3" in errors[0] and "killed by SIGKILL" in errors[0]
    assert f"grove train --resume {run}" in errors[0]
    assert "Traceback" not in err.decode() and "EOFError" not in err.decode()

    again = _grove(["train", "--resume", str(run)], ROOT)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err.decode()[-3000:]
    ref = tmp_path / "ref"  # uninterrupted, the env in this process (the workers run the same env code)
    from shared_rl.api import train

    train({**CFG, "robotics": {**CFG["robotics"], "env": {**CFG["robotics"]["env"], "num_workers": 0}}},
          run_dir=ref, log=lambda *_: None)
    assert _records(run) == _records(ref)
