"""``--resume``, Ctrl-C and ``grove eval`` never destroy or silently change a run.

- ``--resume`` refuses (exit 2, one line, the run untouched) when no checkpoint is usable (all corrupt, or none
  yet), when a CONFIG or ``--out`` is given with it, and when nothing is left to train; with a corrupt newest
  checkpoint it falls back to the older one and replays exactly; overrides given at resume are written into the
  run's ``config.yaml`` and its next metrics record.
- Ctrl-C (SIGINT) behaves like SIGTERM: the iteration finishes, a checkpoint is written, the exit code is 130 and
  the message says how to resume; a second Ctrl-C aborts at once, keeping the newest checkpoint (or removing a run
  directory that has none, since nothing resumable was made).
- ``grove eval`` writes its results into a directory of its own and leaves every byte of the run as it was.

The Ctrl-C cases need a real process and an iteration slow enough to interrupt: ``SlowToy`` (the toy domain with
a sleep in every rollout, registered by name in the child process) marks each rollout's start in a file.
"""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shared_rl.cli import main
from shared_rl.toy import ToyDomain

ROOT = Path(__file__).resolve().parents[2]

GOOD = {
    "domain": "toy", "seed": 3, "iterations": 3, "logging": {"progress": False},
    "checkpoint": {"every": 1, "keep_last": 2},
    "rollout": {"groups_per_iteration": 2, "group_size": 4}, "optim": {"lr": 0.1},
    "toy": {"num_contexts": 4},
}


def tree_state(root: Path) -> dict[str, str]:
    """Every file (relative path -> sha256) and directory under ``root``: what "untouched" compares."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


def _one_error(capsys, expect: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("grove: error: ") and expect in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def _template_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("template")
    cfg = base / "c.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    assert main(["train", str(cfg), "--out", str(base / "run")]) == 0
    return base


@pytest.fixture
def finished_run(_template_run, tmp_path, monkeypatch):
    """A finished 3-iteration toy run with checkpoints at iterations 2 and 3 (a fresh copy per test)."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copy(_template_run / "c.yaml", tmp_path / "c.yaml")
    run = shutil.copytree(_template_run / "run", tmp_path / "run")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    return run


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"} for r in records]


def test_resume_refuses_when_every_checkpoint_fails_its_checksum(finished_run, capsys):
    for ckpt in (finished_run / "checkpoints").iterdir():
        (ckpt / "model.safetensors").write_bytes(b"garbage")
    before = tree_state(finished_run)
    assert main(["train", "--resume", str(finished_run), "iterations=5"]) == 2
    line = _one_error(capsys, "no usable checkpoint")
    assert "step_000003: model.safetensors fails its checksum" in line and "step_000002" in line
    assert tree_state(finished_run) == before  # metrics.jsonl and both checkpoints as they were


def test_resume_refuses_a_run_without_checkpoints(finished_run, capsys):
    import shutil

    shutil.rmtree(finished_run / "checkpoints")
    before = tree_state(finished_run)
    assert main(["train", "--resume", str(finished_run), "iterations=5"]) == 2
    _one_error(capsys, "no usable checkpoint (it has none yet")
    assert tree_state(finished_run) == before


def test_a_corrupt_newest_checkpoint_falls_back_and_replays_exactly(finished_run, capsys):
    want = _comparable(_records(finished_run))
    (finished_run / "checkpoints" / "step_000003" / "model.safetensors").write_bytes(b"garbage")
    # iteration 3 is trained again from the checkpoint at 2; records past it are replayed, not lost
    assert main(["train", "--resume", str(finished_run), "iterations=3"]) == 0
    err = capsys.readouterr().err
    assert "trying the previous one, step_000002" in err and "resumed from" in err
    assert _comparable(_records(finished_run))[:-1] == want[:-1]
    assert _records(finished_run)[-1]["step"] == 3


@pytest.mark.parametrize("extra,expect", [(["CFG"], "drop"), (["--out", "OTHER"], "drop --out")])
def test_resume_refuses_a_config_or_out(finished_run, tmp_path, capsys, extra, expect):
    extra = [str(tmp_path / "c.yaml") if a == "CFG" else str(tmp_path / "other") if a == "OTHER" else a for a in extra]
    before = tree_state(tmp_path)
    assert main(["train", *extra, "--resume", str(finished_run), "iterations=5"]) == 2
    _one_error(capsys, expect)
    assert tree_state(tmp_path) == before


def test_resume_refuses_a_finished_run_with_nothing_left_to_train(finished_run, capsys):
    before = tree_state(finished_run)
    assert main(["train", "--resume", str(finished_run)]) == 2
    _one_error(capsys, "nothing is left to train; pass iterations=N with N > 3")
    assert tree_state(finished_run) == before


def test_resume_overrides_are_recorded_in_config_and_metrics(finished_run, capsys):
    assert main(["train", "--resume", str(finished_run), "iterations=5", "optim.lr=0.05"]) == 0
    text = (finished_run / "config.yaml").read_text()
    assert text.splitlines()[0].startswith("# resumed at iteration 3 (") and "iterations=5 optim.lr=0.05" in text
    resolved = yaml.safe_load(text)
    assert resolved["iterations"] == 5 and resolved["optim"]["lr"] == 0.05
    records = _records(finished_run)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert records[4]["resume/overrides"] == "iterations=5 optim.lr=0.05" and "resume/overrides" not in records[5]


def test_eval_writes_its_own_results_and_never_changes_the_run(finished_run, tmp_path, capsys):
    before = tree_state(finished_run)
    assert main(["eval", str(finished_run), "--out", str(tmp_path / "ev")]) == 0
    out = capsys.readouterr()
    assert "resumed from" not in out.err and "grove eval:" in out.err
    result = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert result["iteration"] == 3 and result["checkpoint"].endswith("step_000003")
    assert result["metrics"] == json.loads(out.out) and "eval/greedy_accuracy" in result["metrics"]
    assert tree_state(finished_run) == before
    # the default results directory is runs/eval-<run>-<time> in the working directory, not inside the run
    assert main(["eval", str(finished_run)]) == 0
    assert len(list((tmp_path / "runs").glob("eval-run-*/results.json"))) == 1
    assert tree_state(finished_run) == before


# ------------------------------------------------------------------------------------------------- Ctrl-C
class SlowToy(ToyDomain):
    """The toy bandit with a sleep in each rollout (``GROVE_TEST_SLOW`` seconds); each rollout appends its
    iteration to ``GROVE_TEST_MARK`` as it starts, so a test can signal mid-iteration."""

    def rollout(self, keys, group_size, generator, iteration):
        with open(os.environ["GROVE_TEST_MARK"], "a") as f:
            f.write(f"{iteration}\n")
        time.sleep(float(os.environ.get("GROVE_TEST_SLOW", "0")))
        return super().rollout(keys, group_size, generator, iteration)


LAUNCH = ("import sys; from shared_rl import registry; registry.DOMAINS['slow_toy'] = "
          "'tests.core.test_resume:SlowToy'; from shared_rl.cli import main; sys.exit(main(sys.argv[1:]))")


def _slow_run(tmp_path, every=1, iterations=50):
    data = {**GOOD, "domain": "slow_toy", "iterations": iterations, "checkpoint": {"every": every, "keep_last": 2},
            "slow_toy": GOOD["toy"]}
    data.pop("toy")
    cfg = tmp_path / "slow.yaml"
    cfg.write_text(yaml.safe_dump(data))
    mark = tmp_path / "mark.txt"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), GROVE_TEST_SLOW="0.7", GROVE_TEST_MARK=str(mark))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "train", str(cfg), "--out", str(run)], cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    return proc, run, mark


def _wait_for_rollout(mark: Path, iteration: int, proc, timeout=90):
    t = time.time()
    while time.time() - t < timeout and proc.poll() is None:
        if mark.is_file() and str(iteration) in mark.read_text().split():
            return
        time.sleep(0.05)
    raise AssertionError(f"rollout {iteration} never started: {proc.stdout.read().decode()[-2000:] if proc.poll() is not None else ''}")


def test_ctrl_c_finishes_the_iteration_checkpoints_and_exits_130(tmp_path):
    proc, run, mark = _slow_run(tmp_path, every=0)
    _wait_for_rollout(mark, 1, proc)  # iteration 2 (0-based 1) is running
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=90)[0].decode()
    assert proc.returncode == 130, out[-2000:]
    assert "SIGINT: finishing this iteration" in out and f"resume with: grove train --resume {run}" in out
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]  # checkpoint.every=0: only Ctrl-C's
    assert _records(run)[-1]["step"] == 2
    assert "Traceback" not in out


class SignalToy(ToyDomain):
    """The toy bandit that sends this process ``signals`` SIGINTs at the start of iteration ``at`` (in-process:
    the handler runs in the main thread, exactly as for a Ctrl-C typed while that iteration samples)."""

    at, signals = 1, 2

    def rollout(self, keys, group_size, generator, iteration):
        if iteration == self.at:
            for _ in range(self.signals):
                os.kill(os.getpid(), signal.SIGINT)
        return super().rollout(keys, group_size, generator, iteration)


def _signal_run(tmp_path, monkeypatch, at, signals, every):
    from shared_rl import registry

    monkeypatch.setitem(registry.DOMAINS, "signal_toy", f"{__name__}:SignalToy")
    monkeypatch.setattr(SignalToy, "at", at)
    monkeypatch.setattr(SignalToy, "signals", signals)
    data = {**GOOD, "domain": "signal_toy", "iterations": 6, "checkpoint": {"every": every, "keep_last": 2},
            "signal_toy": GOOD["toy"]}
    data.pop("toy")
    cfg = tmp_path / "sig.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    try:
        code = main(["train", str(cfg), "--out", str(run)])
    except KeyboardInterrupt:  # pragma: no cover - the handler is missing: fail the test, not the session
        pytest.fail("Ctrl-C escaped grove train")
    return code, run, cfg


def test_a_second_ctrl_c_aborts_keeping_the_newest_checkpoint(tmp_path, monkeypatch, capsys):
    code, run, cfg = _signal_run(tmp_path, monkeypatch, at=2, signals=2, every=1)
    err = capsys.readouterr().err
    assert code == 130 and "interrupted; the newest checkpoint is kept" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert [r["step"] for r in _records(run)] == [0, 1, 2]  # the aborted iteration wrote nothing
    monkeypatch.setattr(SignalToy, "at", -1)
    assert main(["train", "--resume", str(run)]) == 0
    assert [r["step"] for r in _records(run)] == list(range(7))


def test_a_second_ctrl_c_before_any_checkpoint_leaves_nothing(tmp_path, monkeypatch, capsys):
    code, run, _ = _signal_run(tmp_path, monkeypatch, at=0, signals=2, every=0)
    err = capsys.readouterr().err
    assert code == 130 and "interrupted before the first checkpoint" in err, err
    assert not run.exists()


def test_one_ctrl_c_in_process_checkpoints_where_it_stopped(tmp_path, monkeypatch, capsys):
    code, run, _ = _signal_run(tmp_path, monkeypatch, at=3, signals=1, every=0)
    err = capsys.readouterr().err
    assert code == 130 and f"resume with: grove train --resume {run}" in err, err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000004"]
    monkeypatch.setattr(SignalToy, "at", -1)
    assert main(["train", "--resume", str(run)]) == 0
    assert [r["step"] for r in _records(run)] == list(range(7))


def test_a_run_started_from_python_can_be_evaluated_and_resumed_from_the_cli(tmp_path, capsys):
    """``shared_rl.api.train(..., run_dir=...)`` writes config.yaml as ``grove train`` does: ``grove eval RUN`` reads
    its checkpoint and ``grove train --resume RUN iterations=N`` continues it, the records equal to an
    uninterrupted run's."""
    from shared_rl.api import train

    run = tmp_path / "run"
    train(GOOD, run_dir=run, log=lambda *_: None)
    assert (run / "config.yaml").is_file() and "started from Python" in (run / "config.yaml").read_text()
    assert main(["eval", str(run), "--out", str(tmp_path / "ev")]) == 0
    assert (tmp_path / "ev" / "results.json").is_file()
    assert main(["train", "--resume", str(run), "iterations=5"]) == 0
    ref = tmp_path / "ref"
    train({**GOOD, "iterations": 5}, run_dir=ref, log=lambda *_: None)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time/", "resume/", "eval/")) and k != "samples_per_s"}  # noqa: E731
                        for r in rs]
    read = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert strip(read(run)) == strip(read(ref))
