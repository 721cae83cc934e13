"""The tiny SD3 pipeline: builds from configs, saves/loads offline, samples; the committed asset beats noise."""
import json

import pytest
import torch

from visgen import tiny
from visgen.rewards import get_reward
from visgen.tasks import shapes as S


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def sample(pipe, prompts, steps=3, guidance=1.0, seed=0):
    return pipe(prompts, num_inference_steps=steps, guidance_scale=guidance, output_type="pt",
                max_sequence_length=tiny.MAX_SEQUENCE_LENGTH, generator=torch.Generator().manual_seed(seed)).images


def test_tokenizer_word_level_round_trip_and_eos():
    tok = tiny.build_tokenizer(S.vocabulary())
    prompt = "a red circle on the left and a blue square on the right"
    ids = tok(prompt).input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id == 3  # never 2 (legacy CLIP pooling)
    assert len(ids) == len(prompt.split()) + 2 and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == prompt
    longest = max((s.prompt for s in S.all_prompts()), key=lambda p: len(p.split()))
    assert len(tok(longest).input_ids) <= tiny.TOKENIZER_MAX_LENGTH


def test_build_save_load_round_trip(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    pipe = tiny.build_pipeline(S.vocabulary(), seed=0)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.text_encoder_3 is None and pipe.vae_scale_factor == 2
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    assert 1.0e6 < n_params < 1.6e6
    images = sample(pipe, ["a red circle", "two blue squares"])
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1

    tiny.save_pipeline(pipe, tmp_path / "pipe")
    settings = json.loads((tmp_path / "pipe" / "grove.json").read_text())
    assert settings["max_sequence_length"] == tiny.MAX_SEQUENCE_LENGTH and settings["resolution"] == 32
    loaded = StableDiffusion3Pipeline.from_pretrained(
        tmp_path / "pipe", text_encoder_3=None, tokenizer_3=None, local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    torch.testing.assert_close(sample(loaded, ["a red circle", "two blue squares"]), images)
    assert torch.equal(tiny.load_shapes_asset(tmp_path / "pipe").transformer.pos_embed.proj.weight,
                       pipe.transformer.pos_embed.proj.weight)
    with pytest.raises(FileNotFoundError, match="visgen.pretrain"):
        tiny.load_shapes_asset(tmp_path / "missing")


def test_committed_asset_loads_and_beats_noise():
    assert (tiny.ASSET_DIR / "model_index.json").exists(), "assets/shapes-sd3-tiny is missing"
    pipe = tiny.load_shapes_asset(tiny.ASSET_DIR)
    settings = tiny.asset_settings(tiny.ASSET_DIR)
    assert settings["max_sequence_length"] == tiny.MAX_SEQUENCE_LENGTH
    _, held_out = S.split_prompts(settings.get("split_seed", 0), settings.get("eval_fraction", 0.2))
    specs = held_out[::4][:12]
    prompts = [s.prompt for s in specs]
    images = sample(pipe, prompts, steps=10, guidance=1.0, seed=0)
    noise = torch.rand(images.shape, generator=torch.Generator().manual_seed(0))
    reward = get_reward("shapes")
    generated = reward(images, prompts)["shapes"].mean().item()
    random = reward(noise, prompts)["shapes"].mean().item()
    blank = reward(torch.zeros_like(images), prompts)["shapes"].mean().item()
    assert generated > max(random, blank) + 0.3
