"""Reward registry: shapes (score + strict), DDPO JPEG (in)compressibility, error and NaN handling."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from visgen.rewards import RewardInputError, available_rewards, get_reward, register
from visgen.rewards.compressibility import jpeg_size_kb
from visgen.tasks import shapes as S


def test_registry_lists_builtins_and_rejects_unknown_and_duplicates():
    assert {"shapes", "jpeg_compressibility", "jpeg_incompressibility"} <= set(available_rewards())
    with pytest.raises(RewardInputError, match="unknown reward 'nope'.*shapes"):
        get_reward("nope")

    @register("test_constant_reward")
    def build(value=1.0):
        return lambda images, prompts, metadata=None: {"const": torch.full((len(prompts),), value)}

    assert get_reward("test_constant_reward", value=2.0)(torch.zeros(2, 3, 4, 4), ["a", "b"])["const"].tolist() == [2, 2]
    with pytest.raises(RewardInputError, match="already registered"):
        register("test_constant_reward")(lambda: None)


def test_shapes_reward_ground_truth_vs_wrong_and_metadata():
    specs = [S.parse_prompt(p) for p in ("a red circle on the left and a blue square on the right", "two green triangles")]
    truth = torch.from_numpy(S.render_batch(specs, seed=0))
    wrong = torch.from_numpy(S.render_batch(
        [S.parse_prompt("a blue circle on the left and a red square on the right"), S.parse_prompt("a green triangle")], seed=0))
    reward = get_reward("shapes")
    prompts = [s.prompt for s in specs]
    good = reward(truth, prompts, [s.to_dict() for s in specs])
    bad = reward(wrong, prompts, None)  # specs parsed from the prompt text
    assert set(good) == {"shapes", "shapes_strict"}
    assert good["shapes"].shape == (2,) and good["shapes"].dtype == torch.float32
    assert good["shapes"].tolist() == [1.0, 1.0] and good["shapes_strict"].tolist() == [1.0, 1.0]
    assert bad["shapes_strict"].tolist() == [0.0, 0.0]
    # colours swapped: colour+count right, shape and position wrong for both objects -> 5/9; one triangle -> 3/4
    assert bad["shapes"].tolist() == pytest.approx([5 / 9, 3 / 4])


def test_shapes_reward_errors_and_nan():
    reward = get_reward("shapes")
    with pytest.raises(RewardInputError, match="not a shapes-task prompt"):
        reward(torch.zeros(1, 3, 32, 32), ["a photo of a cat"])
    with pytest.raises(RewardInputError, match=r"\[B,3,H,W\]"):
        reward(torch.zeros(3, 32, 32), ["a red circle"])
    with pytest.raises(RewardInputError, match=r"in \[0,1\]"):
        reward(torch.full((1, 3, 32, 32), -1.0), ["a red circle"])
    with pytest.raises(RewardInputError, match="2 prompts for 1 images"):
        reward(torch.zeros(1, 3, 32, 32), ["a red circle"] * 2)
    images = torch.zeros(2, 3, 32, 32)
    images[0, 0, 0, 0] = float("nan")
    out = reward(images, ["a red circle"] * 2)
    assert torch.isnan(out["shapes"][0]) and torch.isnan(out["shapes_strict"][0])
    assert out["shapes"][1].item() == pytest.approx(1 / 4)  # blank image: only "no stray objects" holds


def test_jpeg_rewards_order_flat_vs_noise():
    generator = torch.Generator().manual_seed(0)
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand((1, 3, 64, 64), generator=generator)
    images = torch.cat([flat, noise])
    small = get_reward("jpeg_compressibility")(images, ["", ""])["jpeg_compressibility"]
    large = get_reward("jpeg_incompressibility")(images, ["", ""])["jpeg_incompressibility"]
    assert small[0] > small[1]  # the flat image is more compressible
    assert large[1] > large[0]
    assert torch.equal(small, -large)
    # The value is the JPEG size in kB at quality 95, computed the same way by hand.
    pixels = (noise[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    assert large[1].item() == pytest.approx(buffer.tell() / 1000.0)
    assert jpeg_size_kb(np.zeros((8, 8, 3), np.uint8)) < 1.0
    nan_images = images.clone()
    nan_images[1, 0, 0, 0] = float("nan")
    out = get_reward("jpeg_incompressibility")(nan_images, ["", ""])["jpeg_incompressibility"]
    assert torch.isfinite(out[0]) and torch.isnan(out[1])
