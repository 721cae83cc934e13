"""The command line: bad input (exit code 2, one actionable line, nothing written to the run directory), train /
resume / eval, ``grove config show`` and command groups resolved by name."""
import dataclasses
import importlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from shared_rl import registry
from shared_rl.cli import format_config, main
from shared_rl.config import TrainConfig, describe, dump_train_config, load_train_config, load_yaml

ROOT = Path(__file__).resolve().parents[2]

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
    assert (out / "curves.png").is_file() and (out / "summary.txt").is_file() and (out / "report.html").is_file()
    # an existing run directory is not overwritten without --resume
    assert main(["train", str(cfg), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    # resuming a finished run with more iterations continues from its checkpoint
    assert main(["train", "--resume", str(out), "iterations=5"]) == 0
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    capsys.readouterr()
    assert main(["eval", str(out), "--out", str(tmp_path / "ev")]) == 0  # never the checkout's runs/ from a test
    assert "eval/greedy_accuracy" in json.loads(capsys.readouterr().out)
    page = (tmp_path / "ev" / "report.html").read_text()  # the eval's own page: its metrics at iteration 5
    assert "grove eval: run at iteration 5" in page and "eval/greedy_accuracy" in page


# ------------------------------------------------------------------------------------------ grove config show
def test_config_show_prints_values_help_and_defaults(capsys):
    assert main(["config", "show", str(ROOT / "configs" / "toy.yaml"), "optim.weight_decay=0.01"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    lr = next(line for line in lines if line.strip().startswith("lr:"))
    assert lr.startswith("  lr: 0.1 ") and lr.endswith("# AdamW peak learning rate (after warm-up) (default: 0.0001)"), lr
    assert any(line.startswith("  weight_decay: 0.01 ") for line in lines), out  # the override is applied
    for section in ("optim:", "selection:", "eval:", "toy:"):
        assert section in lines, section
    # the output is the resolved config itself: it loads back to exactly what `grove train` would run
    want = dump_train_config(load_train_config({**load_yaml(ROOT / "configs" / "toy.yaml"), "optim": {
        **load_yaml(ROOT / "configs" / "toy.yaml")["optim"], "weight_decay": 0.01}}))
    assert yaml.safe_load(out) == want


@pytest.mark.parametrize("argv,expect", [
    (["config"], "config needs a sub-command"),
    (["config", "show", "missing.yaml"], "does not exist"),
    (["config", "show", str(ROOT / "configs" / "toy.yaml"), "optim.lr=-1"], "optim.lr must be > 0"),
    (["config", "show", str(ROOT / "configs" / "llm" / "arith_sft.yaml")], "kind: supervised"),
])
def test_config_show_bad_input(capsys, argv, expect):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err


def test_config_show_without_a_config_shows_the_default_that_train_runs(monkeypatch, capsys):
    """Bare `grove config show` resolves what bare `grove train` would run (and says which file), overrides too."""
    from shared_rl import cli

    monkeypatch.setattr(cli, "DEFAULT_CONFIG", ROOT / "configs" / "toy.yaml")  # the real default loads visgen
    assert main(["config", "show", "optim.lr=0.05"]) == 0
    out, err = capsys.readouterr()
    assert "no config given; running the default configs/toy.yaml" in err
    want = load_yaml(ROOT / "configs" / "toy.yaml")
    want["optim"]["lr"] = 0.05
    assert yaml.safe_load(out) == dump_train_config(load_train_config(want))


def test_pretrain_dry_run_checks_every_setting(tmp_path, monkeypatch, capsys):
    """`grove pretrain C --dry-run` checks the job's settings as its run does and prints them resolved."""
    monkeypatch.chdir(tmp_path)
    sft = ROOT / "configs" / "llm" / "arith_sft.yaml"
    assert main(["pretrain", str(sft), "--dry-run", "max_steps=7"]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    assert resolved["kind"] == "supervised" and resolved["max_steps"] == 7
    assert "weight_decay" in resolved and "every setting of the llm job checked" in out  # defaults filled in
    assert main(["pretrain", str(sft), "--dry-run", "max_stepz=7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'max_steps'" in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_field_without_help_gets_no_comment():
    @dataclass
    class Demo:
        documented: int = field(default=3, metadata={"help": "a documented knob"})
        bare: str = "x"

    cfg = TrainConfig(domain="demo", domain_config=Demo(documented=4))
    assert ("domain_config.bare", "x", "x", "") in describe(cfg)
    lines = format_config(cfg)
    i = lines.index("demo:")
    assert lines[i + 1].startswith("  documented: 4 ") and lines[i + 1].endswith("# a documented knob (default: 3)")
    assert lines[i + 2] == "  bare: x"


# Every setting of these sections carries help text (``field(..., metadata={"help": ...})``) for
# `grove config show`; a field without it fails here. Nested dataclasses are sections, listed themselves.
DOCUMENTED = [
    "shared_rl.config:EvalConfig", "shared_rl.config:LoggingConfig", "shared_rl.config:DistributedConfig",
    "shared_rl.config:CheckpointConfig", "shared_rl.config:SelectionConfig", "shared_rl.config:OptimConfig",
    "shared_rl.rewards:RewardGuardConfig", "shared_rl.toy:ToyConfig",
    "shared_rl.llm.domain:LLMConfig", "shared_rl.llm.domain:LLMEvalSettings", "shared_rl.llm.model:LLMLoraSettings",
    "shared_rl.llm.rewards:LLMRewardSpec", "shared_rl.llm.tree:LLMTreeSettings", "shared_rl.llm.tasks:DatasetSettings",
    "shared_rl.llm.pretrain:SFTConfig", "shared_rl.llm.pretrain:TinyLlamaArch",
    "robotics.domain:RoboticsConfig", "robotics.envs.vector:EnvConfig", "robotics.policies.vla:VLAConfig",
    "robotics.bc:BCConfig", "robotics.bc:CollectConfig",
    "visgen.domain:VisgenConfig", "visgen.domain:EvalSettings", "visgen.domain:RewardSpec",
    "visgen.policy:LoraSettings", "visgen.policy:EmaSettings",
    "visgen.plans:FlowGRPOPlan", "visgen.plans:DanceGRPOPlan", "visgen.plans:FlowGRPOFastPlan",
    "visgen.plans:MixGRPOPlan", "visgen.plans:ExplicitPlan",
    "visgen.methods.branch:BranchSettings", "visgen.methods.branch:BranchMixSettings",
    "visgen.methods.tree_grpo:TreeGRPOSettings", "visgen.methods.egrpo:EGRPOSettings",
]


def fields_without_help(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls)
            if not dataclasses.is_dataclass(hints[f.name]) and not str(f.metadata.get("help", "")).strip()]


@pytest.mark.parametrize("target", DOCUMENTED)
def test_every_setting_has_help_text(target):
    module, _, name = target.partition(":")
    if module.startswith("robotics"):
        pytest.importorskip("mujoco")
    cls = getattr(importlib.import_module(module), name)
    missing = fields_without_help(cls)
    assert not missing, f"{target}: add field(..., metadata={{'help': '...'}}) to {missing}"


def test_help_check_catches_a_bare_field():
    @dataclass
    class Half:
        ok: int = field(default=1, metadata={"help": "documented"})
        bare: int = 2

    assert fields_without_help(Half) == ["bare"]


# ---------------------------------------------------------------------------------------- command groups
def _demo_main(argv):
    print("demo got", argv)
    return 7


def test_command_groups_are_resolved_by_name(monkeypatch, capsys):
    monkeypatch.setitem(registry.COMMANDS, "demo-tools", f"{__name__}:_demo_main")
    assert main(["demo-tools", "run", "--fast"]) == 7
    assert "demo got ['run', '--fast']" in capsys.readouterr().out
    monkeypatch.setitem(registry.COMMANDS, "broken-tools", "no_such_module_xyz:main")
    assert main(["broken-tools"]) == 2
    assert "command group 'broken-tools' needs module 'no_such_module_xyz'" in capsys.readouterr().err
    assert registry.COMMANDS["robotics"] == "robotics.cli:main"


def test_output_dir_check_tolerates_a_parent_made_by_a_concurrent_run(tmp_path, monkeypatch):
    """Two runs (or evals) started together under one new parent: the writability probe of the second finds the
    folder the first just made; that is a creatable place, not an error (it was: 'cannot be created (File exists)')."""
    import pathlib

    from shared_rl.cli import check_output_dir

    real_mkdir = pathlib.Path.mkdir

    def raced(self, *args, **kwargs):  # the other process made the probe folder between the exists() check and here
        real_mkdir(self, *args, **kwargs)
        raise FileExistsError(17, "File exists")

    monkeypatch.setattr(pathlib.Path, "mkdir", raced)
    assert check_output_dir(tmp_path / "new_parent" / "run") == tmp_path / "new_parent" / "run"
