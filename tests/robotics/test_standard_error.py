"""The held-out read-out computed by hand: standard errors over reset states (``robotics.eval_standard_error``), the
spread of start-noise draws (``robotics.eval_noise_draws``) and the paired before -> after
(``evaluation.paired_delta``: ``eval/success_delta`` ± ``eval/success_delta_se``)."""
import numpy as np
import pytest

from robotics.evaluation import EvalOutcomes, outcome_metrics, paired_delta

SETTINGS = {"split": "eval", "seed": 0}


def outcomes(success, tasks, keys, draws=None, settings=SETTINGS):
    n = len(success)
    return EvalOutcomes(list(tasks), list(keys), list(draws or [0] * n), np.array(success, bool),
                        np.full(n, 10), dict(settings))


def test_standard_errors_by_hand():
    # task a: 3 of 4 succeed (se sqrt(.75 * .25 / 4)); task b: 1 of 2 (se sqrt(.25 / 2)); overall stratified
    out = outcome_metrics(outcomes([1, 1, 1, 0, 1, 0], ["a"] * 4 + ["b"] * 2, range(6)), standard_errors=True)
    se_a, se_b = np.sqrt(0.75 * 0.25 / 4), np.sqrt(0.5 * 0.5 / 2)
    assert out["eval/success_se/a"] == pytest.approx(se_a) and out["eval/success_se/b"] == pytest.approx(se_b)
    assert out["eval/success_se"] == pytest.approx(np.sqrt((4 / 6) ** 2 * se_a ** 2 + (2 / 6) ** 2 * se_b ** 2))
    assert out["eval/success"] == pytest.approx(4 / 6)
    plain = outcome_metrics(outcomes([1, 1, 1, 0, 1, 0], ["a"] * 4 + ["b"] * 2, range(6)))
    assert not any("_se" in k or "draw_sd" in k for k in plain), "off by default: the recorded runs keep their keys"
    all_ok = outcome_metrics(outcomes([1] * 100, ["a"] * 100, range(100)), standard_errors=True)
    assert all_ok["eval/success_se"] == 0.0
    half = outcome_metrics(outcomes([1, 0] * 50, ["a"] * 100, range(100)), standard_errors=True)
    assert half["eval/success_se"] == pytest.approx(0.05), "100 states at 0.5: 5 points"


def test_draws_of_one_state_are_one_cluster():
    # two states x two draws: state 0 succeeds in both draws, state 1 in draw 0 only. State means 1 and 0.5, so the
    # standard error is sqrt(var([1, .5]) / 2) = sqrt(.0625 / 2), not the binomial of 4 independent episodes; the
    # draws score .. draw 0: 2/2, draw 1: 1/2 -> sd(ddof 1) of [1, .5] = .3536
    out = outcome_metrics(outcomes([1, 1, 1, 0], ["a"] * 4, [10, 11, 10, 11], [0, 0, 1, 1]), standard_errors=True)
    assert out["eval/success"] == pytest.approx(0.75)
    assert out["eval/success_se"] == pytest.approx(np.sqrt(0.0625 / 2))
    assert out["eval/success_draw_sd"] == pytest.approx(np.std([1.0, 0.5], ddof=1))
    assert out["eval/success_draw_sd/a"] == out["eval/success_draw_sd"]


def test_paired_delta_by_hand():
    tasks, keys = ["a"] * 4 + ["b"] * 4, list(range(8))
    before = outcomes([1, 0, 0, 1, 1, 1, 0, 0], tasks, keys)
    after = outcomes([1, 1, 1, 0, 1, 1, 1, 0], tasks, keys)
    out = paired_delta(before, after)
    d_a, d_b = np.array([0, 1, 1, -1.0]), np.array([0, 0, 1, 0.0])
    se_a, se_b = d_a.std(ddof=1) / 2, d_b.std(ddof=1) / 2
    assert out["eval/success_delta/a"] == pytest.approx(0.25) and out["eval/success_delta/b"] == pytest.approx(0.25)
    assert out["eval/success_delta_se/a"] == pytest.approx(se_a) and out["eval/success_delta_se/b"] == pytest.approx(se_b)
    assert out["eval/success_delta"] == pytest.approx(0.25)
    assert out["eval/success_delta_se"] == pytest.approx(np.sqrt(0.25 * se_a ** 2 + 0.25 * se_b ** 2))
    assert (out["eval/paired_gained"], out["eval/paired_lost"]) == (3, 1)
    # the same policy twice: exactly no change, no spread
    same = paired_delta(before, before)
    assert same["eval/success_delta"] == 0 and same["eval/success_delta_se"] == 0
    # different episodes (another seed, other states) do not pair
    assert paired_delta(before, outcomes(after.success, tasks, keys, settings={"split": "eval", "seed": 1})) == {}
    assert paired_delta(before, outcomes(after.success, tasks, [k + 1 for k in keys])) == {}


def test_paired_delta_averages_a_states_draws_first():
    # one task, two states x two draws; state 10 changes +1 in both draws, state 11 -1 in one: d_s = [1, -.5]
    keys, draws = [10, 11, 10, 11], [0, 0, 1, 1]
    before = outcomes([0, 1, 0, 1], ["a"] * 4, keys, draws)
    after = outcomes([1, 0, 1, 1], ["a"] * 4, keys, draws)
    out = paired_delta(before, after)
    assert out["eval/success_delta"] == pytest.approx(0.25)
    assert out["eval/success_delta_se"] == pytest.approx(np.std([1, -0.5], ddof=1) / np.sqrt(2))


def test_outcomes_round_trip_json():
    import json

    o = outcomes([1, 0, 1], ["a", "a", "b"], [3, 4, 5], [0, 1, 0])
    back = EvalOutcomes.from_json(json.loads(json.dumps(o.to_json())))
    assert back.pairs_with(o) and (back.success == o.success).all() and (back.length == o.length).all()
