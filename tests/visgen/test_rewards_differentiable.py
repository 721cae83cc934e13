"""The neural rewards' differentiable calls (DiffusionOPSD follows their gradient through the VAE decode), on tiny
random models built here from configs (no downloads): the torch pre-processing is PIL's geometry at real sizes
(Pillow's bicubic weights, within the uint8 roundings it leaves out), the differentiable score is the scored one,
its gradient is finite, nonzero and a central finite difference along one pixel, and DiffusionOPSD's config check
takes each of them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from visgen.rewards import get_reward, reward_info
from visgen.rewards.preprocess import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, clip_preprocess, differentiable_preprocess,
                                       pil_bicubic_weights, smooth_preprocess)

torch.set_num_threads(1)
PROMPTS = ["a red circle", "two blue squares"]
NEURAL = ["pickscore", "clipscore", "aesthetic", "hps", "imagereward"]


def _natural(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """Smooth colour fields plus a little noise (a photo-like spectrum), away from 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, h // 16 + 2, w // 16 + 2, generator=g)
    x = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    return (0.1 + 0.8 * x + 0.03 * torch.randn(n, 3, h, w, generator=g)).clamp(0.05, 0.95)


# ------------------------------------------------------------------------------------------ pre-processing
def test_pil_bicubic_weights_reproduce_pillow_on_one_axis():
    """A one-row image resized in width only: Pillow's one pass, rounded to uint8, equals the weights applied by hand
    and rounded (the half-up rounding of its fixed-point sum), so the kernel, the taps and the normalisation are
    Pillow's, at a reduction (support widened) and an enlargement."""
    rng = np.random.default_rng(0)
    for w, nw in [(517, 224), (96, 224), (64, 32)]:
        row = rng.integers(0, 256, (1, w, 3), dtype=np.uint8)
        ref = np.asarray(Image.fromarray(row).resize((nw, 1), Image.BICUBIC)).astype(np.float64)
        weights = pil_bicubic_weights(w, nw)
        assert np.allclose(weights.sum(1), 1.0)
        mine = np.clip(np.floor(np.einsum("ow,hwc->hoc", weights, row.astype(np.float64)) + 0.5), 0, 255)
        assert np.abs(mine - ref).max() <= 1 and (mine != ref).mean() < 0.01  # a tie off the fixed-point grid at most


@pytest.mark.parametrize("h,w,size,crop", [(512, 512, 224, "round"), (768, 1024, 224, "floor"),
                                           (1024, 1024, 224, "round"), (200, 150, 224, "round")])
def test_torch_preprocessing_is_the_pil_path_at_real_sizes(h, w, size, crop):
    """The smooth torch path is within the PIL path's three uint8 roundings (measured: at most 1.5 levels, 0.3 on
    average); the straight-through path's value is the PIL path's exactly."""
    x = _natural(2, h, w)
    pil = clip_preprocess(x, size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, crop)
    smooth = smooth_preprocess(x, size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, crop)
    levels = ((pil - smooth) * torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1) * 255).abs()
    assert smooth.shape == pil.shape == (2, 3, size, size)
    assert levels.max() < 2.0 and levels.mean() < 0.45
    y = x.clone().requires_grad_(True)
    exact = differentiable_preprocess(y, size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, crop)
    assert torch.allclose(exact, pil, atol=1e-6)
    (grad,) = torch.autograd.grad(exact.sum(), y)
    (grad_smooth,) = torch.autograd.grad(smooth_preprocess(y, size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, crop).sum(), y)
    assert torch.equal(grad, grad_smooth)  # straight-through: the smooth path's gradient


# ------------------------------------------------------------------------------------------ tiny models
@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from visgen import tiny
    from visgen.tasks.shapes import vocabulary

    path = tmp_path_factory.mktemp("clip") / "clip"
    tok = tiny.build_tokenizer(vocabulary())
    text = dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).save_pretrained(path)
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=ip, tokenizer=tok).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory) -> tuple[Path, Path]:
    open_clip = pytest.importorskip("open_clip", reason="the hps reward needs open_clip_torch")
    path = tmp_path_factory.mktemp("hps")
    config = {"embed_dim": 8, "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "patch_size": 8,
                                             "head_width": 8},
              "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1}}
    (path / "hps-tiny-diff.json").write_text(json.dumps(config))
    open_clip.add_model_config(path / "hps-tiny-diff.json")
    torch.manual_seed(1)
    model = open_clip.create_model("hps-tiny-diff")
    torch.save({"state_dict": model.state_dict()}, path / "hps.pt")
    return path / "hps.pt", path / "hps-tiny-diff.json"


@pytest.fixture(scope="module")
def ir_files(tmp_path_factory) -> tuple[Path, Path, dict]:
    from transformers import BertTokenizerFast

    from visgen.rewards.imagereward import DEFAULT_CONFIG, ImageRewardModel, _merge

    path = tmp_path_factory.mktemp("ir")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted({w for p in PROMPTS for w in p.split()})
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt"), do_lower_case=True).save_pretrained(path)
    tiny = {"image_size": 32,
            "vision": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "patch_size": 8},
            "text": {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 40},
            "mlp_hidden": [16, 8, 8, 4]}
    torch.manual_seed(2)
    model = ImageRewardModel(_merge(DEFAULT_CONFIG, tiny))
    with torch.no_grad():  # BERT's 0.02 initialisation leaves the tiny [CLS] state blind to the image (grad ~1e-12)
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "ir.safetensors"))
    return path / "ir.safetensors", path, tiny


def _build(name, clip_dir, hps_files, ir_files):
    if name == "pickscore":
        return get_reward("pickscore", model=str(clip_dir), processor=None, device="cpu")
    if name == "clipscore":  # the raw cosine: the clipped scalings have no gradient where the cosine is below 0
        return get_reward("clipscore", model=str(clip_dir), device="cpu", scaling="cosine")
    if name == "aesthetic":
        torch.manual_seed(3)
        return get_reward("aesthetic", checkpoint=None, clip_model=str(clip_dir), device="cpu", hidden=[16, 8, 8, 4])
    if name == "hps":
        return get_reward("hps", checkpoint=str(hps_files[0]), arch=str(hps_files[1]), device="cpu")
    return get_reward("imagereward", checkpoint=str(ir_files[0]), tokenizer=str(ir_files[1]), config=ir_files[2],
                      device="cpu")


def _to_float64_smooth(reward) -> None:
    """The reward in float64 with the smooth pre-processing (no straight-through): the finite-difference setting."""
    if hasattr(reward, "clip"):
        reward.clip.model.double()
        reward.clip.dtype, reward.clip.straight_through = torch.float64, False
        if hasattr(reward, "mlp"):
            reward.mlp.double()
    else:
        reward.model.double()
        reward.straight_through = False


@pytest.mark.parametrize("name", NEURAL)
def test_differentiable_score_is_the_scored_one_with_a_finite_difference_gradient(name, clip_dir, request):
    hps_files = request.getfixturevalue("hps_files") if name == "hps" else None
    ir_files = request.getfixturevalue("ir_files") if name == "imagereward" else None
    reward = _build(name, clip_dir, hps_files, ir_files)
    assert reward_info(name).differentiable
    images = _natural(2, 48, 72, seed=4)  # a resize and a crop on the way to the 32 px models

    scored = reward(images, PROMPTS)[name]
    x = images.clone().requires_grad_(True)
    value = reward.differentiable(x, PROMPTS)[name]
    assert value.shape == (2,) and value.requires_grad
    assert torch.allclose(value.detach().float(), scored, atol=1e-4, rtol=0), (value, scored)
    (grad,) = torch.autograd.grad(value.sum(), x)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0

    # the gradient is the smooth pre-processing's: a central difference along the steepest pixel, in float64
    _to_float64_smooth(reward)
    x64 = images.double().requires_grad_(True)
    smooth = reward.differentiable(x64, PROMPTS)[name]
    assert torch.allclose(smooth.detach().float(), scored, atol=0.05)  # within the uint8 roundings left out
    (g64,) = torch.autograd.grad(smooth[0], x64)
    cos = torch.nn.functional.cosine_similarity(g64[0].flatten(), grad[0].double().flatten(), dim=0)
    assert cos > 0.9  # the same direction as the straight-through gradient at the rounded point
    flat = int(g64[0].abs().flatten().argmax())
    eps = 1e-5
    with torch.no_grad():
        up, down = images.double().clone(), images.double().clone()
        up[0].view(-1)[flat] += eps
        down[0].view(-1)[flat] -= eps
        fd = (reward.differentiable(up, PROMPTS)[name][0] - reward.differentiable(down, PROMPTS)[name][0]) / (2 * eps)
    analytic = g64[0].flatten()[flat]
    assert analytic.abs() > 0 and torch.isclose(fd, analytic, rtol=1e-4, atol=1e-9), (float(fd), float(analytic))


def test_the_registry_and_the_config_index_mark_the_neural_rewards_differentiable():
    from visgen.preflight import reward_differentiable, reward_source_index

    index = reward_source_index()
    for name in NEURAL + ["shapes_colour"]:
        assert reward_info(name).differentiable and index[name]["differentiable"] and reward_differentiable(name)
    for name in ["shapes", "shapes_soft", "ocr", "jpeg_compressibility"]:
        assert not reward_info(name).differentiable and not reward_differentiable(name)


@pytest.mark.parametrize("name", ["hps", "imagereward", "clipscore", "aesthetic"])
def test_diffusion_opsd_config_check_takes_the_neural_rewards(tiny_dir, name):
    """DiffusionOPSD's check (``visgen.config``: a trained reward must be differentiable) takes them; the rewards are
    not built by the check (no weights load)."""
    from shared_rl.config import load_train_config

    cfg = load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1, "rollout": {"groups_per_iteration": 2, "group_size": 3},
        "advantage": {"estimator": "grpo", "weights": {name: 1.0}}, "loss": {"kl_coef": 0.0},
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "objective": {"name": "diffusion_opsd"}, "rewards": [{"name": name}]},
    })
    assert cfg.domain == "visgen"
