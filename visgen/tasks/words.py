"""The embedded "words" text-rendering task: prompts ``a sign that says "WORD"``, ground-truth renders, a tokenizer.

A text-rendering task small enough to pretrain and RL-finetune a text-to-image model on a CPU, scored by a real
OCR model (``visgen.rewards.ocr``: PP-OCRv4 through RapidOCR, the model family of Flow-GRPO's OCR reward). The
words are every string of :data:`WORD_LENGTH` letters over the small alphabet :data:`ALPHABET` (letters the OCR
model never confuses with digits or each other: no I/J/O/Q), in a fixed order; :func:`split_words` holds a
seeded 20% of them out of pretraining and RL training, so the held-out OCR score measures whether the model
*composes* letters it has seen at each position into words it has never seen (like the shapes task's held-out
pairs).

Ground truth: the word in DejaVu Sans Mono Bold (it ships with matplotlib, so rendering needs nothing but PIL),
dark on a light sign, a monospaced font so that letter ``k`` always sits in the same columns, with jittered
brightness and a one-pixel position jitter. ``docs/tasks/words.md`` has the OCR read rate of these renders per
resolution and why the task uses 32x32.

Tokenizer (:func:`build_tokenizer`): word-level for the template words, but an upper-case run is split into
single letters (``"CAT"`` -> ``" C A T "``), so a held-out word is a sequence of known tokens, never ``<unk>``.
"""
from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .base import ImagePretrainConfig, ImageTask, register_task

IMAGE_SIZE = 32
ALPHABET = "ACEHKNRT"
WORD_LENGTH = 3
TEMPLATE = 'a sign that says "{word}"'
TEMPLATE_WORDS = ("a", "sign", "that", "says", '"')
FONT_FILE = "DejaVuSansMono-Bold.ttf"
# ground-truth appearance (fractions of full intensity); jittered per image
BACKGROUND = (0.82, 0.97)
INK = (0.02, 0.22)
POSITION_JITTER = 1  # pixels, each axis
# how the task reads its images (visgen.rewards.ocr arguments): detection + recognition, the detector's input
# resized to 64 px on the shorter side (reads the 32x32 ground truth like the default 736 px, 7x faster), one
# onnxruntime thread (it runs beside sampling). scripts/words_ocr_resolution.py measures the alternatives.
OCR_SETTINGS = {"mode": "det_rec", "det_limit_side_len": 64, "num_threads": 1}
_QUOTED = re.compile(r'"([^"]*)"')


@dataclass(frozen=True)
class WordSpec:
    """One prompt of the task: the word to render (its metadata)."""

    word: str

    @property
    def prompt(self) -> str:
        return TEMPLATE.format(word=self.word)

    def to_dict(self) -> dict:
        return {"word": self.word, "text": self.word, "kind": "word"}


def target_text(prompt: str) -> str | None:
    """The text a prompt asks to render: what stands between its first pair of double quotes (Flow-GRPO's rule),
    or None when the prompt quotes nothing."""
    m = _QUOTED.search(prompt)
    return m.group(1) if m else None


def parse_prompt(prompt: str) -> WordSpec:
    word = target_text(prompt)
    if word is None or TEMPLATE.format(word=word) != prompt:
        raise ValueError(f"not a words-task prompt: {prompt!r} (expected {TEMPLATE.format(word='WORD')!r})")
    return WordSpec(word)


def all_words(alphabet: str = ALPHABET, length: int = WORD_LENGTH) -> list[str]:
    """Every ``length``-letter string over ``alphabet``, in lexicographic order (512 for the defaults)."""
    return ["".join(t) for t in itertools.product(alphabet, repeat=length)]


def all_prompts() -> list[WordSpec]:
    return [WordSpec(w) for w in all_words()]


def split_prompts(seed: int = 0, eval_fraction: float = 0.2) -> tuple[list[WordSpec], list[WordSpec]]:
    """Deterministic, disjoint (train, held-out) split of :func:`all_prompts`: a ``numpy`` permutation seeded
    ``seed``; the first ``round(eval_fraction * n)`` words are held out; both lists keep the fixed order."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    specs = all_prompts()
    order = np.random.default_rng(seed).permutation(len(specs))
    n_eval = int(round(eval_fraction * len(specs)))
    held = set(order[:n_eval].tolist())
    return [s for i, s in enumerate(specs) if i not in held], [s for i, s in enumerate(specs) if i in held]


def vocabulary() -> list[str]:
    """The tokenizer's words after the special tokens: the template words, then the letters."""
    return list(TEMPLATE_WORDS) + list(ALPHABET)


def build_tokenizer(model_max_length: int = 16):
    """``tiny.build_tokenizer``'s vocabulary (same ids) with case kept and upper-case runs split into letters."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from visgen.tiny import SPECIAL_TOKENS

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in vocabulary():
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Split(Regex("[A-Z]"), behavior="isolated")])
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=model_max_length, padding_side="right")


def font_path() -> str:
    """DejaVu Sans Mono Bold from matplotlib's bundled fonts (offline)."""
    import matplotlib

    path = os.path.join(matplotlib.get_data_path(), "fonts", "ttf", FONT_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{FONT_FILE} not found under matplotlib's data path ({path}); reinstall matplotlib")
    return path


@lru_cache(maxsize=32)
def _font(size: int):
    from PIL import ImageFont

    return ImageFont.truetype(font_path(), size)


def font_size_for(size: int, text: str = "W" * WORD_LENGTH, fill: float = 0.86) -> int:
    """The largest font size at which ``text`` spans at most ``fill`` of the width and 0.7 of the height."""
    from PIL import Image, ImageDraw

    draw = ImageDraw.Draw(Image.new("L", (size, size)))
    fs = 4
    while True:
        left, top, right, bottom = draw.textbbox((0, 0), text, font=_font(fs + 1))
        if right - left > fill * size or bottom - top > 0.7 * size:
            return fs
        fs += 1


def render(word: str, rng: np.random.Generator | None = None, size: int = IMAGE_SIZE,
           jitter: bool = True) -> np.ndarray:
    """``word`` on a light sign: float32 ``[3,size,size]`` in [0,1]. ``rng`` draws the jitter (brightness of
    sign and ink, a slight tint, +-1 px position); ``jitter=False`` or ``rng=None`` gives the canonical render."""
    from PIL import Image, ImageDraw

    jitter = jitter and rng is not None
    if jitter:
        bg = rng.uniform(*BACKGROUND) - rng.uniform(0, 0.04, size=3)
        ink = rng.uniform(*INK) + rng.uniform(0, 0.04, size=3)
        dx, dy = rng.integers(-POSITION_JITTER, POSITION_JITTER + 1, size=2)
    else:
        bg, ink, dx, dy = np.full(3, 0.9), np.full(3, 0.1), 0, 0
    img = Image.new("RGB", (size, size), tuple(int(round(255 * v)) for v in bg))
    draw = ImageDraw.Draw(img)
    font = _font(font_size_for(size))
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    x = (size - (right - left)) / 2 - left + int(dx)
    y = (size - (bottom - top)) / 2 - top + int(dy)
    draw.text((x, y), word, fill=tuple(int(round(255 * v)) for v in ink), font=font)
    return (np.asarray(img, dtype=np.float32) / 255.0).transpose(2, 0, 1).copy()


def render_batch(specs, seed: int = 0, size: int = IMAGE_SIZE) -> np.ndarray:
    """``[N,3,size,size]`` renders of ``specs`` (WordSpec or str) with jitter drawn from one seeded generator."""
    rng = np.random.default_rng(seed)
    return np.stack([render(s.word if isinstance(s, WordSpec) else s, rng, size) for s in specs])


# ------------------------------------------------------------------------------------------------ the registered task
@dataclass
class WordsPretrainConfig(ImagePretrainConfig):
    """Pretraining settings of the words task: the shared ones plus the image size and the pipeline's shape."""

    resolution: int = field(default=IMAGE_SIZE, metadata={
        "help": "image side in pixels (32: the smallest the OCR model reads reliably, docs/tasks/words.md)"})
    pipeline: dict = field(default_factory=dict, metadata={"help": "extra visgen.tiny.build_pipeline arguments"})


@lru_cache(maxsize=1)
def _ocr_reader():
    """The task's OCR reward (one per process: building it loads the ONNX models)."""
    from visgen.rewards.ocr import OcrReward

    return OcrReward(**OCR_SETTINGS)


@register_task
class WordsTask(ImageTask):
    """RL prompts from the seeded word split, read by the ``ocr`` reward; pretrains the tiny SD3 with a tokenizer
    that spells the quoted word letter by letter."""

    name = "words"
    eval_reward = ("ocr", OCR_SETTINGS)
    pretrain_config = WordsPretrainConfig

    def split_prompts(self, seed: int, eval_fraction: float) -> tuple[list, list]:
        return split_prompts(seed, eval_fraction)

    def eval_metrics(self, scores: dict) -> dict[str, float]:
        """``eval/ocr_exact``: the fraction of words read exactly (OCR score 1)."""
        if "ocr" not in scores:
            return {}
        ok = scores["ocr"].isfinite()
        return {"eval/ocr_exact": float((scores["ocr"][ok] == 1).float().mean()) if ok.any() else float("nan")}

    def render(self, spec, rng, conf) -> np.ndarray:
        return render(spec.word, rng, conf.resolution)

    def build_pipeline(self, conf):
        from visgen import tiny

        pipe = tiny.build_pipeline(words=vocabulary(), seed=conf.seed, sample_size=conf.resolution, **conf.pipeline)
        pipe.tokenizer = pipe.tokenizer_2 = build_tokenizer()  # same ids; spells the quoted word
        return pipe

    def score(self, samples, specs: list) -> dict[str, float]:
        """OCR score (1 - normalised edit distance) and exact-read rate (``visgen.rewards.ocr``)."""
        score = _ocr_reader()(samples, [s.prompt for s in specs])["ocr"]
        return {"ocr": float(score.nanmean()), "exact": float((score == 1).float().mean())}

    def after_vae(self, vae, held_out: list, conf) -> dict[str, float]:
        """``vae/ocr``: the OCR score of the VAE's reconstructions of 64 held-out renders (is the latent space
        legible?)."""
        import torch

        truth = torch.from_numpy(render_batch(held_out[:64], seed=123, size=conf.resolution))
        with torch.no_grad():
            recon = (vae.decode(vae.encode(truth * 2 - 1).latent_dist.mean).sample / 2 + 0.5).clamp(0, 1)
        return {"vae/ocr": self.score(recon, held_out[:64])["ocr"]}
