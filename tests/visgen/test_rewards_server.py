"""The reward server and its client on loopback: JSON + PNG round trip equal to local scoring, request batching,
health, malformed/oversized requests answered 4xx while the server keeps serving, and the client's time-out,
retries on a 500, malformed replies and connection refused, each ending in one clear error; the time-out bounds a
whole request (a server trickling its reply is cut off) and a reply cut short is retried."""
from __future__ import annotations

import base64
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from visgen.rewards import RewardInputError, get_reward
from visgen.rewards.remote import RemoteReward, RemoteRewardError
from visgen.rewards.server import RewardServer, encode_png

torch.set_num_threads(1)


def mean_pixel(images, prompts, metadata=None):
    """A reward whose value depends on every pixel, the prompt and the metadata (so mix-ups show)."""
    if any(p == "reject me" for p in prompts):
        raise RewardInputError("this prompt is not scorable")
    if any(p == "crash" for p in prompts):
        raise RuntimeError("the model fell over")
    bonus = torch.tensor([float((m or {}).get("bonus", 0)) for m in (metadata or [None] * len(prompts))])
    return {"brightness": images.mean(dim=(1, 2, 3)) + torch.tensor([len(p) for p in prompts]) + bonus}


@pytest.fixture
def server():
    s = RewardServer(mean_pixel, "brightness", port=0, max_images=8, max_body_bytes=200_000, max_wait_ms=30,
                     log=lambda *_: None).start()
    yield s
    s.stop()


def _images(n=3, size=16, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _post(url: str, body: bytes, headers=None) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/score", data=body, method="POST",
                                 headers=headers or {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_round_trip_equals_local_score_of_the_uint8_image(server):
    client = RemoteReward(server.url, timeout_s=10, retries=0, batch_size=2, name=None)
    images, prompts = _images(5), ["a", "bb", "ccc", "dddd", "e"]
    metas = [{"bonus": i} for i in range(5)]
    got = client(images, prompts, metas)["brightness"]
    quantised = (images * 255).round() / 255
    assert torch.allclose(got, mean_pixel(quantised, prompts, metas)["brightness"], atol=1e-6)
    assert client.attempts == 3  # 5 images in requests of at most 2
    assert RemoteReward(server.url, name="renamed")(images[:1], ["a"]).keys() == {"renamed"}
    health = client.health()
    assert health["status"] == "ok" and health["outputs"] == ["brightness"] and health["served"] == 6
    nan = images.clone()
    nan[1, 0, 0, 0] = float("nan")
    out = client(nan[:2], prompts[:2])["brightness"]
    assert torch.isnan(out[1]) and torch.isfinite(out[0])


def test_concurrent_requests_are_batched_into_fewer_reward_calls(server):
    results, clients = {}, []

    def call(i):
        c = RemoteReward(server.url, timeout_s=10, retries=0, name=None)
        results[i] = c(_images(2, seed=i), [f"p{i}", f"q{i}"])["brightness"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(results) == 6 and server.calls < 6  # merged
    for i in range(6):
        expected = mean_pixel((_images(2, seed=i) * 255).round() / 255, [f"p{i}", f"q{i}"])["brightness"]
        assert torch.allclose(results[i], expected, atol=1e-6)


def test_malformed_and_oversized_requests_get_4xx_and_the_server_keeps_serving(server):
    png = encode_png((torch.rand(8, 8, 3) * 255).byte().numpy())
    cases = [
        (b"not json", 400, "not JSON"),
        (json.dumps([1, 2]).encode(), 400, "JSON object"),
        (json.dumps({"images": [png]}).encode(), 400, "must be lists"),
        (json.dumps({"images": [png], "prompts": ["a", "b"]}).encode(), 400, "2 prompts for 1 images"),
        (json.dumps({"images": ["@@@"], "prompts": ["a"]}).encode(), 400, "not valid base64"),
        (json.dumps({"images": [base64.b64encode(b"GIF89a....").decode()], "prompts": ["a"]}).encode(), 400,
         "not a PNG"),
        (json.dumps({"images": [png] * 9, "prompts": ["a"] * 9}).encode(), 413, "limit is 8"),
        (json.dumps({"images": [png], "prompts": ["a"], "metadata": "x"}).encode(), 400, "metadata"),
        (json.dumps({"images": [png], "prompts": ["reject me"]}).encode(), 422, "not scorable"),
        (json.dumps({"images": [png], "prompts": ["crash"]}).encode(), 500, "fell over"),
        (b"{" + b" " * 300_000 + b"}", 413, "limit is 200000"),
    ]
    for body, status, message in cases:
        code, reply = _post(server.url, body)
        assert (code, message in reply["error"]) == (status, True), (body[:40], code, reply)
    code, reply = _post(server.url + "/nope", b"{}")
    assert code == 404
    assert RemoteReward(server.url, retries=0, name=None)(_images(1), ["ok"])["brightness"].shape == (1,)
    with pytest.raises(RewardInputError, match="refused the request.*422"):  # a 4xx is not retried
        client = RemoteReward(server.url, retries=3, backoff_s=0.01)
        client(_images(1), ["reject me"])
    assert client.attempts == 1


class _Fake(BaseHTTPRequestHandler):
    """A misbehaving server: the class attribute ``mode`` says how."""

    mode = "ok"
    hits = 0

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        type(self).hits += 1
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
        if self.mode == "slow":
            time.sleep(1.0)
        if self.mode == "trickle":  # headers at once, then one byte of the body every 0.3 s (40 bytes: 12 s)
            body = json.dumps({"scores": {"x": [0.5] * n}}).encode().ljust(40)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for i in range(len(body)):
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                    time.sleep(0.3)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        if self.mode == "cut" and type(self).hits == 1:  # promises 1000 bytes, sends 10, hangs up
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"scores":')
            self.wfile.flush()
            self.close_connection = True
            return
        if self.mode == "flaky" and type(self).hits == 1 or self.mode == "500":
            body, status = b'{"error": "boom"}', 500
        elif self.mode == "garbage":
            body, status = b"<html>proxy error</html>", 200
        elif self.mode == "short":
            body, status = json.dumps({"scores": {"x": [1.0] * (n - 1)}}).encode(), 200
        elif self.mode == "strings":
            body, status = json.dumps({"scores": {"x": ["1"] * n}}).encode(), 200
        else:
            body, status = json.dumps({"scores": {"x": [0.5] * n}}).encode(), 200
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture
def fake():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("mode, match", [("slow", "timed out|TimeoutError"), ("500", "HTTP 500"),
                                         ("garbage", "malformed reply: the reply is not JSON"),
                                         ("short", "malformed reply.*list of 2"),
                                         ("strings", "malformed reply.*neither a number")])
def test_client_retries_then_one_clear_error(fake, mode, match):
    _Fake.mode, _Fake.hits = mode, 0
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    client = RemoteReward(url, timeout_s=0.3, retries=2, backoff_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError, match=f"failed after 3 attempts.*({match})"):
        client(_images(2), ["a", "b"])
    assert client.attempts == 3 and time.perf_counter() - t0 < 5


def test_client_recovers_from_a_transient_500_and_reports_connection_refused(fake):
    _Fake.mode, _Fake.hits = "flaky", 0
    client = RemoteReward(f"http://127.0.0.1:{fake.server_address[1]}", retries=2, backoff_s=0.01)
    assert client(_images(2), ["a", "b"])["remote"].tolist() == [0.5, 0.5] and client.attempts == 2
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = RemoteReward(f"http://127.0.0.1:{port}", timeout_s=1, retries=1, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match="failed after 2 attempts.*refused.*grove reward-server"):
        dead(_images(1), ["a"])
    with pytest.raises(RemoteRewardError, match="/health failed"):
        dead.health()
    with pytest.raises(RewardInputError, match="url must start with http"):
        get_reward("remote", url="localhost:8765")


def test_the_reward_server_command_serves_a_registered_reward(tmp_path):
    """`grove reward-server` end to end in a subprocess (bounded: it is stopped after one request)."""
    import os
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "shared_rl.cli", "reward-server", "--reward",
                             "jpeg_incompressibility", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        client = RemoteReward(f"http://127.0.0.1:{port}", timeout_s=5, retries=40, backoff_s=0.25, name=None)
        images = _images(2, 32)
        got = client(images, ["", ""])
        local = get_reward("jpeg_incompressibility")((images * 255).round() / 255, ["", ""])
        assert torch.equal(got["jpeg_incompressibility"], local["jpeg_incompressibility"])
    finally:
        proc.terminate()
        proc.wait(20)
    from shared_rl.errors import ConfigError
    from visgen.cli import reward_server_main

    with pytest.raises(ConfigError, match="did you mean 'pickscore'"):
        reward_server_main(["--reward", "pickscor"])
    with pytest.raises(ConfigError, match="--port must be in 0..65535"):
        reward_server_main(["--reward", "ocr", "--port", "70000"])


def test_the_time_out_bounds_the_whole_request_and_a_cut_reply_is_retried(fake):
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    _Fake.mode, _Fake.hits = "trickle", 0  # every read gets a byte in time: only a whole-request deadline stops it
    client = RemoteReward(url, timeout_s=1.0, retries=1, backoff_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError, match="failed after 2 attempts.*TimeoutError: no complete answer within 1s"):
        client(_images(2), ["a", "b"])
    assert client.attempts == 2 and time.perf_counter() - t0 < 5
    _Fake.mode, _Fake.hits = "cut", 0  # the first reply ends early (IncompleteRead), the second is whole
    client = RemoteReward(url, timeout_s=5.0, retries=2, backoff_s=0.01)
    assert client(_images(2), ["a", "b"])["remote"].tolist() == [0.5, 0.5] and client.attempts == 2
