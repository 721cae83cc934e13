"""One writer per run directory (``shared_rl.rundir``): a second ``grove train``, ``--resume`` or ``eval`` into a
directory another process writes exits 2 with one line naming the owner and changes nothing; two runs started
into the same new directory at once leave one history, not an interleaving; a lock left by a killed run is taken
over; a run whose directory is deleted stops with exit code 1 and never recreates it. Every wait is bounded."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from shared_rl.checkpoint import save_checkpoint
from shared_rl.cli import main
from shared_rl.errors import RunDirectoryBusy, RunDirectoryLost
from shared_rl.rundir import LOCK_NAME, RunLock, check_run_dir, holder

ROOT = Path(__file__).resolve().parents[2]
CFG = {"domain": "toy", "seed": 0, "iterations": 3, "logging": {"progress": False},
       "checkpoint": {"every": 1, "keep_last": 2}, "rollout": {"groups_per_iteration": 2, "group_size": 4},
       "toy": {"num_contexts": 4}}


def _grove(args, cwd):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "shared_rl", *args], cwd=str(cwd), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, text=True)


def _config(tmp_path, **over):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**CFG, **over}))
    return path


def _steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("grove: error:")]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


# ------------------------------------------------------------------------------------------------- the lock itself
def test_the_lock_is_exclusive_names_its_owner_and_leaves_nothing(tmp_path):
    first = RunLock(tmp_path, "grove train").acquire()
    assert holder(tmp_path)["pid"] == os.getpid()
    with pytest.raises(RunDirectoryBusy, match=rf"in use by grove train \(pid {os.getpid()} on this host"):
        RunLock(tmp_path, "grove eval").acquire()  # a second open file: flock refuses it, also in one process
    first.release()
    assert not (tmp_path / LOCK_NAME).exists() and holder(tmp_path) is None
    with RunLock(tmp_path, "grove eval"):  # free again
        assert (tmp_path / LOCK_NAME).is_file()
    assert list(tmp_path.iterdir()) == []


def test_a_stale_lock_of_a_dead_process_is_taken_over_loudly(tmp_path):
    dead = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": os.uname().nodename, "pid": dead, "command": "grove train",
                                                  "started": "earlier"}))
    said = []
    lock = RunLock(tmp_path, "grove train --resume", log=said.append).acquire()
    assert lock.stale["pid"] == dead and f"pid {dead}" in said[0] and "no longer running" in said[0]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_deleted_or_replaced_run_directory_is_noticed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock(run, "grove train").acquire()
    check_run_dir(run)
    shutil.rmtree(run)
    run.mkdir()  # recreated by someone else: not the directory this run owns
    with pytest.raises(RunDirectoryLost, match="deleted, moved or replaced"):
        check_run_dir(run)
    lock.release()
    assert list(run.iterdir()) == []  # release never deletes another lock file
    shutil.rmtree(run)
    with pytest.raises(RunDirectoryLost):  # a checkpoint never recreates a vanished run directory
        save_checkpoint(run / "checkpoints", 1, {"w": torch.zeros(2)}, None, {"iteration": 1})
    assert not run.exists()


# ------------------------------------------------------------------------------------------------- through grove
def test_a_writer_that_passed_the_emptiness_check_is_stopped_by_the_lock(tmp_path, capsys):
    """The race of two runs into one empty directory, made deterministic: the other writer holds the lock when this
    one reaches it (after loading its model); this one exits 2 naming the owner and leaves the directory alone."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = _config(tmp_path)
    with RunLock(run, "grove train"):
        assert main(["train", str(cfg), "--out", str(run)]) == 2
        err = _error_lines(capsys)
        assert len(err) == 1 and f"in use by grove train (pid {os.getpid()}" in err[0], err
        assert [p.name for p in run.iterdir()] == [LOCK_NAME]
    assert main(["train", str(cfg), "--out", str(run)]) == 0  # free again: the directory is still usable
    assert _steps(run) == [0, 1, 2, 3] and not (run / LOCK_NAME).exists()


def test_second_writers_exit_2_naming_the_owner_and_a_deleted_run_stops_with_1(tmp_path, capsys):
    done = tmp_path / "done"
    assert main(["train", str(_config(tmp_path)), "--out", str(done)]) == 0  # a finished run, for grove eval
    cfg = _config(tmp_path, iterations=1_000_000, checkpoint={"every": 1, "keep_last": 1})
    run = tmp_path / "run"
    proc = _grove(["train", str(cfg), "--out", str(run)], tmp_path)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").is_file() and len(_steps(run)) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0][-2000:]
        owner = f"in use by grove train (pid {proc.pid} on this host"
        for argv in (["train", str(cfg), "--out", str(run)], ["train", "--resume", str(run)]):
            assert main(argv) == 2
            err = _error_lines(capsys)
            assert len(err) == 1 and owner in err[0], (argv, err)
        assert main(["eval", str(done), "--out", str(run)]) == 2  # results into a directory a run writes
        err = _error_lines(capsys)
        assert len(err) == 1 and owner in err[0], err
        # the run directory vanishes under the running process: it stops with exit code 1 and one line
        t0 = time.time()
        while run.exists() and time.time() - t0 < 30:
            shutil.rmtree(run, ignore_errors=True)  # the writer may add a file between listing and removal
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out[-2000:]
    errors = [line for line in out.splitlines() if line.startswith("grove: error:")]
    assert len(errors) == 1 and "was deleted, moved or replaced" in errors[0], out[-2000:]
    assert "Traceback" not in out
    assert not run.exists()  # never recreated


def test_two_runs_started_into_one_new_directory_leave_one_history(tmp_path):
    cfg = _config(tmp_path, iterations=4)
    run = tmp_path / "runs" / "same"
    procs = [_grove(["train", str(cfg), "--out", str(run)], tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    loser = outs[[p.returncode for p in procs].index(2)]
    errors = [line for line in loser.splitlines() if line.startswith("grove: error:")]
    # the loser may meet the lock before or after the owner record is written, or the folder already filled
    assert len(errors) == 1 and any(s in errors[0] for s in ("in use by grove train", "in use by another grove",
                                                             "is not empty")), loser
    assert _steps(run) == [0, 1, 2, 3, 4]
    assert yaml.safe_load((run / "config.yaml").read_text())["iterations"] == 4
    assert not (run / LOCK_NAME).exists()
