"""Faults: SIGKILL at random points + resume equals an uninterrupted run; SIGTERM checkpoints and exits cleanly;
reward back-ends retried then masked or fatal; out-of-memory turned into advice. Issue 38 (nothing lost, nothing
hung): a torn last metrics line, history damaged in the middle, a second Ctrl-C during checkpoint rotation, SIGKILL
during the final export, a full disk at the start, rewards that hang (fatal, or stuck under SIGTERM) and rewards
that fail on every call. One writer per run directory and deleted run directories: ``test_run_lock.py``. Every
child process is waited for with a timeout."""
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from shared_rl import checkpoint as ckpt
from shared_rl.cli import main
from shared_rl.config import ResourceError, load_train_config
from shared_rl.rewards import RewardFailure, RewardGuardConfig, guarded_reward
from shared_rl.toy import ToyDomain
from shared_rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]

CFG = {
    "domain": "toy", "seed": 1, "iterations": 16, "logging": {"progress": False},
    "checkpoint": {"every": 1, "keep_last": 2},
    "rollout": {"groups_per_iteration": 4, "group_size": 4},
    "optim": {"lr": 0.2, "minibatches_per_epoch": 2},
    "selection": {"sampler": "vade"},
    "toy": {"num_contexts": 6, "horizon": 3, "reward_noise": 0.1},
}


def _grove(args, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "shared_rl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, **kw)


def _records(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"} for r in records]


def _wait_for_step(run, step, proc, timeout=600):  # generous: a loaded machine starts python slowly
    t = time.time()
    while time.time() - t < timeout:
        if (run / "metrics.jsonl").is_file():
            lines = (run / "metrics.jsonl").read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        if proc.poll() is not None:
            return
        time.sleep(0.02)


def test_sigkill_at_several_points_then_resume_matches(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    ref = tmp_path / "ref"
    assert _grove(["train", str(cfg), "--out", str(ref)]).wait() == 0
    run = tmp_path / "killed"
    p = _grove(["train", str(cfg), "--out", str(run), "toy.num_contexts=6"])
    for kill_after in (3, 7, 12):
        _wait_for_step(run, kill_after, p)
        p.kill()  # SIGKILL: no handler runs
        p.wait()
        p = _grove(["train", "--resume", str(run)])
    assert p.wait() == 0, p.stdout.read().decode()[-2000:]
    assert _comparable(_records(run)) == _comparable(_records(ref))


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    data = dict(CFG, iterations=400, checkpoint={"every": 0, "keep_last": 2})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    p = _grove(["train", str(cfg), "--out", str(run)])
    _wait_for_step(run, 2, p)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0].decode()
    assert p.returncode == 0 and "SIGTERM" in out
    step = _records(run)[-1]["step"]
    assert (run / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
    assert step < 400


def test_reward_retries_then_nan_or_fatal():
    calls = []

    def flaky(images):
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("backend down")
        return {"r": [1.0] * len(images)}

    guarded = guarded_reward(flaky, "r", RewardGuardConfig(retries=2, backoff_s=0), len, log=lambda *_: None)
    assert torch.equal(guarded([0, 0])["r"], torch.tensor([1.0, 1.0])) and len(calls) == 3

    def dead(images):
        raise ConnectionError("backend down")

    masked = guarded_reward(dead, "r", RewardGuardConfig(retries=1, backoff_s=0), len, log=lambda *_: None,
                            output_names=["r", "r_strict"])
    out = masked([0, 0, 0])
    assert set(out) == {"r", "r_strict"} and torch.isnan(out["r"]).all() and out["r"].shape == (3,)
    fatal = guarded_reward(dead, "r", RewardGuardConfig(retries=0, on_failure="fatal"), len, log=lambda *_: None)
    with pytest.raises(RewardFailure, match="failed after 1 attempts"):
        fatal([0])

    release, finished = threading.Event(), threading.Event()

    def hung(images):  # a backend that answers only when released (or after 30 s)
        release.wait(30)
        finished.set()
        return {"r": [0.0]}

    timed = guarded_reward(hung, "r", RewardGuardConfig(retries=0, timeout_s=0.1), len, log=lambda *_: None)
    assert torch.isnan(timed([0])["r"]).all()
    assert not finished.is_set()   # the guard returned while the backend still hung (it did not wait to join it)
    release.set()


def test_reward_guard_remembers_output_names_and_never_retries_contract_errors():
    calls = []

    def backend(images):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("down")
        if len(calls) == 3:
            raise ValueError("images must be [B,3,H,W]")    # a bug in the caller: raised at once, not masked
        return {"score": [0.5] * len(images), "strict": [0.0] * len(images)}

    g = guarded_reward(backend, "score", RewardGuardConfig(retries=0, backoff_s=0), len, log=lambda *_: None)
    assert set(g([0, 0])) == {"score", "strict"}
    out = g([0, 0, 0])                                      # fails: NaN under the names it answered with before
    assert set(out) == {"score", "strict"} and all(torch.isnan(v).all() and v.shape == (3,) for v in out.values())
    with pytest.raises(ValueError, match="B,3,H,W"):
        g([0])
    assert len(calls) == 3
    with pytest.raises(Exception, match="retries must be >= 0"):
        RewardGuardConfig(retries=-1).check("visgen.reward_guard")


def test_nan_rewards_are_masked_and_counted(monkeypatch):
    tr = Trainer(load_train_config({**CFG, "checkpoint": {}}), None, log=lambda *_: None)
    real = tr.domain.rollout

    def some_nan(keys, group_size, generator, iteration):
        r = real(keys, group_size, generator, iteration)
        r.rewards["correct"][::3] = float("nan")
        return r

    monkeypatch.setattr(tr.domain, "rollout", some_nan)
    m = tr.iteration(0)
    assert m["reward/nan_count"] == 6 and m["reward/mean"] == m["reward/mean"]  # finite mean despite NaNs
    assert torch.isfinite(tr.domain.state_dict()["logits"]).all()


def test_out_of_memory_becomes_advice(monkeypatch):
    tr = Trainer(load_train_config({**CFG, "checkpoint": {}}), None, log=lambda *_: None)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(tr.domain, "rollout", oom)
    with pytest.raises(ResourceError, match="groups_per_call"):
        tr.iteration(0)


# ------------------------------------------------------------------------------------------------- issue 38
SMALL = {"domain": "toy", "seed": 4, "iterations": 4, "logging": {"progress": False},
         "checkpoint": {"every": 1, "keep_last": 2}, "rollout": {"groups_per_iteration": 2, "group_size": 4},
         "toy": {"num_contexts": 4}}


def _write(tmp_path, data, name="c.yaml"):
    (tmp_path / name).write_text(yaml.safe_dump(data))
    return tmp_path / name


def _errors(text):
    return [line for line in text.splitlines() if line.startswith("grove: error:")]


def test_a_torn_last_metrics_line_is_dropped_loudly_and_resume_matches(tmp_path, capsys):
    cfg = _write(tmp_path, SMALL)
    for name in ("ref", "torn"):
        assert main(["train", str(cfg), "--out", str(tmp_path / name)]) == 0
    with open(tmp_path / "torn" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward/me')  # what a kill or a full disk during the append leaves
    capsys.readouterr()
    for name in ("ref", "torn"):
        assert main(["train", "--resume", str(tmp_path / name), "iterations=6"]) == 0
        err = capsys.readouterr().err
        assert ("dropped its torn last line" in err) == (name == "torn"), err
    assert _comparable(_records(tmp_path / "torn")) == _comparable(_records(tmp_path / "ref"))


def test_history_damaged_in_the_middle_is_refused_before_anything_is_written(tmp_path, capsys):
    cfg = _write(tmp_path, SMALL)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run)]) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:2] + ["#garbage"] + lines[2:]) + "\n")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "iterations=6"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "line 3 is not a metrics record" in err[0], err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_second_ctrl_c_during_checkpoint_rotation_never_leaves_half_a_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    state = lambda it: {"iteration": it}  # noqa: E731
    for it in (1, 2):
        ckpt.save_checkpoint(root, it, {"w": torch.full((4,), float(it))}, None, state(it), keep_last=2)

    def interrupted(path, *args, **kwargs):  # removes one file, then the second Ctrl-C lands
        (Path(path) / "state.json").unlink(missing_ok=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", interrupted)
    for it in (3, 3):  # rotation (step 1 goes), then the same iteration saved again (step 3 is replaced)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save_checkpoint(root, it, {"w": torch.full((4,), 3.0)}, None, state(it), keep_last=2)
    monkeypatch.undo()
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000002", "step_000003"]
    assert all(ckpt.verify_checkpoint(p) is None for p in ckpt.list_checkpoints(root))
    ckpt.save_checkpoint(root, 4, {"w": torch.zeros(4)}, None, state(4), keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]  # the leftovers are gone


class SlowExportToy(ToyDomain):
    """The toy bandit with an export that writes a file, marks ``GROVE_TEST_MARK`` and then takes
    ``GROVE_TEST_EXPORT_S`` seconds: a test kills the process inside it."""

    def save_pretrained(self, out_dir):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "weights.txt").write_text(str(self.logits.detach().tolist()))
        Path(os.environ["GROVE_TEST_MARK"]).write_text("exporting")
        gate = os.environ.get("GROVE_TEST_EXPORT_GATE")
        if gate:  # wait for the test to open the gate (a condition, not a clock), at most a minute
            for _ in range(1200):
                if Path(gate).exists():
                    break
                time.sleep(0.05)
            return
        time.sleep(float(os.environ.get("GROVE_TEST_EXPORT_S", "0")))


_REWARD_CALLS = [0]  # reward calls made in this process (GROVE_TEST_HANG_AT)


class GuardedToy(ToyDomain):
    """The toy bandit whose reward goes through ``guarded_reward`` like visgen's and the LLM's. GROVE_TEST_REWARD:
    ``raise`` fails every call; ``hang`` sleeps an hour whenever the file GROVE_TEST_FLAG exists, or from the
    GROVE_TEST_HANG_AT-th call of the process on (writing GROVE_TEST_HANG_MARK first, so a test waits for the hang
    itself, not a clock). The guard's settings come from GROVE_TEST_GUARD (JSON)."""

    def _reward(self, ctx, actions, generator):
        mode = os.environ.get("GROVE_TEST_REWARD", "")
        real = super()._reward

        def backend(ctx):
            if mode == "raise":
                raise ConnectionError("backend down")
            _REWARD_CALLS[0] += 1
            hang_at = int(os.environ.get("GROVE_TEST_HANG_AT", "0"))
            if mode == "hang" and (os.path.exists(os.environ["GROVE_TEST_FLAG"])
                                   or (hang_at and _REWARD_CALLS[0] >= hang_at)):
                if os.environ.get("GROVE_TEST_HANG_MARK"):  # tells a waiting test the call is stuck now
                    Path(os.environ["GROVE_TEST_HANG_MARK"]).write_text(str(_REWARD_CALLS[0]))
                time.sleep(3600)
            return {"correct": real(ctx, actions, generator)}

        guard = RewardGuardConfig(**{"retries": 0, "backoff_s": 0, **json.loads(os.environ.get("GROVE_TEST_GUARD", "{}"))})
        log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
        return guarded_reward(backend, "correct", guard, len, log=log)(ctx)["correct"]


LAUNCH = ("import sys; from shared_rl import registry; registry.DOMAINS['{name}'] = 'tests.core.test_faults:{cls}'; "
          "from shared_rl.cli import main; sys.exit(main(sys.argv[1:]))")


def _launch(tmp_path, cls, name, data, args, **env):
    cfg = _write(tmp_path, {**{k: v for k, v in data.items() if k != "toy"}, "domain": name, name: data["toy"]},
                 name=f"{name}.yaml")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **env)
    return cfg, subprocess.Popen([sys.executable, "-c", LAUNCH.format(name=name, cls=cls), "train", str(cfg), *args],
                                 cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def _wait_for(predicate, proc, timeout=120):
    t = time.time()
    while time.time() - t < timeout and proc.poll() is None:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {proc.communicate(timeout=30)[0][-2000:] if proc.poll() is not None else ''}")


def test_sigkill_during_the_final_export_then_resume_exports_it(tmp_path, monkeypatch, capsys):
    from shared_rl import registry

    mark = tmp_path / "mark"
    run = tmp_path / "run"
    _, proc = _launch(tmp_path, "SlowExportToy", "slow_export_toy", SMALL, ["--out", str(run)],
                      GROVE_TEST_MARK=str(mark), GROVE_TEST_EXPORT_S="60")
    try:
        _wait_for(mark.exists, proc)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert not (run / "final").exists()  # never a final/ that looks finished but is not
    monkeypatch.setitem(registry.DOMAINS, "slow_export_toy", f"{__name__}:SlowExportToy")
    monkeypatch.setenv("GROVE_TEST_MARK", str(mark))
    monkeypatch.setenv("GROVE_TEST_EXPORT_S", "0")
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    assert "exporting it again" in capsys.readouterr().err
    assert (run / "final" / "weights.txt").is_file() and not (run / ".tmp-final").exists()
    assert [r["step"] for r in _records(run)] == [0, 1, 2, 3, 4]  # nothing trained again
    assert main(["train", "--resume", str(run)]) == 2
    assert "nothing is left to train" in capsys.readouterr().err


def test_sigterm_while_a_finished_run_writes_its_end_exits_cleanly_and_complete(tmp_path):
    """SIGTERM after the last iteration, inside the final export: the run finishes its end (final/ whole, the report)
    and exits 0 as a complete run, saying so; no traceback, no -15."""
    mark, gate, run = tmp_path / "mark", tmp_path / "gate", tmp_path / "run"
    _, proc = _launch(tmp_path, "SlowExportToy", "slow_export_toy", SMALL, ["--out", str(run)],
                      GROVE_TEST_MARK=str(mark), GROVE_TEST_EXPORT_GATE=str(gate))
    try:
        _wait_for(mark.exists, proc)  # inside save_pretrained, after every iteration
        proc.send_signal(signal.SIGTERM)
        gate.write_text("go")
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in out, out[-2000:]
    assert "SIGTERM: every iteration is done and checkpointed" in out and "the run is complete" in out, out[-2000:]
    assert (run / "final" / "weights.txt").is_file() and not (run / ".tmp-final").exists()
    assert (run / "report.html").is_file()


def test_a_full_disk_at_the_start_leaves_nothing_behind(tmp_path, capsys):
    """A real ENOSPC: a 256 KiB tmpfs (needs root and mount; skipped elsewhere) filled to the last byte."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True, timeout=30).returncode != 0:
        pytest.skip("needs root and a mountable tmpfs")
    try:
        try:
            with open(mnt / "filler", "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        before = sorted(p.name for p in mnt.iterdir())
        cfg = _write(tmp_path, SMALL)
        capsys.readouterr()
        assert main(["train", str(cfg), "--out", str(mnt / "run")]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grove:")]
        assert len(err) == 1 and "No space left on device" in err[0], err
        assert sorted(p.name for p in mnt.iterdir()) == before  # no run directory, no 0-byte config.yaml
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)


def test_a_hung_reward_with_a_time_out_ends_the_process(tmp_path):
    """The hung call is abandoned in a daemon thread: the run stops with its error line and the process exits (it
    used to wait forever for the executor's worker at interpreter exit)."""
    flag = tmp_path / "flag"
    flag.write_text("hang")
    for guard, expect in (({"timeout_s": 1, "on_failure": "fatal"}, "timed out after 1s"),
                          ({"timeout_s": 1, "on_failure": "nan"}, "every reward call of iteration 0 failed")):
        run = tmp_path / guard["on_failure"]
        _, proc = _launch(tmp_path, "GuardedToy", "guarded_toy", SMALL, ["--out", str(run)], GROVE_TEST_REWARD="hang",
                          GROVE_TEST_FLAG=str(flag), GROVE_TEST_GUARD=json.dumps(guard))
        try:
            out = proc.communicate(timeout=60)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 1, out[-2000:]
        assert len(_errors(out)) == 1 and expect in _errors(out)[0], out[-2000:]


def test_a_reward_failing_every_call_stops_the_run(tmp_path, monkeypatch, capsys):
    from shared_rl import registry

    monkeypatch.setitem(registry.DOMAINS, "guarded_toy", f"{__name__}:GuardedToy")
    monkeypatch.setenv("GROVE_TEST_REWARD", "raise")
    data = {**{k: v for k, v in SMALL.items() if k != "toy"}, "domain": "guarded_toy", "guarded_toy": SMALL["toy"]}
    cfg = _write(tmp_path, data)
    capsys.readouterr()
    assert main(["train", str(cfg), "--out", str(tmp_path / "stop")]) == 1
    err = _errors(capsys.readouterr().err)
    assert len(err) == 1 and "every reward call of iteration 0 failed" in err[0] and "backend down" in err[0], err
    assert not (tmp_path / "stop" / "final").exists()
    monkeypatch.setenv("GROVE_TEST_GUARD", json.dumps({"stop_if_all_fail": False}))  # asked to keep going on NaN
    assert main(["train", str(cfg), "--out", str(tmp_path / "go")]) == 0
    assert all(r.get("reward/nan_count") == 8 for r in _records(tmp_path / "go") if r["step"] > 0)


def test_sigterm_abandons_a_stuck_reward_checkpoints_and_resume_is_exact(tmp_path, monkeypatch):
    """No time-out configured (timeout_s: 0) and a reward that hangs: SIGTERM still ends the run (after the grace
    period) with a checkpoint from before the stuck iteration, and --resume replays it exactly."""
    from shared_rl import registry

    data = {**SMALL, "iterations": 8, "checkpoint": {"every": 3, "keep_last": 2}}
    flag = tmp_path / "flag"  # never written: the hang is armed by call count, so the run cannot finish first
    mark = tmp_path / "hanging"
    guard = json.dumps({"timeout_s": 0})
    run = tmp_path / "run"
    _, proc = _launch(tmp_path, "GuardedToy", "guarded_toy", data, ["--out", str(run)], GROVE_TEST_REWARD="hang",
                      GROVE_TEST_FLAG=str(flag), GROVE_TEST_GUARD=guard, GROVE_TEST_HANG_AT="5",
                      GROVE_TEST_HANG_MARK=str(mark))
    try:
        _wait_for(mark.is_file, proc)  # the fifth reward call (iteration 4) is stuck, iteration 3's checkpoint written
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in out, out[-2000:]
    stopped = _records(run)[-1]["step"]
    assert stopped < 8 and f"checkpoint saved at iteration {stopped}" in out, out[-2000:]
    monkeypatch.setitem(registry.DOMAINS, "guarded_toy", f"{__name__}:GuardedToy")
    monkeypatch.setenv("GROVE_TEST_REWARD", "hang")
    monkeypatch.setenv("GROVE_TEST_FLAG", str(flag))
    monkeypatch.setenv("GROVE_TEST_GUARD", guard)
    assert main(["train", "--resume", str(run)]) == 0
    cfg = tmp_path / "guarded_toy.yaml"
    assert main(["train", str(cfg), "--out", str(tmp_path / "ref")]) == 0
    assert _comparable(_records(run)) == _comparable(_records(tmp_path / "ref"))


def test_a_reward_thread_computes_with_the_callers_torch_state():
    seen = []

    def backend(x):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
                     threading.current_thread().daemon))
        return {"r": [0.0] * len(x)}

    g = guarded_reward(backend, "r", RewardGuardConfig(), len, log=lambda *_: None)
    with torch.no_grad():
        g([0])
    with torch.inference_mode():
        g([0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g([0])
    g([0])
    assert seen == [(False, False, False, True), (False, True, False, True), (True, False, True, True),
                    (True, False, False, True)]
