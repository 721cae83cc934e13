"""A config error under ``torchrun --nproc_per_node 2`` is one ``grove: error:`` line, not one per worker, and each
worker exits 2 without a traceback of its own (issue 64). What torchrun's launcher prints after a worker's non-zero
exit (its ``ChildFailedError`` summary) is its own: grove does not launch torchrun, so ``grove train --dry-run``
before the launch is where a config error is one line alone (docs/scaling.md)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared_rl import cli

ROOT = Path(__file__).resolve().parents[2]


def test_the_first_worker_of_a_launch_prints_the_line_and_the_others_stay_silent(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for k, v in {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "r/1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["train", "configs/toy.yaml", "optim.lrr=1", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == "grove: error: unknown config key 'optim.lrr'; did you mean 'lr'?"
    monkeypatch.setenv("LOCAL_RANK", "0")  # the other worker of the same launch
    assert cli.main(["train", "configs/toy.yaml", "optim.lrr=1", "--dry-run"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MASTER_PORT", "2")  # another launch
    assert cli.main(["train", "configs/toy.yaml", "optim.lrr=1", "--dry-run"]) == 2
    assert "grove: error:" in capsys.readouterr().err


def test_two_gloo_workers_under_torchrun_print_a_config_error_once(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("no torchrun")
    proc = subprocess.run([str(torchrun if torchrun.exists() else shutil.which("torchrun")), "--nproc_per_node", "2",
                           "-m", "shared_rl.cli", "train", "configs/toy.yaml", "optim.lrr=1", "--out",
                           str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert [line for line in out.splitlines() if line.startswith("grove: error:")] == [
        "grove: error: unknown config key 'optim.lrr'; did you mean 'lr'?"], out
    assert "exitcode  : 2" in out  # the worker that stopped first exited 2
    assert "shared_rl/cli.py" not in out  # no worker printed a traceback
    assert not (tmp_path / "run").exists()
