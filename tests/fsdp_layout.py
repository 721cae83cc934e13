"""What the FSDP2 domain tests assert of a 2-process run against the 1-process run of the same global batch: the
same weights (within 1e-5, and identical on both ranks), the same metric records, step by step, and updates that
really happened. One helper for tests/visgen, tests/robotics (tiny VLA and LeRobot policies)."""
import json

import pytest
import torch


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(live: dict, ranks: list[dict], atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """``ranks``: each process's gathered state dict; every one equals rank 0's exactly, and rank 0's the 1-process
    ``live`` state within tolerance (float summation order differs between the layouts)."""
    assert live.keys() == ranks[0].keys()
    for k, v in live.items():
        assert torch.allclose(v, ranks[0][k], atol=atol, rtol=rtol), k
        for other in ranks[1:]:
            assert torch.equal(ranks[0][k], other[k]), k


def assert_same_records(one_dir, two_dir, metrics, min_compared: int, last: str = "") -> list[dict]:
    """The runs' ``metrics.jsonl``: the same steps, and each of ``metrics`` a record has within 1e-5; at least
    ``min_compared`` values compared, ``last`` (e.g. the evaluation's metric) in the last record, and some update
    (``grad_norm`` > 1e-3). Returns the 1-process records."""
    one, two = records(one_dir), records(two_dir)
    assert [r["step"] for r in one] == [r["step"] for r in two]
    compared = 0
    for a, b in zip(one, two):
        for k in metrics:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k, a[k], b[k])
                compared += 1
    assert compared >= min_compared, compared
    assert not last or last in one[-1]
    assert max(r.get("grad_norm", 0.0) for r in one) > 1e-3, "no update happened: the comparison would be vacuous"
    return one
