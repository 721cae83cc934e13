"""Restructurings keep results: fixed-seed short runs of every method reproduce their recorded metrics.

The fixtures (``tests/golden/*.jsonl``) were recorded before the one-engine restructuring (issue 12) by
``python -m tests.golden.runs``. Bit-for-bit equality holds on one machine only: the same code on another CPU
(session 9's AMD EPYC against the machine that recorded them) differs in the last float bits — losses and KLs of
~1e-4 by up to 4e-4 relative (3e-8 absolute), continuous rewards by up to 2e-6 relative — through CPU-specific
kernels. So losses, ratios, gradients and entropies are compared to ``CROSS_MACHINE_REL`` (plus ``CROSS_MACHINE_ABS``
for values near zero), continuous outcomes (soft rewards, their std, soft evaluation) to ``OUTCOME_REL``; counts
and discrete outcomes (successes, NFE, groups) have no float slack to hide in and stay exact. A restructuring that
changes what is computed moves these metrics by far more (``test_compare_catches_a_changed_metric``).
"""
import pytest

from tests.golden import runs

# Losses, ratios, gradients, entropies: relative tolerance. It also covers the robotics fixture's own ~2e-6 drift
# from moving the flow action head onto the shared Flow-GRPO kernel (shared_rl.flow_kernels: the same formulas in
# another op order), which needed a per-run 1e-5 before.
CROSS_MACHINE_REL = 1e-3
CROSS_MACHINE_ABS = 1e-7  # session 30's Xeon (AVX-512 / AMX): a loss/policy of 3.1e-5 off by 4.5e-8
OUTCOME_REL = 1e-5


@pytest.mark.parametrize("name", sorted(runs.RUNS))
def test_golden_metrics_unchanged(tmp_path, name):
    got = runs.run(name, tmp_path)
    expected = runs.load(name)
    bad = runs.compare(expected, got, rel=CROSS_MACHINE_REL, abs_=CROSS_MACHINE_ABS, outcome_rel=OUTCOME_REL)
    assert not bad, f"{name}: " + "; ".join(bad[:8])


def test_compare_catches_a_changed_metric():
    rec = [{"step": 1, "loss/policy": 0.25, "time/rollout": 3.0}]
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25, "time/rollout": 9.0}]) == []
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25000001}])
    assert runs.compare(rec, [{"step": 1}])
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25000001}], rel=1e-5) == []
    assert runs.compare([{"reward/mean": 0.5}], [{"reward/mean": 0.50000001}], rel=1e-5), "outcomes stay exact"
    # the tolerances the fixtures are compared with: last-bit noise passes, a changed computation does not
    tol = dict(rel=CROSS_MACHINE_REL, abs_=CROSS_MACHINE_ABS, outcome_rel=OUTCOME_REL)
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25 * (1 + 4e-4)}], **tol) == []
    assert runs.compare(rec, [{"step": 1, "loss/policy": 0.25 * (1 + 3e-3)}], **tol)
    assert runs.compare([{"reward/mean": 0.89}], [{"reward/mean": 0.89 * (1 + 2e-6)}], **tol) == []
    assert runs.compare([{"reward/mean": 0.75}], [{"reward/mean": 0.625}], **tol), "a flipped success is caught"
