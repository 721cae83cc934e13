"""The client of ``grove reward-server`` (``visgen.rewards.server``): reward ``remote``.

Images are quantised to uint8 and sent as base64 PNG in JSON (never pickle) to ``POST {url}/score``, at most
``batch_size`` per request. Each request has its own ``timeout_s``; a connection error, a time-out, a 5xx answer
or a malformed reply (not JSON, wrong field, wrong length, a non-number) is retried ``retries`` times with
exponential back-off from ``backoff_s``, then raises :class:`RemoteRewardError` with one line naming the URL, the
attempts and the last cause (the domain's ``reward_guard`` turns that into NaN or a stop). A 4xx answer means the
request itself is wrong (too big, malformed, a prompt the reward rejects): it is a ``RewardInputError`` at once,
never retried. Outputs: a single server output is returned as ``name`` (default ``remote``; ``null`` keeps the
server's name); several keep the server's names.
"""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from typing import Sequence

import torch

from .base import RewardInfo, RewardInputError, check_batch, register, to_uint8
from .server import encode_png


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or answered garbage after every retry."""


class _Malformed(Exception):
    pass


class RemoteReward:
    def __init__(self, url: str = "http://127.0.0.1:8765", timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, batch_size: int = 64, name: str | None = "remote") -> None:
        if not url.startswith(("http://", "https://")):
            raise RewardInputError(f"remote: url must start with http:// or https://, got {url!r}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or batch_size < 1:
            raise RewardInputError("remote: timeout_s > 0, retries >= 0, backoff_s >= 0 and batch_size >= 1 required")
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
        self.batch_size, self.name = int(batch_size), name
        self.attempts = 0  # HTTP requests sent (tests count retries with it)

    def _post(self, payload: dict) -> dict:
        body = json.dumps(payload).encode()
        req = urllib.request.Request(self.url + "/score", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        self.attempts += 1
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            raw = resp.read()
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _Malformed(f"the reply is not JSON ({raw[:60]!r})") from None

    @staticmethod
    def _scores(reply: dict, n: int) -> dict[str, torch.Tensor]:
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, dict) or not scores:
            raise _Malformed("the reply has no 'scores' object")
        out = {}
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != n:
                raise _Malformed(f"scores[{key!r}] is not a list of {n} values")
            if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
                raise _Malformed(f"scores[{key!r}] holds a value that is neither a number nor null")
            out[str(key)] = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
        return out

    def _request(self, payload: dict, n: int) -> dict[str, torch.Tensor]:
        last = "no attempt"
        for attempt in range(self.retries + 1):
            try:
                return self._scores(self._post(payload), n)
            except urllib.error.HTTPError as exc:
                try:
                    message = json.loads(exc.read().decode("utf-8")).get("error", "")
                except Exception:  # noqa: BLE001 — an error page that is not JSON
                    message = exc.reason
                if 400 <= exc.code < 500:
                    raise RewardInputError(f"remote reward {self.url}: the server refused the request "
                                           f"({exc.code}: {message})") from None
                last = f"HTTP {exc.code}: {message}"
            except _Malformed as exc:
                last = f"malformed reply: {exc}"
            except (urllib.error.URLError, OSError) as exc:  # refused, reset, time-out
                reason = getattr(exc, "reason", exc)
                last = f"{type(reason).__name__}: {reason}"
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise RemoteRewardError(f"remote reward {self.url} failed after {self.retries + 1} attempts (last: {last}); "
                                "is `grove reward-server` running there?")

    def health(self) -> dict:
        """``GET /health`` (one attempt, ``timeout_s``); RemoteRewardError when unreachable."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=self.timeout_s) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise RemoteRewardError(f"remote reward {self.url}: /health failed ({exc})") from None

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        finite = torch.isfinite(images.detach()).flatten(1).all(1)
        pixels = to_uint8(images)
        n = images.shape[0]
        parts: list[dict[str, torch.Tensor]] = []
        for start in range(0, n, self.batch_size):
            stop = min(n, start + self.batch_size)
            payload = {"images": [encode_png(p) for p in pixels[start:stop]], "prompts": list(prompts[start:stop])}
            if metadata is not None:
                payload["metadata"] = [dict(m) for m in metadata[start:stop]]
            parts.append(self._request(payload, stop - start))
        names = list(parts[0])
        if any(list(p) != names for p in parts):
            raise RemoteRewardError(f"remote reward {self.url}: the outputs changed between requests")
        out = {k: torch.cat([p[k] for p in parts]) for k in names}
        for k in out:
            out[k][~finite] = math.nan  # a NaN image was sent as zeros: never let it score
        if self.name and len(out) == 1:
            out = {self.name: next(iter(out.values()))}
        return out


@register("remote", RewardInfo(weights="none here: whatever `grove reward-server --reward NAME` serves",
                               licence="that of the served reward", range="that of the served reward",
                               summary="a reward served by `grove reward-server` (JSON + PNG over HTTP)"))
def build_remote(url: str = "http://127.0.0.1:8765", timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, batch_size: int = 64, name: str | None = "remote") -> RemoteReward:
    return RemoteReward(url, timeout_s, retries, backoff_s, batch_size, name)
