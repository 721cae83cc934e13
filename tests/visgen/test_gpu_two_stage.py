"""The prepared GPU two-stage benchmark: skips cleanly without FP8 kernels; its timing path runs on a tiny DiT."""
import json

import torch

from bench import gpu_two_stage as g


def test_cpu_run_writes_a_skip_page(tmp_path):
    res = g.run(tmp_path, quick=True, log=lambda s: None, device="cpu")
    assert res["skipped"] is True and res["rows"] == []
    page = (tmp_path / "results.md").read_text()
    assert "skipped" in page and "8.9" in page
    assert json.loads((tmp_path / "results.json").read_text())["skipped"] is True


def test_rollout_timing_and_error_on_a_tiny_dit():
    model = g.build_dit(1, 2, 8, "cpu", torch.float32)
    inp = g.inputs(2, 8, "cpu", torch.float32, text_tokens=4)
    x = g.rollout(model, inp, 2)
    assert x.shape == inp["x"].shape and torch.isfinite(x).all()
    assert not torch.equal(x, inp["x"])  # the steps moved the latents
    t = g.time_rollouts(model, inp, 2, warmup=0, repeats=1)
    assert t["images_per_s"] > 0 and t["ms_per_step"] > 0
    assert g.velocity_error(model, model, inp) == 0.0
    other = g.build_dit(1, 2, 8, "cpu", torch.float32, seed=1)
    assert g.velocity_error(model, other, inp) > 0.1
