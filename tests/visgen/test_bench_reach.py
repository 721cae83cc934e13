"""The visgen-trees benchmark's "NFE to reach flat's final score": defined only when flat's rise beats the noise."""
from bench.visgen_trees import MIN_FLAT_GAIN, _first_reach, _smooth, flat_gain_is_signal


def _points(scores, nfe_step=1024.0, time_step=4.0):
    return [{"nfe": i * nfe_step, "time": i * time_step, "score": s} for i, s in enumerate(scores)]


def test_flat_gain_must_exceed_one_evaluations_noise():
    # the 800-step asset's run: 0.860 -> 0.888 smoothed, a real rise
    assert flat_gain_is_signal(_smooth(_points([0.860, 0.866, 0.874, 0.880, 0.886, 0.890, 0.888])))
    # a rise of +0.005 (what flat did on the 1,400-step asset), inside the +-0.02 of one evaluation -> no target;
    # the old rule (any rise) accepted it and noise then "reached" it almost at once
    small = _smooth(_points([0.915, 0.915, 0.918, 0.920, 0.920]))
    assert abs((small[-1]["score"] - small[0]["score"]) - 0.005) < 1e-9
    assert not flat_gain_is_signal(small)
    assert flat_gain_is_signal(_points([0.5, 0.5 + MIN_FLAT_GAIN]))
    assert not flat_gain_is_signal(_points([0.5, 0.5 + MIN_FLAT_GAIN - 1e-6]))


def test_first_reach_interpolates_between_evaluations():
    pts = _points([0.80, 0.82, 0.86, 0.90])
    # target 0.85 lies 3/4 of the way from 0.82 (nfe 1024, t 4) to 0.86 (nfe 2048, t 8)
    nfe, t = _first_reach(pts, 0.85)
    assert abs(nfe - (1024 + 0.75 * 1024)) < 1e-6 and abs(t - 7.0) < 1e-9
    assert _first_reach(pts, 0.95) == (None, None)
