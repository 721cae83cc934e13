"""The bad-input corpus: every user mistake grove knows of, for every command, exits with code 2, prints exactly
one line ``grove: error: ...`` naming what to change, and leaves the file system exactly as it was (every file and
folder under the test's directory, which is also the working directory, so a default ``runs/...`` would show).

Categories: the trainer's config (types, ranges, non-finite numbers, names, batch arithmetic; the corpus of
``tests/core/test_cli.py`` is run here too), the machine (devices, optional loggers), output paths (``--out``
empty, a file, under a file, not creatable), each domain's inputs (models, prompt files, datasets, rewards, reward
arguments, reward/prompt fit, ``advantage.weights`` names) found before a model loads, command lines of ``train``,
``pretrain``, ``eval``, ``bench``, ``config``, ``--resume`` (more in ``tests/core/test_resume.py``) and the
``grove robotics`` tools; inputs read defensively (issue 38): config files that are binary, not UTF-8, nested too
deep, alias bombs or too large; numbers the libraries cannot hold (seeds, int64, batch sizes); files a config names
that are not UTF-8 or not their format; user modules that do not import (missing, a syntax error, raising at import
time); sizes that do not fit in memory; a run directory that is read-only at resume.

Every config in the corpus (the trainer's and the domains') is given to both ``grove train --out DIR`` and
``grove train --dry-run``: the two run one list of checks (``shared_rl.preflight``) before any weights load, so each
must exit 2 with the very same line — except the few that only building the domain can find
(``FOUND_ONLY_BY_BUILDING``, each with its reason). Hub ids are answered offline (``HF_HUB_OFFLINE=1``), from the
local cache alone, so the corpus gives the same lines with network and without.
"""
import hashlib
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from shared_rl.cli import main

from .core.test_cli import BAD_CONFIGS, GOOD

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()


def _visgen(**domain):
    return {"domain": "visgen", "iterations": 1, "logging": {"progress": False}, "visgen": domain}


def _llm(**domain):
    return {"domain": "llm", "iterations": 1, "logging": {"progress": False}, "llm": domain}


def _robotics(**domain):
    return {"domain": "robotics", "iterations": 1, "logging": {"progress": False}, "robotics": domain}


def _toy(**over):
    data = json.loads(json.dumps(GOOD))
    for key, value in over.items():
        node = data
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return data


def _files(tmp):
    (tmp / "empty.jsonl").write_text("")
    (tmp / "broken.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    (tmp / "nocol.jsonl").write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    (tmp / "noanswer.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n"
                                                for i in range(4)))
    (tmp / "empty.txt").write_text("\n\n")
    (tmp / "cats.txt").write_text("a photo of a cat\na red circle\n")
    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "garbage.npz").write_text("not an archive\n")
    (tmp / "not_a_dataset").mkdir()
    (tmp / "not_a_dataset" / "notes.txt").write_text("hello\n")
    (tmp / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (tmp / "latin1.txt").write_bytes("a caf\xe9 on a red circle\n".encode("latin-1"))
    (tmp / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9 1+1=", "answer": "2"}\n'.encode("latin-1"))
    (tmp / "policies" / "smolvla-tiny").mkdir(parents=True)  # a LeRobot policy directory a typo is near
    (tmp / "policies" / "smolvla-tiny" / "config.json").write_text("{}")
    (tmp / "clone").mkdir()
    (tmp / "clone" / "eval_episodes.json").write_text("[]")
    (tmp / "damaged_model").mkdir()
    (tmp / "damaged_model" / "config.json").write_text("{not json")
    (tmp / "damaged_model" / "model.safetensors").write_bytes(b"\x00" * 16)
    (tmp / "rows_not_objects.jsonl").write_text('[1, 2]\n"x"\n')
    (tmp / "int_prompts.jsonl").write_text('{"prompt": 5, "answer": "2"}\n' * 10)
    (tmp / "empty_prompts.jsonl").write_text('{"prompt": "  ", "answer": "2"}\n' * 10)
    (tmp / "null_answers.jsonl").write_text('{"prompt": "1+1=", "answer": null}\n' * 10)
    (tmp / "numbers.json").write_text("[1, 2, 3]")
    (tmp / "truncated.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+')
    (tmp / "unterminated_quote.csv").write_text('prompt,answer\n"1+1=,2\n')
    (tmp / "huge_prompt.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "2"}) + "\n"
                                                   for p in ["1+1="] * 20 + ["9" * 1_000_000 + "+1="]))
    (tmp / "grove_bad_syntax_reward.py").write_text("def score(prompts, completions, examples):\n    return [1 +\n")
    (tmp / "grove_raising_reward.py").write_text("raise RuntimeError('no licence key in the environment')\n")
    return tmp


def tree_state(root: Path) -> dict[str, str]:
    """Every file (relative path -> sha256) and folder under ``root``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
            for p in sorted(root.rglob("*"))}


def assert_one_line_error(argv, expect, root: Path, capsys) -> str:
    """``grove argv`` exits 2 with one ``grove: error:`` line containing ``expect`` and changes nothing in ``root``;
    returns the line."""
    before = tree_state(root)
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    err = [line for line in captured.err.strip().splitlines() if line.strip()]
    assert code == 2, (code, err[-5:])
    assert len(err) == 1 and err[0].startswith("grove: error: ") and expect in err[0], err
    assert tree_state(root) == before
    return err[0]


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default run directories (runs/...) land here, where the snapshot sees them
    # no Hub: a hub id is answered from the local cache alone, the same on a machine with network and without
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return _files(tmp_path)


# ------------------------------------------------------------------------------------- domains' inputs
CASES = {
    # visgen
    "visgen missing model": (_visgen(model="no/such/pipeline"), "no/such/pipeline"),
    "visgen unknown reward": (_visgen(rewards=[{"name": "pickscorr"}]), "pickscorr"),
    "visgen unknown kernel": (_visgen(kernel="euler"), "visgen.kernel"),
    "visgen unknown method": (_visgen(method={"name": "nope"}), "nope"),
    "visgen bad resolution": (_visgen(resolution=30), "resolution"),
    "visgen resolution beyond the model's positional table": (_visgen(resolution=512),
                                                              "fits at most 64 x 64 pixels; use visgen.resolution <= 64"),
    "visgen missing prompt file": (_visgen(task="file", train_prompts="TMP/none.txt"), "none.txt"),
    "visgen empty prompt file": (_visgen(task="file", train_prompts="TMP/empty.txt", eval_prompts="TMP/empty.txt"),
                                 "empty.txt"),
    "visgen negative noise": (_visgen(noise_level=-0.5), "noise_level"),
    "visgen binary prompt file": (_visgen(task="file", train_prompts="TMP/binary.txt"),
                                  "binary.txt' is not text (a NUL byte at offset 0)"),
    "visgen prompt file not utf-8": (_visgen(task="file", train_prompts="TMP/latin1.txt"),
                                     "latin1.txt' is not UTF-8 text (byte 0xe9 at offset 5)"),
    "visgen prompt file typo": (_visgen(task="file", train_prompts="TMP/cat.txt"),
                                "prompt file 'TMP/cat.txt' does not exist (did you mean 'TMP/cats.txt'?)"),
    "visgen lora rank zero": (_visgen(lora={"rank": 0}), "rank"),
    "visgen prompts the reward cannot score": (_visgen(task="file", train_prompts="TMP/cats.txt"),
                                               "prompt 1 cannot be scored by reward 'shapes'"),
    "visgen unknown advantage weight": ({**_visgen(), "advantage": {"weights": {"shapes_strictt": 1.0}}},
                                        "did you mean 'shapes_strict'?"),
    "visgen reward argument it does not take": (_visgen(rewards=[{"name": "pickscore", "kwargs": {"modle": "x"}}]),
                                                "unexpected keyword argument 'modle'"),
    "visgen reward argument value": (_visgen(rewards=[{"name": "shapes_soft", "kwargs": {"temperature": -1}}]),
                                     "temperature must be > 0"),
    "visgen model path with a typo": (_visgen(model="assets/shapes-sd3-tny"),
                                      "model path 'assets/shapes-sd3-tny' does not exist (did you mean "
                                      "'assets/shapes-sd3-tiny'?)"),
    "visgen hub id not in the cache, offline": (_visgen(model="stabilityai/stable-diffusion-3.5-mediun"),
                                                "is not in the local Hugging Face cache"),
    "visgen hub id typo, did you mean": (_visgen(model="stabilityai/stable-diffusion-3.5-mediun"),
                                         "(did you mean 'stabilityai/stable-diffusion-3.5-medium'?)"),
    "visgen fsdp2 with an EMA": ({**_visgen(ema={"enabled": True}), "distributed": {"strategy": "fsdp2"}},
                                 "distributed.strategy: fsdp2 with visgen.ema.enabled"),
    # llm
    "llm missing model": (_llm(model="no/such/model"), "no/such/model"),
    "llm hub id not in the cache, offline": (_llm(model="Qwen/Qwen2.5-0.5B-Instrct"),
                                             "llm.model 'Qwen/Qwen2.5-0.5B-Instrct' is not in the local Hugging Face "
                                             "cache"),
    "llm unknown reward": (_llm(rewards=[{"name": "exact_matchh"}]), "exact_matchh"),
    # peft's name for the rank: every LoRA section of grove says rank, and the old key names the new one
    "llm lora r instead of rank": (_llm(lora={"enabled": True, "r": 16}),
                                   "config key 'llm.lora.r' was replaced: use llm.lora.rank"),
    "llm reward guard bad policy": (_llm(reward_guard={"on_failure": "ignore"}), "on_failure"),
    "visgen reward guard negative retries": (_visgen(reward_guard={"retries": -1}), "reward_guard.retries"),
    "llm empty dataset": (_llm(dataset={"source": "jsonl", "path": "TMP/empty.jsonl"}), "empty.jsonl"),
    "llm malformed jsonl": (_llm(dataset={"source": "jsonl", "path": "TMP/broken.jsonl"}), "broken.jsonl"),
    "llm missing column": (_llm(dataset={"source": "jsonl", "path": "TMP/nocol.jsonl"}), "prompt"),
    "llm missing dataset file": (_llm(dataset={"source": "jsonl", "path": "TMP/none.jsonl"}), "none.jsonl"),
    "llm zero new tokens": (_llm(max_new_tokens=0), "max_new_tokens"),
    "llm negative temperature": (_llm(temperature=-1.0), "temperature"),
    "llm custom reward that does not import": (_llm(rewards=[{"name": "no_such_module_xyz:score"}]),
                                               "module 'no_such_module_xyz' does not import"),
    "llm custom reward attribute missing": (_llm(rewards=[{"name": "json:no_such_function"}]),
                                            "has no 'no_such_function'"),
    "llm custom reward with a syntax error": (_llm(rewards=[{"name": "grove_bad_syntax_reward:score"}]),
                                              "grove_bad_syntax_reward.py:2: SyntaxError"),
    "llm custom reward raising at import": (_llm(rewards=[{"name": "grove_raising_reward:score"}]),
                                            "raised RuntimeError: no licence key in the environment"),
    "llm engine that does not import": (_llm(engine="no_such_engine_xyz:Engine"),
                                        "No module named 'no_such_engine_xyz'"),
    "llm custom reward named like a relative module": (_llm(rewards=[{"name": "..rewards:score"}]),
                                                       "'..rewards:score' is not 'module:attribute'"),
    "llm custom reward named like a file path": (_llm(rewards=[{"name": "../my_rewards.py:score"}]),
                                                 "file paths and relative modules are not imported"),
    "llm engine named like a path": (_llm(engine="./engines/fast.py:Engine"), "llm.engine: './engines/fast.py:Engine'"),
    "llm jsonl rows that are not objects": (_llm(dataset={"source": "jsonl", "path": "TMP/rows_not_objects.jsonl"}),
                                            "row 0 is a list, not an object with named columns"),
    "llm prompts that are numbers": (_llm(dataset={"source": "jsonl", "path": "TMP/int_prompts.jsonl"}),
                                     "the 'prompt' column holds int 5"),
    "llm empty prompts": (_llm(dataset={"source": "jsonl", "path": "TMP/empty_prompts.jsonl"}),
                          "the 'prompt' column is empty"),
    "llm null answers": (_llm(dataset={"source": "jsonl", "path": "TMP/null_answers.jsonl"}),
                         "scores column 'answer', which train row 0 leaves empty (null)"),
    "llm json list of numbers": (_llm(dataset={"source": "json", "path": "TMP/numbers.json"}),
                                 "row 0 is a int, not an object"),
    "llm truncated jsonl": (_llm(dataset={"source": "jsonl", "path": "TMP/truncated.jsonl"}),
                            "truncated.jsonl: line 2 is not valid JSON"),
    "llm csv with an unterminated quote": (_llm(dataset={"source": "csv", "path": "TMP/unterminated_quote.csv"}),
                                           "leaves empty (null)"),
    "llm model directory with a damaged config": (_llm(model="TMP/damaged_model"), "damaged_model"),
    "robotics checkpoint with a damaged config": (_robotics(checkpoint="TMP/damaged_model"), "damaged_model"),
    "llm model path with a typo": (_llm(model="assets/llm-arith-tiy"),
                                   "model path 'assets/llm-arith-tiy' does not exist (did you mean 'assets/llm-arith-tiny'?)"),
    "llm prompt beyond the model's context": (_llm(dataset={"source": "jsonl", "path": "TMP/huge_prompt.jsonl"}),
                                               "prompt is 1,000,004 tokens, more than 24 (the model's context 32 "
                                               "minus llm.max_new_tokens 8)"),
    "llm prompt beyond max_prompt_tokens": (_llm(dataset={"source": "jsonl", "path": "TMP/huge_prompt.jsonl",
                                                          "max_prompt_tokens": 3}),
                                            "more than 3 (llm.dataset.max_prompt_tokens)"),
    "llm dataset not utf-8": (_llm(dataset={"source": "jsonl", "path": "TMP/latin1.jsonl"}),
                              "latin1.jsonl' is not UTF-8 text (byte 0xe9 at offset"),
    "llm dataset the reward cannot score": (_llm(dataset={"source": "jsonl", "path": "TMP/noanswer.jsonl"}),
                                            "numeric_match scores column 'answer'"),
    "llm unknown accuracy reward": (_llm(eval={"accuracy_reward": "nope"}), "accuracy_reward 'nope'"),
    "llm unknown advantage weight": ({**_llm(), "advantage": {"weights": {"numeric": 1.0}}}, "numeric"),
    "llm reward factory argument": (_llm(rewards=[{"name": "numeric_match", "args": {"tolerence": 1}}]),
                                    "unexpected keyword argument 'tolerence'"),
    # robotics
    "robotics unknown task": (_robotics(env={"tasks": ["reach-v9"]}), "reach-v9"),
    "robotics missing checkpoint": (_robotics(checkpoint="no/such/vla"), "no/such/vla"),
    "robotics checkpoint with a typo": (_robotics(checkpoint="assets/metaworld-vla-tiy"),
                                        "(did you mean 'metaworld-vla-tiny'?)"),
    "robotics missing LIBERO clone": (_robotics(checkpoint="TMP/libero/vla-tiny-bc5",
                                                env={"kind": "libero", "tasks": ["libero_spatial/0"],
                                                     "cameras": ["image", "image2"], "horizon": 280}),
                                      "make it with `grove train configs/robotics/libero_bc.yaml export_dir="),
    "robotics missing eval baseline": (_robotics(eval_baseline="TMP/none/eval_episodes.json"),
                                       "robotics.eval_baseline TMP/none/eval_episodes.json: no such file"),
    "robotics image size mismatch": (_robotics(env={"image_size": 48}), "env gives"),
    "robotics action dim mismatch": (_robotics(checkpoint="", model={"action_dim": 3}), "action_dim"),
    "robotics unknown head mode": (_robotics(head_mode="gaussian"), "head_mode"),
    "robotics bad horizon": (_robotics(env={"horizon": 0}), "horizon"),
    "robotics unknown advantage weight": ({**_robotics(), "advantage": {"weights": {"dense": 0.5}}},
                                          "'dense'"),
    "robotics fsdp2 with per-task adapter steps": ({**_robotics(adapters={"rank": 4, "steps": "by_episodes"}),
                                                    "distributed": {"strategy": "fsdp2"}},
                                                   "distributed.strategy: fsdp2 with robotics.adapters.steps: "
                                                   "by_episodes"),
    "robotics LeRobot policy hub id not cached": (_robotics(policy={"type": "lerobot", "path": "lerobot/pi05_libero"},
                                                            head_mode="sde_one_step"),
                                                  "'lerobot/pi05_libero' is neither a LeRobot policy directory nor a "
                                                  "hub id in the local cache"),
    "robotics LeRobot policy dir without config.json": (_robotics(policy={"type": "lerobot",
                                                                       "path": "TMP/not_a_dataset"},
                                                               head_mode="sde_one_step"),
                                                     "not_a_dataset has no config.json; it must be a LeRobot policy "
                                                     "directory"),
    "robotics LeRobot policy path typo": (_robotics(policy={"type": "lerobot", "path": "TMP/policies/smolvla-tny"},
                                                    head_mode="sde_one_step"),
                                          "smolvla-tny does not exist (did you mean 'TMP/policies/smolvla-tiny'?)"),
    "robotics eval baseline typo": (_robotics(eval_baseline="TMP/clone/eval_episode.json"),
                                    "no such file (did you mean 'TMP/clone/eval_episodes.json'?)"),
    "robotics LeRobot policy path missing": (_robotics(policy={"type": "lerobot", "path": "TMP/lerobot/smolvla-tiny"},
                                                       head_mode="sde_one_step"),
                                             "does not exist (a local path, not a hub id); make this recipe's tiny "
                                             "policy with `python scripts/robotics_lerobot_tiny.py"),
    # supervised entry points
    "pretrain without domain": ({"kind": "supervised"}, "domain"),
    "pretrain unknown domain": ({"kind": "supervised", "domain": "audio"}, "audio"),
    "bc task_demos for a task not trained": ({"kind": "supervised", "domain": "robotics", "data": "TMP/none.npz",
                                              "env": {"tasks": ["reach-v3"]}, "collect": {"task_demos": {"push-v3": 160}}},
                                             "collect.task_demos names ['push-v3'], which are not in env.tasks"),
    "bc task_demos of zero": ({"kind": "supervised", "domain": "robotics", "data": "TMP/none.npz",
                               "env": {"tasks": ["reach-v3"]}, "collect": {"task_demos": {"reach-v3": 0}}},
                              "every task_demos count must be >= 1"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_domain_bad_input(tmp, capsys, monkeypatch, name):
    data, expect = CASES[name]
    monkeypatch.syspath_prepend(str(tmp))  # the user reward modules written by _files
    if name.startswith("robotics"):
        pytest.importorskip("mujoco")
    cfg = tmp / "bad.yaml"
    cfg.write_text(yaml.safe_dump(data).replace("TMP/", f"{tmp}/"))
    expect = expect.replace("TMP/", f"{tmp}/")
    line = assert_one_line_error(["train", str(cfg), "--out", str(tmp / "run")], expect, tmp, capsys)
    if data.get("kind") != "supervised" and name not in FOUND_ONLY_BY_BUILDING:
        # one list of checks (shared_rl.preflight) runs in both: --dry-run refuses it with the very same line
        assert assert_one_line_error(["train", str(cfg), "--dry-run"], expect, tmp, capsys) == line


# What only building the domain can find, so --dry-run (which builds nothing) says "valid": each with why.
FOUND_ONLY_BY_BUILDING = {
    # the engine class is imported when the llm domain is built; the llm domain's preflight does not import it
    "llm engine that does not import": "shared_rl/llm/domain.py",
    "llm engine named like a path": "shared_rl/llm/domain.py",
    "a domain size beyond memory": "the allocation itself is the check",
}


# ------------------------------------------------------------------------------------- the trainer's config
TRAINER_CASES = {
    **BAD_CONFIGS,
    "lr overflows to inf": (_toy(**{"optim.lr": "1e309"}), "optim.lr: expected a finite number"),
    "grad clip nan": (_toy(**{"optim.grad_clip": float("nan")}), "optim.grad_clip: expected a finite number"),
    "kl coef inf": (_toy(**{"loss.kl_coef": float("inf")}), "loss.kl_coef: expected a finite number"),
    "weight nan": (_toy(**{"advantage.weights": {"correct": float("nan")}}), "expected a finite number"),
    "minibatches beyond sequences": (_toy(**{"optim.minibatches_per_epoch": 1000}),
                                     "is more than the 2x4=8 sequences"),
    "negative eval cadence": (_toy(**{"eval.every": -5}), "eval.every must be >= 0"),
    "negative weight decay": (_toy(**{"optim.weight_decay": -0.1}), "optim.weight_decay must be >= 0"),
    "beta of one": (_toy(**{"optim.betas": [0.9, 1.0]}), "betas must be two numbers in [0, 1)"),
    "zero nonfinite budget": (_toy(max_nonfinite_steps=0), "max_nonfinite_steps must be > 0"),
    "unknown device": (_toy(device="tpu"), "device 'tpu' is not a device grove runs on"),
    "a TRL key": (_toy(learning_rate=1e-4), "'learning_rate': that is TRL's GRPOConfig name; grove's is optim.lr"),
    "another TRL key": (_toy(num_generations=8), "grove's is rollout.group_size"),
    "gpu index out of range": (_toy(device="cuda:99"), "device 'cuda:99' is not available"),
    "unknown advantage weight": (_toy(**{"advantage.weights": {"corect": 1.0}}), "did you mean 'correct'?"),
    "unknown band reward": (_toy(**{"selection.band_reward": "succes"}), "selection.band_reward 'succes'"),
    # numbers the libraries cannot hold, and sizes that cannot fit
    "seed beyond numpy": (_toy(seed=2**40), "seed=1099511627776 is not a seed numpy and torch accept"),
    "negative seed": (_toy(seed=-1), "seed=-1 is not a seed"),
    "integer beyond int64": (_toy(**{"toy.num_contexts": 10**30}), "toy.num_contexts=" + str(10**30) + " is too large"),
    "a terabyte batch": (_toy(**{"rollout.group_size": 2**31}), "sequences per iteration; at most 16,777,216"),
    "a domain size beyond memory": (_toy(**{"toy.num_contexts": 10**14}), "asks for more memory than this machine"),
    # the FSDP2 policies (shared_rl.sharding.check_settings): refused by --dry-run and the trainer alike
    "fsdp2 precision without fsdp2": (_toy(**{"distributed.mixed_precision": "bf16"}),
                                      "distributed.mixed_precision: FSDP2 settings, but distributed.strategy is "
                                      "replicate"),
}
if not HAS_CUDA:
    TRAINER_CASES["cuda without a gpu"] = (_toy(device="cuda"), "torch sees no CUDA GPU")
if importlib.util.find_spec("wandb") is None:
    TRAINER_CASES["wandb not installed"] = (_toy(**{"logging.wandb": True}), "needs the wandb package")


@pytest.mark.parametrize("name", sorted(TRAINER_CASES))
def test_trainer_config_bad_input(tmp, capsys, name):
    data, expect = TRAINER_CASES[name]
    cfg = tmp / "bad.yaml"
    cfg.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    line = assert_one_line_error(["train", str(cfg), "--out", str(tmp / "run")], expect, tmp, capsys)
    if name not in FOUND_ONLY_BY_BUILDING:  # --dry-run finds the same, in the same line, also writing nothing
        assert assert_one_line_error(["train", str(cfg), "--dry-run"], expect, tmp, capsys) == line


# ------------------------------------------------------------------------------------- command lines
def _unwritable() -> str:
    """A folder nobody may create (``/proc`` refuses new entries, also for root)."""
    return "/proc/grove-corpus/run" if Path("/proc/self").exists() else "/dev/null/run"


COMMAND_LINES = {
    # train
    "config missing": (["train", "missing.yaml"], "does not exist"),
    "override without =": (["train", "CFG", "optim.lr"], "must look like key.sub=value"),
    "unknown flag": (["train", "CFG", "--bogus-flag"], "unrecognized arguments"),
    "--out empty": (["train", "CFG", "--out", ""], "--out is empty"),
    "--out a file": (["train", "CFG", "--out", "TMP/a_file"], "is a file, not a directory"),
    "--out under a file": (["train", "CFG", "--out", "TMP/a_file/run"], "which is a file"),
    "--out not creatable": (["train", "CFG", "--out", "UNWRITABLE"], "choose another --out"),
    "--out not empty": (["train", "CFG", "--out", "TMP/not_a_dataset"], "is not empty"),
    "--dry-run out a file": (["train", "CFG", "--dry-run", "--out", "TMP/a_file"], "is a file"),
    # pretrain
    "pretrain without config": (["pretrain"], "pretrain needs a config"),
    "pretrain --out a file": (["pretrain", "SUPERVISED", "--out", "TMP/a_file"], "is a file"),
    # resume (more in tests/core/test_resume.py)
    "resume nowhere": (["train", "--resume", "nowhere"], "does not exist"),
    "resume not a run": (["train", "--resume", "TMP/not_a_dataset"], "no config.yaml there"),
    "resume with a config": (["train", "CFG", "--resume", "TMP/not_a_dataset"], "drop"),
    # eval
    "eval nowhere": (["eval", "nowhere"], "not a grove run directory"),
    "eval not a run": (["eval", "TMP/not_a_dataset"], "not a grove run directory"),
    # bench
    "bench unknown": (["bench", "nosuchbench"], "unknown benchmark"),
    "bench --out a file": (["bench", "llm", "--out", "TMP/a_file"], "is a file"),
    "bench --out empty": (["bench", "llm", "--out", ""], "--out is empty"),
    # config show
    "config without sub-command": (["config"], "config needs a sub-command"),
    # robotics command group (argument checks run before any simulation)
    "robotics unknown tool": (["robotics", "dance"], "unknown tool 'dance'"),
    "collect without --out": (["robotics", "collect"], "required: --out"),
    "collect unknown task": (["robotics", "collect", "--out", "TMP/d.npz", "--tasks", "reach-v9"],
                             "unknown Meta-World task(s) ['reach-v9']"),
    "collect --out exists": (["robotics", "collect", "--out", "TMP/garbage.npz"], "already exists"),
    "collect --out not npz": (["robotics", "collect", "--out", "TMP/demos"], "must end in .npz"),
    "collect --out under a file": (["robotics", "collect", "--out", "TMP/a_file/d.npz"], "which is a file"),
    "collect lerobot dir exists": (["robotics", "collect", "--out", "TMP/d.npz", "--lerobot", "TMP/not_a_dataset"],
                                   "exists"),
    "collect zero demos": (["robotics", "collect", "--out", "TMP/d.npz", "--demos-per-task", "0"],
                           "--demos-per-task must be >= 1"),
    "collect nothing kept": (["robotics", "collect", "--out", "TMP/d.npz", "--tasks", "reach-v3",
                              "--demos-per-task", "1", "--horizon", "1"], "kept no episode"),
    "collect task demos malformed": (["robotics", "collect", "--out", "TMP/d.npz", "--task-demos", "push-v3:160"],
                                     "'push-v3:160' must be TASK=N"),
    "collect task demos not collected": (["robotics", "collect", "--out", "TMP/d.npz", "--tasks", "reach-v3",
                                          "--task-demos", "push-v3=160"], "TASK in --tasks ['reach-v3']"),
    "collect bad number": (["robotics", "collect", "--out", "TMP/d.npz", "--horizon", "long"], "invalid int value"),
    "to-lerobot missing episodes": (["robotics", "to-lerobot", "TMP/none.npz", "TMP/lr"], "does not exist"),
    "to-lerobot garbage episodes": (["robotics", "to-lerobot", "TMP/garbage.npz", "TMP/lr"],
                                    "is not an episodes .npz"),
    "to-lerobot target exists": (["robotics", "to-lerobot", "TMP/garbage.npz", "TMP/not_a_dataset"], "exists"),
    "from-lerobot missing dataset": (["robotics", "from-lerobot", "TMP/none", "TMP/out.npz"], "does not exist"),
    "from-lerobot not a dataset": (["robotics", "from-lerobot", "TMP/not_a_dataset", "TMP/out.npz"],
                                   "is not a LeRobot dataset"),
    "from-lerobot output exists": (["robotics", "from-lerobot", "TMP/not_a_dataset", "TMP/garbage.npz"],
                                   "already exists"),
    "from-lerobot output not npz": (["robotics", "from-lerobot", "TMP/not_a_dataset", "TMP/out.txt"],
                                    "must end in .npz"),
    "from-lerobot --out exists": (["robotics", "from-lerobot", "TMP/not_a_dataset", "--out", "TMP/garbage.npz"],
                                  "already exists"),
    "from-lerobot without output": (["robotics", "from-lerobot", "TMP/not_a_dataset"],
                                    "the output is required: grove robotics from-lerobot INPUT OUT (or --out OUT)"),
    "from-lerobot output twice": (["robotics", "from-lerobot", "TMP/not_a_dataset", "TMP/a.npz", "--out", "TMP/b.npz"],
                                  "the output is given twice"),
    "to-lerobot --out exists": (["robotics", "to-lerobot", "TMP/garbage.npz", "--out", "TMP/not_a_dataset"], "exists"),
}


def _bench_must_not_run(out, quick):
    raise AssertionError("the benchmark ran although its --out was refused")


@pytest.mark.parametrize("name", sorted(COMMAND_LINES))
def test_bad_command_line(tmp, capsys, monkeypatch, name):
    argv, expect = COMMAND_LINES[name]
    if argv[0] == "bench":  # a refused --out must stop it before any work: a stub instead of minutes of benchmark
        from shared_rl import registry

        monkeypatch.setitem(registry.BENCHMARKS, "llm", f"{__name__}:_bench_must_not_run")
    if argv[0] == "robotics":
        pytest.importorskip("mujoco")
        if name.startswith("collect") and name not in ("collect without --out",):
            pytest.importorskip("metaworld")
    cfg = tmp / "good.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    supervised = Path(__file__).resolve().parents[1] / "configs" / "llm" / "arith_sft.yaml"
    subst = {"CFG": str(cfg), "SUPERVISED": str(supervised), "UNWRITABLE": _unwritable()}
    argv = [subst.get(a, a.replace("TMP/", f"{tmp}/")) for a in argv]
    assert_one_line_error(argv, expect, tmp, capsys)


def test_a_run_directory_given_twice_is_refused_and_left_alone(tmp, capsys):
    """A finished run: training into it again, resuming it with --out, and evaluating into it all refuse."""
    cfg = tmp / "good.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    assert main(["train", str(cfg), "--out", str(tmp / "run")]) == 0
    assert_one_line_error(["train", str(cfg), "--out", str(tmp / "run")], "is not empty", tmp, capsys)
    assert_one_line_error(["train", "--resume", str(tmp / "run"), "--out", str(tmp / "x"), "iterations=4"],
                          "drop --out", tmp, capsys)
    assert_one_line_error(["eval", str(tmp / "run"), "--out", str(tmp / "run" / "ev")], "inside the run", tmp, capsys)
    assert_one_line_error(["eval", str(tmp / "run"), "toy.num_contexts=5"], "does not fit this config", tmp, capsys)


# ------------------------------------------------------------------------------------------------- config files as bytes
CONFIG_BYTES = {
    "binary": (bytes(range(256)) * 8, "is not text (a NUL byte at offset 0)"),
    "not utf-8": ("domain: toy\nname: caf\xe9\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset 21)"),
    "flow nesting": (b"domain: toy\nx: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nests more than 64 levels"),
    "block nesting": (b"domain: toy\n" + b"".join(b"  " * i + b"k:\n" for i in range(200)) + b"  " * 200 + b"v: 1\n",
                      "nests more than 64 levels"),
    "alias bomb": (b"domain: toy\na: &a [x, x, x, x, x, x, x, x, x, x]\n"
                   + b"".join(f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n".encode()
                              for p, c in zip("abcdefgh", "bcdefghi")), "expands to more than 200,000 values"),
    "too large": (b"domain: toy\n" + b"# padding\n" * 120_000, "a config is at most 1,048,576 bytes"),
}


@pytest.mark.parametrize("name", sorted(CONFIG_BYTES))
def test_config_file_read_defensively(tmp, capsys, name):
    raw, expect = CONFIG_BYTES[name]
    cfg = tmp / "bad.yaml"
    cfg.write_bytes(raw)
    for argv in (["train", str(cfg), "--out", str(tmp / "run")], ["train", str(cfg), "--dry-run"],
                 ["config", "show", str(cfg)]):
        assert_one_line_error(argv, expect, tmp, capsys)


@pytest.mark.parametrize("strategy", ["replicate", "fsdp2"])
def test_fewer_rollout_chunks_than_processes_is_refused_before_a_worker_loads(tmp, capsys, monkeypatch, strategy):
    """Under ``torchrun`` / ``accelerate launch`` (WORLD_SIZE set in every worker): 2 groups in one call on 2
    processes would leave one sampling nothing. Both modes refuse it in one line, before the process group starts."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = tmp / "bad.yaml"
    cfg.write_text(yaml.safe_dump(_toy(**{"rollout.groups_per_iteration": 2, "rollout.groups_per_call": 2,
                                          "distributed.strategy": strategy})))
    expect = ("fsdp2 needs a rollout chunk on each of the 2 processes, but 2 groups in calls of 2 make 1 chunks"
              if strategy == "fsdp2" else
              "2 processes but 2 groups in calls of 2 make 1 rollout chunk(s): 1 process(es) would sample nothing")
    expect += "; set rollout.groups_per_call <= 1"
    line = assert_one_line_error(["train", str(cfg), "--out", str(tmp / "run")], expect, tmp, capsys)
    assert assert_one_line_error(["train", str(cfg), "--dry-run"], expect, tmp, capsys) == line


@pytest.mark.parametrize("name", ["llm hub id not in the cache, offline", "llm model path with a typo",
                                  "visgen model path with a typo", "robotics checkpoint with a typo"])
def test_python_train_refuses_a_bad_path_with_the_cli_s_line(tmp, capsys, name):
    """``shared_rl.api.train`` of a config runs the CLI's path checks first: the same line, at once (an uncached hub
    id from Python used to spend a minute in the loader's retries and end in a traceback), nothing left behind."""
    from shared_rl.api import train
    from shared_rl.errors import ConfigError

    if name.startswith("robotics"):
        pytest.importorskip("mujoco")
    data, expect = CASES[name]
    cfg = tmp / "bad.yaml"
    cfg.write_text(yaml.safe_dump(data))
    line = assert_one_line_error(["train", str(cfg), "--dry-run"], expect, tmp, capsys)
    with pytest.raises(ConfigError) as refused:
        train(str(cfg), run_dir=tmp / "py-run", log=lambda *_: None)
    assert f"grove: error: {refused.value}" == line
    assert not (tmp / "py-run").exists()


def test_python_overrides_take_the_cli_s_dotted_keys(tmp, capsys):
    """``overrides={"llm.model": ...}`` names the setting ``llm.model=...`` names on the command line (it was refused
    as an unknown top-level key, with a list of keys that does not hold the domain's section)."""
    from shared_rl.api import train
    from shared_rl.errors import ConfigError

    line = assert_one_line_error(["train", str(ROOT / "configs/llm/arith_grpo.yaml"),
                                  "llm.model=Qwen/Qwen2.5-0.5B-Instrct", "--dry-run"], "Qwen/Qwen2.5-0.5B-Instrct",
                                 tmp, capsys)
    with pytest.raises(ConfigError) as refused:
        train(str(ROOT / "configs/llm/arith_grpo.yaml"), overrides={"llm.model": "Qwen/Qwen2.5-0.5B-Instrct"},
              log=lambda *_: None)
    assert f"grove: error: {refused.value}" == line


def test_fsdp2_on_a_domain_with_nothing_to_shard_is_refused_by_both_modes(tmp, capsys, monkeypatch):
    """A domain that lists no modules to shard refuses ``distributed.strategy: fsdp2`` in every layout, so
    ``--dry-run`` before ``torchrun`` says it, in the real run's line (not after the launch, once per worker)."""
    from shared_rl.domain import DomainBase
    from shared_rl.toy import ToyDomain

    monkeypatch.setattr(ToyDomain, "fsdp_modules", DomainBase.fsdp_modules)
    cfg = tmp / "bad.yaml"
    cfg.write_text(yaml.safe_dump(_toy(**{"distributed.strategy": "fsdp2"})))
    expect = "distributed.strategy: fsdp2 is not supported by domain 'toy' (it lists no modules to shard)"
    line = assert_one_line_error(["train", str(cfg), "--out", str(tmp / "run")], expect, tmp, capsys)
    assert assert_one_line_error(["train", str(cfg), "--dry-run"], expect, tmp, capsys) == line


def test_an_override_nested_too_deep_is_refused(tmp, capsys):
    cfg = tmp / "good.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    assert_one_line_error(["train", str(cfg), "--dry-run", "toy.num_contexts=" + "[" * 5000 + "]" * 5000],
                          "override 'toy.num_contexts' nests more than 64 levels", tmp, capsys)


def test_a_read_only_run_directory_at_resume(tmp, capsys):
    """A real read-only mount (root and mount needed; skipped elsewhere): --resume exits 2 with one line and
    changes nothing."""
    cfg = tmp / "good.yaml"
    cfg.write_text(yaml.safe_dump({**GOOD, "checkpoint": {"every": 1}}))
    run = tmp / "run"
    assert main(["train", str(cfg), "--out", str(run)]) == 0
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "--bind", str(run), str(run)], capture_output=True,
                                                   timeout=30).returncode == 0
    if not mounted:
        pytest.skip("needs root and bind mounts")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(run)], capture_output=True, timeout=30).returncode:
            pytest.skip("cannot remount read-only")
        assert_one_line_error(["train", "--resume", str(run), "iterations=4"], "Read-only file system", tmp, capsys)
    finally:
        subprocess.run(["umount", str(run)], capture_output=True, timeout=30)


def test_files_and_dataset_folders_a_config_names_are_read_by_their_suffix(tmp):
    """A LeRobot-like dataset folder: its parquet files must carry parquet's marks and its JSON must be UTF-8;
    npz and safetensors files their own marks. The line names the setting and the file."""
    from dataclasses import dataclass

    from shared_rl.errors import ConfigError
    from shared_rl.preflight import check_named_files

    @dataclass
    class Settings:
        domain: str
        data: str

    ds = tmp / "lerobot"
    (ds / "meta").mkdir(parents=True)
    (ds / "data").mkdir()
    (ds / "meta" / "info.json").write_text('{"fps": 10}')
    (ds / "data" / "episode_0.parquet").write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")
    check_named_files(Settings("x", str(ds)))  # well formed: nothing to say
    (ds / "data" / "episode_1.parquet").write_bytes(b"<html>404 not found</html>")
    with pytest.raises(ConfigError, match=r"^data '.*episode_1.parquet' is not a valid parquet file"):
        check_named_files(Settings("x", str(ds)))
    (ds / "data" / "episode_1.parquet").unlink()
    (ds / "meta" / "info.json").write_bytes('{"robot": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"info.json' is not UTF-8 text \(byte 0xe9 at offset 14\)"):
        check_named_files(Settings("x", str(ds)))
    for name in ("demos.npz", "model.safetensors"):
        (tmp / name).write_bytes(b"\xff" * 64)
        with pytest.raises(ConfigError, match=rf"{name}' is not a valid {name.split('.')[1]} file"):
            check_named_files(Settings("x", str(tmp / name)))


@pytest.mark.parametrize("override, expect", [
    ("visgenn.x=1", "did you mean 'visgen'? (a 'visgen' section needs domain: visgen; this config's domain is "
                    "'toy', its settings go under toy:)"),
    ("visgen.x=1", "this config's domain is 'toy', so its own settings go under toy:"),
    ("domain_config.x=1", "the domain's own settings go under its name: toy:"),
    ("tooy.x=1", "did you mean 'toy'?"),
    ("zzzz=1", "known keys: advantage, checkpoint, device, distributed, domain, eval, iterations, kind, logging, "
               "loss, max_nonfinite_steps, optim, resume, rollout, seed, selection, toy"),
])
def test_an_unknown_top_level_key_names_the_domains_section(tmp, capsys, override, expect):
    """The hint of an unknown top-level key lists the keys a user writes: the domain's own section by its name
    (``toy:``), never the attribute ``domain_config`` (which is refused as a key, not silently dropped); another
    domain's section name says which ``domain:`` it needs."""
    for command in (["config", "show"], ["train"]):
        argv = command + [str(ROOT / "configs/toy.yaml"), override] + (["--dry-run"] if command == ["train"] else [])
        line = assert_one_line_error(argv, expect, tmp, capsys)
        assert "domain_config" not in line.replace("'domain_config'", "")
