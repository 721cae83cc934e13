"""Pretraining (visgen.pretrain): one loop for the image and video tasks, parameterised by the task and its model
family. Small seeded runs of shapes (tiny SD3) and video_shapes (tiny Wan) reproduce the metrics the two separate
loops recorded before they became one (tests/visgen/fixtures/pretrain_small.json); the shipped recipes load with
their task's defaults; a setting of another task is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from shared_rl.config import ConfigError
from tests.golden.runs import compare
from tests.test_golden import CROSS_MACHINE_ABS, CROSS_MACHINE_REL, OUTCOME_REL
from visgen.pretrain import load_config, run

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "pretrain_small.json"

# the configs the fixture was recorded with (by the image loop of visgen/pretrain.py and the video loop of
# visgen/tasks/video_pretrain.py, before they were merged): seconds on one CPU thread each
SMALL = {"seed": 1, "log_every": 5, "dataset_size": 32, "vae": {"steps": 50, "batch_size": 4},
         "transformer": {"steps": 10, "batch_size": 4, "warmup_steps": 4},
         "eval": {"every": 5, "samples_per_prompt": 1, "num_inference_steps": 2, "guidance_scales": [2.0],
                  "batch_size": 64}}
CONFIGS = {
    "shapes": {**SMALL, "task": "shapes", "eval": {**SMALL["eval"], "final_samples_per_prompt": 1, "train_prompts": 2}},
    "video_shapes": {**SMALL, "task": "video_shapes", "caption_noise": 0.5, "vae": {"steps": 50, "batch_size": 2},
                     "model": {"num_layers": 1, "head_dim": 8, "text_dim": 16}},
}


@pytest.mark.parametrize("task", sorted(CONFIGS))
def test_small_pretraining_reproduces_the_recorded_metrics(tmp_path, task):
    torch.set_num_threads(1)
    result = run(json.loads(json.dumps(CONFIGS[task])), tmp_path, log=lambda *_: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    got = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
    expected = json.loads(FIXTURE.read_text())[task]
    bad = compare(expected, got, rel=CROSS_MACHINE_REL, abs_=CROSS_MACHINE_ABS, outcome_rel=OUTCOME_REL)
    assert not bad, "; ".join(bad[:8])
    # the asset records what sampling and RL reuse, and the task's split
    settings = json.loads((tmp_path / "pipeline" / "grove.json").read_text())
    assert settings["task"] == task and settings["split_seed"] == 0 and settings["step"] == 10
    assert settings["measured"]["loss/flow"] == round(result["loss/flow"], 4)
    snapshot = json.loads((tmp_path / "step_000005" / "grove.json").read_text())
    assert snapshot["step"] == 5 and snapshot["task"] == task
    assert (tmp_path / ("samples.gif" if task == "video_shapes" else "samples.png")).is_file()
    if task == "video_shapes":
        assert settings["num_frames"] == 9 and settings["fps"] == 8 and not any("eval/train" in k for k in result)
    else:
        assert settings["eval_fraction"] == 0.2 and any(k.startswith("eval/train_g2/") for k in result)


@pytest.mark.parametrize("name, task", [("shapes_pretrain", "shapes"), ("words_pretrain", "words"),
                                        ("video_pretrain", "video_shapes")])
def test_shipped_recipes_load_with_their_task_defaults(name, task):
    data = yaml.safe_load((REPO / "configs" / "visgen" / f"{name}.yaml").read_text())
    got, conf = load_config({k: v for k, v in data.items() if k not in ("kind", "domain")})
    assert got.name == task and type(conf) is got.pretrain_config
    if task == "video_shapes":  # the video recipe's eval section is partial: the task's defaults fill the rest
        assert conf.eval.train_prompts == 0 and conf.eval.final_samples_per_prompt is None and conf.frames == 9
    else:
        assert conf.eval.train_prompts == 64 and conf.eval.final_samples_per_prompt == 4


def test_task_defaults_and_one_line_errors():
    _, conf = load_config({"task": "video_shapes", "eval": {"every": 7}})
    assert (conf.dataset_size, conf.vae.steps, conf.transformer.warmup_steps) == (4096, 600, 100)
    assert (conf.eval.every, conf.eval.samples_per_prompt, conf.eval.train_prompts) == (7, 4, 0)
    _, conf = load_config({})
    assert (conf.dataset_size, conf.vae.steps, conf.eval.train_prompts, conf.eval_fraction) == (16384, 1500, 64, 0.2)
    with pytest.raises(ConfigError, match="pretrain.resolution is a setting of task words, not of task shapes"):
        load_config({"task": "shapes", "resolution": 64})
    with pytest.raises(ConfigError, match="pretrain.caption_noise is a setting of task video_shapes"):
        load_config({"task": "words", "caption_noise": 0.5})
    with pytest.raises(ConfigError, match="the file task has no embedded model to pretrain"):
        load_config({"task": "file"})
    with pytest.raises(ConfigError, match=r"pretrain.task: unknown task 'shape' \(did you mean 'shapes'\?\)"):
        load_config({"task": "shape"})
    with pytest.raises(ConfigError, match="lr_schedule: 'constant' or 'cosine'"):
        load_config({"transformer": {"lr_schedule": "linear"}})
    with pytest.raises(ConfigError, match="frames must be 4k\\+1"):
        load_config({"task": "video_shapes", "frames": 8})
    with pytest.raises(ConfigError, match="caption_noise must be in"):
        load_config({"task": "video_shapes", "caption_noise": 1.0})
