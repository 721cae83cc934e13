"""Branching (tree) groups in MuJoCo, the point env and imagination, with the shared tree estimators."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch

from shared_rl.advantages import ESTIMATORS, AdvantageInputs
from shared_rl.config import AdvantageConfig, ConfigError, EstimatorChoice, from_dict, load_train_config
from shared_rl.domain import RunContext
from shared_rl.trainer import Trainer

from robotics.branching import BranchConfig, run_branching_episodes
from robotics.domain import RoboticsConfig, RoboticsDomain
from robotics.episodes import SamplingSettings
from robotics.policies.vla import TinyVLA, VLAConfig

from .test_world_model_fixtures import TINY_VLA

POINT = {"kind": "point", "tasks": ["point-reach"], "horizon": 24}


def _domain(branch, env=None, **extra):
    sec = {"env": env or dict(POINT), "checkpoint": "", "model": dict(TINY_VLA), "head_mode": "flow_sde",
           "train_states_per_task": 8, "eval_states_per_task": 4, "gifs": False,
           "rollout": {"name": "tree", "branch": branch}, **extra}
    cfg = from_dict(RoboticsConfig, sec, "robotics")
    return RoboticsDomain(cfg, RunContext(run_dir=None, device=torch.device("cpu"), seed=0))


def _advantages(ro, est: str) -> torch.Tensor:
    """The shared tree estimator ``est`` on a rollout (every estimator has this one call shape)."""
    cfg = AdvantageConfig(estimator=EstimatorChoice(est), clip=None, multi_reward="sum_then_normalize")
    return ESTIMATORS[est](AdvantageInputs(ro.rewards, ro.group_ids, {}, ro.parent), cfg).advantages


def test_branching_rollouts_share_prefixes_and_get_tree_advantages():
    dom = _domain({"at_chunks": [1, 3], "factors": [2, 4]})
    keys = dom.train_keys()[:3]
    ro = dom.rollout(keys, 8, torch.Generator().manual_seed(0), 0)
    # per tree: root, the shared prefix edge, 2 children, 8 leaves
    assert len(ro) == 3 * (1 + 1 + 2 + 8)
    parent, leaf = ro.parent, torch.isfinite(ro.rewards["success"])
    assert int((parent < 0).sum()) == 3 and int(leaf.sum()) == 24
    for g in range(3):
        assert int(leaf[ro.group_ids == g].sum()) == 8
    c, s = dom.n_chunks, dom.steps_per_chunk
    trained_chunks = ro.mask.view(len(ro), c, s).any(-1)
    prefix = torch.nonzero(parent == 0).flatten()
    assert prefix.numel() == 1 and trained_chunks[prefix[0]].nonzero().flatten().tolist() == [0]
    kids = torch.nonzero(parent == prefix[0]).flatten()
    assert kids.numel() == 2 and all(trained_chunks[k].nonzero().flatten().tolist() == [1, 2] for k in kids)
    imgs = ro.payload["images"]
    assert torch.equal(imgs[kids[0], 1], imgs[kids[1], 1]), "siblings start from the restored parent state"
    # fewer env steps than 8 independent episodes would need
    flat = dom.cfg.env.horizon * 8 * 3
    assert ro.info["env/steps"] < flat
    out = dom.log_probs(ro, torch.arange(len(ro)), need_kl=False)
    assert (out.logp - ro.logp_old)[ro.mask].abs().max() < 1e-4, "tree edges recompute with ratio 1"
    ro.rewards["success"][leaf] = torch.arange(24, dtype=torch.float32)[: int(leaf.sum())] % 3  # varied outcomes
    for est in ("sibling", "leaf_global", "treerl"):
        adv = _advantages(ro, est)
        assert adv.shape == (len(ro),) and (adv[parent < 0] == 0).all()
        assert adv[kids].abs().sum() > 0 or est == "sibling", est
        assert adv[leaf].abs().sum() > 0, f"{est}: leaves get their own credit"
    sib = _advantages(ro, "sibling")
    for p in kids.tolist():
        ch = torch.nonzero(parent == p).flatten()
        assert abs(float(sib[ch].sum())) < 1e-5, "sibling advantages are centred on their parent's value"


def test_branching_in_mujoco_restores_exact_states():
    env = {"tasks": ["door-open-v3"], "horizon": 16}
    dom = _domain({"at_chunks": [0, 2], "factors": [2, 2]}, env=env, train_states_per_task=2)
    ro = dom.rollout(dom.train_keys()[:1], 4, torch.Generator().manual_seed(0), 0)
    parent, imgs = ro.parent, ro.payload["images"]
    firsts = torch.nonzero(parent == 0).flatten()
    assert firsts.numel() == 2 and torch.equal(imgs[firsts[0], 0], imgs[firsts[1], 0])
    for p in firsts.tolist():
        ch = torch.nonzero(parent == p).flatten()
        assert ch.numel() == 2 and torch.equal(imgs[ch[0], 2], imgs[ch[1], 2]), "branch = exact MuJoCo restore"
        assert not torch.equal(imgs[ch[0], 3], imgs[ch[1], 3]), "then the children act differently"
    assert not torch.equal(imgs[firsts[0], 1], imgs[firsts[1], 1])
    dom.close()


def test_branching_in_imagination():
    from robotics.envs.metaworld_env import make_key
    from robotics.world_model.env import Keyframe, WorldModelEnv
    from robotics.world_model.model import WorldModel, WorldModelConfig
    from robotics.world_model.reward import SuccessModel, SuccessModelConfig

    torch.manual_seed(0)
    wm = WorldModel(WorldModelConfig(latent_channels=4, width=8, ensemble=2))
    sm = SuccessModel(SuccessModelConfig(latent_dim=256, proprio_dim=4, threshold=2.0))
    fr = np.random.default_rng(0).integers(0, 255, (2, 64, 64, 3), dtype=np.uint8)
    kfs = {make_key(0, "train", 300_000 + i): Keyframe(make_key(0, "train", 300_000 + i), "point-reach", fr[i], fr[i],
                                                       np.zeros(4, np.float32)) for i in range(2)}
    env = WorldModelEnv(wm, kfs, horizon=16, success=sm)
    cfg = VLAConfig(**TINY_VLA)
    cfg.proprio_dim = 4
    policy = TinyVLA(cfg).eval()
    tree = run_branching_episodes(policy, env, list(kfs), ["point-reach"] * 2, SamplingSettings(mode="flow_sde"), 16,
                                  BranchConfig(at_chunks=[1, 2], factors=[2, 2]), torch.Generator().manual_seed(0))
    assert tree.leaf.sum() == 8 and tree.env_steps == 2 * (4 + 2 * 4 + 4 * 2 * 4)
    kids = np.nonzero(tree.parent == np.nonzero(tree.parent == 0)[0][0])[0]
    assert np.array_equal(tree.images[kids[0], 1], tree.images[kids[1], 1]), "latent copy = identical start"
    g0, g1 = (np.nonzero(tree.parent == k)[0] for k in kids)
    assert np.array_equal(tree.images[g0[0], 2], tree.images[g0[1], 2])
    assert not np.array_equal(tree.images[g0[0], 2], tree.images[g1[0], 2]), "siblings acted differently in imagination"


def test_branch_config_errors():
    with pytest.raises(ConfigError, match="same length"):
        BranchConfig(at_chunks=[0, 4], factors=[2]).check()
    with pytest.raises(ConfigError, match="increasing"):
        BranchConfig(at_chunks=[4, 4], factors=[2, 2]).check()
    section = {"env": dict(POINT), "checkpoint": "", "model": dict(TINY_VLA), "head_mode": "flow_sde",
               "train_states_per_task": 4, "eval_states_per_task": 2, "gifs": False}
    base = {"domain": "robotics", "iterations": 1, "rollout": {"groups_per_iteration": 2, "group_size": 4},
            "advantage": {"estimator": "treerl"}, "logging": {"progress": False}, "eval": {"at_start": False, "every": 0},
            "optim": {"inner_epochs": 1, "minibatches_per_epoch": 1},
            "robotics": {**section, "rollout": {"name": "tree", "branch": {"at_chunks": [0, 2], "factors": [2, 2]}}}}
    Trainer(load_train_config(base), None, log=lambda s: None).fit()  # one tree iteration through the trainer
    bad = {**base, "robotics": {**section, "rollout": {"name": "tree", "branch": {"at_chunks": [0], "factors": [2]}}}}
    with pytest.raises(ConfigError, match="group_size"):
        load_train_config(bad)
    flat = {**base, "robotics": {**section, "rollout": {"name": "flat"}}}
    with pytest.raises(ConfigError, match="tree rollouts"):
        load_train_config(flat)
    # the strategy's settings are checked against its name, and what needs flat groups refuses trees
    for rollout, match in (({"name": "tree"}, "name: tree branches at"),
                           ({"name": "flat", "branch": {"at_chunks": [0], "factors": [4]}}, "makes tree groups"),
                           ({"name": "tree", "branch": {"at_chunks": [0], "factors": [4]}, "world_model": {"horizon": 8}},
                            "world_model is read by name: world_model")):
        with pytest.raises(ConfigError, match=match):
            from_dict(RoboticsConfig, {**section, "rollout": rollout}, "robotics")
    with pytest.raises(ConfigError, match="critic.enabled learns from the episodes of flat groups"):
        from_dict(RoboticsConfig, {**section, "critic": {"enabled": True},
                                   "rollout": {"name": "tree", "branch": {"at_chunks": [0], "factors": [4]}}}, "robotics")
    with pytest.raises(ConfigError, match=r"config key 'robotics.branch' was replaced: use robotics.rollout: \{name: tree"):
        from_dict(RoboticsConfig, {**section, "branch": {"at_chunks": [0], "factors": [4]}}, "robotics")
