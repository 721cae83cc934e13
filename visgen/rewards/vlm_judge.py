"""A vision-language model as the judge, through any OpenAI-compatible chat-completions endpoint.

UnifiedReward (Wang et al., "Unified Reward Model for Multimodal Understanding and Generation", 2025; used by
Pref-GRPO) and general VLMs (Qwen2.5-VL, ...) are served by vLLM / SGLang / TGI behind ``POST
{base_url}/chat/completions``. Each image goes as a PNG data URL next to a question built from ``question``
(``{prompt}`` is replaced by the generation prompt), temperature 0, and the reply is parsed robustly:

- ``mode: yes_no``: the first standalone "yes" or "no" (any case, punctuation around it ignored) -> 1 / 0;
- ``mode: scale``: the first number in ``[1, max_score]`` ("8", "8/10", "Score: 8.5") -> ``(n - 1) / (max_score
  - 1)`` in [0, 1].

A reply with neither, an HTTP error, a malformed JSON body, a reply cut short or a time-out (``timeout_s`` for the whole request, its own,
independent of the domain's ``reward_guard``) is retried ``retries`` times with exponential back-off
(``backoff_s``); after the last attempt that *image* scores NaN (masked and counted by the trainer), the rest of
the batch keeps its scores. ``max_workers`` requests run concurrently. The API key, if the server needs one, is
read from the environment variable named by ``api_key_env`` (never from the YAML). Output name: ``vlm_judge``.
"""
from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import math
import os
import re
import time
import http.client
from typing import Sequence

import numpy as np
import torch

from .base import RewardInfo, RewardInputError, check_batch, finite_rows, register, to_uint8
from .remote import _fetch

QUESTIONS = {
    "yes_no": 'Does this image match the description "{prompt}"? Answer with yes or no.',
    "scale": 'Rate how well this image matches the description "{prompt}" and how good it looks, on a scale of 1 '
             "to {max_score}. Answer with the number only.",
}
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)")


def parse_yes_no(text: str) -> float:
    m = _YES_NO.search(text or "")
    return math.nan if m is None else float(m.group(1).lower() == "yes")


def parse_scale(text: str, max_score: int) -> float:
    """The first number in [1, max_score], mapped to [0, 1]; NaN when there is none."""
    for m in _NUMBER.finditer(text or ""):
        value = float(m.group(1))
        if 1 <= value <= max_score:
            return (value - 1) / (max_score - 1)
    return math.nan


def png_data_url(pixels: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class VlmJudge:
    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", model: str = "UnifiedReward", mode: str = "scale",
                 question: str | None = None, max_score: int = 10, timeout_s: float = 60.0, retries: int = 2,
                 backoff_s: float = 0.5, max_workers: int = 4, max_tokens: int = 16, api_key_env: str | None = None,
                 name: str = "vlm_judge") -> None:
        if mode not in QUESTIONS:
            raise RewardInputError(f"vlm_judge mode must be one of {sorted(QUESTIONS)}, got {mode!r}")
        if max_score < 2 or timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_workers < 1 or max_tokens < 1:
            raise RewardInputError("vlm_judge: max_score >= 2, timeout_s > 0, retries >= 0, backoff_s >= 0, "
                                   "max_workers >= 1 and max_tokens >= 1 are required")
        if not base_url.startswith(("http://", "https://")):
            raise RewardInputError(f"vlm_judge base_url must start with http:// or https://, got {base_url!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.mode, self.max_score = model, mode, int(max_score)
        self.question = question or QUESTIONS[mode]
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
        self.max_workers, self.max_tokens, self.name = int(max_workers), int(max_tokens), name
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not self.api_key:
            raise RewardInputError(f"vlm_judge: environment variable {api_key_env} (api_key_env) is not set")
        self.failures = 0  # images that scored NaN so far (logged by the caller, tested)

    def _request(self, pixels: np.ndarray, prompt: str) -> str:
        body = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens, "messages": [{
            "role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(pixels)}},
                {"type": "text", "text": self.question.format(prompt=prompt, max_score=self.max_score)}]}]}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # timeout_s bounds the whole request (a server trickling its reply is cut off), as the remote reward's
        status, raw = _fetch(self.url, "POST", json.dumps(body).encode(), self.timeout_s, headers)
        if status >= 400:
            raise ValueError(f"HTTP {status}")
        reply = json.loads(raw.decode("utf-8"))
        content = reply["choices"][0]["message"]["content"]
        if isinstance(content, list):  # some servers return content parts
            content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
        return str(content)

    def parse(self, text: str) -> float:
        return parse_yes_no(text) if self.mode == "yes_no" else parse_scale(text, self.max_score)

    def score_one(self, pixels: np.ndarray, prompt: str) -> float:
        for attempt in range(self.retries + 1):
            try:
                value = self.parse(self._request(pixels, prompt))
                if not math.isnan(value):
                    return value
            except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError):
                pass  # connection refused, time-out, HTTP error, a reply cut short, malformed JSON: retried
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        self.failures += 1
        return math.nan

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        ok = finite_rows(images).tolist()
        pixels = to_uint8(images)
        scores = [math.nan] * len(prompts)
        with cf.ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            futures = {pool.submit(self.score_one, pixels[i], prompts[i]): i for i in range(len(prompts)) if ok[i]}
            for future, i in futures.items():
                scores[i] = future.result()
        return {self.name: torch.tensor(scores, dtype=torch.float32)}


@register("vlm_judge", RewardInfo(weights="none here: the VLM you serve (UnifiedReward, Qwen2.5-VL, ...) behind an "
                                          "OpenAI-compatible endpoint", licence="that of the served model",
                                  range="[0, 1] (yes/no -> 1/0; 1..max_score -> (n-1)/(max_score-1))",
                                  summary="a VLM judge over an OpenAI-compatible chat endpoint, parsed robustly"))
def build_vlm_judge(base_url: str = "http://127.0.0.1:8000/v1", model: str = "UnifiedReward", mode: str = "scale",
                    question: str | None = None, max_score: int = 10, timeout_s: float = 60.0, retries: int = 2,
                    backoff_s: float = 0.5, max_workers: int = 4, max_tokens: int = 16,
                    api_key_env: str | None = None, name: str = "vlm_judge") -> VlmJudge:
    return VlmJudge(base_url, model, mode, question, max_score, timeout_s, retries, backoff_s, max_workers,
                    max_tokens, api_key_env, name)
