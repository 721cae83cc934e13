"""OCR reward: does the image show the text the prompt quotes? A real OCR model that runs offline.

Flow-GRPO (Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025) trains text rendering on
PaddleOCR's reading of the image: the target is the text between the prompt's first pair of double quotes, both
strings are lower-cased with spaces removed, and the score is ``1 - d / len(target)`` where ``d`` is the
Levenshtein distance, capped at ``len(target)``, and ``d = 0`` when the target occurs inside the reading (so a
legible target next to extra text still scores 1). That definition is implemented here (:func:`ocr_score`) on
PP-OCRv4 — the same PaddleOCR model family — run by ``rapidocr-onnxruntime``, whose wheel ships the detection and
recognition ONNX models (no download, no GPU): ``pip install 'grove[ocr]'``.

Modes: ``det_rec`` (default, what PaddleOCR's ``ocr()`` does: detect text boxes, recognise each, keep readings
with confidence >= ``text_score``, join them top-to-bottom, left-to-right) or ``rec`` (recognise the whole image
as one text line, for tasks whose images *are* the text, such as ``visgen.tasks.words``). Images are converted to
uint8 BGR (the models were trained on OpenCV-loaded images). Small images: the detector resizes its input so
the shorter side is ``det_limit_side_len`` (RapidOCR's default 736 makes a 32-pixel image cost ~120 ms; 64 reads
the words task's 32x32 ground truth as well in 16 ms, ``docs/tasks/words.md``) and ``upscale`` enlarges the image
(bicubic) before anything else. Recognition runs in batches of ``rec_batch_size`` crops (on one CPU thread 4-6
was fastest; 64 was 7x slower per crop).

Target text: ``metadata[i]["text"]`` when given, else the prompt's quotes; a prompt with neither is a
``RewardInputError``. NaN images score NaN. Output name: ``ocr`` (or ``name``), in [0, 1].
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch

from .base import RewardInfo, RewardInputError, check_batch, finite_rows, register, to_uint8

MODES = ("det_rec", "rec")


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def normalise(text: str, case_sensitive: bool = False) -> str:
    text = "".join(text.split())
    return text if case_sensitive else text.lower()


def ocr_score(recognised: str, target: str, case_sensitive: bool = False) -> float:
    """Flow-GRPO's OCR reward: 1 - min(d, |t|)/|t| with d = 0 when the target occurs in the reading."""
    r, t = normalise(recognised, case_sensitive), normalise(target, case_sensitive)
    if not t:
        raise RewardInputError("ocr: the target text is empty (spaces only?)")
    d = 0 if t in r else min(levenshtein(r, t), len(t))
    return 1.0 - d / len(t)


def quoted_text(prompt: str) -> str | None:
    """The text between the first pair of double quotes (straight or typographic), or None."""
    p = prompt.replace("\u201c", '"').replace("\u201d", '"')
    parts = p.split('"')
    return parts[1] if len(parts) >= 3 else None


def target_texts(prompts: Sequence[str], metadata: Sequence[dict] | None) -> list[str]:
    metas = metadata if metadata is not None else [None] * len(prompts)
    out = []
    for i, (prompt, meta) in enumerate(zip(prompts, metas)):
        text = meta.get("text") if isinstance(meta, dict) else None
        text = text if text is not None else quoted_text(prompt)
        if text is None or not normalise(str(text)):
            raise RewardInputError(f"ocr: prompt {i} {prompt!r} quotes no text (write it as ... \"TEXT\" ...) and its "
                                   "metadata has no 'text'")
        out.append(str(text))
    return out


def _engine(mode: str, det_limit_side_len: int, text_score: float, num_threads: int, device: str,
            rec_batch_size: int, det_model_path: str | None, rec_model_path: str | None):
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError:
        raise RewardInputError("the 'ocr' reward needs rapidocr-onnxruntime: pip install 'grove[ocr]'") from None
    threads = num_threads if num_threads > 0 else -1
    cuda = device.startswith("cuda")
    kwargs = dict(intra_op_num_threads=threads, inter_op_num_threads=threads, text_score=text_score,
                  det_limit_side_len=det_limit_side_len, rec_batch_num=rec_batch_size, det_use_cuda=cuda,
                  rec_use_cuda=cuda, cls_use_cuda=cuda)
    if det_model_path:
        kwargs["det_model_path"] = det_model_path
    if rec_model_path:
        kwargs["rec_model_path"] = rec_model_path
    try:
        return RapidOCR(**kwargs)
    except Exception as exc:  # noqa: BLE001 — a missing model file, an ONNX that does not load
        raise RewardInputError(f"ocr: cannot build the RapidOCR engine ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


class OcrReward:
    """PP-OCRv4 reading scored against the quoted text (see the module docstring)."""

    def __init__(self, mode: str = "det_rec", det_limit_side_len: int = 736, upscale: int = 1,
                 text_score: float = 0.5, case_sensitive: bool = False, num_threads: int = 0, device: str = "cpu",
                 rec_batch_size: int = 6, det_model_path: str | None = None, rec_model_path: str | None = None,
                 name: str = "ocr") -> None:
        if mode not in MODES:
            raise RewardInputError(f"ocr: mode must be one of {list(MODES)}, got {mode!r}")
        if det_limit_side_len < 32 or upscale < 1 or rec_batch_size < 1 or num_threads < 0:
            raise RewardInputError("ocr: det_limit_side_len must be >= 32, upscale and rec_batch_size >= 1, "
                                   "num_threads >= 0 (0: onnxruntime's default)")
        if not 0 <= text_score < 1:
            raise RewardInputError(f"ocr: text_score must be in [0, 1), got {text_score}")
        self.mode, self.upscale, self.case_sensitive, self.name = mode, int(upscale), bool(case_sensitive), name
        self.engine = _engine(mode, int(det_limit_side_len), float(text_score), int(num_threads), device,
                              int(rec_batch_size), det_model_path, rec_model_path)
        self._lock = threading.Lock()  # one engine, callers on several threads (overlapped scoring, the server)

    def _bgr(self, pixels: np.ndarray) -> np.ndarray:
        if self.upscale > 1:
            from PIL import Image

            h, w = pixels.shape[:2]
            pixels = np.asarray(Image.fromarray(pixels).resize((w * self.upscale, h * self.upscale), Image.BICUBIC))
        return np.ascontiguousarray(pixels[..., ::-1])

    def read(self, images: torch.Tensor) -> list[str]:
        """What the OCR model reads in each ``[3,H,W]`` image of the batch (no scoring)."""
        pixels = [self._bgr(p) for p in to_uint8(images)]
        with self._lock:
            if self.mode == "rec":
                results, _ = self.engine.text_rec(pixels)
                return [text if score >= self.engine.text_score else "" for text, score in results]
            texts = []
            for img in pixels:
                result, _ = self.engine(img, use_cls=False)
                texts.append("".join(r[1] for r in result) if result else "")
            return texts

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        targets = target_texts(prompts, metadata)
        ok = finite_rows(images)
        scores = torch.full((images.shape[0],), float("nan"))
        idx = torch.nonzero(ok).flatten()
        if idx.numel():
            texts = self.read(images[idx])
            for i, text in zip(idx.tolist(), texts):
                scores[i] = ocr_score(text, targets[i], self.case_sensitive)
        return {self.name: scores}


@register("ocr", RewardInfo(weights="PP-OCRv4 det + rec ONNX models inside the rapidocr-onnxruntime wheel (no "
                                    "download)", licence="Apache-2.0 (PaddleOCR models, RapidOCR)",
                            range="[0, 1]; 1 = the quoted text is read exactly", extra="ocr (rapidocr-onnxruntime)",
                            summary="1 - normalised edit distance between the OCR reading and the prompt's quoted "
                                    "text (Flow-GRPO)"))
def build_ocr(mode: str = "det_rec", det_limit_side_len: int = 736, upscale: int = 1, text_score: float = 0.5,
              case_sensitive: bool = False, num_threads: int = 0, device: str = "cpu", rec_batch_size: int = 6,
              det_model_path: str | None = None, rec_model_path: str | None = None, name: str = "ocr") -> OcrReward:
    return OcrReward(mode, det_limit_side_len, upscale, text_score, case_sensitive, num_threads, device,
                     rec_batch_size, det_model_path, rec_model_path, name)
