"""The VLM judge against a fake OpenAI-compatible endpoint on loopback (robust parsing, per-image NaN after
retries, its own time-out), ``grove rewards`` / ``grove rewards score``, and the registry's documentation."""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shared_rl.errors import ConfigError
from visgen.rewards import RewardInputError, available_rewards, get_reward, reward_info
from visgen.rewards.vlm_judge import parse_scale, parse_yes_no

REPO = Path(__file__).resolve().parents[2]


def builtin_rewards() -> list[str]:
    """The registry's own rewards (other tests register throw-away ones)."""
    from visgen.rewards.base import _REGISTRY

    return [n for n in available_rewards() if _REGISTRY[n].__module__.startswith("visgen.rewards.")]


def test_parsers_are_robust():
    assert parse_yes_no("Yes.") == 1.0 and parse_yes_no("**No**, it does not") == 0.0
    assert parse_yes_no("The answer: YES") == 1.0 and np.isnan(parse_yes_no("eyes closed; nothing"))
    assert parse_scale("8", 10) == pytest.approx(7 / 9) and parse_scale("Score: 8.5/10", 10) == pytest.approx(7.5 / 9)
    assert parse_scale("10", 10) == 1.0 and parse_scale("1", 10) == 0.0
    assert parse_scale("0 ... no, 3", 5) == pytest.approx(0.5)  # out-of-range numbers are skipped
    assert np.isnan(parse_scale("excellent!", 10)) and np.isnan(parse_scale("11", 10))


class _Judge(BaseHTTPRequestHandler):
    replies: dict = {}
    seen: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, self.headers.get("Authorization"), body))
        content = body["messages"][0]["content"]
        text = next(c["text"] for c in content if c["type"] == "text")
        url = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
        assert url.startswith("data:image/png;base64,")
        reply = type(self).replies.get(re.search(r'"(.*)"', text).group(1), "7")
        if reply == "SLOW":
            time.sleep(1.0)
            reply = "9"
        trickle = reply == "TRICKLE"  # headers at once, then a byte every 0.2 s: each read is in time, the whole not
        if reply == "BROKEN":
            raw = b"{not json"
        else:
            raw = json.dumps({"choices": [{"message": {"role": "assistant", "content": "6" if trickle else reply}}]}
                             ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        try:
            if trickle:
                for i in range(len(raw)):
                    self.wfile.write(raw[i:i + 1])
                    self.wfile.flush()
                    time.sleep(0.2)
            else:
                self.wfile.write(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture
def judge_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_vlm_judge_scores_parses_and_isolates_failures(judge_url, monkeypatch):
    _Judge.replies = {"cat": "8", "dog": "I'd say 3 out of 10", "fish": "no idea", "bird": "BROKEN", "slow": "SLOW"}
    _Judge.seen = []
    monkeypatch.setenv("TEST_JUDGE_KEY", "secret")
    judge = get_reward("vlm_judge", base_url=judge_url, model="m", timeout_s=0.3, retries=1, backoff_s=0.01,
                       api_key_env="TEST_JUDGE_KEY")
    images = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    images[5, 0, 0, 0] = float("nan")
    score = judge(images, ["cat", "dog", "fish", "bird", "slow", "cat"])["vlm_judge"]
    assert score[0] == pytest.approx(7 / 9) and score[1] == pytest.approx(2 / 9)
    assert torch.isnan(score[2:]).all()  # unparseable, malformed JSON, time-out, NaN image
    assert judge.failures == 3
    paths = {p for p, _, _ in _Judge.seen}
    assert paths == {"/v1/chat/completions"} and all(auth == "Bearer secret" for _, auth, _ in _Judge.seen)
    assert sum(1 for _, _, b in _Judge.seen if "fish" in json.dumps(b)) == 2  # one retry
    yes_no = get_reward("vlm_judge", base_url=judge_url, mode="yes_no", retries=0)
    _Judge.replies = {"cat": "Yes, it does.", "dog": "No."}
    assert yes_no(images[:2], ["cat", "dog"])["vlm_judge"].tolist() == [1.0, 0.0]
    with pytest.raises(RewardInputError, match="is not set"):
        get_reward("vlm_judge", base_url=judge_url, api_key_env="SURELY_NOT_SET_ANYWHERE")
    with pytest.raises(RewardInputError, match="mode must be one of"):
        get_reward("vlm_judge", base_url=judge_url, mode="stars")


def test_vlm_judge_time_out_bounds_the_whole_request(judge_url):
    """A server trickling its reply (every socket read in time, ~14 s in all) is cut off at timeout_s per attempt:
    the image scores NaN after 2 attempts of 0.5 s, not after the whole trickle."""
    _Judge.replies = {"cat": "TRICKLE"}
    judge = get_reward("vlm_judge", base_url=judge_url, timeout_s=0.5, retries=1, backoff_s=0.01)
    t = time.perf_counter()
    score = judge(torch.rand(1, 3, 8, 8), ["cat"])["vlm_judge"]
    assert torch.isnan(score).all() and judge.failures == 1
    assert time.perf_counter() - t < 4.0


def test_grove_rewards_lists_every_reward_and_scores_images(tmp_path, capsys):
    from visgen.cli import list_rewards, rewards_main

    rows = {row[0]: row for row in list_rewards()}
    assert list(rows) == available_rewards() and {"ocr", "pickscore", "imagereward", "vlm_judge", "remote"} <= set(rows)
    assert all(rows[n][2] and rows[n][3] and rows[n][4] for n in builtin_rewards())  # weights, licence, range
    assert rewards_main(["list"]) == 0 and "licence:" in capsys.readouterr().out
    flat, noisy = tmp_path / "flat.png", tmp_path / "noisy.png"
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(flat)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(noisy)
    assert rewards_main(["score", "jpeg_incompressibility", "--prompt", "x", str(flat), str(noisy)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    sizes = [float(line.split("=")[1]) for line in lines]
    assert lines[0].startswith(str(flat)) and sizes[1] > sizes[0]
    with pytest.raises(ConfigError, match="unknown reward 'ocrr' \\(did you mean 'ocr'"):
        rewards_main(["score", "ocrr", "--prompt", "x", str(flat)])
    with pytest.raises(ConfigError, match="--kwargs is not JSON"):
        rewards_main(["score", "ocr", "--prompt", "x", "--kwargs", "{mode: rec}", str(flat)])
    with pytest.raises(ConfigError, match="unexpected keyword argument 'modes'"):
        rewards_main(["score", "ocr", "--prompt", "x", "--kwargs", '{"modes": "rec"}', str(flat)])
    with pytest.raises(ConfigError, match="does not exist"):
        rewards_main(["score", "ocr", "--prompt", "x", str(tmp_path / "missing.png")])
    with pytest.raises(ConfigError, match="quotes no text"):
        rewards_main(["score", "ocr", "--prompt", "no quotes", str(flat)])


def test_docs_list_every_reward():
    text = (REPO / "docs" / "rewards.md").read_text()
    assert len(builtin_rewards()) >= 12
    for name in builtin_rewards():  # the video rewards too, when their module is loaded
        assert f"`{name}`" in text, f"docs/rewards.md does not document {name}"
        assert reward_info(name).range
