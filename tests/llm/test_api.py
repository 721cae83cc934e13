"""The Python API: ``shared_rl.llm.api.GRPOTrainer`` (TRL-shaped: the model, reward functions and dataset the
caller holds) and ``shared_rl.api.train`` run the same loop as ``grove train``."""
from __future__ import annotations

import pytest
import torch

from shared_rl.config import ConfigError
from shared_rl.llm.api import GRPOTrainer
from shared_rl.llm.model import build_tiny_llama
from shared_rl.llm.tasks import arith_problems
from shared_rl.llm.tokenizer import build_char_tokenizer

ARGS = {"seed": 0, "iterations": 2, "rollout": {"groups_per_iteration": 4, "group_size": 4},
        "optim": {"lr": 5e-3}, "eval": {"at_start": False}, "logging": {"progress": False},
        "llm": {"max_new_tokens": 4, "eval": {"num_prompts": 4}, "num_threads": 1}}


def _model():
    tok = build_char_tokenizer()
    return build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32, seed=0), tok


def _rows(n=16):
    return [{"prompt": p["prompt"], "answer": str(p["answer"])} for p in arith_problems("train", n, 1, seed=0)]


def test_grpo_trainer_trains_the_callers_model_with_a_python_reward():
    model, tok = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def short_answers(prompts, completions, answer, **_):  # TRL's signature; a dataset column by name
        seen.append((len(completions), answer[0]))
        return [1.0 if len(c) <= 2 else 0.0 for c in completions]

    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[short_answers, "numeric_match"],
                          reward_weights=[0.5, 1.0], train_dataset=_rows(), eval_dataset=_rows(4), args=ARGS,
                          log=lambda *_: None)
    hist = trainer.train()
    assert seen and seen[0][0] == 16 and isinstance(seen[0][1], str)  # 4 prompts x 4 completions, columns passed
    last = hist[-1]
    assert {"reward/short_answers/mean", "reward/numeric_match/mean"} <= set(last)
    assert trainer.config.advantage.weights == {} and trainer.trainer.reward_weights == {"short_answers": 0.5,
                                                                                       "numeric_match": 1.0}
    assert trainer.model is model  # no LoRA: the caller's object is the policy, trained in place
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_held_model_trains_exactly_as_the_same_model_loaded_from_its_path(tmp_path):
    model, tok = _model()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    runs = []
    for held in (True, False):
        m, t = _model()
        tr = GRPOTrainer(model=m if held else str(tmp_path / "m"), processing_class=t if held else None,
                         reward_funcs="numeric_match", train_dataset=_rows(), args=ARGS, log=lambda *_: None)
        runs.append([{k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"}
                     for r in tr.train()])
    assert runs[0] == runs[1]


def test_bad_inputs_are_one_line_errors():
    model, tok = _model()
    with pytest.raises(ConfigError, match="row 1 has no 'prompt' column"):
        GRPOTrainer(model=model, processing_class=tok, reward_funcs="numeric_match",
                    train_dataset=[{"prompt": "1+1=", "answer": "2"}, {"question": "x"}], args=ARGS)
    with pytest.raises(ConfigError, match="reward_weights has 1 values for 2 reward functions"):
        GRPOTrainer(model=model, processing_class=tok, reward_funcs=["numeric_match", "format"], reward_weights=[1.0],
                    train_dataset=_rows(), args=ARGS)
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        GRPOTrainer(model=model, processing_class=tok, reward_funcs="numeric_match", train_dataset=_rows(),
                    args={**ARGS, "optim": {"lrr": 1.0}})


def test_a_refused_config_leaves_no_run_dir_behind(tmp_path):
    """The rows are written to RUN/datasets before the config check reads them; a refusal removes what it made."""
    model, tok = _model()
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        GRPOTrainer(model=model, processing_class=tok, reward_funcs="numeric_match", train_dataset=_rows(),
                    args={**ARGS, "optim": {"lrr": 1.0}}, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there before is the caller's: only what the call made goes
    with pytest.raises(ConfigError):
        GRPOTrainer(model=model, processing_class=tok, reward_funcs="numeric_match", train_dataset=_rows(),
                    args={**ARGS, "optim": {"lrr": 1.0}}, run_dir=tmp_path / "kept")
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "datasets").exists()


def test_train_from_python_equals_the_cli(tmp_path):
    import json

    from shared_rl.api import train
    from shared_rl.cli import main

    over = ["iterations=3", "logging.progress=false"]
    trainer = train("configs/toy.yaml", overrides=over, run_dir=tmp_path / "py", log=lambda *_: None)
    assert main(["train", "configs/toy.yaml", "--out", str(tmp_path / "cli"), *over]) == 0

    def records(run):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/") and k != "samples_per_s"}
                for x in (run / "metrics.jsonl").read_text().splitlines()]

    assert records(tmp_path / "py") == records(tmp_path / "cli") and len(trainer.history) == 4
