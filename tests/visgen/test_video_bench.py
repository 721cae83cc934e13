"""``grove bench visgen-video``: every variant is a valid config, the memory probe sees an allocation, and (slow)
the quick benchmark runs end to end and reports ratios."""
from __future__ import annotations

import json

import pytest

from bench import visgen_video as bench
from shared_rl.registry import resolve_benchmark


def test_registered_and_every_variant_is_a_valid_config(tmp_path):
    assert resolve_benchmark("visgen-video") is bench.run
    from shared_rl.config import load_train_config

    for name, over in bench.VARIANTS.items():
        visgen = {"model": str(tmp_path), "memory": {"prompt_cache": False}}
        over = json.loads(json.dumps(over))
        visgen["memory"].update(over.pop("memory", {}))
        visgen.update(over)
        cfg = load_train_config({"domain": "visgen", "visgen": visgen})
        assert cfg.domain_config.memory.prompt_cache == ("prompt_cache" in json.dumps(bench.VARIANTS[name])), name


def test_peak_memory_probe_sees_a_large_allocation():
    """In a fresh process: a long test session keeps freed pages resident, so the resident-set probe could see
    nothing new there (it measures growth above its starting level, which is what the benchmark needs)."""
    import subprocess
    import sys

    code = ("import time, torch\n"
            "from bench.visgen_video import PeakMemory\n"
            "with PeakMemory(torch.device('cpu')) as peak:\n"
            "    x = torch.ones(64 * 2 ** 20 // 4); x.add_(1); time.sleep(0.2); del x\n"
            "print(peak.mb)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr[-500:]
    assert float(out.stdout.strip().splitlines()[-1]) > 40


@pytest.mark.slow
def test_quick_benchmark_reports_ratios(tmp_path):
    result = bench.run(tmp_path, quick=True, variants=["frame-chunked decode (1)", "prompt cache"], log=lambda *_: None,
                       write_doc=False)
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["baseline (no controls)"]["speed_ratio"] == 1.0
    assert rows["frame-chunked decode (1)"]["exact"] == "yes" and rows["prompt cache"]["exact"] == "yes"
    assert rows["prompt cache"]["cache_hit_rate"] == 1.0
    assert (tmp_path / "results.md").is_file()
