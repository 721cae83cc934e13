"""RoboticsDomain against the trainer contract: group layout, masks, ratio 1 per head mode, and learning."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch

from shared_rl.config import ConfigError, from_dict, load_train_config
from shared_rl.domain import RunContext
from shared_rl.trainer import Trainer

from robotics.domain import RoboticsConfig, RoboticsDomain

TINY_MODEL = {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64, "num_denoise_steps": 3}


def _domain(head_mode="flow_sde", env=None, **extra):
    head = "discrete" if head_mode == "discrete" else "flow"
    section = {"env": env or {"kind": "point", "tasks": ["point-reach"], "horizon": 8}, "checkpoint": "",
               "model": dict(TINY_MODEL, head=head), "head_mode": head_mode, "train_states_per_task": 8,
               "eval_states_per_task": 4, "gifs": False, **extra}
    cfg = from_dict(RoboticsConfig, section, "robotics")
    return RoboticsDomain(cfg, RunContext(run_dir=None, device=torch.device("cpu"), seed=0))


@pytest.mark.parametrize("mode,trained_per_chunk", [("flow_sde", 2), ("flow_noise", 3), ("sde_one_step", 1), ("discrete", 1)])
def test_rollout_layout_and_recompute_ratio_is_one(mode, trained_per_chunk):
    dom = _domain(mode)
    keys = dom.train_keys()[:3]
    ro = dom.rollout(keys, 4, torch.Generator().manual_seed(0), 0)
    s = dom.steps_per_chunk
    assert len(ro) == 12 and ro.num_steps == dom.n_chunks * s
    assert ro.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    per_chunk = ro.mask.view(12, dom.n_chunks, s).sum(-1)
    executed = ro.payload["images"].flatten(2).any(-1)  # chunk observed = chunk planned
    assert ((per_chunk == trained_per_chunk) == executed).all()
    assert set(ro.rewards["success"].unique().tolist()) <= {0.0, 1.0}
    out = dom.log_probs(ro, torch.arange(12), need_kl=True)
    diff = (out.logp - ro.logp_old)[ro.mask]
    assert diff.abs().max() < 1e-4, f"recomputed log-probs must match the rollout's ({mode})"
    assert (out.logp[~ro.mask] == 0).all()
    kl = out.kl if out.kl is not None else out.ref_logp - out.logp
    assert kl[ro.mask].abs().max() < 1e-4, "before any update the policy equals its reference"
    out.logp[ro.mask].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in dom.parameters())


def test_metaworld_group_shares_its_reset_state_and_eval_states_are_held_out():
    env = {"tasks": ["reach-v3", "drawer-close-v3"], "horizon": 8}
    dom = _domain("sde_one_step", env=env, train_states_per_task=3)
    keys = [dom.train_keys()[0], dom.train_keys()[4]]
    ro = dom.rollout(keys, 3, torch.Generator().manual_seed(0), 0)
    first = ro.payload["images"][:, 0]
    for g in range(2):
        members = first[ro.group_ids == g]
        assert all(torch.equal(members[0], m) for m in members[1:]), "a group starts from ONE reset state"
    assert not torch.equal(first[0], first[3])
    later = ro.payload["chain"][:, 1, -1]
    assert not torch.allclose(later[0], later[1]), "members of a group sample different actions"
    assert not set(dom.train_keys()) & set(dom.eval_keys())
    ev = dom.evaluate(0)
    assert set(ev) >= {"eval/success", "eval/success/reach-v3", "eval/success/drawer-close-v3"}
    dom.close()


def test_eval_split_train_evaluates_the_states_rl_draws(monkeypatch):
    """robotics.eval_split=train (grove eval RUN robotics.eval_split=train): the ODE evaluation runs on the first
    eval_states_per_task training states, the keys RL's rollouts draw, to measure the generalisation gap."""
    import robotics.domain as domain_module

    dom = _domain("flow_sde", eval_split="train", eval_states_per_task=3)
    assert dom.eval_keys() == dom.train_keys()[:3]
    seen = []
    real = domain_module.evaluate_policy

    def spy(*args, **kw):
        seen.append(kw.get("split"))
        return real(*args, **kw)

    monkeypatch.setattr(domain_module, "evaluate_policy", spy)
    out = dom.evaluate(0)
    assert seen == ["train"] and dom.eval_baseline.keys == dom.train_keys()[:3] and 0.0 <= out["eval/success"] <= 1.0
    held_out = _domain("flow_sde")  # the default split stays held out
    assert not set(held_out.eval_keys()) & set(dom.train_keys())
    held_out.close()
    with pytest.raises(ConfigError, match="eval_split"):
        from_dict(RoboticsConfig, {"eval_split": "val"}, "robotics")
    dom.close()


def test_config_errors_are_actionable():
    with pytest.raises(ConfigError, match="head_mode"):
        _domain("discrete", model=dict(TINY_MODEL, head="flow"))
    with pytest.raises(ConfigError, match="train_tasks"):
        from_dict(RoboticsConfig, {"train_tasks": ["nope-v3"]}, "robotics")
    with pytest.raises(ConfigError, match="init_noise"):
        from_dict(RoboticsConfig, {"eval_init_noise": -1.0}, "robotics")
    # a key of earlier configs names its new place in one line
    for old, new in (("task_adapters", "robotics.adapters.rank"), ("replay_data", "robotics.replay.data"),
                     ("critic_init", "robotics.critic.init"), ("keep_best_adapters", "robotics.adapters.keep_best")):
        with pytest.raises(ConfigError, match=rf"config key 'robotics.{old}' was replaced: use {new}$"):
            from_dict(RoboticsConfig, {old: 1}, "robotics")


def test_grpo_improves_success_on_the_point_env():
    data = {
        "domain": "robotics", "seed": 0, "iterations": 10,
        "rollout": {"groups_per_iteration": 8, "group_size": 8},
        "optim": {"lr": 2e-3, "inner_epochs": 2, "minibatches_per_epoch": 2},
        "loss": {"clip_low": 0.2, "clip_high": 0.28},
        "logging": {"progress": False},
        "robotics": {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 8}, "checkpoint": "",
                     "model": TINY_MODEL, "head_mode": "flow_sde", "train_states_per_task": 32,
                     "eval_states_per_task": 32, "gifs": False},
    }
    trainer = Trainer(load_train_config(data), None, log=lambda s: None)
    hist = trainer.fit()
    first, last = hist[0]["eval/success"], hist[-1]["eval/success"]
    rewards = [h["reward/mean"] for h in hist if "reward/mean" in h]
    assert last >= first + 0.3, (first, last)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards


def test_an_evaluation_episode_does_not_depend_on_the_rest_of_the_batch():
    """Evaluation noise per episode (run_episodes(episode_noise_seed=...), used by evaluate_policy): an episode's ODE
    chain is a function of its key and the seed, not of which other episodes share the batch (with one stream for
    the batch, another task's episodes shifted its draws, so its score moved when only that task's policy did)."""
    from robotics.episodes import SamplingSettings, run_episodes

    dom = _domain("sde_one_step", eval_states_per_task=3)
    keys = dom.eval_keys()
    ode = SamplingSettings(mode="ode")

    def chains(ks, seed=0):
        tasks = [dom._task_of(k) for k in ks]
        return run_episodes(dom.policy, dom.venv, ks, tasks, ode, dom.cfg.env.horizon, torch.Generator().manual_seed(9),
                            episode_noise_seed=seed).chain

    together, alone = chains(keys), chains(keys[2:])
    assert abs(together[2] - alone[0]).max() < 1e-5, "the last episode's chain must not depend on the episodes before it"
    assert not (chains(keys[2:], seed=1)[0] == alone[0]).all(), "another seed draws other noise"
    assert not (together[0] == together[1]).all(), "each key has its own noise"
    dom.close()


def test_an_evaluation_in_slices_equals_one_at_once():
    """robotics.env.eval_batch (LIBERO's memory cap) runs the held-out keys in slices: the same episodes, so the same
    scores and lengths (the chains agree to batch-size rounding)."""
    import copy

    from robotics.evaluation import evaluate_policy

    dom = _domain("sde_one_step", eval_states_per_task=3)
    sliced_cfg = copy.deepcopy(dom.cfg.env)
    sliced_cfg.eval_batch = 2
    whole = evaluate_policy(dom.policy, dom.cfg.env, 3, dom.venv)
    sliced = evaluate_policy(dom.policy, sliced_cfg, 3, dom.venv)
    assert whole == sliced and len(dom.cfg.env.tasks) * 3 > 2
    dom.close()


def test_evaluation_slices_mix_tasks_so_the_env_pool_stays_small():
    """Each task keeps its own envs; slices of one task each would pool eval_batch envs *per task* (a LIBERO env holds
    ~0.35 GB: that killed a LIBERO run for memory), so the slices take the tasks in turn and the pool holds
    eval_batch envs in all."""
    pytest.importorskip("metaworld")
    from robotics.envs.vector import BatchedMetaWorld, EnvConfig
    from robotics.evaluation import evaluate_policy
    from robotics.policies.vla import TinyVLA, VLAConfig

    env = EnvConfig(tasks=["reach-v3", "drawer-close-v3"], horizon=4, image_size=32, eval_batch=2)
    torch.manual_seed(0)
    policy = TinyVLA(VLAConfig(image_size=32, cnn_channels=[8, 8, 8, 8], feature_dim=32, text_dim=8, hidden=64))
    venv = BatchedMetaWorld(env)
    out = evaluate_policy(policy, env, 3, venv)
    pooled = sum(len(v) for v in venv._pool.values()) + len(venv.slots)
    venv.close()
    assert pooled == 2 and set(out) >= {"eval/success/reach-v3", "eval/success/drawer-close-v3"}, pooled


def test_every_rl_recipe_parses_as_one_robotics_domain():
    """The recipes in configs/robotics are on the current keys; flat, tree and world-model rollouts are one domain
    with a rollout strategy (``robotics.rollout.name``)."""
    from pathlib import Path

    import yaml

    names = {}
    for path in sorted((Path(__file__).resolve().parents[2] / "configs" / "robotics").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if data.get("kind") == "supervised":
            continue
        cfg = load_train_config(data)
        assert cfg.domain == "robotics", path.name
        names[path.name] = cfg.domain_config.rollout.name
    assert names["world_model_grpo.yaml"] == "world_model" and names["metaworld_mt5_rl.yaml"] == "flat"
    assert names["libero_wm_verified.yaml"] == "verified"


@pytest.mark.parametrize("shared", [False, True])
def test_group_start_noise_shared_within_a_group_only(shared):
    dom = _domain("sde_one_step", group_start_noise="shared" if shared else "independent")
    keys = dom.train_keys()[:2]
    ro = dom.rollout(keys, 3, torch.Generator().manual_seed(0), 0)
    start = ro.payload["chain"][:, 0, 0]  # the first chunk's chain start: the same state, so only the noise differs
    same = [torch.equal(start[0], start[i]) for i in (1, 2)]
    assert all(same) if shared else not any(same)
    assert not torch.equal(start[0], start[3]), "another group draws other start noise"
    end = ro.payload["chain"][:, 0, -1]
    assert not torch.allclose(end[0], end[1]), "the members still explore (the SDE step)"


def test_group_start_noise_needs_a_flow_head():
    with pytest.raises(ConfigError, match="group_start_noise"):
        _domain("discrete", group_start_noise="shared")
    with pytest.raises(ConfigError, match="group_start_noise: shared is drawn by the flat"):
        from_dict(RoboticsConfig, {"group_start_noise": "shared", "rollout": {"name": "tree", "branch": {
            "at_chunks": [0], "factors": [2]}}}, "robotics")
