"""``scripts/fsdp2_gpu_check.py`` (the NCCL check of docs/scaling.md, for a machine with 2+ GPUs) runs its flow on
gloo CPU processes too: the toy cases pass there (fp32 metrics and the resumed sharded checkpoint's weights within
1e-5), and a negative tolerance turns the same run into a FAIL with exit status 1, so the script reports a
difference rather than hiding it. The comparison itself: records that do not line up compare as infinitely
different. ``slow`` (~60 s: several torchrun launches)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("fsdp2_gpu_check", ROOT / "scripts" / "fsdp2_gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_records_are_compared_step_by_step():
    check = _script()
    a = [{"step": 0, "grad_norm": 1.0, "reward/mean": 0.5}, {"step": 1, "grad_norm": 2.0}]
    assert check.largest_difference(a, [{"step": 0, "grad_norm": 1.5, "reward/mean": 0.5}, {"step": 1,
                                                                                          "grad_norm": 2.0}]) == 0.5
    assert check.largest_difference(a, a[:1]) == float("inf")
    assert set(check.CASES) >= {"toy", "toy-bf16", "toy-offload", "toy-resume", "sd3-lora", "sd3-full", "wan22",
                                "llm-lora"}


@pytest.mark.slow
def test_the_gpu_check_passes_on_cpu_processes_and_fails_below_any_difference(tmp_path):
    check = _script()
    out = tmp_path / "check"
    assert check.main(["--device", "cpu", "--only", "toy,toy-resume,toy-offload", "--out", str(out)]) == 0
    results = {r["case"]: r for r in json.loads((out / "summary.json").read_text())["results"]}
    assert results["toy"]["pass"] and results["toy"]["largest_metric_difference"] <= 1e-5
    assert results["toy-resume"]["pass"] and results["toy-resume"]["largest_weight_difference"] <= 1e-5
    assert results["toy-offload"]["skipped"]  # CPU offload needs a GPU
    assert check.main(["--device", "cpu", "--only", "toy", "--out", str(out), "--tolerance", "-1"]) == 1
