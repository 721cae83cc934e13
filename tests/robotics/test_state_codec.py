"""Simulator states survive a JSON round trip without pickle: a restored continuation is bit-identical."""
import json

import numpy as np
import pytest

from robotics.envs.metaworld_env import make_key
from robotics.envs.point import PointState
from robotics.envs.state_codec import decode, encode
from robotics.envs.vector import BatchedMetaWorld, EnvConfig


def test_values_round_trip_exactly():
    gen = np.random.default_rng(3)
    gen.random(5)
    value = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": (1, 2.5, True, None, "x"), "c": np.int64(7),
             "d": [np.bool_(True), np.float64(0.1)], "rng": gen, 4: "int key"}
    back = decode(json.loads(json.dumps(encode(value))))
    np.testing.assert_array_equal(back["a"], value["a"])
    assert back["a"].dtype == np.float32 and back["b"] == (1, 2.5, True, None, "x") and back[4] == "int key"
    assert back["c"] == 7 and isinstance(back["c"], np.int64) and isinstance(back["d"][1], np.float64)
    assert back["rng"].random() == gen.random()  # the generator continues where it was
    p = PointState("reach", np.array([0.1, 0.2]), np.array([0.3, 0.4]), 3, False, False, False)
    q = decode(encode(p))
    assert isinstance(q, PointState) and np.array_equal(q.pos, p.pos) and q.steps == 3


def test_refuses_what_it_cannot_rebuild():
    with pytest.raises(TypeError, match="cannot encode"):
        encode(object())
    with pytest.raises(ValueError, match="unknown state class"):
        decode({"__state__": "os.system", "fields": {}})
    with pytest.raises(ValueError, match="unknown bit generator"):
        decode({"__generator__": "Evil", "state": {}})


def test_a_metaworld_state_restored_from_json_continues_bit_identically():
    cfg = EnvConfig(tasks=["door-open-v3"], horizon=40)
    env = BatchedMetaWorld(cfg)
    try:
        env.reset([make_key(0, "train", 1)])
        rng = np.random.default_rng(0)
        env.step_chunk(rng.uniform(-1, 1, (1, 4, 4)))
        saved = json.dumps(encode(env.get_states([0])))
        actions = [rng.uniform(-1, 1, (1, 4, 4)) for _ in range(2)]
        first = [env.step_chunk(a) for a in actions]
        env.reset([make_key(0, "train", 2)])
        env.set_states([0], decode(json.loads(saved)))
        again = [env.step_chunk(a) for a in actions]
        for r1, r2 in zip(first, again):
            np.testing.assert_array_equal(r1.state, r2.state)
            np.testing.assert_array_equal(r1.image, r2.image)
    finally:
        env.close()
