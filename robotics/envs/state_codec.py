"""Simulator states to and from plain JSON-able data, without pickle.

A saved state (``EnvState`` of Meta-World, ``PointState`` of the point env, and the ``(state, done, success)``
tuples of the batched envs) holds NumPy arrays, NumPy scalars, Python scalars, dicts, tuples and the env's
``np.random.Generator``. :func:`encode` turns such a value into nested dicts/lists of JSON types with a type tag
where the kind would otherwise be lost; :func:`decode` rebuilds it exactly (arrays bit for bit: their bytes travel
as base64; generators by their bit generator's class name and state). Only the state dataclasses named in
``STATE_CLASSES`` (and LIBERO's ``LiberoState``, see :func:`state_class`) and NumPy's own bit generators can be
rebuilt, so a file cannot make the reader run code.
"""
from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np

from .metaworld_env import EnvState
from .point import PointState

STATE_CLASSES: dict[str, type] = {"EnvState": EnvState, "PointState": PointState}
# LIBERO's state class lives in a module that needs MuJoCo and LIBERO's task tables: it is imported only when a
# LIBERO state is actually encoded or decoded, so reading a Meta-World file never loads it
_LAZY_STATE_CLASSES = {"LiberoState": ("robotics.envs.libero_env", "LiberoState")}


def state_class(name: str) -> type | None:
    """The state dataclass a saved state names, or None when it is not one this codec rebuilds."""
    if name in STATE_CLASSES:
        return STATE_CLASSES[name]
    if name in _LAZY_STATE_CLASSES:
        import importlib

        module, attr = _LAZY_STATE_CLASSES[name]
        return getattr(importlib.import_module(module), attr)
    return None
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def encode(value: Any) -> Any:
    """``value`` as JSON-able data (see the module docstring); TypeError for anything else."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, np.generic):
        return value
    if isinstance(value, np.ndarray):
        arr = value if value.flags.c_contiguous else value.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
        return {"__ndarray__": base64.b64encode(arr.tobytes()).decode("ascii"), "dtype": arr.dtype.str,
                "shape": list(arr.shape)}
    if isinstance(value, np.generic):
        return {"__npscalar__": encode(np.asarray(value))}
    if isinstance(value, np.random.Generator):
        return {"__generator__": type(value.bit_generator).__name__, "state": encode(value.bit_generator.state)}
    if dataclasses.is_dataclass(value) and state_class(type(value).__name__) is type(value):
        return {"__state__": type(value).__name__,
                "fields": {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"__dict__": {k: encode(v) for k, v in value.items()}}
        return {"__pairs__": [[encode(k), encode(v)] for k, v in value.items()]}
    raise TypeError(f"cannot encode a {type(value).__name__} in a simulator state")


def decode(data: Any) -> Any:
    """The value :func:`encode` made ``data`` from."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__ndarray__" in data:
        raw = base64.b64decode(data["__ndarray__"])
        return np.frombuffer(raw, dtype=np.dtype(data["dtype"])).reshape(tuple(data["shape"])).copy()
    if "__npscalar__" in data:
        return decode(data["__npscalar__"])[()]
    if "__generator__" in data:
        name = data["__generator__"]
        if name not in _BIT_GENERATORS:
            raise ValueError(f"unknown bit generator {name!r} in a saved state")
        bit = getattr(np.random, name)()
        bit.state = decode(data["state"])
        return np.random.Generator(bit)
    if "__state__" in data:
        cls = state_class(data["__state__"])
        if cls is None:
            raise ValueError(f"unknown state class {data['__state__']!r} in a saved state")
        return cls(**{k: decode(v) for k, v in data["fields"].items()})
    if "__tuple__" in data:
        return tuple(decode(v) for v in data["__tuple__"])
    if "__dict__" in data:
        return {k: decode(v) for k, v in data["__dict__"].items()}
    if "__pairs__" in data:
        return {decode(k): decode(v) for k, v in data["__pairs__"]}
    raise ValueError(f"not an encoded simulator state: keys {sorted(data)}")
