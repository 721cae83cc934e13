"""Using a run's ``final/`` outside grove (README "Use your results"): ``grove_export.json`` records where the base
pipeline is as a path that resolves from anywhere, and ``visgen.export.load_trained_pipeline`` gives the stock
pipeline with the trained LoRA plus the training's sampling settings, reproducing the domain's own samples."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from visgen.domain import VisgenDomain
from visgen.export import load_trained_pipeline, sampling_settings

from .test_domain import STEPS, _ctx, make_cfg


def test_export_loads_into_the_stock_pipeline_from_another_directory(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(Path(tiny_dir).parent)  # the config names the base pipeline relative to here, as recipes do
    cfg = make_cfg(tiny_dir)
    cfg.domain_config.model = Path(tiny_dir).name
    dom = VisgenDomain(cfg.domain_config, _ctx())
    g = torch.Generator().manual_seed(0)
    dom.load_state_dict({k: 0.3 * torch.randn(v.shape, generator=g) for k, v in dom.state_dict().items()})
    final = tmp_path / "run" / "final"
    dom.save_pretrained(final)
    info = json.loads((final / "grove_export.json").read_text())
    assert Path(info["base_model"]).is_absolute() and Path(info["base_model"]) == Path(tiny_dir).absolute()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a relative base path would not resolve from here
    pipe, settings = load_trained_pipeline(final)
    assert settings == sampling_settings(info) and settings["num_inference_steps"] == STEPS
    assert settings["guidance_scale"] == info["guidance_scale"]

    def sample(p):
        return p(["a red circle", "two blue squares"], generator=torch.Generator().manual_seed(3), output_type="pt",
                 **settings).images

    trained, loaded = sample(dom.pipe), sample(pipe)
    assert torch.allclose(trained, loaded, atol=1e-5)
    with dom.policy.reference():  # the adapter switched off: the base model draws something else
        assert not torch.allclose(sample(dom.pipe), loaded, atol=1e-3)


def test_an_export_of_a_checkout_asset_loads_in_a_checkout_elsewhere(tmp_path, monkeypatch):
    """Exports travel (issue 50): a base pipeline inside the checkout is also recorded relative to it, so a run
    copied to another machine (its absolute path gone) still finds the base in that machine's checkout."""
    import visgen.export as export

    fake_root = tmp_path / "checkout-here"
    (fake_root / "assets" / "base").mkdir(parents=True)
    (fake_root / "assets" / "base" / "model_index.json").write_text("{}")
    monkeypatch.setattr(export, "REPO_ROOT", fake_root)
    assert export.checkout_relative(str(fake_root / "assets" / "base")) == "assets/base"
    assert export.checkout_relative(str(tmp_path)) is None
    gone = "/machine-that-trained/grove/assets/base"  # the absolute path recorded on the other machine
    assert export.resolve_base(gone, "assets/base") == str(fake_root / "assets" / "base")
    assert export.resolve_base(gone) == gone  # without the record it cannot know
