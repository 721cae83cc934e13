"""Video rewards: the moving-shapes task reward, per-frame image rewards aggregated over frames, temporal
consistency, motion magnitude, the VideoAlign-style model hook (a tiny stand-in from a local path), offloading."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from visgen.rewards import RewardInputError, get_reward
from visgen.rewards import base as reward_base
from visgen.rewards import video as vr
from visgen.tasks import video as vtask

from . import videoalign_standin


def clip_of(spec: vtask.ClipSpec, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(vtask.render_clip(spec, seed))


RIGHT = vtask.ClipSpec("red", "circle", "right")


def test_video_batches_are_checked():
    reward = get_reward("video_motion")
    with pytest.raises(RewardInputError, match=r"\[B, F, 3, H, W\].*video_frames"):
        reward(torch.rand(2, 3, 8, 8), ["a", "b"])
    with pytest.raises(RewardInputError, match="in \\[0, 1\\]"):
        reward(torch.rand(1, 3, 3, 8, 8) * 3, ["a"])
    with pytest.raises(RewardInputError, match="2 prompts for 1 videos"):
        reward(torch.rand(1, 3, 3, 8, 8), ["a", "b"])


def test_task_reward_scores_motion_direction_colour_and_smoothness():
    reward, strict = get_reward("video_shapes"), get_reward("video_shapes_strict")
    good = clip_of(RIGHT)
    wrong_way = clip_of(vtask.ClipSpec("red", "circle", "left"))
    wrong_colour = clip_of(vtask.ClipSpec("blue", "circle", "right"))
    still = good[:1].repeat(vtask.FRAMES, 1, 1, 1)
    jumpy = good[torch.tensor([0, 5, 1, 6, 2, 7, 3, 8, 4])]  # same frames, shuffled in time
    nan = good.clone()
    nan[3, 0, 0, 0] = float("nan")
    videos = torch.stack([good, wrong_way, wrong_colour, still, jumpy, nan])
    prompts = [RIGHT.prompt] * 6
    score = reward(videos, prompts)["video_shapes"]
    flags = strict(videos, prompts)["video_shapes_strict"]
    assert score[0] > 0.9 and flags[0] == 1.0
    assert score[1] < score[0] - 0.2 and flags[1] == 0  # moved the wrong way: the direction term is 0
    assert score[2] < 0.6 and flags[2] == 0  # no red, an extra blue
    assert score[3] == pytest.approx(0.75, abs=1e-6) and flags[3] == 0  # still: no direction term
    assert score[4] < score[0] - 0.1 and flags[4] == 0  # jerky
    assert torch.isnan(score[5]) and torch.isnan(flags[5])
    # metadata (ClipSpec.to_dict) wins over the text; a prompt outside the grammar is an error
    meta_score = reward(videos[:1], ["anything"], [RIGHT.to_dict()])["video_shapes"]
    assert meta_score[0] == score[0]
    with pytest.raises(RewardInputError, match="not a video_shapes prompt"):
        reward(videos[:1], ["a red circle dancing"])


def test_task_prompts_split_and_files(tmp_path):
    train, held_out = vtask.split_prompts(0)
    assert len(train) == 24 and len(held_out) == 8 and not set(train) & set(held_out)
    assert {s.direction for s in held_out} == set(vtask.DIRECTIONS)  # stratified by direction
    assert all(vtask.parse_prompt(s.prompt) == s for s in vtask.all_prompts())
    train_path, eval_path = vtask.write_prompt_files(tmp_path)
    from visgen.domain import read_prompt_file

    prompts, metas = read_prompt_file(str(eval_path))
    assert prompts == [s.prompt for s in held_out] and vtask.spec_of(prompts[0], metas[0]) == held_out[0]
    # the shipped prompt files are the split's
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "configs" / "visgen" / "prompts"
    assert (shipped / "video_shapes_train.jsonl").read_text() == train_path.read_text()
    assert (shipped / "video_shapes_eval.jsonl").read_text() == eval_path.read_text()


@pytest.fixture
def brightness_reward(monkeypatch):
    """An image reward (registered for this test): mean brightness of each image."""

    def build():
        def fn(images, prompts, metadata=None):
            reward_base.check_batch(images, prompts, metadata)
            return {"brightness": images.flatten(1).mean(1)}
        return fn

    monkeypatch.setitem(reward_base._REGISTRY, "brightness", build)
    return "brightness"


def test_frame_rewards_aggregate_over_frames(brightness_reward):
    levels = torch.tensor([0.1, 0.5, 0.3, 0.9, 0.2])
    video = levels.view(1, 5, 1, 1, 1).expand(1, 5, 3, 4, 4).clone()
    videos = torch.cat([video, video.flip(1)])
    for aggregate, stride, expected in (("mean", 1, levels.mean()), ("min", 1, 0.1), ("max", 1, 0.9),
                                        ("mean", 2, levels[::2].mean()), ("max", 2, 0.3)):
        reward = get_reward("video_frames", reward={"name": brightness_reward}, aggregate=aggregate,
                            frame_stride=stride, batch_frames=3)
        got = reward(videos, ["p", "q"])["video_frames"]
        if stride == 1:
            assert torch.allclose(got, torch.full((2,), float(expected))), (aggregate, got)
        else:  # the flipped video's every-other frames are [0.2, 0.3, 0.1]
            assert got[0] == pytest.approx(float(expected), abs=1e-6)
    named = get_reward("video_frames", reward="brightness", name="frame_brightness", first_frame=4)
    assert named(videos, ["p", "q"])["frame_brightness"].tolist() == pytest.approx([0.2, 0.1])
    with pytest.raises(RewardInputError, match="aggregate"):
        get_reward("video_frames", reward="brightness", aggregate="median")
    with pytest.raises(RewardInputError, match="past the clip"):
        get_reward("video_frames", reward="brightness", first_frame=9)(videos, ["p", "q"])


def test_frame_rewards_wrap_registered_image_rewards():
    """The shapes task's image checker per frame of a clip of one static shape."""
    from visgen.tasks import shapes

    spec = shapes.parse_prompt("a red circle")
    image = torch.from_numpy(shapes.render(spec, 0))
    video = image[None, None].repeat(1, 3, 1, 1, 1)
    reward = get_reward("video_frames", reward={"name": "shapes"}, output="shapes_strict", aggregate="min")
    assert reward(video, ["a red circle"])["video_frames"].item() == 1.0


def test_temporal_consistency_and_motion():
    good = clip_of(RIGHT)[None]
    still = good[:, :1].repeat(1, vtask.FRAMES, 1, 1, 1)
    noise = torch.rand(1, vtask.FRAMES, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    videos = torch.cat([still, good, noise])
    tc = get_reward("video_temporal_consistency")(videos, ["p"] * 3)["video_temporal_consistency"]
    assert tc[0] == pytest.approx(1.0, abs=1e-5) and tc[0] > tc[1] > tc[2]
    motion = get_reward("video_motion")(videos, ["p"] * 3)["video_motion"]
    assert motion[0] == 0 and 0 < motion[1] < motion[2]
    band = get_reward("video_motion", target=float(motion[1]))(videos, ["p"] * 3)["video_motion"]
    assert band[1] == pytest.approx(0.0, abs=1e-4) and band[0] < 0 and band[2] < 0


def test_temporal_consistency_with_a_local_backbone(tmp_path):
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    model = CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                           num_attention_heads=2, image_size=32, patch_size=8,
                                                           projection_dim=8))
    model.save_pretrained(tmp_path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    reward = get_reward("video_temporal_consistency", features="model", model=str(tmp_path), device="cpu")
    good = clip_of(RIGHT)[None]
    still = good[:, :1].repeat(1, vtask.FRAMES, 1, 1, 1)
    out = reward(torch.cat([still, good]), ["p", "p"])["video_temporal_consistency"]
    assert out[0] == pytest.approx(1.0, abs=1e-5) and out[1] < out[0]
    with pytest.raises(RewardInputError, match="cannot load"):
        get_reward("video_temporal_consistency", features="model", model=str(tmp_path / "missing"))


@pytest.mark.parametrize("input", ["frames", "paths"])
def test_videoalign_hook_loads_a_model_from_a_local_path(tmp_path, input):
    ckpt = videoalign_standin.save_checkpoint(tmp_path / "ckpt")
    reward = get_reward("videoalign", path=str(ckpt), entry="tests.visgen.videoalign_standin:TinyVideoReward",
                        input=input, device="cpu", dtype="float32", call_kwargs={"use_norm": True})
    good = clip_of(RIGHT)
    still = good[:1].repeat(vtask.FRAMES, 1, 1, 1)
    nan = good.clone()
    nan[0, 0, 0, 0] = float("nan")
    out = reward(torch.stack([good, still, nan]), [RIGHT.prompt] * 3)["videoalign"]
    assert torch.isnan(out[2]) and out[0] > out[1]  # MQ weighs motion: the moving clip scores higher
    vq = get_reward("videoalign", path=str(ckpt), entry="tests.visgen.videoalign_standin:TinyVideoReward",
                    input=input, output_key="VQ", name="vq", device="cpu")
    got = vq(torch.stack([good]), [RIGHT.prompt])["vq"]
    tol = 0.02 if input == "paths" else 1e-6  # MP4 (yuv420p) round trip
    assert got[0] == pytest.approx(float(vtask.to_uint8_frames(good).astype(np.float32).mean() / 255), abs=tol)


def test_videoalign_errors_are_one_line(tmp_path):
    with pytest.raises(RewardInputError, match="does not exist"):
        get_reward("videoalign", path=str(tmp_path / "nope"))
    ckpt = videoalign_standin.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(RewardInputError, match="does not import"):
        get_reward("videoalign", path=str(ckpt), entry="no_such_module:Model")
    with pytest.raises(RewardInputError, match="is not 'module:attribute'"):
        get_reward("videoalign", path=str(ckpt), entry="../inference.py:Model")
    bad_key = get_reward("videoalign", path=str(ckpt), entry="tests.visgen.videoalign_standin:TinyVideoReward",
                         input="frames", output_key="Aesthetics", device="cpu")
    with pytest.raises(RewardInputError, match="not 'Aesthetics'"):
        bad_key(clip_of(RIGHT)[None], ["p"])


class _Recorder(torch.nn.Module):
    """A module that records ``.to`` calls instead of moving (so a CUDA target can be tested on CPU)."""

    def __init__(self):
        super().__init__()
        self.moves: list[str] = []

    def to(self, device, *args, **kwargs):
        self.moves.append(str(torch.device(device)))
        return self


def test_offload_moves_models_only_around_calls():
    class Scorer:
        def __init__(self):
            self.model = _Recorder()
            self.device = torch.device("cpu")
            self.seen = None

        def __call__(self, images, prompts, metadata=None):
            self.seen = (self.model.moves[-1], str(self.device))
            return {"s": torch.zeros(len(prompts))}

    scorer = Scorer()
    wrapped = vr.OffloadedReward(scorer, device="cuda:0")
    assert scorer.model.moves == ["cpu"]  # parked on the CPU when wrapped
    wrapped(torch.zeros(1, 3, 4, 4), ["p"])
    assert scorer.seen == ("cuda:0", "cuda:0")  # on the device (and told so) during the call
    assert scorer.model.moves[-1] == "cpu" and str(scorer.device) == "cpu"  # and back
    inactive = vr.Offload(Scorer(), "cpu")
    assert not inactive.active
