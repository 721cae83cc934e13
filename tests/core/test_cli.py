"""Bad input: exit code 2, one actionable line, nothing written to the run directory."""
import json

import pytest
import yaml

from shared_rl.cli import main

GOOD = {
    "domain": "toy", "iterations": 2, "logging": {"progress": False},
    "rollout": {"groups_per_iteration": 2, "group_size": 4}, "toy": {"num_contexts": 4},
}


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


BAD_CONFIGS = {
    "unknown top key": ({**GOOD, "iteratons": 3}, "did you mean 'iterations'"),
    "unknown nested key": ({**GOOD, "optim": {"learning_rate": 1e-3}}, "optim.learning_rate"),
    "wrong type int": ({**GOOD, "iterations": "many"}, "expected an integer"),
    "wrong type float": ({**GOOD, "optim": {"lr": "fast"}}, "expected a number"),
    "wrong type bool": ({**GOOD, "logging": {"progress": "yes please"}}, "expected true/false"),
    "negative lr": ({**GOOD, "optim": {"lr": -1.0}}, "optim.lr must be > 0"),
    "group of one": ({**GOOD, "rollout": {"groups_per_iteration": 2, "group_size": 1}}, "group_size must be >= 2"),
    "bad estimator": ({**GOOD, "advantage": {"estimator": "grpoo"}}, "did you mean 'grpo'"),
    "bad aggregation": ({**GOOD, "loss": {"aggregation": "mean"}}, "is not one of"),
    "bad band": ({**GOOD, "selection": {"filter": "band", "band": [0.9, 0.1]}}, "band must be [lo, hi]"),
    "dual clip <= 1": ({**GOOD, "loss": {"dual_clip": 0.5}}, "dual_clip must be > 1"),
    "unknown domain": ({**GOOD, "domain": "vizgen"}, "unknown domain 'vizgen'"),
    "bad domain key": ({**GOOD, "toy": {"num_context": 3}}, "toy.num_context"),
    "bad domain value": ({**GOOD, "toy": {"num_actions": 0}}, "toy.num_actions must be >= 1"),
    "section not mapping": ({**GOOD, "optim": 3}, "expected a mapping"),
    "minibatches do not divide": ({**GOOD, "optim": {"minibatches_per_epoch": 3, "micro_batch_size": 1}},
                                  "must divide"),
    "betas wrong length": ({**GOOD, "optim": {"betas": [0.9]}}, "betas must be two numbers"),
    "empty file": ("", "is empty"),
    "not yaml": ("a: [1, 2\nb: :", "not valid YAML"),
    "yaml list": ("- 1\n- 2\n", "must be a mapping"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, name):
    data, expect = BAD_CONFIGS[name]
    cfg = write(tmp_path, data)
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grove: error: ") and expect in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("argv,expect", [
    (["train", "missing.yaml"], "does not exist"),
    (["train", "CFG", "optim.lr"], "must look like key.sub=value"),
    (["train", "--resume", "nowhere"], "does not exist"),
    (["bench", "nosuchbench"], "unknown benchmark"),
    (["eval", "nowhere"], "not a grove run directory"),
    (["pretrain"], "pretrain needs a config"),
    (["train", "CFG", "--bogus-flag"], "unrecognized arguments"),
])
def test_bad_command_lines(tmp_path, capsys, argv, expect):
    cfg = write(tmp_path, GOOD)
    argv = [str(cfg) if a == "CFG" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[-1], err


def test_train_override_resume_and_eval(tmp_path, capsys):
    cfg = write(tmp_path, GOOD)
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "iterations=3", "optim.lr=0.05"]) == 0
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["iterations"] == 3 and resolved["optim"]["lr"] == 0.05 and resolved["toy"]["num_contexts"] == 4
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for key in ("reward/mean", "loss/policy", "ratio/mean", "clip_frac", "grad_norm", "lr", "nfe/rollout",
                "nfe/train", "time/rollout", "time/train", "samples_per_s", "groups/drawn", "frac_zero_std"):
        assert key in records[1], key
    assert (out / "curves.png").is_file() and (out / "summary.txt").is_file()
    # an existing run directory is not overwritten without --resume
    assert main(["train", str(cfg), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    # resuming a finished run with more iterations continues from its checkpoint
    assert main(["train", "--resume", str(out), "iterations=5"]) == 0
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    capsys.readouterr()
    assert main(["eval", str(out)]) == 0
    assert "eval/greedy_accuracy" in json.loads(capsys.readouterr().out)
