"""The standard error beside every held-out success (``robotics.eval_standard_error``), computed by hand."""
from types import SimpleNamespace

import numpy as np
import pytest

from robotics.episodes import standard_error, success_by_task


def test_standard_errors_by_hand():
    # task a: 3 of 4 succeed (se sqrt(.75 * .25 / 4)); task b: 1 of 2 (se sqrt(.25 / 2)); overall stratified
    succ = np.array([1, 1, 1, 0, 1, 0], bool)
    batch = SimpleNamespace(success_once=succ, success_end=succ, tasks=["a"] * 4 + ["b"] * 2, length=np.full(6, 10))
    out = success_by_task(batch, "once", standard_errors=True)
    se_a, se_b = np.sqrt(0.75 * 0.25 / 4), np.sqrt(0.5 * 0.5 / 2)
    assert out["eval/success_se/a"] == pytest.approx(se_a) and out["eval/success_se/b"] == pytest.approx(se_b)
    assert out["eval/success_se"] == pytest.approx(np.sqrt((4 / 6) ** 2 * se_a ** 2 + (2 / 6) ** 2 * se_b ** 2))
    assert out["eval/success"] == pytest.approx(4 / 6)
    assert not any("_se" in k for k in success_by_task(batch, "once")), "off by default: the recorded runs keep their keys"
    assert standard_error(np.ones(100, bool)) == 0.0
    assert standard_error(np.array([1, 0] * 50, bool)) == pytest.approx(0.05), "100 states at 0.5: 5 points"
