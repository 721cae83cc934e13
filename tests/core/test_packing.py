"""``shared_rl.packing``: a part's history as one checkpoint tensor, rebuilt exactly; only named classes rebuilt."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from shared_rl.packing import pack, unpack


@dataclass
class Episode:
    task: str
    frames: np.ndarray
    states: list | None = None


@dataclass
class Other:
    x: int = 0


def test_a_nested_state_round_trips_bit_for_bit():
    rng = np.random.default_rng(7)
    rng.random(3)  # a generator part-way through its stream
    gen = torch.Generator().manual_seed(5)
    torch.rand(2, generator=gen)
    value = {
        "episodes": [Episode("reach", np.arange(24, dtype=np.uint8).reshape(2, 3, 4), [(np.float64(0.5), True)]),
                     Episode("push", np.zeros((0, 3), np.float32))],
        3: {"opt": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.arange(6.0).view(2, 3)}},
                    "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]}},
        "flags": torch.tensor([True, False]), "half": torch.tensor([1.5], dtype=torch.bfloat16),
        "rng": rng, "gen": gen, "none": None, "inf": float("inf"), "scalar": np.int64(2**40),
    }
    packed = pack(value, {"Episode": Episode})
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    back = unpack(packed, {"Episode": Episode})
    e0, e1 = back["episodes"]
    assert e0.task == "reach" and e0.frames.dtype == np.uint8 and np.array_equal(e0.frames, value["episodes"][0].frames)
    assert e0.states == [(np.float64(0.5), True)] and isinstance(e0.states[0], tuple)
    assert e1.frames.shape == (0, 3) and e1.states is None
    opt = back[3]["opt"]
    assert torch.equal(opt["state"][0]["exp_avg"], torch.arange(6.0).view(2, 3)) and opt["state"][0]["step"] == 4.0
    assert opt["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(back["flags"], torch.tensor([True, False])) and back["half"].dtype == torch.bfloat16
    assert back["rng"].random() == rng.random()  # the same stream continues
    assert torch.equal(torch.rand(3, generator=back["gen"]), torch.rand(3, generator=gen))
    assert back["none"] is None and back["inf"] == float("inf") and back["scalar"] == 2**40


def test_frames_are_stored_compressed():
    frames = np.zeros((50, 64, 64, 3), np.uint8)  # a flat scene: what zlib shrinks most
    frames[:, 20:40, 20:40] = 200
    assert pack(frames).numel() < frames.nbytes / 20


def test_only_the_named_classes_are_packed_or_rebuilt():
    with pytest.raises(TypeError, match="cannot pack a Other"):
        pack([Other()], {"Episode": Episode})
    with pytest.raises(TypeError, match="cannot pack a set"):
        pack({1, 2})
    packed = pack([Episode("reach", np.zeros(1))], {"Episode": Episode})
    with pytest.raises(ValueError, match="not among the classes"):
        unpack(packed, {})
    with pytest.raises(ValueError, match="bad magic"):
        unpack(torch.zeros(30, dtype=torch.uint8))
