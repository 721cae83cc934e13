"""A reward served over HTTP with JSON and PNG images — never pickle.

``grove reward-server --reward NAME [--kwargs JSON] [--host 127.0.0.1] [--port N]`` builds one reward from the
registry and answers:

- ``GET /health`` -> ``{"status": "ok", "reward": NAME, "outputs": [...], "served": n, "max_images": ...}``;
- ``POST /score`` with ``{"images": [base64 PNG, ...], "prompts": [...], "metadata": [{...}, ...] (optional)}``
  -> ``{"scores": {output: [float | null, ...]}, "count": n}`` (NaN travels as ``null``).

Why not pickle: the anchors' reward servers unpickle request bodies (a remote-code-execution hole on any
reachable port) and break across library versions (flow_grpo #232 "Connection refused", Pref-GRPO #2). Here a
malformed request is answered 400 (bad JSON, bad base64, not a PNG, missing or mismatched fields), an oversized
one 413 (body over ``max_body_bytes``, more than ``max_images`` images, a side over ``max_side``), one the reward
rejects (``RewardInputError``) 422, a reward crash 500 with its one-line reason — and the server keeps serving.

Request batching: concurrent requests are merged (up to ``max_batch`` images, waiting at most ``max_wait_ms``
for company) into one reward call when their images share a size; if a merged call fails, each request is
retried alone so one bad request cannot fail its neighbours. PNG is lossless, so a remote score equals the local
score of the same uint8 image (tested).
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import math
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import numpy as np
import torch

from .base import RewardInputError


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def encode_png(pixels: np.ndarray) -> str:
    """``[H,W,3]`` uint8 -> base64 PNG text."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(text: Any, max_side: int, index: int) -> np.ndarray:
    """base64 PNG text -> ``[H,W,3]`` uint8; RequestError 400/413 on anything else."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(text, str):
        raise RequestError(400, f"images[{index}] must be a base64 PNG string, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"images[{index}] is not valid base64") from None
    if not raw.startswith(b"\x89PNG\r\n\x1a\n"):
        raise RequestError(400, f"images[{index}] is not a PNG (send PNG, lossless)")
    try:
        image = Image.open(io.BytesIO(raw))
        if max(image.size) > max_side:
            raise RequestError(413, f"images[{index}] is {image.size[0]}x{image.size[1]}; the limit is {max_side} px")
        return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise RequestError(400, f"images[{index}] cannot be decoded ({type(exc).__name__})") from None


def _jsonable(values: torch.Tensor) -> list:
    return [None if not math.isfinite(v) else v for v in values.float().tolist()]


class _Job:
    def __init__(self, images: torch.Tensor, prompts: list[str], metas: list[dict] | None) -> None:
        self.images, self.prompts, self.metas = images, prompts, metas
        self.done = threading.Event()
        self.result: dict[str, torch.Tensor] | None = None
        self.error: BaseException | None = None


class RewardServer:
    """Serve ``reward(images, prompts, metadata) -> {name: [B]}`` on ``host:port`` (port 0: any free port)."""

    def __init__(self, reward: Callable[..., dict[str, torch.Tensor]], name: str, host: str = "127.0.0.1",
                 port: int = 0, max_batch: int = 64, max_wait_ms: float = 5.0, max_body_bytes: int = 64 << 20,
                 max_images: int = 256, max_side: int = 4096, request_timeout_s: float = 600.0, log=print) -> None:
        if max_batch < 1 or max_images < 1 or max_side < 1 or max_body_bytes < 1:
            raise RewardInputError("reward server: max_batch, max_images, max_side and max_body_bytes must be >= 1")
        self.reward, self.name, self.log = reward, name, log
        self.max_batch, self.max_wait = int(max_batch), max_wait_ms / 1000.0
        self.max_body_bytes, self.max_images, self.max_side = int(max_body_bytes), int(max_images), int(max_side)
        self.request_timeout_s = float(request_timeout_s)
        self.outputs: list[str] = []
        self.served = 0
        self.calls = 0  # reward calls made (fewer than requests when batching merged some)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="reward-batcher", daemon=True)
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    # ----------------------------------------------------------------------------------------- batching worker
    def _call(self, images: torch.Tensor, prompts: list[str], metas: list[dict] | None) -> dict[str, torch.Tensor]:
        self.calls += 1
        out = {k: torch.as_tensor(v, dtype=torch.float32).reshape(-1) for k, v in self.reward(images, prompts, metas).items()}
        for k, v in out.items():
            if v.numel() != len(prompts):
                raise RuntimeError(f"reward output {k!r} has {v.numel()} values for {len(prompts)} images")
        self.outputs = list(out)
        return out

    def _run_one(self, job: _Job) -> None:
        try:
            job.result = self._call(job.images, job.prompts, job.metas)
        except BaseException as exc:  # noqa: BLE001 — reported to that request only
            job.error = exc
        job.done.set()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            deadline = time.monotonic() + self.max_wait
            size = job.images.shape[0]
            while size < self.max_batch:
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                jobs.append(nxt)
                size += nxt.images.shape[0]
            groups: dict[tuple, list[_Job]] = {}
            for j in jobs:  # merge only images of one size and requests that agree on having metadata
                groups.setdefault((tuple(j.images.shape[1:]), j.metas is None), []).append(j)
            for group in groups.values():
                if len(group) == 1:
                    self._run_one(group[0])
                    continue
                try:
                    metas = None if group[0].metas is None else [m for j in group for m in j.metas]
                    out = self._call(torch.cat([j.images for j in group]), [p for j in group for p in j.prompts], metas)
                    start = 0
                    for j in group:
                        n = j.images.shape[0]
                        j.result = {k: v[start:start + n] for k, v in out.items()}
                        start += n
                        j.done.set()
                except BaseException:  # noqa: BLE001 — isolate the request that broke the merged call
                    for j in group:
                        self._run_one(j)

    # ----------------------------------------------------------------------------------------- HTTP
    def _parse(self, body: bytes) -> _Job:
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RequestError(400, "the body is not JSON; send {\"images\": [base64 PNG], \"prompts\": [...]}") from None
        if not isinstance(data, dict):
            raise RequestError(400, "the body must be a JSON object with 'images' and 'prompts'")
        images, prompts, metas = data.get("images"), data.get("prompts"), data.get("metadata")
        if not isinstance(images, list) or not isinstance(prompts, list):
            raise RequestError(400, "'images' and 'prompts' must be lists")
        if len(images) > self.max_images:
            raise RequestError(413, f"{len(images)} images in one request; the limit is {self.max_images}")
        if len(images) != len(prompts):
            raise RequestError(400, f"{len(prompts)} prompts for {len(images)} images")
        if not images:
            raise RequestError(400, "no images")
        if not all(isinstance(p, str) for p in prompts):
            raise RequestError(400, "every prompt must be a string")
        if metas is not None and (not isinstance(metas, list) or len(metas) != len(images)
                                  or not all(isinstance(m, dict) for m in metas)):
            raise RequestError(400, "'metadata' must be a list of objects, one per image")
        arrays = [decode_png(t, self.max_side, i) for i, t in enumerate(images)]
        if len({a.shape for a in arrays}) != 1:
            raise RequestError(400, "all images of one request must have the same size")
        pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0
        return _Job(pixels, prompts, metas)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # quiet: one line per error only
                pass

            def _send(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if status >= 400:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(body)

            def _error(self, status: int, message: str) -> None:
                if status >= 500:
                    server.log(f"reward server: {status} {message}")
                self._send(status, {"error": message})

            def do_GET(self):  # noqa: N802
                if self.path.rstrip("/") == "/health":
                    self._send(200, {"status": "ok", "reward": server.name, "outputs": server.outputs,
                                     "served": server.served, "max_images": server.max_images,
                                     "max_body_bytes": server.max_body_bytes})
                else:
                    self._error(404, f"no such endpoint {self.path!r}; use GET /health or POST /score")

            def do_POST(self):  # noqa: N802
                if self.path.rstrip("/") != "/score":
                    self._error(404, f"no such endpoint {self.path!r}; use POST /score")
                    return
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit():
                    self._error(411, "a Content-Length header is required")
                    return
                if int(length) > server.max_body_bytes:
                    left = int(length)  # drain what a client would still send (bounded), so it reads the 413
                    while 0 < left <= 4 * server.max_body_bytes:
                        chunk = self.rfile.read(min(left, 1 << 20))
                        if not chunk:
                            break
                        left -= len(chunk)
                    self._error(413, f"body of {int(length)} bytes; the limit is {server.max_body_bytes} "
                                     "(send fewer images per request: the client's batch_size)")
                    return
                body = self.rfile.read(int(length))
                try:
                    job = server._parse(body)
                except RequestError as exc:
                    self._error(exc.status, str(exc))
                    return
                server._queue.put(job)
                if not job.done.wait(server.request_timeout_s):
                    self._error(503, f"the reward did not answer within {server.request_timeout_s:g} s")
                    return
                if job.error is not None:
                    status = 422 if isinstance(job.error, (RewardInputError, ValueError, TypeError)) else 500
                    text = " ".join(str(job.error).split()) or type(job.error).__name__
                    self._error(status, f"{type(job.error).__name__}: {text}"[:500])
                    return
                server.served += len(job.prompts)
                self._send(200, {"scores": {k: _jsonable(v) for k, v in job.result.items()},
                                 "count": len(job.prompts)})

        return Handler

    # ----------------------------------------------------------------------------------------- lifecycle
    def start(self) -> "RewardServer":
        """Serve in background threads (tests, notebooks); returns self."""
        self._worker.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="reward-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._worker.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.stop()

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
