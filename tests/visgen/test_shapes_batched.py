"""The batched shapes checker (visgen.rewards.shapes_batched) against the numpy checker it replaces.

The oracle is the per-image numpy/scipy code: ``visgen.tasks.shapes.find_components`` / ``score_batch`` and
``visgen.rewards.shapes_soft.soft_score``. Components must match exactly (colour, area, centroid, shape class, order),
the moments to float rounding, ``shapes`` / ``shapes_strict`` exactly, ``shapes_soft`` to float32 rounding (in
practice bit for bit). Images: the task's renders (right and wrong prompts), blurred/noisy renders, random
"generated-like" images, images sampled from the tiny SD3 asset when it is present, and hand-made edge cases.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import ndimage

from visgen.rewards import get_reward
from visgen.rewards import shapes_batched as SB
from visgen.rewards.shapes_soft import soft_score
from visgen.tasks import shapes as S

ASSET = Path(__file__).resolve().parents[2] / "assets" / "shapes-sd3-tiny"


def assert_same(images: np.ndarray, specs: list, temperature: float = 0.05) -> SB.ShapesAnalysis:
    """Every component and every reward output of the batched checker equals the numpy checker's."""
    images = np.ascontiguousarray(images, dtype=np.float32)
    analysis = SB._analyse(torch.from_numpy(images))
    for b, image in enumerate(images):
        if not np.isfinite(image).all():
            continue
        ref, got = S.find_components(image), analysis.components(b)
        assert [(c.color, c.area, c.cx, c.cy, c.shape) for c in got] == \
            [(c.color, c.area, c.cx, c.cy, c.shape) for c in ref], f"image {b}"
        for r, g in zip(ref, got):
            assert g.threefold == pytest.approx(r.threefold, rel=1e-12, abs=1e-12), f"image {b}"
            assert g.fourfold == pytest.approx(r.fourfold, rel=1e-12, abs=1e-12), f"image {b}"
    score, strict = S.score_batch(images, specs)
    got_score, got_strict = SB.score(analysis, specs)
    np.testing.assert_array_equal(got_score.numpy(), score)
    np.testing.assert_array_equal(got_strict.numpy(), strict)
    soft = np.array([soft_score(i, s, temperature) if np.isfinite(i).all() else np.nan
                     for i, s in zip(images, specs)], dtype=np.float32)
    np.testing.assert_allclose(SB.soft_score(analysis, specs, temperature).numpy(), soft, rtol=0, atol=1e-6)
    return analysis


def test_renders_right_and_wrong_prompts():
    specs = S.all_prompts()
    images = S.render_batch(specs, seed=0)
    assert_same(images, specs)
    wrong = [specs[i] for i in np.random.default_rng(0).permutation(len(specs))]
    score, _ = S.score_batch(images, wrong)
    assert 0.1 < score.mean() < 0.6  # the shuffled prompts exercise failing checks of every kind
    assert_same(images, wrong, temperature=0.2)


def test_blurred_and_noisy_renders():
    rng = np.random.default_rng(1)
    specs = S.all_prompts()
    images = S.render_batch(specs, seed=1)
    blurred = ndimage.gaussian_filter(images, sigma=(0, 0, 0.8, 0.8)) + 0.05 * rng.standard_normal(images.shape)
    assert_same(np.clip(blurred, 0, 1), specs)
    noisy = np.clip(images + 0.3 * rng.standard_normal(images.shape), 0, 1)  # many small stray components
    analysis = assert_same(noisy, specs)
    assert (analysis.count.sum(1) > 2).any()


def test_generated_like_images():
    """Smooth random colour fields: blobs of every hue and brightness, touching, merging, filling the image."""
    rng = np.random.default_rng(2)
    specs = [S.all_prompts()[i] for i in rng.integers(0, 288, 96)]
    fields = ndimage.gaussian_filter(rng.random((96, 3, 32, 32)), sigma=(0, 0, 2.5, 2.5))
    lo, hi = fields.min(axis=(2, 3), keepdims=True), fields.max(axis=(2, 3), keepdims=True)
    images = (fields - lo) / (hi - lo)
    analysis = assert_same(images ** rng.uniform(1, 4, (96, 1, 1, 1)), specs)
    assert analysis.comp_area.max() > 100 and len(analysis.comp_area) > 96


@pytest.mark.skipif(not (ASSET / "model_index.json").is_file(), reason="needs assets/shapes-sd3-tiny")
def test_images_sampled_from_the_tiny_sd3_asset():
    """The demo's own images: SDE samples of the pretrained asset, 10 steps (as configs/visgen/shapes_grpo.yaml)."""
    from visgen import tiny
    from visgen.trajectory import sample

    pipe = tiny.load_shapes_asset(ASSET)
    specs = S.all_prompts()[::3][:64]
    traj = sample(pipe, [s.prompt for s in specs], 10, 1.0, torch.Generator().manual_seed(0), "sde", 0.7,
                  decode=True, max_sequence_length=1)
    analysis = assert_same(traj.images.float().numpy(), specs)
    assert 0 < float(SB.score(analysis, specs)[1].mean()) < 1  # some right, some wrong


def canvas(h: int = 32, w: int = 32) -> np.ndarray:
    return np.zeros((3, h, w), dtype=np.float32)


def edge_cases() -> list[np.ndarray]:
    cases = [canvas()]  # empty
    img = canvas()  # two red squares touching only at a corner: one component under 8-connectivity
    img[0, 4:10, 4:10] = 1
    img[0, 10:16, 10:16] = 1
    cases.append(img)
    img = canvas()  # a red and a green square sharing an edge: two components, each cut out of the other's region
    img[0, 8:16, 6:14] = 1
    img[1, 8:16, 14:22] = 1
    cases.append(img)
    img = canvas()  # a one-pixel-wide serpentine along the rows and one along the columns: long chains to merge
    img[2, 1:16:2, 1:31] = 1
    img[2, 2:16:4, 30] = img[2, 4:16:4, 1] = 1
    img[1, 18:31, 1:31:2] = 1
    img[1, 17, 2:31:4] = img[1, 31, 4:31:4] = 1
    cases.append(img)
    img = canvas()  # MIN_AREA: 5 pixels (noise) and 6 pixels (a component)
    img[0, 2, 2:7] = 1
    img[0, 20, 2:8] = 1
    cases.append(img)
    img = canvas()  # components at every border and corner
    img[1, :4, :4] = img[1, -4:, -4:] = img[2, :3, 12:20] = img[0, 14:20, -2:] = 1
    cases.append(img)
    img = canvas()  # the whole image one colour
    img[2] = 0.9
    cases.append(img)
    img = canvas()  # a checkerboard of one colour: only diagonal neighbours, one component
    img[0][(np.indices((32, 32)).sum(0) % 2) == 0] = 1
    cases.append(img)
    img = canvas()  # exact thresholds: value == FG_VALUE, saturation == FG_SATURATION, hue exactly 30 from a centre
    img[0, 2:6, 2:6] = np.float32(S.FG_VALUE)
    img[:, 2:6, 10:14] = np.array([1, 1 - np.float32(S.FG_SATURATION), 1 - np.float32(S.FG_SATURATION)],
                                  np.float32)[:, None, None]
    hues = [(1, 0.5, 0), (0.5, 1, 0), (0, 1, 0.5), (0, 0.5, 1), (0.5, 0, 1), (1, 0, 0.5)]  # 30, 90, ..., 330 degrees
    for i, rgb in enumerate(hues):
        y, x = 10 + 8 * (i // 3), 2 + 10 * (i % 3)
        img[:, y:y + 4, x:x + 6] = np.asarray(rgb, np.float32)[:, None, None]
    cases.append(img)
    img = canvas()  # two red squares of equal area: ties broken by raster order (the position check reads the first)
    img[0, 4:10, 20:26] = 1
    img[0, 20:26, 4:10] = 1
    cases.append(img)
    return cases


def test_edge_cases():
    cases = edge_cases()
    specs = [S.parse_prompt(p) for p in ["a red square on the right", "a red square", "a red square and a green "
             "square", "a blue circle", "a red circle at the top", "two green squares", "a blue square",
             "a red triangle", "a red circle on the left and a yellow circle on the right", "a red square on the "
             "right"]]
    assert len(specs) == len(cases)
    analysis = assert_same(np.stack(cases), specs)
    assert [len(analysis.components(b)) for b in (0, 1, 2, 3, 4, 6, 7)] == [0, 1, 2, 2, 1, 1, 1]
    # on the thresholds: both patches count; hue 30 / 330 is red, 90 yellow (ties go to the first colour), 150 green
    assert [c.color for c in analysis.components(8)] == ["red"] * 4 + ["yellow", "green", "blue", "blue"]
    # the 8-connectivity the checker uses: 4-connectivity would split the corner-touching squares
    assert ndimage.label(cases[1][0] > 0)[1] == 2 and S.find_components(cases[1])[0].area == 72
    assert S.check_image(cases[-1], specs[-1])["obj0/position"]  # the first (upper right) square is "on the right"


def test_nan_non_square_and_empty_batches():
    specs = S.all_prompts()[:4]
    images = S.render_batch(specs, seed=3)
    images[1, 0, 5, 5] = np.nan
    images[2, 2, 0, 0] = np.inf
    score, strict = get_reward("shapes")(torch.from_numpy(images), [s.prompt for s in specs]).values()
    assert torch.isnan(score[1:3]).all() and torch.isnan(strict[1:3]).all() and score[[0, 3]].eq(1).all()
    assert torch.isnan(get_reward("shapes_soft")(torch.from_numpy(images), [s.prompt for s in specs])["shapes_soft"][1:3]).all()
    assert_same(images, specs)
    wide = np.zeros((2, 3, 24, 40), dtype=np.float32)  # the checker's halves come from the width for both axes
    wide[0, 0, 2:10, 22:30] = 1
    wide[1, 1, 14:22, 3:11] = 1
    assert_same(wide, [S.parse_prompt("a red square on the right"), S.parse_prompt("a green square at the bottom")])
    out = get_reward("shapes")(torch.zeros(0, 3, 32, 32), [])
    assert out["shapes"].shape == (0,) and out["shapes_strict"].shape == (0,)
    assert get_reward("shapes_soft")(torch.zeros(0, 3, 32, 32), [])["shapes_soft"].shape == (0,)


def test_float32_pairwise_sums_are_numpys():
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 1100, 300)
    segments = [(rng.random(n) * rng.choice([1e-3, 1, 100], n)).astype(np.float32) for n in lengths]
    n = torch.from_numpy(lengths)
    got = SB.float32_pairwise_sums(torch.from_numpy(np.concatenate(segments)), torch.cumsum(n, 0) - n, n)
    np.testing.assert_array_equal(got.numpy(), np.array([s.sum() for s in segments], dtype=np.float32))
    naive = np.array([np.float32(sum(s.astype(np.float64))) for s in segments], np.float32)
    assert (naive != got.numpy()).any()  # numpy's float32 rounding is reproduced, not an exact sum


@pytest.mark.parametrize("name", ["shapes", "shapes_soft"])
def test_registered_rewards_are_batched_and_equal_to_the_reference(name):
    rng = np.random.default_rng(5)
    specs = S.all_prompts()[::5]
    images = np.clip(S.render_batch(specs, seed=5) + 0.1 * rng.standard_normal((len(specs), 3, 32, 32)), 0, 1)
    x = torch.from_numpy(images.astype(np.float32))
    prompts, metas = [s.prompt for s in specs], [s.to_dict() for s in specs]
    batched, reference = get_reward(name)(x, prompts, metas), get_reward(name, reference=True)(x, prompts)
    assert batched.keys() == reference.keys()
    for key in batched:
        assert batched[key].dtype == reference[key].dtype == torch.float32
        torch.testing.assert_close(batched[key], reference[key], rtol=0, atol=0 if key != "shapes_soft" else 1e-6)


def test_components_are_found_once_per_images_tensor_through_the_domain():
    """The domain scores every configured reward on the same tensor (each in a guard thread of its own): the
    analysis is computed once and shared; new or changed images are analysed again."""
    from shared_rl.rewards import RewardGuardConfig, guarded_reward
    from visgen.domain import VisgenDomain

    def guarded(name):
        return name, guarded_reward(get_reward(name), name, RewardGuardConfig(), lambda i, p, m: len(p))

    fake = SimpleNamespace(rewards=[guarded("shapes_soft"), guarded("shapes")])
    specs = S.all_prompts()[:8]
    images = torch.from_numpy(S.render_batch(specs, seed=6))
    prompts, metas = [s.prompt for s in specs], [s.to_dict() for s in specs]
    before = SB._CACHE.computed
    out = VisgenDomain.score(fake, images, prompts, metas)
    assert set(out) == {"shapes_soft", "shapes", "shapes_strict"} and out["shapes_strict"].eq(1).all()
    assert SB._CACHE.computed == before + 1
    VisgenDomain.score(fake, images.clone(), prompts, metas)
    assert SB._CACHE.computed == before + 2
    images[:, 0] = 0  # in place: the red objects vanish, the cached analysis must not be reused
    assert VisgenDomain.score(fake, images, prompts, metas)["shapes_strict"].lt(1).any()
    assert SB._CACHE.computed == before + 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_check_batch_fast_path_keeps_the_outcomes(dtype):
    """check_batch's one-pass min/max path accepts and refuses exactly what the masked finite-values check did:
    NaN and Inf are allowed, a value out of [0,1] (beyond 1e-3) is refused even beside a NaN."""
    from visgen.rewards.base import RewardInputError, check_batch

    prompts = ["p"] * 2
    ok = torch.rand(2, 3, 4, 4).to(dtype)
    check_batch(ok, prompts, None)
    check_batch(torch.zeros(0, 3, 4, 4, dtype=dtype), [], None)
    for bad_value, refused in ((float("nan"), False), (float("inf"), False), (-float("inf"), False),
                               (1.0005, False), (-0.0005, False), (1.01, True), (-0.5, True)):
        x = ok.clone()
        x[1, 2, 3, 3] = bad_value
        if refused:
            with pytest.raises(RewardInputError, match=r"in \[0,1\]"):
                check_batch(x, prompts, None)
            x[0, 0, 0, 0] = float("nan")  # a NaN elsewhere must not hide it
            with pytest.raises(RewardInputError, match=r"in \[0,1\]"):
                check_batch(x, prompts, None)
        else:
            check_batch(x, prompts, None)


def test_memoised_specs_and_rows_are_the_parsed_ones():
    """The reward's spec parsing and per-spec rows are memoised: same specs, malformed dicts still refused."""
    from visgen.rewards.base import RewardInputError
    from visgen.rewards.shapes import specs_of

    specs = S.all_prompts()[::7]
    metas = [s.to_dict() for s in specs]
    assert specs_of([s.prompt for s in specs], metas) == specs == specs_of([s.prompt for s in specs], metas)
    assert specs_of([s.prompt for s in specs], None) == specs
    objs = SB._objects(specs, torch.device("cpu"))
    assert objs.color[0, 0] == SB.COLOR_NAMES.index(specs[0].objects[0].color)
    with pytest.raises((ValueError, RewardInputError)):
        specs_of(["x"], [{"kind": "single", "objects": [{"color": "mauve", "shape": "circle"}]}])
    with pytest.raises((ValueError, RewardInputError)):
        specs_of(["x"], [{"kind": "single", "objects": [{"colour": "red", "shape": "circle"}]}])
