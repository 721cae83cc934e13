"""The OCR reward with the real PP-OCRv4 model (rapidocr-onnxruntime's wheel ships it): text rendered here with
PIL, the Flow-GRPO score definition, target extraction, NaN and error handling; and the words task."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from visgen.rewards import RewardInputError, get_reward
from visgen.rewards.ocr import levenshtein, ocr_score, quoted_text
from visgen.tasks import words

pytest.importorskip("rapidocr_onnxruntime", reason="the ocr reward needs the ocr extra: pip install 'grove[ocr]'")
torch.set_num_threads(1)


def _sign(text: str, width: int = 128, height: int = 48, size: int = 24) -> torch.Tensor:
    """Black DejaVu Sans Bold ``text`` on white (matplotlib's bundled font), as a [3,H,W] tensor in [0,1]."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(words.font_path().replace("SansMono-Bold", "Sans-Bold"), size)
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    if text:
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        draw.text(((width - right + left) / 2 - left, (height - bottom + top) / 2 - top), text, fill=(0, 0, 0), font=font)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255.0


@pytest.fixture(scope="module")
def ocr():
    return get_reward("ocr", det_limit_side_len=96, num_threads=1)


def test_score_definition_is_flow_grpos():
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert ocr_score("HELLO", "hello") == 1.0  # case and spaces are ignored
    assert ocr_score("H E L L O", "hello") == 1.0
    assert ocr_score("HELO", "hello") == pytest.approx(0.8)
    assert ocr_score("", "hello") == 0.0
    assert ocr_score("xxhelloxx", "hello") == 1.0  # the target inside a longer reading counts as read
    assert ocr_score("completely unrelated text", "hi") == 0.0  # distance capped at len(target)
    assert ocr_score("Hello", "hello", case_sensitive=True) == pytest.approx(0.8)
    assert quoted_text('a sign that says "OPEN now"') == "OPEN now"
    assert quoted_text("a sign that says \u201cSTOP\u201d") == "STOP"
    assert quoted_text("no quotes") is None


def test_real_ocr_reads_rendered_text_right_misspelled_blank(ocr):
    images = torch.stack([_sign("HELLO"), _sign("HELO"), _sign(""), _sign("WORLD", 160)[:, :, 16:144]])
    prompts = ['a sign that says "hello"'] * 3 + ['a sign that says "world"']
    score = ocr(images, prompts)["ocr"]
    assert score.shape == (4,) and score.dtype == torch.float32
    assert score[0] == 1.0 and score[3] == 1.0
    assert 0.5 <= score[1] < 1.0  # one letter missing: 1 - 1/5
    assert score[2] == 0.0
    assert ocr.read(images[:1]) == ["HELLO"]
    # batched = one at a time; deterministic
    again = torch.cat([ocr(images[i:i + 1], prompts[i:i + 1])["ocr"] for i in range(4)])
    assert torch.equal(score, again) and torch.equal(score, ocr(images, prompts)["ocr"])


def test_metadata_text_nan_and_errors(ocr):
    images = torch.stack([_sign("OPEN"), _sign("OPEN")])
    images[1, 0, 0, 0] = float("nan")
    out = ocr(images, ["a shop sign", "a shop sign"], [{"text": "open"}, {"text": "open"}])["ocr"]
    assert out[0] == 1.0 and torch.isnan(out[1])
    with pytest.raises(RewardInputError, match="quotes no text"):
        ocr(images[:1], ["a shop sign"])
    with pytest.raises(RewardInputError, match="mode must be one of"):
        get_reward("ocr", mode="fast")
    with pytest.raises(RewardInputError, match="2 prompts for 1 images"):
        ocr(images[:1], ['"a"', '"b"'])


def test_rec_mode_reads_a_whole_image_line():
    reward = get_reward("ocr", mode="rec", num_threads=1)
    score = reward(torch.stack([_sign("STOP"), _sign("STAR")]), ['"STOP"', '"STOP"'])["ocr"]
    assert score[0] == 1.0 and score[1] == pytest.approx(0.5)


def test_words_task_split_tokenizer_and_legible_ground_truth():
    train, held = words.split_prompts(0, 0.2)
    assert len(train) + len(held) == len(words.ALPHABET) ** words.WORD_LENGTH == 512
    assert not {s.word for s in train} & {s.word for s in held} and len(held) == 102
    assert words.split_prompts(0, 0.2) == (train, held) and words.split_prompts(1, 0.2)[1] != held
    for pos in range(words.WORD_LENGTH):  # every letter is seen at every position in training
        assert {s.word[pos] for s in train} == set(words.ALPHABET)
    spec = held[0]
    assert words.parse_prompt(spec.prompt) == spec and spec.prompt == f'a sign that says "{spec.word}"'
    with pytest.raises(ValueError, match="not a words-task prompt"):
        words.parse_prompt("a red circle")
    tok = words.build_tokenizer()
    ids = tok('a sign that says "CAT"').input_ids
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens == ["<bos>", "a", "sign", "that", "says", '"', "C", "A", "T", '"', "<eos>"]  # spelled out
    assert tok.convert_ids_to_tokens(tok('"CZ"').input_ids)[3] == "<unk>"  # Z is outside the alphabet
    image = words.render("CAT", np.random.default_rng(0))
    assert image.shape == (3, 32, 32) and image.dtype == np.float32 and 0 <= image.min() < image.max() <= 1
    assert np.array_equal(words.render("CAT", None), words.render("CAT", None))
    ocr = get_reward("ocr", **{**words.OCR_SETTINGS})
    sample = held[::9]
    truth = torch.from_numpy(words.render_batch(sample, seed=0))
    score = ocr(truth, [s.prompt for s in sample])["ocr"]
    assert score.mean() >= 0.95  # the 32x32 ground truth is legible to the OCR model
    assert ocr(truth[:4], [sample[(i + 1) % 4].prompt for i in range(4)])["ocr"].mean() < 0.8


def test_words_task_trains_and_evaluates_in_the_domain(tmp_path):
    """task: words end to end on a tiny random words pipeline: the OCR reward trains, eval/ocr and eval/ocr_exact
    are reported on the 102 held-out words' prompts (here 3 of them)."""
    from shared_rl.config import ConfigError, load_train_config
    from shared_rl.trainer import Trainer
    from visgen import tiny

    pipe = tiny.build_pipeline(words=words.vocabulary(), seed=0, sample_size=32, vae_channels=(8, 16), num_layers=1,
                               num_heads=2, head_dim=8, text_hidden=16)
    pipe.tokenizer = pipe.tokenizer_2 = words.build_tokenizer()
    tiny.save_pipeline(pipe, tmp_path / "words-tiny", {"task": "words"})
    data = {"domain": "visgen", "seed": 0, "iterations": 1, "rollout": {"groups_per_iteration": 2, "group_size": 2},
            "logging": {"progress": False},
            "visgen": {"model": str(tmp_path / "words-tiny"), "task": "words", "num_inference_steps": 3,
                       "rewards": [{"name": "ocr", "kwargs": dict(words.OCR_SETTINGS)}],
                       "eval": {"max_prompts": 3, "samples_per_prompt": 1, "grid_prompts": 0}}}
    tr = Trainer(load_train_config(data), None, log=lambda *_: None)
    assert tr.domain.train_prompts[0].startswith('a sign that says "') and len(tr.domain.train_prompts) == 410
    history = tr.fit()
    assert {"eval/ocr", "eval/ocr_exact"} <= set(history[0]) and "reward/ocr/mean" in history[1]
    assert 0 <= history[-1]["eval/ocr"] <= 1
    bad = {**data, "visgen": {**data["visgen"], "train_prompts": "x.txt"}}
    with pytest.raises(ConfigError, match="the words task has its own"):
        load_train_config(bad)
