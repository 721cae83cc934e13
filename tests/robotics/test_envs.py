"""Meta-World env layer: reset-state keys, disjoint splits, branch-by-restore, rendering, success modes."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest

pytest.importorskip("metaworld")

from robotics.envs import BatchedMetaWorld, EnvConfig, MetaWorldTaskEnv, SubprocMetaWorld, decode_key, make_key
from robotics.envs.gym_env import MetaWorldGymEnv

TASKS = ["reach-v3", "push-v3"]


def test_key_roundtrip_and_split_ranges():
    for t, split, i in [(0, "train", 0), (3, "eval", 17), (1, "train", 499_999)]:
        assert decode_key(make_key(t, split, i)) == (t, split, i)
    train = {make_key(t, "train", i) for t in range(5) for i in range(100)}
    evals = {make_key(t, "eval", i) for t in range(5) for i in range(100)}
    assert not train & evals


def test_reset_is_deterministic_across_instances_and_histories():
    a, b = MetaWorldTaskEnv("reach-v3"), MetaWorldTaskEnv("reach-v3")
    key = make_key(0, "train", 3)
    b.reset(make_key(0, "train", 9))  # a different history first
    for _ in range(7):
        b.step(np.array([1.0, -1.0, 0.5, 0.0]))
    oa, ob = a.reset(key), b.reset(key)
    np.testing.assert_array_equal(oa, ob)
    other = a.reset(make_key(0, "train", 4))
    assert not np.allclose(other[36:39], oa[36:39]), "different reset states must differ (goal position)"


@pytest.mark.parametrize("task", TASKS)
def test_train_and_eval_reset_states_are_disjoint(task):
    env = MetaWorldTaskEnv(task)
    vecs = {}
    for split in ("train", "eval"):
        vs = []
        for i in range(20):
            env.reset(make_key(0, split, i))
            vs.append(env.rand_vec())
        vecs[split] = np.stack(vs)
    dist = np.linalg.norm(vecs["train"][:, None] - vecs["eval"][None], axis=-1)
    assert dist.min() > 1e-6
    # within a split, indices give distinct states too
    d_train = np.linalg.norm(vecs["train"][:, None] - vecs["train"][None], axis=-1) + np.eye(20)
    assert d_train.min() > 1e-6


def test_branch_by_restore_gives_identical_continuations():
    cfg = EnvConfig(tasks=TASKS, horizon=60)
    env = BatchedMetaWorld(cfg)
    keys = [make_key(0, "train", 1), make_key(1, "train", 2)]
    env.reset(keys)
    rng = np.random.default_rng(0)
    env.step_chunk(rng.uniform(-1, 1, (2, 4, 4)))
    branch = env.get_states([0, 1])
    actions = [rng.uniform(-1, 1, (2, 4, 4)) for _ in range(3)]
    first = [env.step_chunk(a) for a in actions]
    # restore into the other slots' envs (different instances, different histories): slot order swapped
    env.reset([keys[1], keys[0]])
    env.step_chunk(rng.uniform(-1, 1, (2, 4, 4)))
    env.set_states([0, 1], branch)
    again = [env.step_chunk(a) for a in actions]
    for r1, r2 in zip(first, again):
        np.testing.assert_array_equal(r1.state, r2.state)
        np.testing.assert_array_equal(r1.image, r2.image)
        np.testing.assert_array_equal(r1.reward, r2.reward)
    env.close()


def test_subprocess_vector_env_matches_in_process():
    cfg = EnvConfig(tasks=TASKS, horizon=12)
    keys = [make_key(0, "train", 0), make_key(0, "train", 0), make_key(1, "eval", 5)]
    acts = np.random.default_rng(1).uniform(-1, 1, (3, 3, 4, 4))
    local = BatchedMetaWorld(cfg)
    remote = SubprocMetaWorld(EnvConfig(tasks=TASKS, horizon=12, num_workers=2))
    try:
        o1, o2 = local.reset(keys), remote.reset(keys)
        np.testing.assert_array_equal(o1["image"], o2["image"])
        for a in acts:
            r1, r2 = local.step_chunk(a), remote.step_chunk(a)
            np.testing.assert_array_equal(r1.state, r2.state)
            np.testing.assert_array_equal(r1.done, r2.done)
        assert r1.done.all(), "horizon 12 with chunks of 4 ends every episode after 3 chunks"
        s = remote.get_states([2])
        remote.set_states([0], s)  # cross-worker restore (slot 0 lives in worker 0, slot 2 in worker 1)
        np.testing.assert_array_equal(remote.render([0]), remote.render([2]))
    finally:
        local.close()
        remote.close()


def test_corner_camera_is_upright():
    env = BatchedMetaWorld(EnvConfig(tasks=["reach-v3"]))
    img = env.reset([make_key(0, "train", 0)])["image"][0].astype(float)
    # upright: the dark background is above the table; Meta-World's raw corner image has it below
    assert img[:20].mean() < img[-20:].mean()
    env.close()


def test_success_once_vs_success_at_end_with_the_expert():
    from metaworld.policies import ENV_POLICY_MAP

    expert = ENV_POLICY_MAP["reach-v3"]()
    results = {}
    for mode in ("once", "end"):
        env = MetaWorldGymEnv("reach-v3", horizon=120, success_mode=mode)
        obs, info = env.reset(seed=5)
        assert env.observation_space.contains(obs)
        steps, term, trunc = 0, False, False
        while not (term or trunc):
            obs, r, term, trunc, info = env.step(expert.get_action(obs["state"].astype(np.float64)))
            steps += 1
        results[mode] = (steps, term, trunc, info)
        env.close()
    steps_once, term_once, _, info_once = results["once"]
    steps_end, term_end, trunc_end, info_end = results["end"]
    assert term_once and info_once["success"] and steps_once < 120  # stops at the first success
    assert not term_end and trunc_end and steps_end == 120  # runs the whole horizon
    assert info_end["success_once"] and info_end["success_end"]  # the expert stays at the goal


def test_proprio_layout_with_object_and_goal_tracks_the_moving_puck():
    """``include_object`` puts the object's xyz (state 4:7) after hand + gripper and before the goal (36:39), in the
    batched env, the subprocess env and the gym env alike; the puck's entry moves when the expert pushes it."""
    from metaworld.policies import ENV_POLICY_MAP

    from shared_rl.config import ConfigError

    cfg = EnvConfig(tasks=["push-v3"], horizon=60, include_goal=True, include_object=True)
    assert cfg.proprio_dim == 10 and EnvConfig(include_object=True).proprio_dim == 7
    key = make_key(0, "train", 3)
    local, remote = BatchedMetaWorld(cfg), SubprocMetaWorld(EnvConfig(**{**cfg.__dict__, "num_workers": 1}))
    try:
        o, o2 = local.reset([key]), remote.reset([key])
        s, p = o["state"][0], o["proprio"][0]
        np.testing.assert_array_equal(p, np.concatenate([s[0:4], s[4:7], s[36:39]]))
        np.testing.assert_array_equal(o2["proprio"], o["proprio"])
    finally:
        local.close()
        remote.close()
    env = MetaWorldGymEnv("push-v3", horizon=60, include_goal=True, include_object=True)
    obs, _ = env.reset(seed=3)
    assert env.observation_space["proprio"].shape == (10,) and env.observation_space.contains(obs)
    start = obs["proprio"][4:7].copy()
    expert = ENV_POLICY_MAP["push-v3"]()
    for _ in range(60):
        obs, *_ = env.step(expert.get_action(obs["state"].astype(np.float64)))
    np.testing.assert_array_equal(obs["proprio"][4:7], obs["state"][4:7])
    assert np.linalg.norm(obs["proprio"][4:7] - start) > 0.01, "the pushed puck moved, so must its proprio entry"
    env.close()
    with pytest.raises(ConfigError, match="include_object needs Meta-World"):
        EnvConfig(kind="point", tasks=["point-reach"], include_object=True).check()
