"""The shapes task: prompt grammar, deterministic split, renderer, and the analytic checker on hand-made cases."""
import numpy as np
import pytest
from scipy import ndimage

from visgen.tasks import shapes as S


def spec_of(prompt):
    return S.parse_prompt(prompt)


def test_prompt_space_and_round_trip():
    specs = S.all_prompts()
    assert len(specs) == 60 + 12 + 216
    assert len({s.prompt for s in specs}) == len(specs)
    for spec in specs:
        assert S.parse_prompt(spec.prompt) == spec
        assert S.PromptSpec.from_dict(spec.to_dict()) == spec
    assert set(" ".join(s.prompt for s in specs).split()) == set(S.vocabulary())
    with pytest.raises(ValueError):
        S.parse_prompt("a purple hexagon")
    with pytest.raises(ValueError):
        S.parse_prompt("two red circle")


def test_split_is_deterministic_disjoint_and_complete():
    train, held_out = S.split_prompts(seed=0, eval_fraction=0.2)
    train2, held_out2 = S.split_prompts(seed=0, eval_fraction=0.2)
    assert [s.prompt for s in train] == [s.prompt for s in train2]
    assert [s.prompt for s in held_out] == [s.prompt for s in held_out2]
    assert not {s.prompt for s in train} & {s.prompt for s in held_out}
    assert len(train) + len(held_out) == len(S.all_prompts())
    assert {s.kind for s in held_out} == {"single", "count", "pair"}
    _, other = S.split_prompts(seed=1)
    assert {s.prompt for s in other} != {s.prompt for s in held_out}


def test_ground_truth_scores_perfectly():
    specs = S.all_prompts()
    images = S.render_batch(specs, seed=0)
    assert images.shape == (len(specs), 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    score, strict = S.score_batch(images, specs)
    assert score.mean() == pytest.approx(1.0)
    assert strict.mean() == pytest.approx(1.0)


def test_ground_truth_survives_blur_and_noise():
    """Generated-looking images: the frozen shape thresholds still read blurred, noisy renders correctly."""
    rng = np.random.default_rng(3)
    specs = S.all_prompts()
    images = S.render_batch(specs, seed=1)
    images = ndimage.gaussian_filter(images, sigma=(0, 0, 0.8, 0.8)) + 0.05 * rng.standard_normal(images.shape)
    score, strict = S.score_batch(np.clip(images, 0, 1).astype(np.float32), specs)
    assert score.mean() > 0.98 and strict.mean() > 0.95


def render(prompt, seed=0):
    return S.render(spec_of(prompt), seed)


def test_wrong_colour_wrong_position_wrong_shape_wrong_count():
    target = spec_of("a red circle on the left and a blue square on the right")
    checks = S.check_image(render("a red circle on the left and a blue square on the right"), target)
    assert all(checks.values())

    # Wrong colour: the left object is green; the red object is missing, green is an extra colour.
    checks = S.check_image(render("a green circle on the left and a blue square on the right"), target)
    assert not checks["obj0/color"] and not checks["obj0/count"] and not checks["no_extra"]
    assert checks["obj1/color"] and checks["obj1/shape"] and checks["obj1/position"]
    score, strict = S.score_image(render("a green circle on the left and a blue square on the right"), target)
    assert score == pytest.approx(4 / 9) and not strict  # obj0: 4 checks fail; obj1: 4 hold; extra green

    # Swapped positions: colours, counts and shapes right, both positions wrong.
    checks = S.check_image(render("a blue square on the left and a red circle on the right"), target)
    assert not checks["obj0/position"] and not checks["obj1/position"]
    assert S.score_image(render("a blue square on the left and a red circle on the right"), target) == (7 / 9, False)

    # Wrong shape only.
    checks = S.check_image(render("a red triangle on the left and a blue square on the right"), target)
    assert [k for k, v in checks.items() if not v] == ["obj0/shape"]

    # Count: one red circle for "two red circles".
    checks = S.check_image(render("a red circle"), spec_of("two red circles"))
    assert checks["obj0/color"] and checks["obj0/shape"] and not checks["obj0/count"]


def test_blank_and_nan_images():
    blank = np.zeros((3, 32, 32), dtype=np.float32)
    spec = spec_of("a yellow triangle at the top")
    score, strict = S.score_image(blank, spec)
    assert score == pytest.approx(1 / 5) and not strict  # only "no_extra" holds
    nan = blank.copy()
    nan[0, 0, 0] = np.nan
    score, strict = S.score_batch(np.stack([nan, blank]), [spec, spec])
    assert np.isnan(score[0]) and np.isnan(strict[0]) and score[1] == pytest.approx(0.2)


def test_angular_moments_hand_computed():
    """A plus sign of 5 unit-weight pixels has m3 = 0 and m4 = 1 (all arms at angles where cos 4θ = 1)."""
    plus = np.zeros((5, 5))
    plus[2, :] = plus[:, 2] = 1.0
    plus[2, 0] = plus[2, 4] = plus[0, 2] = plus[4, 2] = 1.0
    m3, m4 = S.angular_moments(plus)
    assert m3 == pytest.approx(0.0, abs=1e-9) and m4 == pytest.approx(1.0)
    assert S.classify_shape(0.6, 0.0) == "triangle"
    assert S.classify_shape(0.0, 0.4) == "square"
    assert S.classify_shape(0.0, 0.0) == "circle"
