"""What a new user meets first: ``grove --version``, ``grove list``, ``grove train --dry-run`` (validates, prints the
resolved config and the batch arithmetic, writes nothing), the device check, ``curves.png`` with one axis per kind
of metric, and a log file without progress-bar carriage returns."""
import json
from pathlib import Path

import pytest
import yaml

from shared_rl import __version__
from shared_rl.cli import main
from shared_rl.config import dump_train_config, load_train_config
from shared_rl.metrics import curve_panels

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
    records = [{"step": 0, "eval/accuracy": 0.5, "eval/mean_length": 4.0},
               {"step": 1, "reward/mean": 0.4, "reward/std": 0.1, "reward/correct/mean": 0.4, "frac_zero_std": 0.25,
                "groups/drawn": 8, "groups/kept": 6, "completion/tokens": 5.5, "loss/policy": 0.3, "loss/kl": 1e-4,
                "approx_kl": 2e-5, "clip_frac": 0.01, "ratio/mean": 1.0, "ratio/max": 1.2, "grad_norm": 40.0,
                "entropy": 1.3, "resume/overrides": "iterations=5", "selection/success/push": 0.25,
                "selection/success/reach": 0.875, "selection/keys/push": 6, "select/val/push": 0.3,
                "select/best_iteration/push": 1.0}]
    panels = dict(curve_panels(records))
    assert panels == {
        "training reward": ["reward/correct/mean", "reward/mean"],
        "held-out evaluation": ["eval/accuracy"],
        "rollout success per task (stratum)": ["selection/success/push", "selection/success/reach"],
        "validation (per-task early stopping)": ["select/val/push"],
        "rates (fractions of groups / completions)": ["frac_zero_std", "groups/kept_fraction"],
        "lengths": ["completion/tokens", "eval/mean_length"],
        "losses": ["loss/policy"],
        "KL": ["approx_kl", "loss/kl"],
        "clip fraction": ["clip_frac"],
        "importance ratio": ["ratio/max", "ratio/mean"],
        "grad norm": ["grad_norm"],
        "entropy": ["entropy"],
    }


def test_a_log_file_gets_plain_lines_not_a_progress_bar(tmp_path, capsys):
    """stderr captured (as a log file is: not a terminal) with the bar switched on: one plain line per iteration."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**GOOD, "logging": {"progress": True}}))
    assert main(["train", str(cfg), "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "[1/3] reward/mean=" in err and "[2/3] reward/mean=" in err and "[3/3] " in err
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
