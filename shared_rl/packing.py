"""Arbitrary training state as checkpoint tensors: ``pack(value) -> uint8 tensor``, ``unpack(tensor) -> value``.

A part that learns keeps state that is not a module's parameters — a replay history of real episodes, simulator
states, a world model's co-evolution data, a ranker's training sets, RNGs. The checkpoint protocol has two places for
state: ``Domain.state_dict`` (tensors, ``model.safetensors``) and ``extra_state`` (JSON, ``state.json``, also copied
every iteration for the trainer's roll-back). Large histories belong in the first, so they are packed here into ONE
uint8 tensor per structure: every array's raw bytes concatenated (zlib-compressed: rendered frames shrink several
times, and the bytes are checksummed by the checkpoint manifest anyway), followed by a JSON skeleton that says where
each array lies and how the structure around them was built.

What can be packed: None, bool, int, float, str; NumPy arrays and scalars; torch tensors (moved to the CPU); lists,
tuples, dicts (any hashable keys of those types); ``np.random.Generator`` and ``torch.Generator`` (their states); and
instances of the dataclasses named in ``classes`` (``{name: class}``: only those are rebuilt, so a checkpoint cannot
make the reader construct anything else). Anything else is a TypeError at save time, never a silently lost field.
"""
from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any

import numpy as np
import torch

_MAGIC = b"GPK1"
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def pack(value: Any, classes: dict[str, type] | None = None, level: int = 1) -> torch.Tensor:
    """``value`` as one 1-D uint8 tensor (see the module docstring); ``level``: zlib's (1 = fast)."""
    classes = classes or {}
    chunks: list[bytes] = []
    offset = [0]

    def blob(raw: bytes) -> list[int]:
        chunks.append(raw)
        start = offset[0]
        offset[0] += len(raw)
        return [start, len(raw)]

    def enc(v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, float)) and not isinstance(v, np.generic):
            return v if not isinstance(v, float) or np.isfinite(v) else {"f": repr(v)}
        if isinstance(v, np.generic):
            return {"s": enc(np.asarray(v))}
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v) if v.ndim else v.copy()
            if a.dtype == object:
                raise TypeError("cannot pack an object array")
            return {"a": blob(a.tobytes()), "d": a.dtype.str, "sh": list(a.shape)}
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return {"t": blob(raw), "d": str(t.dtype).removeprefix("torch."), "sh": list(t.shape)}
        if isinstance(v, np.random.Generator):
            return {"g": type(v.bit_generator).__name__, "st": enc(v.bit_generator.state)}
        if isinstance(v, torch.Generator):
            return {"tg": enc(v.get_state())}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            name = type(v).__name__
            if classes.get(name) is not type(v):
                raise TypeError(f"cannot pack a {name}: not among the classes named for this state")
            return {"dc": name, "fs": {f.name: enc(getattr(v, f.name)) for f in dataclasses.fields(v)}}
        if isinstance(v, tuple):
            return {"tu": [enc(x) for x in v]}
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {"di": [[enc(k), enc(x)] for k, x in v.items()]}
        raise TypeError(f"cannot pack a {type(v).__name__}")

    skeleton = json.dumps(enc(value), separators=(",", ":")).encode()
    body = zlib.compress(b"".join(chunks), level)
    raw = _MAGIC + struct.pack("<QQ", len(body), len(skeleton)) + body + skeleton
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def unpack(tensor: torch.Tensor, classes: dict[str, type] | None = None) -> Any:
    """The value ``pack`` made ``tensor`` from (arrays bit for bit)."""
    classes = classes or {}
    raw = tensor.detach().cpu().contiguous().numpy().tobytes()
    if raw[:4] != _MAGIC:
        raise ValueError("not a packed state (bad magic)")
    n_body, n_skel = struct.unpack("<QQ", raw[4:20])
    body = zlib.decompress(raw[20:20 + n_body])
    skeleton = json.loads(raw[20 + n_body:20 + n_body + n_skel])

    def dec(d: Any) -> Any:
        if isinstance(d, list):
            return [dec(x) for x in d]
        if not isinstance(d, dict):
            return d
        if "f" in d:
            return float(d["f"])
        if "s" in d:
            return dec(d["s"])[()]
        if "a" in d:
            start, n = d["a"]
            return np.frombuffer(body[start:start + n], dtype=np.dtype(d["d"])).reshape(d["sh"]).copy()
        if "t" in d:
            start, n = d["t"]
            dtype = getattr(torch, d["d"])
            if not n:
                return torch.empty(d["sh"], dtype=dtype)
            return torch.frombuffer(bytearray(body[start:start + n]), dtype=dtype).reshape(d["sh"])
        if "g" in d:
            if d["g"] not in _BIT_GENERATORS:
                raise ValueError(f"unknown bit generator {d['g']!r}")
            bg = getattr(np.random, d["g"])()
            bg.state = dec(d["st"])
            return np.random.Generator(bg)
        if "tg" in d:
            g = torch.Generator()
            g.set_state(dec(d["tg"]))
            return g
        if "dc" in d:
            cls = classes.get(d["dc"])
            if cls is None:
                raise ValueError(f"a packed {d['dc']} is not among the classes named for this state")
            return cls(**{k: dec(v) for k, v in d["fs"].items()})
        if "tu" in d:
            return tuple(dec(x) for x in d["tu"])
        if "di" in d:
            return {_key(dec(k)): dec(v) for k, v in d["di"]}
        raise ValueError(f"unknown packed node {sorted(d)}")

    return dec(skeleton)


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k
