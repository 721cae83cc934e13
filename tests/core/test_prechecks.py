"""``shared_rl.prechecks``: the CLI's torch-free path checks and the domains' full validation are one list of checks.

For each typo'd path of the corpus (issue 64: a model path, a hub id offline, a robotics checkpoint, ...) the early
pass on the raw YAML dict (``precheck_paths``) and the full validation (``load_train_config`` + ``preflight``, which
the domains run through the same functions) raise the very same line, and ``grove train`` (``--dry-run`` and a real
run) exits 2 with it and writes nothing; in a fresh process that answer comes before torch or a domain package is
imported. Timings: ``grove bench cold-start`` (docs/bench/cold_start.md), not a timed test.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared_rl import prechecks
from shared_rl.cli import main
from shared_rl.config import apply_overrides, load_train_config, load_yaml
from shared_rl.errors import ConfigError
from shared_rl.prechecks import PATH_KEYS, precheck_paths

ROOT = Path(__file__).resolve().parents[2]
HAS_MUJOCO = importlib.util.find_spec("mujoco") is not None

# (config, overrides, text the one line must hold); MISSING is a folder under pytest's tmp_path that does not exist
CORPUS = {
    "llm model path typo": ("configs/llm/arith_grpo.yaml", ["llm.model=assets/llm-arith-tiy"],
                            "model path 'assets/llm-arith-tiy' does not exist (did you mean 'assets/llm-arith-tiny'?)"),
    "llm tokenizer path typo": ("configs/llm/arith_grpo.yaml", ["llm.tokenizer=assets/llm-arith-tiy"],
                                "(did you mean 'assets/llm-arith-tiny'?)"),
    "llm hub id typo offline": ("configs/llm/arith_grpo.yaml", ["llm.model=Qwen/Qwen2.5-0.5B-Instrct"],
                                "llm.model 'Qwen/Qwen2.5-0.5B-Instrct' is not in the local Hugging Face cache"),
    "llm missing local model": ("configs/llm/arith_grpo.yaml", ["llm.model=MISSING/model"], "does not exist"),
    "llm dataset path typo": ("configs/llm/arith_grpo.yaml",
                              ["llm.dataset.source=jsonl", "llm.dataset.path=TMP/data/train.jsnl"],
                              "train.jsnl' not found (llm.dataset.path) (did you mean 'TMP/data/train.jsonl'?)"),
    "llm eval dataset folder typo": ("configs/llm/arith_grpo.yaml",
                                     ["llm.dataset.source=jsonl", "llm.dataset.path=TMP/data/train.jsonl",
                                      "llm.dataset.eval_path=TMP/dat/eval.jsonl"],
                                     "not found (llm.dataset.eval_path) (did you mean 'TMP/data/eval.jsonl'?)"),
    "visgen model path typo": ("configs/visgen/shapes_grpo.yaml", ["visgen.model=assets/shapes-sd3-tny"],
                               "model path 'assets/shapes-sd3-tny' does not exist (did you mean "
                               "'assets/shapes-sd3-tiny'?)"),
    "visgen missing local model": ("configs/visgen/shapes_grpo.yaml", ["visgen.model=./no/such/pipeline"],
                                   "model path './no/such/pipeline' does not exist"),
    "visgen prompt file typo": ("configs/visgen/shapes_grpo.yaml",
                                ["visgen.task=file", "visgen.train_prompts=TMP/prompts/shapes_trian.txt"],
                                "shapes_trian.txt' does not exist (did you mean 'TMP/prompts/shapes_train.txt'?)"),
    "visgen eval prompt folder typo": ("configs/visgen/shapes_grpo.yaml",
                                       ["visgen.task=file", "visgen.train_prompts=TMP/prompts/shapes_train.txt",
                                        "visgen.eval_prompts=TMP/prompt/shapes_eval.txt"],
                                       "(did you mean 'TMP/prompts/shapes_eval.txt'?)"),
    "visgen hub id typo offline": ("configs/visgen/sd35_pickscore.yaml",
                                   ["device=cpu", "visgen.model=stabilityai/stable-diffusion-3.5-mediun"],
                                   "not in the local Hugging Face cache"),
    "robotics checkpoint typo": ("configs/robotics/metaworld_grpo.yaml",
                                 ["robotics.checkpoint=assets/metaworld-vla-tiy"],
                                 "robotics.checkpoint assets/metaworld-vla-tiy: not a VLA directory (no "
                                 "model.safetensors + config.json) (did you mean 'metaworld-vla-tiny'?)"),
    "robotics LIBERO clone missing": ("configs/robotics/libero_grpo.yaml", ["robotics.checkpoint=MISSING/bc5"],
                                      "make it with `grove train configs/robotics/libero_bc.yaml export_dir="),
    "robotics LeRobot policy hub id not cached": ("configs/robotics/pi05_libero_grpo_gpu.yaml", ["device=cpu"],
                                                  "robotics.policy.path: 'lerobot/pi05_libero' is neither a LeRobot "
                                                  "policy directory nor a hub id in the local cache (download it once "
                                                  "with `hf download lerobot/pi05_libero`)"),
    "robotics LeRobot local policy missing": ("configs/robotics/lerobot_smolvla_tiny_grpo.yaml",
                                              ["robotics.policy.path=MISSING/lerobot/smolvla-tiny"],
                                              "does not exist (a local path, not a hub id); make this recipe's tiny "
                                              "policy with `python scripts/robotics_lerobot_tiny.py --out "),
    "robotics LeRobot LIBERO policy missing": ("configs/robotics/libero_smolvla_tiny_grpo.yaml",
                                               ["robotics.policy.path=MISSING/lerobot/smolvla-tiny-libero"],
                                               "make this recipe's tiny policy with `python "
                                               "scripts/robotics_lerobot_tiny.py --env libero --out "),
    "robotics LeRobot policy without config.json": ("configs/robotics/lerobot_smolvla_tiny_grpo.yaml",
                                                    ["robotics.policy.path=EMPTY"],
                                                    "has no config.json; it must be a LeRobot policy directory"),
    "robotics LeRobot policy path typo": ("configs/robotics/lerobot_smolvla_tiny_grpo.yaml",
                                          ["robotics.policy.path=POLICIES/smolvla-tny"],
                                          "smolvla-tny does not exist (did you mean "),
    "robotics eval baseline typo": ("configs/robotics/libero_grpo.yaml",
                                    ["robotics.eval_baseline=assets/libero-vla-tiny-bc5/eval_episode.json"],
                                    "no such file (did you mean 'assets/libero-vla-tiny-bc5/eval_episodes.json'?)"),
    "robotics eval baseline clone typo": ("configs/robotics/libero_grpo.yaml",
                                          ["robotics.eval_baseline=assets/libero-vla-tiny-bc/eval_episodes.json"],
                                          "(did you mean 'assets/libero-vla-tiny-bc5/eval_episodes.json'?)"),
    "robotics eval baseline missing": ("configs/robotics/metaworld_grpo.yaml",
                                       ["robotics.eval_baseline=MISSING/eval_episodes.json"], "no such file"),
}

# Answered by the CLI's early pass only (both `grove train` modes), each with what the domain's own validation, run
# by the Python API, does instead.
EARLY_ONLY = {
    "llm hub id typo offline": "shared_rl/llm/domain.py looks no hub id up: the Python API's loader retries for ~a "
                               "minute, then fails",
}


def _case(name: str, tmp_path: Path) -> tuple[str, list[str], str]:
    config, overrides, expect = CORPUS[name]
    if name.startswith("robotics") and not HAS_MUJOCO:
        pytest.skip("the robotics domain's full validation needs mujoco")
    _folders(tmp_path)
    return config, [_paths(o, tmp_path) for o in overrides], _paths(expect, tmp_path)


def _folders(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir(exist_ok=True)
    (tmp_path / "policies" / "smolvla-tiny").mkdir(parents=True, exist_ok=True)
    (tmp_path / "policies" / "smolvla-tiny" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir(exist_ok=True)  # rows the llm's numeric_match scores
    for split in ("train", "eval"):
        (tmp_path / "data" / f"{split}.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 4)
    (tmp_path / "prompts").mkdir(exist_ok=True)  # prompts the shapes rewards score
    for split in ("train", "eval"):
        (tmp_path / "prompts" / f"shapes_{split}.txt").write_text("a red circle\na blue square\n")


def _paths(override: str, tmp_path: Path) -> str:
    """MISSING: a folder under pytest's tmp_path that does not exist; EMPTY: an empty one there; POLICIES: one that
    holds a LeRobot policy directory, smolvla-tiny; TMP: tmp_path (its prompts/ folder holds two prompt files)."""
    for mark, folder in (("MISSING", "missing"), ("EMPTY", "empty"), ("POLICIES", "policies")):
        override = override.replace(mark, str(tmp_path / folder))
    return override.replace("TMP/", f"{tmp_path}/")


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes' relative paths, as a user in the checkout types them
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id is answered from the cache alone, network or not


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_early_pass_and_the_full_validation_give_the_same_line(name, tmp_path, at_root, capsys):
    config, overrides, expect = _case(name, tmp_path)
    data = apply_overrides(load_yaml(config), overrides)
    with pytest.raises(ConfigError) as early:
        precheck_paths(data)
    from shared_rl.preflight import preflight

    assert expect in str(early.value)
    if name not in EARLY_ONLY:
        with pytest.raises(ConfigError) as full:  # the domains' validation alone, as the Python API runs it
            preflight(load_train_config(data))
        assert str(early.value) == str(full.value)
    for mode in (["--dry-run"], ["--out", str(tmp_path / "run")]):
        capsys.readouterr()
        assert main(["train", config, *overrides, *mode]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert err == [f"grove: error: {early.value}"], (mode, err)
    assert not (tmp_path / "run").exists()


def test_the_cli_answers_a_typod_path_before_importing_torch_or_a_domain(tmp_path):
    """In one fresh process, each corpus command exits 2 with its line while torch, transformers, diffusers and
    the domain packages are still unimported (``load_train_config`` would have imported them)."""
    _folders(tmp_path)
    argvs = [["train", config, *[_paths(o, tmp_path) for o in overrides], "--dry-run"]
             for config, overrides, _ in CORPUS.values()]
    code = ("import sys, io, contextlib; from shared_rl.cli import main; out = []\n"
            f"for argv in {argvs!r}:\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
            "        rc = main(argv)\n"
            "    heavy = [m for m in ('torch', 'transformers', 'diffusers', 'visgen', 'robotics', 'shared_rl.llm')"
            " if m in sys.modules]\n"
            "    out.append((rc, err.getvalue().count('grove: error: '), heavy))\n"
            "print(repr(out))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == repr([(2, 1, [])] * len(argvs)), proc.stdout[-2000:]


def test_what_the_early_pass_leaves_to_the_typed_validation(tmp_path):
    """Only non-empty strings of the declared keys are checked, with the context the full check would read: a
    wrong type, a section of the wrong shape, an unknown domain or another policy type raise nothing early."""
    bogus = str(tmp_path / "missing" / "vla")
    for data in ({"domain": "llm", "llm": {"model": 5}},
                 {"domain": "llm", "llm": {"model": ""}},
                 {"domain": "llm", "llm": "assets/llm-arith-tiy"},
                 {"domain": "third_party", "third_party": {"model": bogus}},
                 {"domain": "robotics", "robotics": {"checkpoint": bogus, "policy": {"type": "lerobot"}}},
                 {"domain": "robotics", "robotics": {"checkpoint": bogus, "policy": "tiny_vla"}},
                 {"domain": "robotics", "robotics": {"checkpoint": "held/MyPolicy"}},
                 {"domain": "visgen", "visgen": {"model": "held/MyPipeline"}}):
        precheck_paths(data)
    with pytest.raises(ConfigError, match="robotics.checkpoint"):  # the same key with the default policy type
        precheck_paths({"domain": "robotics", "robotics": {"checkpoint": bogus}})
    with pytest.raises(ConfigError, match="libero_bc.yaml"):  # env.kind read from the section, as the full check
        precheck_paths({"domain": "robotics", "robotics": {"checkpoint": bogus, "env": {"kind": "libero"}}})


def test_the_table_names_the_functions_the_domains_call_and_their_defaults():
    """``PATH_KEYS`` points at the functions the domains' validation calls (one definition each, not a copy), and
    the defaults it assumes for context keys are the config dataclasses' own."""
    from shared_rl.llm import model as llm_model
    from shared_rl.registry import resolve_domain

    calls = {}
    original = prechecks.resolve_llm_model
    try:  # the LLM's resolver looks the shared function up at call time, and so does the CLI's hub-id check
        prechecks.resolve_llm_model = lambda path: calls.setdefault("llm", path)
        assert llm_model.resolve_model_path("x/y/z") == "x/y/z" and calls == {"llm": "x/y/z"}
        calls.clear()
        assert prechecks.check_llm_model(str(ROOT)) == str(ROOT) and calls == {"llm": str(ROOT)}
    finally:
        prechecks.resolve_llm_model = original
    assert {k.key: k.check for k in PATH_KEYS["llm"]} == {"model": prechecks.check_llm_model,
                                                         "tokenizer": prechecks.check_llm_tokenizer,
                                                         "dataset.path": prechecks.check_llm_dataset,
                                                         "dataset.eval_path": prechecks.check_llm_eval_dataset}
    import visgen.pipelines.load
    import visgen.preflight

    assert visgen.preflight.check_visgen_model is prechecks.check_visgen_model
    assert visgen.pipelines.load.resolve_model_location is prechecks.resolve_visgen_model
    assert visgen.preflight.HELD_PREFIX == prechecks.HELD_PREFIX
    domains = ["llm", "visgen"]
    if HAS_MUJOCO:
        import robotics.config
        import robotics.held

        assert robotics.config.check_vla_checkpoint is prechecks.check_vla_checkpoint
        assert robotics.config.check_eval_baseline is prechecks.check_eval_baseline
        assert robotics.held.HELD_PREFIX == prechecks.HELD_PREFIX
        domains.append("robotics")
    for domain in domains:
        section = resolve_domain(domain).config_class()
        for entry in PATH_KEYS[domain]:
            node = section
            for part in entry.key.split("."):  # policy.path: a field of a nested section
                assert part in {f.name for f in dataclasses.fields(node)}, (domain, entry.key)
                node = getattr(node, part)
            for dotted, default in entry.context.values():
                value = section
                for part in dotted.split("."):
                    value = getattr(value, part)
                assert value == default, (domain, dotted, value, default)
