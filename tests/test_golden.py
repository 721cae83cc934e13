"""Restructurings keep results: fixed-seed short runs of every method reproduce their recorded metrics.

The fixtures (``tests/golden/*.jsonl``) were recorded before the one-engine restructuring (issue 12) by
``python -m tests.golden.runs``; every non-timing metric must match bit for bit, except the runs in ``RELATIVE``.
Outcomes (rewards, group counts, NFE, evaluation) are exact in every run.
"""
import pytest

from tests.golden import runs

# run -> relative tolerance of its loss/ratio/gradient/entropy metrics, and why
RELATIVE = {
    # the flow action head moved onto the shared Flow-GRPO kernel (shared_rl.flow_kernels), whose SDE mean multiplies
    # std_t^2/(2 sigma)*dt where the head's own copy did std_t^2*dt/(2 sigma), and whose log-density takes log(std)
    # where the copy took log(var)/2: last-bit differences per step, ~2e-6 relative after two iterations; the
    # sampled episodes, rewards and evaluation are identical
    "robotics": 1e-5,
}


@pytest.mark.parametrize("name", sorted(runs.RUNS))
def test_golden_metrics_unchanged(tmp_path, name):
    got = runs.run(name, tmp_path)
    expected = runs.load(name)
    bad = runs.compare(expected, got, rel=RELATIVE.get(name, 0.0))
    assert not bad, f"{name}: " + "; ".join(bad[:8])


def test_compare_catches_a_changed_metric():
    rec = [{"step": 1, "loss/policy": 0.25, "time/rollout": 3.0}]
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25, "time/rollout": 9.0}]) == []
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25000001}])
    assert runs.compare(rec, [{"step": 1}])
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25000001}], rel=1e-5) == []
    assert runs.compare([{"reward/mean": 0.5}], [{"reward/mean": 0.50000001}], rel=1e-5), "outcomes stay exact"
