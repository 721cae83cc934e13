"""What a new user meets first: ``grove --version``, ``grove list`` (fast: no model library imported),
``grove train --dry-run`` (validates, prints the resolved config and the batch arithmetic, writes nothing), the
device check, ``curves.png`` with one axis per kind of quantity and without the series the run cannot move,
progress and ETA lines, a log file without progress-bar carriage returns, and SIGHUP (a closed terminal)
checkpointing like SIGTERM."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared_rl import __version__
from shared_rl.cli import main
from shared_rl.config import dump_train_config, load_train_config
from shared_rl.metrics import curve_panels
from shared_rl.toy import ToyDomain

from .test_resume import GOOD, tree_state

ROOT = Path(__file__).resolve().parents[2]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"grove {__version__}"


def test_list_names_every_registry(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for heading, names in [("domains", ["toy", "llm", "visgen", "robotics"]),
                           ("advantage estimators, flat", ["grpo", "rloo", "dr_grpo"]),
                           ("advantage estimators, tree", ["depth_zscore", "treerl"]),
                           ("policy losses", ["clipped", "gspo", "cispo", "sapo"]),
                           ("benchmarks", ["llm", "scale", "visgen-trees", "robotics-sim"]),
                           ("visgen: rollout methods", ["flow_grpo", "branch_grpo", "tree_grpo", "egrpo"]),
                           ("visgen: rewards", ["shapes", "shapes_soft", "pickscore"]),
                           ("llm: rewards", ["numeric_match", "exact_match"]),
                           ("recipes", ["configs/toy.yaml", "configs/visgen/shapes_grpo.yaml"])]:
        line = out.split(heading, 1)[1].split("\n", 2)[1]  # the names line under the heading
        assert all(n in line for n in names), (heading, line)


def test_dry_run_validates_prints_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    before = tree_state(tmp_path)
    assert main(["train", str(cfg), "--dry-run", "optim.minibatches_per_epoch=2"]) == 0
    out = capsys.readouterr().out
    assert tree_state(tmp_path) == before  # not even runs/
    want = dump_train_config(load_train_config({**GOOD, "optim": {**GOOD["optim"], "minibatches_per_epoch": 2}}))
    assert yaml.safe_load(out) == want  # the printout is the resolved config (the arithmetic is YAML comments)
    assert "per iteration: 2 groups x 4 samples = 8 sequences, in 1 rollout call(s)" in out
    assert "1 epoch(s) x 2 minibatch(es) = 2 optimizer step(s) per iteration, ~4 sequences each" in out
    assert "whole run: 3 iterations = 6 optimizer steps, 24 sequences" in out
    assert "device: cpu" in out and "run directory: runs/c-" in out


def test_auto_device_and_the_missing_gpu(monkeypatch):
    import torch

    from shared_rl.errors import ConfigError
    from shared_rl.preflight import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="device 'cuda:0' is not available: torch sees no CUDA GPU"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match=r"torch sees 2 GPU\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2")


def test_curves_give_each_kind_of_metric_its_own_axis():
    moving = [{"step": 0, "eval/accuracy": 0.5, "eval/mean_length": 4.0}]
    for i in (1, 2):
        moving.append({"step": i, "reward/mean": 0.4 + i / 10, "reward/std": 0.1, "reward/correct/mean": 0.4,
                       "frac_zero_std": 0.25 * i, "groups/drawn": 8, "groups/kept": 6 + i, "completion/tokens": 580.0 + i,
                       "completion/count": 128, "completion/truncated": 2.0 * i, "loss/policy": 0.3 / i,
                       "loss/kl": 1e-4 * i, "approx_kl": 2e-5 * i, "clip_frac": 0.01 * i, "ratio/mean": 1.0 + i / 100,
                       "ratio/max": 1.2 + i / 10, "grad_norm": 40.0 + i, "entropy": 1.3 - i / 10,
                       "resume/overrides": "iterations=5", "selection/success/push": 0.25 * i,
                       "selection/success/reach": 0.875, "selection/keys/push": 6, "select/val/push": 0.3,
                       "select/best_iteration/push": 1.0})
    panels = dict(curve_panels(moving))
    assert panels == {
        "training reward": ["reward/correct/mean", "reward/mean"],
        "held-out evaluation": ["eval/accuracy"],
        "rollout success per task (stratum)": ["selection/success/push", "selection/success/reach"],
        "validation (per-task early stopping)": ["select/val/push"],
        # counts become fractions: 2 and 4 truncated of 128 completions, 7 and 8 kept of 8 groups
        "rates (fraction of groups / completions)": ["completion/truncated_fraction", "frac_zero_std",
                                                     "groups/kept_fraction"],
        # tokens per completion beside the evaluation's mean length, not the batch's total of ~580 tokens
        "lengths (per completion / episode)": ["completion/mean_length", "eval/mean_length"],
        "losses": ["loss/policy"],
        "KL": ["approx_kl", "loss/kl"],
        "clip fraction": ["clip_frac"],
        "importance ratio": ["ratio/max", "ratio/mean"],
        "grad norm": ["grad_norm"],
        "entropy": ["entropy"],
    }


def test_curves_leave_out_what_the_run_cannot_move(tmp_path):
    """One optimizer step per batch and kl_coef 0: KL 0, clip fraction 0, ratio 1, a fixed-noise entropy. Those
    panels are left out and named under the figure; the training reward and the evaluation always stay."""
    from shared_rl.metrics import constant_series, plot_metrics

    records = [{"step": 0, "eval/strict": 0.5}] + [
        {"step": i, "reward/mean": 0.5 + 0.01 * i, "reward/shapes/mean": 0.2 + 0.01 * i, "loss/policy": -0.01 * i,
         "loss/kl": 0.0, "approx_kl": 0.0, "clip_frac": 0.0, "ratio/mean": 1.0, "ratio/max": 1.0 + 1e-8 * (i % 2),
         "entropy": 2.34, "grad_norm": 1.0 + i, "frac_zero_std": 0.0, "eval/strict": 0.5} for i in range(1, 13)]
    panels = dict(curve_panels(records))
    assert set(panels) == {"training reward", "held-out evaluation", "losses", "grad norm"}
    assert panels["held-out evaluation"] == ["eval/strict"]  # constant, but an unchanged evaluation is a result
    assert constant_series(records) == pytest.approx({"loss/kl": 0.0, "approx_kl": 0.0, "clip_frac": 0.0,
                                                      "ratio/mean": 1.0, "ratio/max": 1.0, "entropy": 2.34,
                                                      "frac_zero_std": 0.0})
    assert plot_metrics(records, tmp_path / "curves.png", "t") == tmp_path / "curves.png"
    from PIL import Image

    width, height = Image.open(tmp_path / "curves.png").size
    assert (width, height) == (int(4.6 * 3 * 90), int((3.1 * 2 + 0.35) * 90))  # 4 panels in 2 rows of 3, a footnote


def test_progress_reports_a_long_step_with_its_eta(monkeypatch):
    from shared_rl import metrics

    clock = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    lines: list[str] = []
    progress = metrics.Progress(lines.append, "evaluation", 200, "images", every=10)
    clock[0] = 105.0
    progress.update(50)  # 5 s in: a fast step stays quiet
    clock[0] = 122.0
    progress.update(100)
    clock[0] = 127.0
    progress.update(150)  # 5 s after the last line: quiet
    clock[0] = 144.0
    progress.update(200)
    assert lines == ["evaluation: 100/200 images, 22 s elapsed, ETA 22 s", "evaluation: 200/200 images, 44 s elapsed, done"]
    assert metrics.eta(30.0, 3, 10) == "10 s/it, ETA 1 min 10 s" and metrics.eta(0.0, 0, 10) == ""
    assert metrics.duration(3725) == "1 h 02 min"


def test_a_log_file_gets_plain_lines_not_a_progress_bar(tmp_path, capsys):
    """stderr captured (as a log file is: not a terminal) with the bar switched on: one plain line per iteration."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**GOOD, "logging": {"progress": True}}))
    assert main(["train", str(cfg), "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "[1/3] reward/mean=" in err and "[2/3] reward/mean=" in err and "[3/3] " in err
    # each line ends with the time per iteration and what is left; the first evaluation says it started
    assert re.search(r"\[1/3\] .* \| [0-9.e-]+ s/it, ETA \d+ s\n", err), err
    assert "evaluating at iteration 0..." in err
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


# ------------------------------------------------------------------------------------------------- fast commands
def test_list_and_the_cli_import_no_model_library():
    """`grove list` answers without diffusers, transformers, Meta-World or MuJoCo (their registries' names are
    text, checked against them in test_docs_match.py), and importing the CLI imports no torch."""
    code = ("import sys, io, contextlib; import shared_rl.cli as c; light = 'torch' not in sys.modules; "
            "contextlib.redirect_stdout(io.StringIO()).__enter__(); c.main(['list']); "
            "heavy = [m for m in ('diffusers', 'transformers', 'metaworld', 'mujoco') if m in sys.modules]; "
            "sys.stderr.write(repr((light, heavy)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "(True, [])", proc.stderr[-2000:]


@pytest.mark.parametrize("argv", [
    ["config", "show", "configs/llm/arith_grpo.yaml"],
    ["config", "show", "configs/visgen/shapes_grpo.yaml"],
    ["train", "configs/llm/arith_grpo.yaml", "llm.model=assets/llm-arith-tiy", "--dry-run"],
    ["train", "configs/visgen/shapes_grpo.yaml", "visgen.model=assets/shapes-sd3-tny", "--dry-run"],
], ids=["show-llm", "show-visgen", "typo-llm", "typo-visgen"])
def test_config_show_and_path_checks_import_no_model_library(argv):
    """`grove config show` and a typo'd model path answer before transformers / diffusers are imported (their
    import is seconds on 2 cores; docs/bench/cold_start.md times these commands)."""
    code = ("import sys, io, contextlib; import shared_rl.cli as c; "
            "out = io.StringIO(); contextlib.redirect_stdout(out).__enter__(); "
            f"rc = c.main({argv!r}); "
            "heavy = [m for m in ('diffusers', 'transformers') if m in sys.modules]; "
            "sys.stderr.write(repr((rc, heavy)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    expected_rc = 2 if "--dry-run" in argv else 0
    assert proc.stderr.strip().splitlines()[-1] == repr((expected_rc, [])), proc.stderr[-2000:]

def test_list_files_pretraining_configs_apart_from_recipes(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    recipes = out.split("recipes (grove train CONFIG", 1)[1].split("\n", 2)[1]
    supervised = out.split("supervised jobs' configs (grove pretrain CONFIG)", 1)[1].split("\n", 2)[1]
    assert "configs/visgen/shapes_grpo.yaml" in recipes and "shapes_pretrain" not in recipes
    assert "configs/visgen/shapes_pretrain.yaml" in supervised and "configs/llm/arith_sft.yaml" in supervised


# ------------------------------------------------------------------------------------------------- SIGHUP
class HangupToy(ToyDomain):
    """The toy bandit whose terminal closes (SIGHUP to this process) while iteration 1 samples."""

    def rollout(self, keys, group_size, generator, iteration):
        if iteration == 1:
            os.kill(os.getpid(), signal.SIGHUP)
        return super().rollout(keys, group_size, generator, iteration)


def test_sighup_checkpoints_and_exits_like_sigterm(tmp_path, monkeypatch, capsys):
    from shared_rl import registry

    monkeypatch.setitem(registry.DOMAINS, "hangup_toy", f"{__name__}:HangupToy")
    before = signal.getsignal(signal.SIGHUP)  # SIG_DFL, or SIG_IGN under nohup
    data = {**GOOD, "domain": "hangup_toy", "iterations": 6, "checkpoint": {"every": 0}, "hangup_toy": GOOD["toy"]}
    data.pop("toy")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run)]) == 0
    err = capsys.readouterr().err
    assert "SIGHUP: finishing this iteration, then checkpointing" in err
    assert f"SIGHUP: checkpoint saved at iteration 2; resume with: grove train --resume {run}" in err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    assert signal.getsignal(signal.SIGHUP) is before  # the run's handler is its own: the caller's is back


def test_sighup_points_a_vanished_terminal_at_dev_null():
    """After SIGHUP the terminal is gone: standard output and error that were that terminal are pointed at
    /dev/null (a write there would fail and lose the checkpoint); a file or pipe is left alone."""
    import pty

    from shared_rl.trainer import _detach_terminal

    saved = os.dup(2)
    master, slave = pty.openpty()
    try:
        os.dup2(slave, 2)
        assert os.isatty(2)
        _detach_terminal()
        assert not os.isatty(2) and os.stat(2).st_rdev == os.stat(os.devnull).st_rdev
        os.write(2, b"after the hangup")  # no EIO
    finally:
        os.dup2(saved, 2)
        for fd in (saved, master, slave):
            os.close(fd)


def test_a_terminal_sees_mid_run_evaluations_above_the_bar(tmp_path):
    """On a terminal (a pty) the progress bar is on, and each mid-run held-out evaluation is printed as a line above
    it (not only in metrics.jsonl)."""
    import pty

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**GOOD, "iterations": 4, "eval": {"every": 2, "at_start": False},
                                   "logging": {"progress": True}}))
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "shared_rl", "train", str(cfg), "--out", str(tmp_path / "run")],
                                stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, cwd=str(tmp_path),
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=120) == 0
    finally:
        os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert "\r" in out, "a terminal gets the bar"
    assert re.search(r"eval at iteration 2: eval/\S+=", out) and re.search(r"eval at iteration 4: eval/\S+=", out), out


def test_a_run_without_held_out_metrics_says_so_and_summarises_its_training_rewards(tmp_path, capsys, monkeypatch):
    """A domain whose evaluation returns nothing: "eval before training:" says there are no held-out metrics (not an
    empty line), and summary.txt reports the training rewards first -> last, labelled as such."""
    from shared_rl.toy import ToyDomain

    monkeypatch.setattr(ToyDomain, "evaluate", lambda self, iteration: {})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    assert main(["train", str(cfg), "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "eval before training: no held-out metrics" in err
    summary = (tmp_path / "run" / "summary.txt").read_text()
    assert summary.startswith("summary of the training rewards (no held-out evaluation) (step 1 -> 3)")
    assert "reward/mean: " in summary
