"""Two-stage robot rollouts (``robotics.rollout.name: verified``): noise streams reproduce episodes exactly, the
simulator restored at a keyframe re-executes an imagined candidate, only real rewards reach the rollout, the
selector is the shared one, and the metrics are logged (point env, tiny models, seconds)."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch

import shared_rl.two_stage
from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer

from robotics.envs.metaworld_env import make_key
from robotics.envs.vector import EnvConfig
from robotics.envs.point import PointReachVec
from robotics.episodes import SamplingSettings, run_episodes
from robotics.policies.vla import TinyVLA, VLAConfig
from robotics.world_model import verified
from robotics.world_model.data import RecordingEnv
from robotics.world_model.env import sample_keyframes
from robotics.world_model.verified import RestoredEnv

from .test_world_model_fixtures import POINT_ENV, TINY_VLA, tiny_wm_asset, wm_train_config


def _policy(head="flow", seed=0):
    torch.manual_seed(seed)
    cfg = VLAConfig(**TINY_VLA, head=head, proprio_dim=4)
    return TinyVLA(cfg).eval()


def _point(horizon=24):
    return PointReachVec(EnvConfig(**{**POINT_ENV, "horizon": horizon}))


FIELDS = ("chain", "logp", "stochastic", "images", "proprio", "chunk_valid", "success_once", "length")


@pytest.mark.parametrize("head,mode", [("flow", "sde_one_step"), ("flow", "flow_sde"), ("discrete", "discrete")])
def test_a_noise_stream_reproduces_an_episode_exactly(head, mode):
    """The same stream gives the same episode whatever the generator (bit for bit) and whatever the batch and the
    row (to float rounding: a batch of another size may take another matmul kernel); another stream does not."""
    pol = _policy(head)
    s = SamplingSettings(mode=mode, noise_level=0.7)
    keys = [make_key(0, "train", i) for i in range(3)]
    a = run_episodes(pol, _point(), keys, ["point-reach"] * 3, s, 24, torch.Generator().manual_seed(0),
                     noise_seeds=[11, 12, 13])
    a2 = run_episodes(pol, _point(), keys, ["point-reach"] * 3, s, 24, torch.Generator().manual_seed(5),
                      noise_seeds=[11, 12, 13])
    for f in FIELDS:
        assert np.array_equal(getattr(a, f), getattr(a2, f)), f
    # other order, another episode in the batch: each stream's episode is the same
    b = run_episodes(pol, _point(), [keys[2], keys[1], keys[0], keys[1]], ["point-reach"] * 4, s, 24,
                     torch.Generator().manual_seed(99), noise_seeds=[13, 12, 11, 14])
    for f in FIELDS:
        x, y = getattr(a, f)[[2, 1, 0]], getattr(b, f)[:3]
        assert (np.allclose(x, y, rtol=1e-5, atol=1e-5) if x.dtype.kind == "f" else np.array_equal(x, y)), f
    assert not np.allclose(b.chain[1], b.chain[3]), "another stream from the same state draws other noise"
    assert a.stochastic.any(), "the episodes sample (their log-probs are trained)"
    with pytest.raises(ValueError, match="noise_seeds"):
        run_episodes(pol, _point(), keys, ["point-reach"] * 3, s, 24, noise_seeds=[1, 2])


def _keyframes(pol, horizon=24):
    rec = RecordingEnv(_point(horizon), record_states=True)
    keys = [make_key(0, "train", i) for i in range(4)]
    run_episodes(pol, rec, keys, ["point-reach"] * 4, SamplingSettings(mode="flow_sde"), horizon,
                 torch.Generator().manual_seed(3))
    eps = rec.episodes()
    kfs = sample_keyframes(eps, {"point-reach": 0}, stride=1, max_chunk=3, first_id=300_000)
    assert len(kfs) >= 4
    return kfs


def test_the_restored_simulator_re_executes_a_candidate_exactly():
    """With a perfect explorer (the simulator itself, restored at the keyframe) the re-execution of a candidate in
    another env instance reproduces it bit for bit: restore + noise stream + closed loop are exact."""
    pol = _policy()
    kfs = _keyframes(pol)
    keys = list(kfs)[:4]
    s = SamplingSettings(mode="sde_one_step", noise_level=0.7)
    seeds = [5, 6, 7, 8]
    explorer = RestoredEnv(_point(), kfs)
    obs = explorer.reset(keys)
    assert all(np.array_equal(obs["image"][i], kfs[k].frame) for i, k in enumerate(keys)), "the real frame at the keyframe"
    imagined = run_episodes(pol, explorer, keys, ["point-reach"] * 4, s, 12, torch.Generator().manual_seed(0),
                            noise_seeds=seeds)
    rec = RecordingEnv(RestoredEnv(_point(), kfs), record_states=True)
    real = run_episodes(pol, rec, keys, ["point-reach"] * 4, s, 12, torch.Generator().manual_seed(1),
                        noise_seeds=seeds)
    for f in FIELDS:
        assert np.array_equal(getattr(imagined, f), getattr(real, f)), f
    eps = rec.episodes("verified")
    assert all(np.array_equal(e.frames[0], kfs[k].frame) for e, k in zip(eps, keys))
    # re-executed episodes start mid-trajectory: their keyframes sit on the absolute grid, boundary 0 skipped
    for e, k in zip(eps, keys):
        e.start_steps = kfs[k].chunk * 4
    again = sample_keyframes(eps, {"point-reach": 0}, stride=2, min_chunk=0, max_chunk=5)
    assert again and all(kf.chunk % 2 == 0 and kf.chunk > kfs[keys[0]].chunk - 1 for kf in again.values()
                         if kf.episode_key == eps[0].key)
    assert all(kf.chunk <= 5 for kf in again.values())


@pytest.fixture(scope="module")
def tiny_asset(tmp_path_factory):
    root = tmp_path_factory.mktemp("wmv")
    return root, tiny_wm_asset(root)


def _verified_config(asset, root, k=3, n=6, **wm):
    cfg = wm_train_config(asset, root / "vla", audit_fraction=0.0, **wm)
    cfg["rollout"]["group_size"] = k
    cfg["robotics"]["rollout"]["name"] = "verified"
    cfg["robotics"]["rollout"]["verify"] = {"candidates": n, "selector": "max_variance"}
    return cfg


def test_only_real_rewards_reach_the_rollout_and_the_selector_is_the_shared_one(tiny_asset):
    root, asset = tiny_asset
    tr = Trainer(load_train_config(_verified_config(asset, root)), None, log=lambda s: None)
    dom, strat = tr.domain, tr.domain.rollouts
    assert verified.select_candidates is shared_rl.two_stage.select_candidates, "no second selector"
    strat.success.cfg.threshold = -1.0  # imagination now says every candidate succeeds at its first chunk
    keys = dom.train_keys()[:3]
    ro = dom.rollout(keys, 3, torch.Generator().manual_seed(0), 0)
    last = strat.last
    assert torch.equal(last["keep"], shared_rl.two_stage.select_candidates(last["score"], 3, "max_variance"))
    assert ro.info["verify/imagined_success"] == 1.0
    # the rewards are the simulator's: re-run each kept candidate independently from its keyframe with its stream
    env_keys = [kk for kk in keys for _ in range(3)]
    seeds = last["seeds"].gather(1, last["keep"]).flatten().tolist()
    ref = run_episodes(dom.policy, RestoredEnv(_point(), strat.keyframes), env_keys, ["point-reach"] * 9,
                       dom.sampling, 12, torch.Generator().manual_seed(7), noise_seeds=seeds)
    assert torch.equal(ro.rewards["success"], torch.from_numpy(ref.success_once.astype(np.float32)))
    assert (ro.rewards["success"] < 1).any(), "imagined successes the simulator does not confirm are not rewarded"
    assert ro.info["verify/hallucinated_success_rate"] == pytest.approx(1 - float(ro.rewards["success"].mean()))
    assert np.array_equal(ro.payload["chain"].numpy(), ref.chain), "the trained steps are the real episodes'"
    assert ro.info["env/steps"] == int(ref.length.sum()) and ro.info["wm/imagined_steps"] > 0
    with torch.no_grad():  # the recorded behaviour log-probs are the policy's on the real episodes: ratio 1
        lp = dom.log_probs(ro, torch.arange(len(ro)), False).logp
    assert torch.allclose(lp[ro.mask], ro.logp_old[ro.mask], atol=1e-4)


def test_verified_training_logs_agreement_and_co_evolves_on_real_episodes(tiny_asset):
    root, asset = tiny_asset
    cfg = _verified_config(asset, root, coevolve_every=1, coevolve_episodes=0, refit_steps=3, refit_success_steps=3)
    cfg["iterations"] = 2
    tr = Trainer(load_train_config(cfg), None, log=lambda s: None)
    strat = tr.domain.rollouts
    steps0, keys0 = strat.real_env_steps, len(tr.domain.train_keys())
    hist = tr.fit()
    for name in ("verify/rank_spearman", "verify/rank_spearman_group", "verify/kept_agreement", "verify/real_success",
                 "verify/imagined_success", "verify/mixed_groups_real", "wm/imagined_steps", "wm/real_env_steps",
                 "env/steps"):
        assert all(name in h for h in hist if "loss/policy" in h or "groups/kept" in h), name
    rounds = [h for h in hist if "coevolve/refit_episodes" in h]
    assert len(rounds) == 1 and rounds[0]["coevolve/refit_episodes"] == 2 * 3, "iteration 1 refits on iteration 0's"
    assert strat.real_env_steps == steps0 + sum(h["env/steps"] for h in hist if "env/steps" in h)
    assert len(tr.domain.train_keys()) > keys0, "the re-executed trajectories add keyframes"


def test_verified_config_errors(tiny_asset):
    root, asset = tiny_asset
    with pytest.raises(ConfigError, match="candidates"):
        load_train_config(_verified_config(asset, root, k=4, n=3))
    bad = _verified_config(asset, root)
    bad["robotics"]["rollout"]["verify"]["selector"] = "best"
    with pytest.raises(ConfigError, match="selector"):
        load_train_config(bad)
    flat = _verified_config(asset, root)
    flat["robotics"]["rollout"]["name"] = "flat"
    del flat["robotics"]["rollout"]["world_model"]
    with pytest.raises(ConfigError, match="verify is read by name: verified"):
        load_train_config(flat)
