"""Model-backed rewards on tiny random models built here (no downloads): pre-processing against hand-written
reference transforms, shapes, batching, determinism, NaN handling and the anchors' score scaling."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from visgen.rewards import RewardInputError, get_reward
from visgen.rewards.preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, clip_preprocess

torch.set_num_threads(1)
PROMPTS = ["a red circle", "two blue squares", "a green triangle on the left"]


def _images(n: int = 3, h: int = 24, w: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _reference(images: torch.Tensor, size: int, crop_round: bool, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD):
    """Hand-written: uint8 -> PIL -> bicubic shorter side `size` -> centre crop -> [0,1] -> normalise."""
    out = []
    for x in images:
        im = Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy())
        w, h = im.size
        nw, nh = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
        im = im.resize((nw, nh), Image.BICUBIC)
        top = int(round((nh - size) / 2)) if crop_round else (nh - size) // 2
        left = int(round((nw - size) / 2)) if crop_round else (nw - size) // 2
        px = torch.from_numpy(np.asarray(im.crop((left, top, left + size, top + size))).copy()).permute(2, 0, 1) / 255
        out.append((px - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1))
    return torch.stack(out)


def test_preprocess_matches_torchvision_and_the_transformers_crop_rule():
    from torchvision import transforms as T

    images = _images(2, 37, 63)  # an odd margin (27 - 16): the two crop rules differ by one pixel
    tv = T.Compose([T.Resize(16, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(16), T.ToTensor(),
                    T.Normalize(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)])
    pils = [Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy()) for x in images]
    assert torch.allclose(clip_preprocess(images, 16, crop="round"), torch.stack([tv(p) for p in pils]), atol=1e-6)
    assert torch.allclose(clip_preprocess(images, 16, crop="floor"), _reference(images, 16, False), atol=1e-6)
    assert not torch.allclose(clip_preprocess(images, 16, crop="floor"), clip_preprocess(images, 16, crop="round"))
    with pytest.raises(RewardInputError, match="crop must be"):
        clip_preprocess(images, 16, crop="middle")


# ---------------------------------------------------------------------------------------------- CLIP family
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


def _clip_embeds(path: Path, images: torch.Tensor, prompts: list[str], crop_round: bool):
    from transformers import AutoProcessor, CLIPModel

    model, proc = CLIPModel.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)
    with torch.no_grad():
        out = model(pixel_values=_reference(images, 32, crop_round), **proc(text=prompts, padding=True,
                                                                             return_tensors="pt"))
    img = torch.nn.functional.normalize(out.image_embeds, dim=-1)
    txt = torch.nn.functional.normalize(out.text_embeds, dim=-1)
    return model, img, txt


def test_pickscore_scalings_batching_and_determinism(clip_dir):
    images = _images()
    model, img, txt = _clip_embeds(clip_dir, images, PROMPTS, crop_round=False)
    expected = model.logit_scale.exp() * (img * txt).sum(-1)
    raw = get_reward("pickscore", model=str(clip_dir), processor=None, device="cpu")(images, PROMPTS)["pickscore"]
    assert raw.shape == (3,) and torch.allclose(raw, expected, atol=1e-4)
    small = get_reward("pickscore", model=str(clip_dir), processor=None, device="cpu", batch_size=1,
                       scaling="flow_grpo")
    assert torch.allclose(small(images, PROMPTS)["pickscore"], raw / 26, atol=1e-5)  # Flow-GRPO's /26
    assert torch.equal(small(images, PROMPTS)["pickscore"], small(images, PROMPTS)["pickscore"])
    with pytest.raises(RewardInputError, match="scaling must be one of"):
        get_reward("pickscore", model=str(clip_dir), processor=None, scaling="half")


def test_clipscore_hessel_torchmetrics_cosine_prefix_and_nan(clip_dir):
    images = _images()
    _, img, txt = _clip_embeds(clip_dir, images, PROMPTS, crop_round=False)
    cos = (img * txt).sum(-1)
    build = lambda **kw: get_reward("clipscore", model=str(clip_dir), device="cpu", **kw)  # noqa: E731
    assert torch.allclose(build()(images, PROMPTS)["clipscore"], 2.5 * cos.clamp(min=0), atol=1e-5)
    assert torch.allclose(build(scaling="torchmetrics")(images, PROMPTS)["clipscore"], 100 * cos.clamp(min=0), atol=1e-3)
    raw = build(scaling="cosine", batch_size=2)(images, PROMPTS)["clipscore"]
    assert torch.allclose(raw, cos, atol=1e-5) and (raw.abs() <= 1).all()
    _, _, prefixed = _clip_embeds(clip_dir, images, ["a " + p for p in PROMPTS], crop_round=False)
    assert torch.allclose(build(scaling="cosine", text_prefix="a ")(images, PROMPTS)["clipscore"],
                          (img * prefixed).sum(-1), atol=1e-5)
    images[1, 0, 0, 0] = float("nan")
    out = build(scaling="cosine")(images, PROMPTS)["clipscore"]
    assert torch.isnan(out[1]) and torch.allclose(out[[0, 2]], cos[[0, 2]], atol=1e-5)


def test_aesthetic_mlp_on_normalised_clip_image_embedding(clip_dir, tmp_path):
    from visgen.rewards.aesthetic import AestheticMLP

    torch.manual_seed(1)
    mlp = AestheticMLP(8, (16, 8, 8, 4)).eval()
    torch.save(mlp.state_dict(), tmp_path / "aesthetic.pth")  # the predictor's published format: layers.*
    reward = get_reward("aesthetic", checkpoint=str(tmp_path / "aesthetic.pth"), clip_model=str(clip_dir),
                        hidden=[16, 8, 8, 4], device="cpu", scale=2.0)
    images = _images()
    _, img, _ = _clip_embeds(clip_dir, images, PROMPTS, crop_round=True)  # OpenAI CLIP / torchvision crop
    with torch.no_grad():
        expected = 2.0 * mlp(img).squeeze(-1)
    score = reward(images, ["", "", ""])["aesthetic"]
    assert torch.allclose(score, expected, atol=1e-5)
    assert torch.equal(score, reward(images, ["x", "y", "z"])["aesthetic"])  # prompt-independent
    with pytest.raises(RewardInputError, match="does not fit"):
        get_reward("aesthetic", checkpoint=str(tmp_path / "aesthetic.pth"), clip_model=str(clip_dir))
    with pytest.raises(RewardInputError, match="neither a file"):
        get_reward("aesthetic", checkpoint="missing.pth", clip_model=str(clip_dir))


# ---------------------------------------------------------------------------------------------- ImageReward
TINY_IR = {"image_size": 32,
           "vision": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "patch_size": 8},
           "text": {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "max_position_embeddings": 40},
           "mlp_hidden": [16, 8, 8, 4]}


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    from transformers import BertTokenizerFast

    path = tmp_path_factory.mktemp("bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted({w for p in PROMPTS for w in p.split()})
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt"), do_lower_case=True).save_pretrained(path)
    return path


def _to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This module's names -> BLIP/timm names of ImageReward.pt (written independently of the converter)."""
    out = {}
    for k, v in state.items():
        if k.startswith("vision."):
            k = (k[len("vision."):].replace("embeddings.class_embedding", "cls_token")
                 .replace("embeddings.position_embedding", "pos_embed")
                 .replace("embeddings.patch_embedding.", "patch_embed.proj.").replace("encoder.layers.", "blocks.")
                 .replace("layer_norm1", "norm1").replace("layer_norm2", "norm2").replace("self_attn.qkv", "attn.qkv")
                 .replace("self_attn.projection", "attn.proj").replace("post_layernorm.", "norm."))
            out["blip.visual_encoder." + k] = v
        elif k.startswith("text."):
            out["blip.text_encoder." + k[len("text."):]] = v
        else:
            out[k] = v
    out["blip.vision_proj.weight"] = torch.zeros(2, 2)  # keys the scorer does not use are ignored
    return out


def test_imagereward_from_original_checkpoint_matches_a_direct_forward(bert_dir, tmp_path):
    from transformers import AutoTokenizer

    from visgen.rewards.imagereward import MEAN, STD, ImageRewardModel, _merge, DEFAULT_CONFIG

    torch.manual_seed(0)
    model = ImageRewardModel(_merge(DEFAULT_CONFIG, TINY_IR)).eval()
    assert model.vision.config.layer_norm_eps == 1e-6  # BLIP's ViT, not transformers' default 1e-5
    torch.save(_to_original(model.state_dict()), tmp_path / "ImageReward.pt")
    reward = get_reward("imagereward", checkpoint=str(tmp_path / "ImageReward.pt"), tokenizer=str(bert_dir),
                        config=TINY_IR, device="cpu", batch_size=2)
    images = _images(3, 40, 56)
    tok = AutoTokenizer.from_pretrained(bert_dir)
    t = tok(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert t["input_ids"].shape == (3, 35)
    with torch.no_grad():
        raw = model(_reference(images, 32, crop_round=True), t["input_ids"], t["attention_mask"])
    score = reward(images, PROMPTS)["imagereward"]
    assert score.shape == (3,) and torch.allclose(score, (raw - MEAN) / STD, atol=1e-5)
    assert torch.equal(score, reward(images, PROMPTS)["imagereward"])
    one = torch.cat([reward(images[i:i + 1], PROMPTS[i:i + 1])["imagereward"] for i in range(3)])
    assert torch.allclose(one, score, atol=1e-6)  # batching changes nothing
    unscaled = get_reward("imagereward", checkpoint=str(tmp_path / "ImageReward.pt"), tokenizer=str(bert_dir),
                          config=TINY_IR, device="cpu", scaling="raw")
    assert torch.allclose(unscaled(images, PROMPTS)["imagereward"], raw, atol=1e-5)
    reward.save(str(tmp_path / "ir.safetensors"))  # grove's own names load as they are
    again = get_reward("imagereward", checkpoint=str(tmp_path / "ir.safetensors"), tokenizer=str(bert_dir),
                       config=TINY_IR, device="cpu")
    assert torch.allclose(again(images, PROMPTS)["imagereward"], score, atol=1e-6)
    broken = {k: v for k, v in _to_original(model.state_dict()).items() if "blocks.1." not in k}
    torch.save(broken, tmp_path / "broken.pt")
    with pytest.raises(RewardInputError, match="does not fit"):
        get_reward("imagereward", checkpoint=str(tmp_path / "broken.pt"), tokenizer=str(bert_dir), config=TINY_IR)
    with pytest.raises(RewardInputError, match="unknown key"):
        get_reward("imagereward", checkpoint=None, tokenizer=str(bert_dir), config={"depth": 3})


def test_pickscore_differentiable_call_is_the_scored_one_and_has_a_gradient(clip_dir):
    """DiffusionOPSD's path: the scored value (straight-through from the PIL path) with the torch pre-processing's
    gradient reaching the pixels (the other neural rewards: tests/visgen/test_rewards_differentiable.py)."""
    reward = get_reward("pickscore", model=str(clip_dir), processor=None, device="cpu")
    images = _images()
    scored = reward(images, PROMPTS)["pickscore"]
    x = images.clone().requires_grad_(True)
    value = reward.differentiable(x, PROMPTS)["pickscore"]
    assert torch.allclose(value.detach(), scored, atol=1e-4)
    (grad,) = torch.autograd.grad(value.sum(), x)
    assert grad.abs().sum() > 0
