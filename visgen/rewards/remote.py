"""The client of ``grove reward-server`` (``visgen.rewards.server``): reward ``remote``.

Images are quantised to uint8 and sent as base64 PNG in JSON (never pickle) to ``POST {url}/score``, at most
``batch_size`` per request. ``timeout_s`` bounds each request as a whole — connecting, sending, the answer's
headers and body — not each socket read: a server that trickles a byte every half second is cut off at the
deadline (a watchdog shuts the socket down). A connection error, a time-out, a 5xx answer, a reply cut short
(``IncompleteRead``, a dropped connection) or a malformed reply (not JSON, wrong field, wrong length, a
non-number) is retried ``retries`` times with
exponential back-off from ``backoff_s``, then raises :class:`RemoteRewardError` with one line naming the URL, the
attempts and the last cause (the domain's ``reward_guard`` turns that into NaN or a stop). A 4xx answer means the
request itself is wrong (too big, malformed, a prompt the reward rejects): it is a ``RewardInputError`` at once,
never retried. Outputs: a single server output is returned as ``name`` (default ``remote``; ``null`` keeps the
server's name); several keep the server's names. The client speaks HTTP itself (``http.client``), so proxy
environment variables are not used: point ``url`` at the server.
"""
from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
import urllib.parse
from typing import Sequence

import torch

from .base import RewardInfo, RewardInputError, check_batch, register, to_uint8
from .server import encode_png


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or answered garbage after every retry."""


class _Malformed(Exception):
    pass


class _HTTPStatus(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"HTTP {code}: {message}")
        self.code, self.message = code, message


def _fetch(url: str, method: str, body: bytes | None, timeout_s: float,
           headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """(status, body) of one HTTP request that takes at most ``timeout_s`` in all; TimeoutError past it. Shared by
    the remote reward and the VLM judge (``vlm_judge.py``)."""
    parts = urllib.parse.urlsplit(url)
    conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_class(parts.hostname or "", parts.port, timeout=timeout_s)
    expired = threading.Event()
    sockets: list[socket.socket] = []  # the connection's socket (the response keeps using it after a
    #                                    'Connection: close' reply, when conn.sock is already None)

    def cut_off() -> None:  # unblocks a read that keeps receiving a byte now and then
        expired.set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout_s, cut_off)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()  # bounded by the socket time-out
        sockets.append(conn.sock)
        if expired.is_set():
            cut_off()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sent = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers={**sent, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise TimeoutError(f"no complete answer within {timeout_s:g}s") from None
        raise exc
    finally:
        watchdog.cancel()
        conn.close()


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
        self.attempts += 1
        status, raw = _fetch(self.url + "/score", "POST", json.dumps(payload).encode(), self.timeout_s)
        if status >= 400:
            try:
                message = json.loads(raw.decode("utf-8")).get("error", "")
            except Exception:  # noqa: BLE001 — an error page that is not JSON
                message = raw[:80].decode("utf-8", errors="replace")
            raise _HTTPStatus(status, " ".join(str(message).split()))
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
            except _HTTPStatus as exc:
                if 400 <= exc.code < 500:
                    raise RewardInputError(f"remote reward {self.url}: the server refused the request "
                                           f"({exc.code}: {exc.message})") from None
                last = str(exc)
            except _Malformed as exc:
                last = f"malformed reply: {exc}"
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, time-out, a reply cut short
                last = f"{type(exc).__name__}: {exc}"
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise RemoteRewardError(f"remote reward {self.url} failed after {self.retries + 1} attempts (last: {last}); "
                                "is `grove reward-server` running there?")

    def health(self) -> dict:
        """``GET /health`` (one attempt, ``timeout_s`` in all); RemoteRewardError when unreachable."""
        try:
            status, raw = _fetch(self.url + "/health", "GET", None, self.timeout_s)
            if status != 200:
                raise ValueError(f"HTTP {status}")
            return json.loads(raw.decode("utf-8"))
        except (OSError, http.client.HTTPException, ValueError) as exc:
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
