"""The world model as a simulator: shapes, determinism, latent branching, rewards, keyframes, truncation, the
MuJoCo audit replay and the co-evolution loop (tiny sizes on the point env; one short Meta-World episode)."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer

from robotics.envs.metaworld_env import decode_key, make_key
from robotics.world_model.audit import audit, replay
from robotics.world_model.data import ChunkEpisode, WindowSampler
from robotics.world_model.env import Keyframe, WorldModelEnv, sample_keyframes
from robotics.world_model.model import WorldModel, WorldModelConfig
from robotics.world_model.reward import SuccessModel, SuccessModelConfig, evaluate_success_model, fit_success_model

from .test_world_model_fixtures import TINY_WM, tiny_policy_dir, tiny_wm_asset, wm_train_config


def _wm(seed=0, **kw):
    torch.manual_seed(seed)
    return WorldModel(WorldModelConfig(**{**TINY_WM, **kw})).eval()


def _frames(n, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 255, (n, 64, 64, 3), dtype=np.uint8))


def test_world_model_shapes_and_determinism():
    wm = _wm()
    x = _frames(3)
    z = wm.encode(x)
    assert z.shape == (3, 4, 8, 8)
    acts, pro = torch.randn(3, 4, 4), torch.randn(3, 4)
    with torch.no_grad():
        a, b = wm.step(z, z, pro, acts), wm.step(z, z, pro, acts)
    assert a.z.shape == z.shape and a.proprio.shape == (3, 4) and a.z_heads.shape == (2, 3, 4, 8, 8)
    assert a.uncertainty.shape == (3,) and (a.uncertainty > 0).all(), "two different heads disagree"
    assert torch.equal(a.z, b.z) and torch.equal(a.proprio, b.proprio), "the model is deterministic"
    img = wm.decode(a.z)
    assert img.dtype == torch.uint8 and img.shape == (3, 64, 64, 3)
    assert not torch.equal(wm.step(z, z, pro, -acts).z, a.z), "the action conditions the prediction"
    frames = torch.stack([x, x], 1)  # [3, 2, ...]: one history frame + one start frame, no model step
    loss, parts = wm.loss(torch.cat([frames, frames], 1), torch.randn(3, 4, 4), torch.randn(3, 3, 4, 4),
                          torch.ones(3, 3, dtype=torch.bool))
    loss.backward()
    assert parts["latent"] > 0 and all(p.grad is not None for p in wm.parameters())
    with pytest.raises(ConfigError, match="ensemble"):
        WorldModelConfig(ensemble=1).check()


def _keyframes(n=3, task="point-reach", seed=0):
    fr = _frames(2 * n, seed).numpy()
    return {make_key(0, "train", 300_000 + i): Keyframe(key=make_key(0, "train", 300_000 + i), task=task, frame=fr[i],
                                                        prev_frame=fr[n + i], proprio=np.full(4, 0.1 * i, np.float32))
            for i in range(n)}


def _env(threshold=0.0, horizon=40, **kw):
    wm = _wm()
    torch.manual_seed(1)
    sm = SuccessModel(SuccessModelConfig(latent_dim=4 * 64, proprio_dim=4, threshold=2.0)).eval()  # never succeeds
    return WorldModelEnv(wm, _keyframes(), horizon, success=sm, uncertainty_threshold=threshold, **kw)


def test_latent_save_restore_branching_gives_identical_continuations():
    env = _env()
    keys = list(env.keyframes)
    obs = env.reset(keys)
    assert np.array_equal(obs["image"][1], env.keyframes[keys[1]].frame), "imagination starts from the real frame"
    rng = np.random.default_rng(0)
    for _ in range(2):
        env.step_chunk(rng.uniform(-1, 1, (3, 4, 4)).astype(np.float32))
    saved = env.get_states([0, 1, 2])
    future = [rng.uniform(-1, 1, (3, 4, 4)).astype(np.float32) for _ in range(3)]
    first = [env.step_chunk(a) for a in future]
    env.step_chunk(rng.uniform(-1, 1, (3, 4, 4)).astype(np.float32))  # move on, then restore into other slots
    env.set_states([2, 0, 1], saved)
    again = [env.step_chunk(a[[1, 2, 0]]) for a in future]
    for r1, r2 in zip(first, again):
        assert np.array_equal(r1.image[[1, 2, 0]], r2.image) and np.array_equal(r1.proprio[[1, 2, 0]], r2.proprio)
    assert not np.array_equal(first[0].image[0], first[0].image[1])
    assert len(env.slots[1].trace["actions"]) == 5, "the restored trace holds the prefix too (audits replay it)"


def test_uncertainty_truncation():
    env = _env(threshold=1e-9)
    env.reset(list(env.keyframes))
    res = env.step_chunk(np.zeros((3, 4, 4), np.float32))
    assert res.done.all() and all(s.truncated for s in env.slots) and not res.success_once.any()
    env2 = _env(threshold=0.0, horizon=8)
    env2.reset(list(env2.keyframes))
    r = env2.step_chunk(np.zeros((3, 4, 4), np.float32))
    assert not r.done.any()
    r = env2.step_chunk(np.zeros((3, 4, 4), np.float32), np.array([True, False, True]))
    assert r.done.tolist() == [True, False, True] and not any(s.truncated for s in env2.slots), "horizon, not truncation"
    assert len(env2.slots[1].trace["actions"]) == 1, "an inactive slot does not move"


def _episode(n, success_at=None, key=0, states=True, task="point-reach", seed=0):
    rng = np.random.default_rng(seed)
    succ = np.zeros(n, bool)
    if success_at is not None:
        succ[success_at] = True
    return ChunkEpisode(task=task, key=key, frames=rng.integers(0, 255, (n + 1, 64, 64, 3), dtype=np.uint8),
                        proprio=rng.normal(size=(n + 1, 4)).astype(np.float32), actions=rng.normal(size=(n, 4, 4)).astype(np.float32),
                        success=succ, executed=np.full(n, 4), states=[f"s{i}" for i in range(n + 1)] if states else None)


def test_keyframe_start_sampling():
    eps = [_episode(10, success_at=5, key=make_key(0, "train", 1)), _episode(6, key=make_key(0, "train", 2), states=False),
           _episode(8, key=make_key(0, "train", 3), task="other")]
    kfs = sample_keyframes(eps, {"point-reach": 0}, stride=2, first_id=300_000)
    assert [k.chunk for k in kfs.values()] == [0, 2, 4], "every 2nd boundary, never at/after the first success"
    assert all(decode_key(k) == (0, "train", 300_000 + i) for i, k in enumerate(kfs))
    kf = list(kfs.values())[1]
    assert np.array_equal(kf.frame, eps[0].frames[2]) and np.array_equal(kf.prev_frame, eps[0].frames[1])
    assert kf.sim_state == "s2" and kf.episode_key == eps[0].key
    assert len(sample_keyframes(eps, {"point-reach": 0}, stride=1, need_state=False)) == 6 + 6, \
        "stateless episodes count when states are not needed; the last boundary never does"
    assert len(sample_keyframes(eps, {"point-reach": 0}, stride=1, limit=3)) == 3
    assert [k.chunk for k in sample_keyframes(eps, {"point-reach": 0}, stride=2, max_chunk=2).values()] == [0, 2]
    # training windows: history frame, start, open-loop targets; past the end is invalid
    ws = WindowSampler([eps[0]], length=3).sample(64, np.random.default_rng(0))
    assert ws.frames.shape == (64, 4, 64, 64, 3) and ws.valid[:, 1].all()


def test_reward_model_training_on_a_toy_split():
    """Success frames are bright, others dark: the classifier must separate held-out episodes."""
    rng = np.random.default_rng(0)

    def ep(success, seed):
        r = np.random.default_rng(seed)
        n = 4
        fr = r.integers(0, 60, (n + 1, 64, 64, 3)).astype(np.uint8)
        succ = np.zeros(n, bool)
        if success:
            fr[-1] = r.integers(190, 255, (64, 64, 3))
            succ[-1] = True
        return ChunkEpisode("point-reach", 0, fr, r.normal(size=(n + 1, 4)).astype(np.float32),
                            r.normal(size=(n, 4, 4)).astype(np.float32), succ, np.full(n, 4))

    train = [ep(i % 2 == 0, i) for i in range(20)]
    held = [ep(i % 2 == 0, 100 + i) for i in range(10)]
    wm = _wm()
    sm = fit_success_model(wm, train, steps=150, seed=0, with_predicted=False)  # the toy WM is untrained
    m = evaluate_success_model(wm, sm, held)
    assert m["precision"] >= 0.8 and m["recall"] >= 0.8, m
    untrained = SuccessModel(sm.cfg)
    assert evaluate_success_model(wm, untrained, held)["accuracy"] < m["accuracy"] or m["accuracy"] == 1.0
    del rng


def test_audit_replay_reproduces_a_simulator_episode_exactly():
    from robotics.envs.vector import BatchedMetaWorld, EnvConfig
    from robotics.world_model.data import RecordingEnv

    cfg = EnvConfig(tasks=["door-open-v3"], horizon=24)
    rng = np.random.default_rng(0)
    env1, env2 = BatchedMetaWorld(cfg), BatchedMetaWorld(cfg)
    rec = RecordingEnv(env1, record_states=True)
    keys = [make_key(0, "train", 3), make_key(0, "train", 4)]
    rec.reset(keys)
    for _ in range(6):
        rec.step_chunk(rng.uniform(-1, 1, (2, 4, 4)).astype(np.float32))
    eps = rec.episodes()
    # from the reset state and from a mid-episode state, in another env instance, with a different reset key
    reps = replay(env2, [keys[1], keys[1]], [eps[0].states[0], eps[1].states[2]], [eps[0].actions, eps[1].actions[2:]])
    assert np.array_equal(reps[0].frames, eps[0].frames) and np.array_equal(reps[0].proprio, eps[0].proprio)
    assert np.array_equal(reps[1].frames, eps[1].frames[2:]) and np.array_equal(reps[1].success, eps[1].success[2:])
    assert not np.array_equal(eps[0].frames[-1], eps[1].frames[-1])
    # the audit's metrics: an imagined success the simulator does not confirm is a hallucination
    imagined = [{"success": True, "frames": list(eps[0].frames[1:]), "prob": []},
                {"success": False, "frames": list(eps[1].frames[3:] // 2), "prob": []}]
    res = audit(imagined, reps)
    assert res["hallucinated_success_rate"] == 1.0 and res["replay_success_rate"] == 0.0
    assert res["image_mse_by_step"][0] > 0 and res["image_mse_by_step"][5] == 0.0, "only episode 0 reaches depth 6"
    env1.close(), env2.close()


@pytest.fixture(scope="module")
def tiny_asset(tmp_path_factory):
    root = tmp_path_factory.mktemp("wm")
    return root, tiny_wm_asset(root)


def test_world_model_training_job_writes_a_small_asset(tiny_asset):
    import json

    root, asset = tiny_asset
    meta = json.loads((asset / "meta.json").read_text())
    assert meta["real_env_steps"] > 0 and meta["policy_episodes"] == 12 and meta["uncertainty_ref"] > 0
    assert sum(f.stat().st_size for f in asset.iterdir()) < 5e6
    wm = WorldModel.load(asset)
    assert wm.cfg.uncertainty_ref == meta["uncertainty_ref"]


def test_coevolution_loop_runs_two_rounds(tiny_asset):
    root, asset = tiny_asset
    cfg = load_train_config(wm_train_config(asset, root / "vla", coevolve_every=1, coevolve_episodes=4, refit_steps=4,
                                            refit_success_steps=4, audit_fraction=0.5))
    tr = Trainer(cfg, None, log=lambda s: None)
    n_keys = len(tr.domain.train_keys())
    steps0 = tr.domain.rollouts.real_env_steps
    hist = tr.fit()
    rounds = [h for h in hist if "coevolve/real_steps" in h]
    assert len(rounds) == 2, "iterations 1 and 2 refit on fresh real rollouts"
    assert tr.domain.rollouts.real_env_steps == steps0 + sum(h["coevolve/real_steps"] for h in rounds)
    assert len(tr.domain.train_keys()) > n_keys, "fresh trajectories add keyframes"
    assert all("audit/replay_success_rate" in h and "wm/imagined_success" in h for h in hist)
    assert "eval/success" in hist[-1] and hist[-1]["eval/real_env_steps"] == tr.domain.rollouts.real_env_steps


def test_imagined_rollouts_drop_uncertain_episodes_and_config_errors(tiny_asset):
    root, asset = tiny_asset
    cfg = load_train_config(wm_train_config(asset, root / "vla", uncertainty_threshold=1e-9, uncertain="drop",
                                            audit_fraction=0.0))
    tr = Trainer(cfg, None, log=lambda s: None)
    dom = tr.domain
    ro = dom.rollout(dom.train_keys()[:2], 4, torch.Generator().manual_seed(0), 0)
    trunc = torch.tensor([s.truncated for s in dom.rollouts.imagine.slots])
    assert ro.info["wm/truncated_frac"] == float(trunc.float().mean()) >= 0.5, "a tiny threshold truncates at once"
    assert torch.isnan(ro.rewards["success"][trunc]).all() and not ro.mask[trunc].any()
    assert torch.isfinite(ro.rewards["success"][~trunc]).all(), "imagined successes are kept (never truncated)"
    with pytest.raises(ConfigError, match="audit_fraction"):
        load_train_config(wm_train_config(asset, root / "vla", audit_fraction=2.0))
    with pytest.raises(ConfigError, match="world_model.checkpoint"):
        Trainer(load_train_config(wm_train_config(root / "nowhere", root / "vla")), None, log=lambda s: None)


@pytest.mark.parametrize("target", ["robotics.world_model.model:WorldModelConfig",
                                    "robotics.world_model.settings:ImaginationSettings",
                                    "robotics.world_model.settings:VerifySettings",
                                    "robotics.world_model.settings:ShortHorizonSettings",
                                    "robotics.world_model.train:WorldModelTrainConfig",
                                    "robotics.world_model.train:CollectSettings", "robotics.world_model.reward:SuccessModelConfig",
                                    "robotics.branching:BranchConfig", "robotics.rollouts:RolloutSettings",
                                    "robotics.critic:CriticConfig", "robotics.replay:ReplayConfig",
                                    "robotics.adapters:AdaptersConfig", "robotics.config:RoboticsConfig"])
def test_every_world_model_and_robotics_setting_has_help_text(target):
    import dataclasses
    import importlib
    import typing

    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    hints = typing.get_type_hints(cls)
    missing = [f.name for f in dataclasses.fields(cls)
               if not dataclasses.is_dataclass(hints[f.name]) and not str(f.metadata.get("help", "")).strip()]
    assert not missing, f"{target}: {missing}"


def test_vla_rft_reference_similarity_reward():
    from robotics.world_model.reward import ReferenceSimilarity

    ref = torch.randn(4, 8, 8)
    rs = ReferenceSimilarity({7: ref}, tau=0.05, threshold=0.5)
    p = rs.prob(torch.stack([ref, ref + 0.1, ref + 1.0]), [7, 7, 7])
    assert p[0] == 1.0 and p[0] > p[1] > p[2] and p[2] < 0.5
