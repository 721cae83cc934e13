"""Restructurings keep results: fixed-seed short runs of every method reproduce their recorded metrics.

The fixtures (``tests/golden/*.jsonl``) were recorded before the one-engine restructuring (issue 12) by
``python -m tests.golden.runs``; every non-timing metric must match exactly (floats bit for bit; the few metrics
that are a reordered float sum allow 1e-6 relative, see ``TOLERANT``).
"""
import pytest

from tests.golden import runs

# metrics whose value is a sum over steps in an order a refactor may legitimately change
TOLERANT: set[str] = set()


@pytest.mark.parametrize("name", sorted(runs.RUNS))
def test_golden_metrics_unchanged(tmp_path, name):
    got = runs.run(name, tmp_path)
    expected = runs.load(name)
    bad = runs.compare(expected, got)
    assert not bad, f"{name}: " + "; ".join(bad[:8])


def test_compare_catches_a_changed_metric():
    rec = [{"step": 1, "loss/policy": 0.25, "time/rollout": 3.0}]
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25, "time/rollout": 9.0}]) == []
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25000001}])
    assert runs.compare(rec, [{"step": 1}])
