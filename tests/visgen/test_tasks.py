"""The visgen task registry (visgen.tasks): one registered class per task gives a run its prompts, the reward that
measures it and its extra metrics, and checks the visgen section's prompt settings."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared_rl.config import ConfigError, from_dict
from visgen.domain import VisgenConfig
from visgen.tasks import TASKS, get_task, shapes, video, words
from visgen.tasks.files import read_prompt_file

REPO = Path(__file__).resolve().parents[2]


def test_registry_names_every_task():
    assert sorted(TASKS) == ["file", "shapes", "video_shapes", "words"]
    with pytest.raises(ConfigError, match=r"visgen.task: unknown task 'shape' \(did you mean 'shapes'\?\)"):
        from_dict(VisgenConfig, {"task": "shape"}, "visgen")


@pytest.mark.parametrize("name, module", [("shapes", shapes), ("words", words)])
def test_embedded_image_tasks_split_as_their_module(name, module):
    """The prompts come from the module's seeded split (the pretraining split); the config's split settings win
    over the asset's grove.json, which wins over the defaults."""
    task = get_task(name)
    cfg = VisgenConfig(task=name)
    train, held_out = module.split_prompts(0, 0.2)
    got = task.prompts(cfg, {})
    assert got.train == [s.prompt for s in train] and got.eval == [s.prompt for s in held_out]
    assert got.train_meta == [s.to_dict() for s in train]
    from_asset = task.prompts(cfg, {"split_seed": 5, "eval_fraction": 0.3})
    assert from_asset.eval == [s.prompt for s in module.split_prompts(5, 0.3)[1]] != got.eval
    cfg = VisgenConfig(task=name, split_seed=7, eval_fraction=0.25)
    assert task.prompts(cfg, {"split_seed": 5, "eval_fraction": 0.3}).eval == [
        s.prompt for s in module.split_prompts(7, 0.25)[1]]


def test_video_shapes_task_gives_the_shipped_prompt_files():
    """``task: video_shapes`` gives exactly the prompts and metadata of the recipes' prompt files (written from
    the same split by ``write_prompt_files``)."""
    got = get_task("video_shapes").prompts(VisgenConfig(task="video_shapes"), {})
    files = get_task("file").prompts(VisgenConfig(task="file",
                                                  train_prompts="configs/visgen/prompts/video_shapes_train.jsonl",
                                                  eval_prompts="configs/visgen/prompts/video_shapes_eval.jsonl"), {})
    assert got == files and len(got.eval) == 8


def test_task_checks_its_prompt_settings():
    with pytest.raises(ConfigError, match="train_prompts must name a prompt file when task is 'file'"):
        from_dict(VisgenConfig, {"task": "file"}, "visgen")
    with pytest.raises(ConfigError, match="train_prompts/eval_prompts are for task: file; the words task"):
        from_dict(VisgenConfig, {"task": "words", "eval_prompts": "x.txt"}, "visgen")
    with pytest.raises(ConfigError, match="eval_fraction is not a setting of the video_shapes task"):
        from_dict(VisgenConfig, {"task": "video_shapes", "eval_fraction": 0.3}, "visgen")


def test_prompt_file_task_reads_both_files(tmp_path):
    (tmp_path / "train.txt").write_text("a red circle\n\nblue square\n")
    cfg = VisgenConfig(task="file", train_prompts=str(tmp_path / "train.txt"))
    got = get_task("file").prompts(cfg, {})
    assert got.train == ["a red circle", "blue square"] and got.eval == [] and got.train_meta == [{}, {}]
    assert get_task("file").prompt_files(cfg) == [("train_prompts", str(tmp_path / "train.txt"))]
    assert read_prompt_file(str(tmp_path / "train.txt"))[0] == got.train


def test_eval_rewards_and_metrics_per_task():
    assert get_task("shapes").eval_reward == ("shapes", {})
    assert get_task("words").eval_reward == ("ocr", words.OCR_SETTINGS)
    assert get_task("video_shapes").eval_reward == ("video_shapes", {})
    assert get_task("file").eval_reward is None
    ocr = torch.tensor([1.0, 0.5, float("nan"), 1.0])
    assert get_task("words").eval_metrics({"ocr": ocr}) == {"eval/ocr_exact": pytest.approx(2 / 3)}
    assert get_task("words").eval_metrics({"shapes": ocr}) == {}
    assert get_task("shapes").eval_metrics({"ocr": ocr}) == {}


def test_pretraining_pieces_render_and_score_the_ground_truth():
    """Each embedded task scores its own ground-truth renders (near) perfectly through its pretraining hooks."""
    import numpy as np

    task = get_task("shapes")
    train, _ = task.split(task.pretrain_config())
    specs = train[:6]
    images = torch.from_numpy(np.stack([task.render(s, np.random.default_rng(i), None) for i, s in enumerate(specs)]))
    assert task.score(images, specs)["score"] == 1.0
    vtask = get_task("video_shapes")
    conf = vtask.pretrain_config()
    specs = vtask.split(conf)[0][:3]
    clips = torch.from_numpy(np.stack([vtask.render(s, np.random.default_rng(i), conf) for i, s in enumerate(specs)]))
    assert clips.shape == (3, video.FRAMES, 3, video.SIZE, video.SIZE)
    assert vtask.score(clips, specs)["strict"] == 1.0
