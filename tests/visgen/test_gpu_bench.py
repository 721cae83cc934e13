"""``grove bench gpu``: without CUDA it writes a page saying it was not run; its rows run on any device (here the
CPU, a rehearsal of the prepared script) and backward_steps 0 / 1 give the same gradient."""
import json

import pytest

from bench import gpu


def test_without_cuda_the_page_says_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    out = gpu.run(tmp_path, quick=True, log=lambda *_: None)
    assert out["rows"] == [{"variant": "skipped", "reason": "no CUDA device"}]
    assert "Not run" in (tmp_path / "results.md").read_text()


@pytest.mark.slow  # the whole quick bench on the CPU (~15 s); the row writer itself is the test above
def test_rows_on_the_cpu_write_after_each_row(tmp_path):
    gpu.run(tmp_path, quick=True, device="cpu", log=lambda *_: None, write_doc=False)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == list(gpu.VARIANTS)
    assert rows[0]["grad_norm"] == pytest.approx(rows[1]["grad_norm"], rel=1e-5)  # the same update
    assert all(0 < r["gpu_share"] <= 1 and r["images_per_iteration"] == 8 for r in rows)
