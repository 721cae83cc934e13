"""``visgen.api.FlowGRPOTrainer``: the diffusers pipeline, reward functions and prompts the caller holds."""
from __future__ import annotations

import pytest
import torch

from shared_rl.config import ConfigError
from visgen.api import FlowGRPOTrainer

ARGS = {"seed": 0, "iterations": 1, "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "optim": {"lr": 1e-2}, "eval": {"at_start": False}, "logging": {"progress": False},
        "visgen": {"num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8}, "num_threads": 1,
                   "eval": {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}}}
PROMPTS = ["a red circle", "a blue square", "a green triangle", "two red circles"]


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


def _pipe(tiny_dir):
    from visgen.domain import load_pipeline

    return load_pipeline(str(tiny_dir), torch.float32)[0]


def _records(hist):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"} for r in hist]


def test_the_callers_pipeline_trains_as_the_same_pipeline_loaded_from_its_path(tiny_dir):
    import json

    # a held pipeline has no grove.json beside it: the sampling settings a saved asset records come through args
    saved = json.loads((tiny_dir / "grove.json").read_text())
    args = {**ARGS, "visgen": {**ARGS["visgen"], "max_sequence_length": saved["max_sequence_length"],
                               "resolution": saved["resolution"]}}
    pipe = _pipe(tiny_dir)
    held = FlowGRPOTrainer(pipeline=pipe, reward_funcs=brightness, prompts=PROMPTS, eval_prompts=PROMPTS[:2],
                           args=args, log=lambda *_: None)
    hist = held.train()
    assert held.pipeline is pipe  # trained in place: its transformer carries the trained LoRA
    assert any("lora" in n and p.abs().sum() > 0 for n, p in pipe.transformer.named_parameters() if "lora_B" in n)
    assert "reward/brightness/mean" in hist[-1] and "eval/brightness" in " ".join(hist[-1])
    by_path = FlowGRPOTrainer(pipeline=str(tiny_dir), reward_funcs=brightness, prompts=PROMPTS,
                              eval_prompts=PROMPTS[:2], args=args, log=lambda *_: None).train()
    assert _records(hist) == _records(by_path)


def test_bad_inputs_are_one_line_errors(tiny_dir):
    with pytest.raises(ConfigError, match="prompts item 1 is a mapping without a 'prompt' key"):
        FlowGRPOTrainer(pipeline=str(tiny_dir), reward_funcs=brightness, prompts=["a", {"text": "b"}], args=ARGS)
    with pytest.raises(ConfigError, match="weigh its outputs"):
        FlowGRPOTrainer(pipeline=str(tiny_dir), reward_funcs=["shapes", brightness], reward_weights=[0.5, 1.0],
                        prompts=PROMPTS, args=ARGS)


def test_a_refused_config_leaves_nothing_behind(tiny_dir, tmp_path):
    """The prompts are written into RUN/prompts before the config check reads them: a refusal removes what it made
    (RUN itself when it was new) and keeps what was there before."""
    bad = {**ARGS, "optim": {"lr": -1.0}}
    with pytest.raises(ConfigError, match="optim.lr"):
        FlowGRPOTrainer(pipeline=str(tiny_dir), reward_funcs=brightness, prompts=PROMPTS, args=bad,
                        run_dir=tmp_path / "new" / "run", log=lambda *_: None)
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match="optim.lr"):
        FlowGRPOTrainer(pipeline=str(tiny_dir), reward_funcs=brightness, prompts=PROMPTS, args=bad,
                        run_dir=tmp_path / "old", log=lambda *_: None)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["notes.txt"]
