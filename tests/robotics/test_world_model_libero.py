"""The world model on LIBERO's observation layout (two cameras stacked as 6 channels, 8-d state, 7-d actions in
chunks, sparse success): training from a per-step demo file and from chunk episodes, the data / settings check, the
held-out metrics on hand-checkable cases, and checkpoints that reload to identical predictions. Tiny sizes, CPU,
everything under tmp_path."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shared_rl.errors import ConfigError

from robotics.data import Episode, save_episodes
from robotics.envs.vector import EnvConfig
from robotics.world_model.data import ChunkEpisode, episodes_from_demos, save_chunk_episodes
from robotics.world_model.heldout import keyframe_rollouts, success_report
from robotics.world_model.model import WorldModel, WorldModelConfig
from robotics.world_model.reward import SuccessModel
from robotics.world_model.train import set_model_dims, split_episodes

TINY_WM = {"latent_channels": 4, "width": 8, "ensemble": 2}
LIBERO_DIMS = {"image_channels": 6, "proprio_dim": 8, "action_dim": 7, "chunk": 4}
TASKS = ["libero_spatial/0", "libero_object/0"]


def _libero_env(**kw) -> EnvConfig:
    # built without check(): the sizes it reports (cameras x 3, LIBERO's 8-d state, 7-d actions) need no LIBERO
    return EnvConfig(kind="libero", tasks=list(TASKS), cameras=["image", "image2"], **kw)


def _demo(rng: np.random.Generator, task: str, key: int, length: int, succeed: bool = True) -> Episode:
    """A per-step LIBERO-layout episode: a bright square moving with the action in camera 1, camera 2 darker."""
    imgs = np.zeros((length, 64, 64, 6), np.uint8)
    pos = np.cumsum(rng.uniform(0.5, 1.5, length)).astype(int) % 48
    for t in range(length):
        imgs[t, 8:16, pos[t]:pos[t] + 8, :3] = 220
        imgs[t, 40:48, pos[t]:pos[t] + 8, 3:] = 120
    proprio = np.cumsum(rng.normal(0, 0.01, (length, 8)), 0).astype(np.float32)
    actions = rng.uniform(-1, 1, (length, 7)).astype(np.float32)
    success = np.zeros(length, bool)
    success[-1] = succeed
    return Episode(task=task, instruction="put the bowl on the plate", images=imgs, proprio=proprio, actions=actions,
                   success=success, key=key)


def _chunk_episode(rng, task="libero_spatial/0", chunks=6, succeed=True, source="policy", chunk=4, channels=6,
                   proprio=8, actions=7) -> ChunkEpisode:
    """A chunk-level real episode in the layout RecordingEnv writes: C+1 boundary frames, success on the last chunk."""
    frames = rng.integers(0, 255, (chunks + 1, 64, 64, channels), dtype=np.uint8)
    success = np.zeros(chunks, bool)
    success[-1] = succeed
    return ChunkEpisode(task=task, key=0, frames=frames, proprio=rng.normal(0, 1, (chunks + 1, proprio)).astype(np.float32),
                        actions=rng.uniform(-1, 1, (chunks, chunk, actions)).astype(np.float32), success=success,
                        executed=np.full(chunks, chunk, np.int64), source=source)


def _train_cfg(tmp_path: Path, **kw) -> dict:
    cfg = {"data": str(tmp_path / "data.npz"), "env": {"kind": "libero", "tasks": list(TASKS), "cameras": ["image", "image2"],
                                                       "horizon": 40},
           "model": dict(TINY_WM), "collect": {"demos_per_task": 0, "policy": "", "demo_files": [str(tmp_path / "demos.npz")]},
           "train_steps": 6, "batch_size": 4, "success_steps": 5, "holdout_fraction": 0.25, "holdout_stratify": True,
           "report_depth": 3, "report_stride": 2, "export_dir": str(tmp_path / "wm")}
    cfg.update(kw)
    return cfg


# ---------------------------------------------------------------------------------------------------------------
def test_training_on_a_libero_demo_file_writes_a_six_channel_asset(tmp_path):
    pytest.importorskip("libero")  # env.kind libero checks its task names against the installed suites
    from robotics.world_model.train import run

    rng = np.random.default_rng(0)
    save_episodes([_demo(rng, TASKS[i % 2], 100000 + i, 30 + 3 * i) for i in range(8)], tmp_path / "demos.npz")
    result = run(_train_cfg(tmp_path), tmp_path / "run", log=lambda *_: None)
    asset = tmp_path / "wm"
    cfg = json.loads((asset / "world_model.json").read_text())
    assert {k: cfg[k] for k in LIBERO_DIMS} == LIBERO_DIMS
    meta = json.loads((asset / "meta.json").read_text())
    assert meta["data_dims"]["image_channels"] == 6 and meta["heldout_episodes"] == 2  # 25% of 8 whole episodes
    assert meta["demo_env_steps"] == sum(30 + 3 * i for i in range(8))
    keyed = meta["heldout_keyframe_rollouts"]
    assert len(keyed["image_mse"]) == 3 and len(keyed["image_mse_by_camera"][0]) == 2  # depth 3, two cameras
    # every camera's error averages to the frame's (the channels split 3 + 3)
    assert np.mean(keyed["image_mse_by_camera"][0]) == pytest.approx(keyed["image_mse"][0], rel=1e-5)
    assert np.isfinite(result["wm/keyframe_mse_step1"])
    wm = WorldModel.load(asset)
    z = wm.encode(torch.zeros(2, 64, 64, 6, dtype=torch.uint8))
    pred = wm.step(z, z, torch.zeros(2, 8), torch.zeros(2, 4, 7))
    assert wm.decode(pred.z).shape == (2, 64, 64, 6) and pred.proprio.shape == (2, 8)


def test_demo_files_are_cut_into_chunks_of_the_policy_length():
    rng = np.random.default_rng(1)
    eps = episodes_from_demos([_demo(rng, TASKS[0], 1, 24)], chunk=4)
    # 24 steps: 5 chunks end at stored frames (step 20 the last); the 6th would end at step 24, after the last
    # stored frame, so it and its success are dropped
    assert eps[0].frames.shape == (6, 64, 64, 6) and eps[0].actions.shape == (5, 4, 7) and not eps[0].succeeded


def test_data_that_disagrees_with_the_settings_is_one_line_error(tmp_path):
    rng = np.random.default_rng(2)
    eps = [_chunk_episode(rng) for _ in range(2)]
    mc = WorldModelConfig(**TINY_WM)
    set_model_dims(mc, _libero_env(), eps, tmp_path / "d.npz", explicit={})
    assert (mc.image_channels, mc.proprio_dim, mc.action_dim, mc.chunk) == (6, 8, 7, 4)
    # one camera in the settings, two in the data
    with pytest.raises(ConfigError) as e:
        set_model_dims(WorldModelConfig(**TINY_WM), EnvConfig(kind="libero", tasks=list(TASKS), cameras=["image"]), eps,
                       tmp_path / "d.npz", explicit={})
    msg = str(e.value)
    assert "\n" not in msg and "image_channels 6" in msg and "env.cameras ['image']" in msg and "gives 3" in msg
    # a size written under model that the data contradicts
    with pytest.raises(ConfigError, match=r"has chunk 4 but model.chunk gives 8"):
        set_model_dims(WorldModelConfig(**TINY_WM), _libero_env(), eps, tmp_path / "d.npz", explicit={"chunk": 8})
    # Meta-World settings (one camera, 4-d proprio and actions) on LIBERO data
    with pytest.raises(ConfigError, match=r"proprio_dim 8 but env.kind metaworld's proprio gives 4"):
        set_model_dims(WorldModelConfig(**TINY_WM), EnvConfig(kind="metaworld", tasks=["reach-v3"], cameras=["a", "b"]),
                       eps, tmp_path / "d.npz", explicit={})
    # episodes of two layouts in one file
    with pytest.raises(ConfigError, match="mixes episodes of action_dim 7 and 4"):
        set_model_dims(mc, _libero_env(), eps + [_chunk_episode(rng, actions=4)], tmp_path / "d.npz", explicit={})


def test_stratified_holdout_keeps_rare_failures_on_both_sides():
    rng = np.random.default_rng(3)
    eps = ([_chunk_episode(rng, source="demo") for _ in range(10)] + [_chunk_episode(rng, succeed=False) for _ in range(3)]
           + [_chunk_episode(rng) for _ in range(2)])
    for seed in range(5):
        train, hold = split_episodes(eps, 0.2, seed, stratify=True)
        groups = lambda xs: sorted((e.source, e.succeeded) for e in xs)  # noqa: E731
        # round(0.2 x 10) = 2 demos; at least one of the 3 failures and one of the 2 successes
        assert groups(hold) == [("demo", True)] * 2 + [("policy", False), ("policy", True)]
        assert len(train) == 11 and not {id(e) for e in train} & {id(e) for e in hold}


class _ThresholdOnProprio:
    """A success model whose decision is readable: success when proprio[0] > 0.5."""

    cfg = SimpleNamespace(threshold=0.5)

    def prob(self, z, proprio):
        return (proprio[:, 0] > 0.5).float()


def test_success_report_precision_recall_on_a_constructed_case():
    rng = np.random.default_rng(4)
    wm = WorldModel(WorldModelConfig(image_channels=6, proprio_dim=8, action_dim=7, **TINY_WM))
    eps = []
    # (real success, boundaries the model calls successful): TP episode, FP episode, FN episode, TN episode
    for succeed, called in [(True, [3]), (False, [1]), (True, []), (False, [])]:
        ep = _chunk_episode(rng, chunks=3, succeed=succeed)
        ep.proprio[:, 0] = 0.0
        for b in called:
            ep.proprio[b, 0] = 1.0  # boundary b = after chunk b-1
        eps.append(ep)
    # a demonstration cut from a per-step file: its success frame is not stored, its last boundary "nearly there"
    demo = _chunk_episode(rng, chunks=3, succeed=False, source="demo")
    demo.proprio[:, 0] = 0.0
    demo.proprio[3, 0] = 1.0
    eps.append(demo)
    r = success_report(wm, _ThresholdOnProprio(), eps)
    # episodes: the four recorded ones only (the demo's outcome frame is missing)
    assert r["episodes"] == 4 and r["successful_episodes"] == 2
    assert r["episode"]["precision"] == 0.5 and r["episode"]["recall"] == 0.5
    # boundaries (every label is the simulator's): 15, real positives 2 (last chunk of episodes 1 and 3), called 3
    # (one right)
    assert r["boundary"]["precision"] == pytest.approx(1 / 3) and r["boundary"]["recall"] == 0.5
    assert r["boundary"]["accuracy"] == pytest.approx(12 / 15)
    # a fixed cut above every probability calls nothing: recall 0, precision undefined
    strict = success_report(wm, _ThresholdOnProprio(), eps, threshold=1.5)
    assert strict["episode"]["recall"] == 0.0 and np.isnan(strict["episode"]["precision"]) and strict["threshold"] == 1.5


def test_keyframe_rollouts_count_steps_and_beat_nothing_for_a_still_scene():
    rng = np.random.default_rng(5)
    wm = WorldModel(WorldModelConfig(image_channels=6, proprio_dim=8, action_dim=7, **TINY_WM))
    ep = _chunk_episode(rng, chunks=6)
    ep.frames[:] = ep.frames[:1]  # nothing moves: the copy baseline is exact
    ep.proprio[:] = ep.proprio[:1]
    short = _chunk_episode(rng, chunks=5)
    short.executed[1] = 1  # chunk 1 ran short of its 4 steps: its end frame is no chunk boundary to roll past
    r = keyframe_rollouts(wm, [ep, short], _ThresholdOnProprio(), depth=3, stride=4)
    # ep: keyframes 0 and 4, steps 1..3 cover chunks {0,4}, {1,5}, {2}; short: keyframes 0, 4: {0,4}, {1}, {}
    assert r["keyframes"] == 4 and r["transitions_by_step"] == [4, 3, 1]
    assert r["copy_mse"][0] > 0  # `short` moves
    r1 = keyframe_rollouts(wm, [ep], None, depth=3, stride=4)
    assert r1["copy_mse"] == [0.0, 0.0, 0.0] and r1["copy_proprio_rmse"] == [0.0, 0.0, 0.0]
    assert all(x > 0 for x in r1["image_mse"])  # an untrained decoder does not reproduce the frame
    # the imagined successes are scored against the real flags of the chunks they imagine (9 transitions)
    # ep's chunk 5 and short's chunk 4 are the real successes among the 8 imagined transitions
    assert r["imagined_success"]["true_positive_count"] == 2.0
    assert r["imagined_success"]["accuracy"] * 8 == pytest.approx(round(r["imagined_success"]["accuracy"] * 8))
    assert r["imagined_success_at_0.5"]["true_positive_count"] == 2.0


def test_checkpoints_reload_to_identical_predictions(tmp_path):
    rng = np.random.default_rng(6)
    torch.manual_seed(0)
    wm = WorldModel(WorldModelConfig(image_channels=6, proprio_dim=8, action_dim=7, **TINY_WM))
    eps = [_chunk_episode(rng, succeed=bool(i % 2)) for i in range(4)]
    from robotics.world_model.reward import fit_success_model
    from robotics.world_model.train import fit_world_model

    fit_world_model(wm, eps, steps=3, batch=4, window=3, lr=1e-3, seed=0)
    sm = fit_success_model(wm, eps, steps=3, seed=0)
    wm.save(tmp_path / "a")
    sm.save(tmp_path / "a")
    wm2, sm2 = WorldModel.load(tmp_path / "a"), SuccessModel.load(tmp_path / "a")
    frames = torch.from_numpy(eps[0].frames[:3])
    z, z2 = wm.encode(frames), wm2.encode(frames)
    assert torch.equal(z, z2)
    acts, pro = torch.from_numpy(eps[0].actions[:3]), torch.from_numpy(eps[0].proprio[:3])
    p, p2 = wm.step(z, z, pro, acts), wm2.step(z2, z2, pro, acts)
    assert torch.equal(wm.decode(p.z), wm2.decode(p2.z)) and torch.equal(p.proprio, p2.proprio)
    assert torch.equal(sm.prob(p.z, p.proprio), sm2.prob(p2.z, p2.proprio))
    assert keyframe_rollouts(wm, eps, sm, depth=2, stride=2) == keyframe_rollouts(wm2, eps, sm2, depth=2, stride=2)


def test_chunk_episode_files_of_real_rollouts_train_too(tmp_path):
    """RL / clone rollouts recorded by RecordingEnv (real successes and failures) train the same job."""
    pytest.importorskip("libero")
    from robotics.world_model.train import run

    rng = np.random.default_rng(7)
    eps = [_chunk_episode(rng, task=TASKS[i % 2], succeed=i % 3 != 0) for i in range(8)]
    save_chunk_episodes(eps, tmp_path / "data.npz")
    result = run(_train_cfg(tmp_path), tmp_path / "run", log=lambda *_: None)
    meta = json.loads((tmp_path / "wm" / "meta.json").read_text())
    assert meta["policy_episodes"] == 8 and meta["heldout_episodes"] == 2
    assert meta["success_heldout_report"]["episodes"] == 2
    # one real success and one real failure held out: the episode recall is 0 or 1, never undefined
    assert result["wm/episode_success_recall"] in (0.0, 1.0)
    # the saved asset re-measured from its config: the same held-out episodes, the same numbers
    import yaml

    from robotics.world_model.remeasure import evaluate_asset

    cfg_path = tmp_path / "wm.yaml"
    cfg_path.write_text(yaml.safe_dump(_train_cfg(tmp_path)))
    again = json.loads(json.dumps(evaluate_asset(str(tmp_path / "wm"), str(cfg_path)), default=float))
    assert again["heldout_keyframe_rollouts"]["image_mse"] == meta["heldout_keyframe_rollouts"]["image_mse"]
    assert again["success_heldout_report"]["episode"] == meta["success_heldout_report"]["episode"]


# ---------------------------------------------------------------------------------------------------------------
# The verified explorer's simulator side on LIBERO (issue 61, part 2): keyframe states recorded, saved and restored


def test_libero_state_through_the_json_codec_is_bit_identical():
    """LiberoState (MuJoCo's state, the fixtures' placement and robosuite's Python state with its buffer objects as
    ("__buffer__", fields) pairs) survives encode -> JSON -> decode exactly; an unknown class is refused."""
    pytest.importorskip("mujoco")
    from robotics.envs import state_codec
    from robotics.envs.libero_env import LiberoState

    rng = np.random.default_rng(0)
    st = LiberoState(task="libero_goal/6", key=12345, physics=rng.normal(size=77), body_pos=rng.normal(size=(9, 3)),
                     body_quat=rng.normal(size=(9, 4)),
                     python={"robot0.controller": {"goal_pos": rng.normal(size=3), "use_delta": True, "steps": 3,
                                                    "history": [np.float64(0.5), 2]},
                             "obs.robot0_eef_pos": {"_sampled": False,
                                                    "_buffer": ("__buffer__", {"buf": rng.normal(size=(2, 3)),
                                                                               "_size": np.int64(2)})}},
                     steps=17, success_once=False, obs={"robot0_eef_pos": rng.normal(size=3).astype(np.float32)})
    back = state_codec.decode(json.loads(json.dumps(state_codec.encode((st, False, True)))))
    got, done, ok = back
    assert type(got) is LiberoState and (done, ok) == (False, True)
    assert np.array_equal(got.physics, st.physics) and np.array_equal(got.body_quat, st.body_quat)
    ctrl = got.python["robot0.controller"]
    assert np.array_equal(ctrl["goal_pos"], st.python["robot0.controller"]["goal_pos"]) and ctrl["use_delta"] is True
    assert ctrl["history"] == [0.5, 2] and isinstance(ctrl["history"][0], np.float64)
    tag, buf = got.python["obs.robot0_eef_pos"]["_buffer"]
    assert tag == "__buffer__" and np.array_equal(buf["buf"], st.python["obs.robot0_eef_pos"]["_buffer"][1]["buf"])
    assert got.obs["robot0_eef_pos"].dtype == np.float32 and got.steps == 17
    with pytest.raises(ValueError, match="unknown state class"):
        state_codec.decode({"__state__": "Evil", "fields": {}})


def test_states_are_recorded_only_up_to_state_max_chunk():
    """RecordingEnv(state_max_chunk=n) stores the simulator state at boundaries 0..n and None after (the
    explorer's keyframes come from there; a LIBERO state is ~37 KB), and asks the simulator for no other."""
    from robotics.envs.metaworld_env import make_key
    from robotics.envs.point import PointReachVec
    from robotics.episodes import SamplingSettings, run_episodes
    from robotics.policies.vla import TinyVLA, VLAConfig
    from robotics.world_model.data import RecordingEnv
    from robotics.world_model.env import sample_keyframes

    from .test_world_model_fixtures import POINT_ENV, TINY_VLA

    class Counting(PointReachVec):
        asked = 0

        def get_states(self, idx):
            Counting.asked += len(idx)
            return super().get_states(idx)

    torch.manual_seed(0)
    pol = TinyVLA(VLAConfig(**TINY_VLA, proprio_dim=4)).eval()
    keys = [make_key(0, "train", i) for i in range(3)]
    runs = {}
    for n in (None, 2):
        Counting.asked = 0
        rec = RecordingEnv(Counting(EnvConfig(**POINT_ENV)), record_states=True, state_max_chunk=n)
        run_episodes(pol, rec, keys, ["point-reach"] * 3, SamplingSettings(mode="flow_sde"), 24,
                     torch.Generator().manual_seed(3))
        runs[n] = (rec.episodes(), Counting.asked)
    full, limited = runs[None][0], runs[2][0]
    assert max(e.num_chunks for e in full) > 3, "some episode runs past boundary 2"
    assert all(st is not None for e in full for st in e.states)
    for a, b in zip(full, limited):
        assert np.array_equal(a.frames, b.frames), "the episodes themselves are the same"
        kept = min(b.num_chunks, 2) + 1
        assert [st is not None for st in b.states] == [True] * kept + [False] * (b.num_chunks + 1 - kept)
    assert runs[2][1] == sum(min(e.num_chunks, 2) + 1 for e in limited)
    assert runs[None][1] == sum(e.num_chunks + 1 for e in full)
    kfs = sample_keyframes(limited, {"point-reach": 0}, stride=1, min_chunk=0, max_chunk=5)
    assert sorted({kf.chunk for kf in kfs.values()}) == [0, 1, 2]


@pytest.mark.slow
def test_libero_keyframes_restore_and_re_execute_a_candidate_exactly(tmp_path):
    """Clone rollouts recorded with LIBERO simulator states at boundaries 0..state_max_chunk only, saved to the data
    file and read back (the JSON state codec rebuilds LiberoState), give keyframes at those boundaries; LIBERO
    restored there observes the recorded frame and state, and re-executes a candidate's noise stream exactly (the
    verified rollout's premise: the same stream and the same real observations give the same episode)."""
    pytest.importorskip("libero")
    from robotics.envs.metaworld_env import make_key
    from robotics.envs.vector import make_vector_env
    from robotics.episodes import SamplingSettings, run_episodes
    from robotics.policies.vla import TinyVLA, VLAConfig
    from robotics.world_model.data import RecordingEnv, load_chunk_episodes
    from robotics.world_model.env import sample_keyframes
    from robotics.world_model.verified import RestoredEnv

    cfg = EnvConfig(kind="libero", tasks=["libero_object/0"], cameras=["image", "image2"], image_size=32, horizon=24)
    cfg.check()
    torch.manual_seed(0)
    pol = TinyVLA(VLAConfig(cnn_channels=[8, 8, 8, 8], feature_dim=32, text_dim=8, hidden=64, num_denoise_steps=3,
                            image_size=32, image_channels=6, proprio_dim=8, action_dim=7, chunk=4)).eval()
    s = SamplingSettings(mode="sde_one_step", noise_level=0.7)
    venv = make_vector_env(cfg)
    try:
        rec = RecordingEnv(venv, record_states=True, state_max_chunk=3)
        keys = [make_key(0, "train", 0), make_key(0, "train", 1)]
        run_episodes(pol, rec, keys, cfg.tasks * 2, s, 24, torch.Generator().manual_seed(0))
        eps = rec.episodes()
        assert all(e.num_chunks == 6 for e in eps)
        assert all(st is not None for e in eps for st in e.states[:4]), "boundaries 0-3 carry their state"
        assert all(st is None for e in eps for st in e.states[4:]), "later ones are not stored (~37 KB each)"
        save_chunk_episodes(eps, tmp_path / "data.npz")
        back = load_chunk_episodes(tmp_path / "data.npz")
        state, _, _ = back[0].states[2]  # the batched env's (state, done, success)
        assert type(state).__name__ == "LiberoState"
        assert np.array_equal(state.physics, eps[0].states[2][0].physics)
        kfs = sample_keyframes(back, {cfg.tasks[0]: 0}, stride=1, min_chunk=1, max_chunk=5, first_id=300_000)
        assert sorted({kf.chunk for kf in kfs.values()}) == [1, 2, 3], "keyframes only where a state was recorded"
        pick = [k for k in kfs if kfs[k].chunk in (2, 3)][:2]
        explorer = RestoredEnv(venv, kfs)
        obs = explorer.reset(pick)
        for i, k in enumerate(pick):
            assert np.array_equal(obs["image"][i], kfs[k].frame) and np.array_equal(obs["proprio"][i], kfs[k].proprio)
        # the recorded episode's next chunk, replayed from the restored state: its next frame and state exactly
        src = [next(e for e in back if e.key == kfs[k].episode_key) for k in pick]
        res = venv.step_chunk(np.stack([e.actions[kfs[k].chunk] for e, k in zip(src, pick)]))
        for i, (e, k) in enumerate(zip(src, pick)):
            assert np.array_equal(res.proprio[i], e.proprio[kfs[k].chunk + 1])
            assert np.array_equal(res.image[i], e.frames[kfs[k].chunk + 1])
        seeds = [11, 12]
        first = run_episodes(pol, RestoredEnv(venv, kfs), pick, cfg.tasks * 2, s, 8,
                             torch.Generator().manual_seed(1), noise_seeds=seeds)
        again = run_episodes(pol, RestoredEnv(venv, kfs), pick, cfg.tasks * 2, s, 8,
                             torch.Generator().manual_seed(2), noise_seeds=seeds)
        for f in ("chain", "logp", "images", "proprio", "success_once", "length"):
            assert np.array_equal(getattr(first, f), getattr(again, f)), f
        other = run_episodes(pol, RestoredEnv(venv, kfs), pick, cfg.tasks * 2, s, 8,
                             torch.Generator().manual_seed(2), noise_seeds=[13, 14])
        assert not np.array_equal(first.proprio, other.proprio), "another stream moves the arm elsewhere"
    finally:
        venv.close()
