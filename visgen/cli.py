"""``grove rewards`` and ``grove reward-server``: the reward registry from the command line.

- ``grove rewards`` (or ``grove rewards list``): every registered reward with where its weights come from, its
  licence note, its score range and the extra it needs.
- ``grove rewards score NAME --prompt TEXT IMAGE... [--kwargs JSON]``: one score per image (PNG/JPEG files), to
  check a reward by hand.
- ``grove reward-server --reward NAME [--kwargs JSON] [--host 127.0.0.1] [--port 8765]``: serve it over HTTP
  (``visgen.rewards.server``: ``POST /score``, ``GET /health``; JSON + PNG, never pickle); a training run uses
  it with ``visgen.rewards: [{name: remote, kwargs: {url: http://HOST:PORT, name: OUTPUT}}]``.

Both keep grove's error contract: a mistake (unknown reward, bad kwargs JSON, an unreadable image, a port in use)
is one ``grove: error: ...`` line with exit code 2 (``ConfigError``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from shared_rl.cli import ArgumentParser
from shared_rl.errors import ConfigError


def _kwargs(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kwargs is not JSON ({exc.msg} at character {exc.pos}); e.g. --kwargs "
                          "'{\"mode\": \"rec\"}'") from None
    if not isinstance(value, dict):
        raise ConfigError("--kwargs must be a JSON object, e.g. '{\"mode\": \"rec\"}'")
    return value


def _build(name: str, kwargs: dict):
    import inspect

    from .catalog import register_rewards
    from .rewards import RewardInputError, available_rewards, get_reward
    from .rewards.base import _REGISTRY

    register_rewards()  # the video and reward-model ones too: the names a config may use
    if name not in available_rewards():
        import difflib

        close = difflib.get_close_matches(name, available_rewards(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown reward {name!r}{hint}; `grove rewards` lists them")
    try:
        inspect.signature(_REGISTRY[name]).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"reward {name!r}: --kwargs {kwargs}: {exc}") from None
    try:
        return get_reward(name, **kwargs)
    except RewardInputError as exc:
        raise ConfigError(" ".join(str(exc).split())) from None


def list_rewards() -> list[tuple[str, str, str, str, str, str]]:
    """(name, summary, weights, licence, range, extra) of every registered reward (``grove list`` names the same)."""
    from .catalog import register_rewards
    from .rewards import reward_info

    rows = []
    for name in register_rewards():
        info = reward_info(name)
        rows.append((name, info.summary, info.weights, info.licence, info.range, info.extra or "core"))
    return rows


def _print_list() -> int:
    for name, summary, weights, licence, range_, extra in list_rewards():
        print(f"{name}\n  {summary}\n  weights: {weights}\n  licence: {licence}\n  range:   {range_}\n  needs:   {extra}")
    return 0


def _load_image(path: str):
    import numpy as np
    import torch
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"image {path!r} does not exist")
    try:
        pixels = np.asarray(Image.open(p).convert("RGB"))
    except (UnidentifiedImageError, OSError):
        raise ConfigError(f"image {path!r} is not an image PIL can read (PNG, JPEG, ...)") from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255.0


def _score(argv: list[str]) -> int:
    import torch

    from .rewards import RewardInputError

    p = ArgumentParser(prog="grove rewards score", description="score images with a registered reward")
    p.add_argument("name", help="reward name (grove rewards lists them)")
    p.add_argument("images", nargs="+", help="image files (PNG, JPEG)")
    p.add_argument("--prompt", required=True, help="the prompt every image is scored against")
    p.add_argument("--kwargs", default=None, help="the reward factory's keyword arguments as JSON")
    a = p.parse_args(argv)
    kwargs = _kwargs(a.kwargs)
    images = [_load_image(path) for path in a.images]
    reward = _build(a.name, kwargs)
    sizes = {tuple(x.shape) for x in images}
    # images of different sizes are scored one at a time (a batch must share a size)
    batches = [torch.stack(images)] if len(sizes) == 1 else [x[None] for x in images]
    rows: list[dict[str, float]] = []
    try:
        for batch in batches:
            out = reward(batch, [a.prompt] * batch.shape[0])
            for i in range(batch.shape[0]):
                rows.append({k: float(v[i]) for k, v in out.items()})
    except RewardInputError as exc:
        raise ConfigError(" ".join(str(exc).split())) from None
    for path, row in zip(a.images, rows):
        print(f"{path}\t" + "\t".join(f"{k}={v:.4f}" for k, v in row.items()))
    return 0


def rewards_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] == "list":
        return _print_list()
    if argv[0] in ("-h", "--help"):
        print("usage: grove rewards [list]                        every reward: weights, licence, range\n"
              "       grove rewards score NAME --prompt TEXT IMAGE... [--kwargs JSON]")
        return 0
    if argv[0] == "score":
        return _score(argv[1:])
    raise ConfigError(f"unknown rewards tool {argv[0]!r}; use `grove rewards list` or `grove rewards score NAME ...`")


def reward_server_main(argv: list[str] | None = None) -> int:
    from .rewards.server import RewardServer

    p = ArgumentParser(prog="grove reward-server", description="serve a registered reward over HTTP (JSON + PNG)")
    p.add_argument("--reward", required=True, help="reward name (grove rewards lists them)")
    p.add_argument("--kwargs", default=None, help="the reward factory's keyword arguments as JSON")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one, printed)")
    p.add_argument("--max-batch", type=int, default=64, help="images per reward call when merging requests")
    p.add_argument("--max-images", type=int, default=256, help="images per request (more: 413)")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="request body limit in MB (more: 413)")
    p.add_argument("--max-side", type=int, default=4096, help="largest image side in pixels (more: 413)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not 0 <= a.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {a.port}")
    if a.max_batch < 1 or a.max_images < 1 or a.max_side < 1 or a.max_body_mb <= 0:
        raise ConfigError("--max-batch, --max-images, --max-side and --max-body-mb must be positive")
    reward = _build(a.reward, _kwargs(a.kwargs))
    try:
        server = RewardServer(reward, a.reward, a.host, a.port, a.max_batch, max_body_bytes=int(a.max_body_mb * 2**20),
                              max_images=a.max_images, max_side=a.max_side)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {a.host}:{a.port} ({exc.strerror or exc}); choose another --port") from None
    print(f"grove reward-server: {a.reward} on {server.url} (POST /score, GET /health); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("grove reward-server: stopped")
    return 0
