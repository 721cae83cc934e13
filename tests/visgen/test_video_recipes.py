"""The real-model recipes (hub ids, GPU) parse, and build: every setting of the recipe — method, kernel, LoRA target
modules, memory controls, encoding options — runs one training iteration on a tiny random pipeline of the *same*
diffusers class (loaded in place of the hub weights), with a cheap stand-in for the reward model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared_rl.config import load_train_config, load_yaml
from shared_rl.trainer import Trainer

from . import tiny_families as tf

REPO = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)

RECIPES = {
    # recipe -> (tiny pipeline builder, expected pipeline class, visgen overrides for the tiny model, stand-in reward)
    "wan22_5b_videoalign": (lambda: tf.build_wan(expand_timesteps=True), "WanPipeline",
                            {"resolution": 32, "encode_options": {}, "num_frames": 5, "max_sequence_length": 8},
                            {"name": "video_motion"}),
    "qwen_image_ocr": (tf.build_qwen_image, "QwenImagePipeline", {"resolution": 32, "max_sequence_length": 16},
                       {"name": "jpeg_compressibility"}),
    "flux2_klein_pickscore": (tf.build_flux2_klein, "Flux2KleinPipeline",
                              {"resolution": 16, "max_sequence_length": 24,
                               "encode_options": {"text_encoder_out_layers": list(tf.FLUX2_LAYERS)}},
                              {"name": "jpeg_compressibility"}),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_builds_and_trains_on_a_tiny_pipeline_of_its_class(name, monkeypatch, tmp_path):
    build, cls, visgen_over, reward = RECIPES[name]
    data = load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml")
    assert "/" in data["visgen"]["model"] and not Path(data["visgen"]["model"]).exists()  # a hub id
    recipe = load_train_config(load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml"))  # parses as shipped
    assert recipe.domain_config.memory.prompt_cache
    pipe = build()
    assert type(pipe).__name__ == cls
    import visgen.domain as domain_module

    import shared_rl.preflight

    monkeypatch.setattr(domain_module, "load_pipeline", lambda model, dtype, meta_transformers=False: (pipe, model, False))
    # the tiny pipeline stands in for the recipe's hub id, so the offline cache check has nothing to answer for
    monkeypatch.setattr(shared_rl.preflight, "check_hub_model", lambda *args, **kwargs: None)
    data.update(device="cpu", iterations=1, logging={"progress": False}, eval={"at_start": False})
    data["rollout"] = {"groups_per_iteration": 2, "group_size": 2}
    data["optim"].update(micro_batch_size=0, minibatches_per_epoch=1)
    data["visgen"].update(dtype="float32", num_inference_steps=4, rewards=[reward], rollout_micro_batch=2,
                          eval={"max_prompts": 1, "samples_per_prompt": 1, "grid_prompts": 0}, **visgen_over)
    if data["visgen"]["method"]["name"] == "flow_grpo_fast":
        data["visgen"]["method"].update(min_window=1, max_window=2)
    data["loss"]["kl_coef"] = 0.0
    cfg = load_train_config(data)
    trainer = Trainer(cfg, None, log=lambda *_: None)
    m = trainer.iteration(0)
    assert m["ratio/mean"] == 1.0 and m["grad_norm"] > 0
    # the recipe's memory controls were applied to the real pipeline class
    applied = trainer.domain.memory
    assert applied["prompt_cache"] and applied.get("offload_text_encoders")
