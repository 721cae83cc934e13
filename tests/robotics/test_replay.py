"""The demonstration-replay anchor (``robotics.replay: {coef, data}``): the loss it adds, its
invariances (a function of (seed, iteration, step) only; process shares sum to the one-process loss), the config
errors, that it pulls RL training towards the demonstrations, and that a resumed run replays the same batches."""
import json
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch
import yaml

from shared_rl.cli import main
from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer

from robotics.data import Episode, save_episodes
from robotics.envs.metaworld_env import instruction_for
from tests.robotics.test_domain import TINY_MODEL, _domain

ENV = {"kind": "point", "tasks": ["point-reach"], "horizon": 8}


def _demos(path, dom, n=6, length=10, seed=0):
    """Synthetic demos in the point env's layout: every action is the same constant chunk (easy to clone)."""
    rng = np.random.default_rng(seed)
    e = dom.cfg.env
    eps = [Episode(task="point-reach", instruction=instruction_for("point-reach"),
                   images=rng.integers(0, 255, (length, e.image_size, e.image_size, e.image_channels), dtype=np.uint8),
                   proprio=rng.normal(size=(length, e.proprio_dim)).astype(np.float32),
                   actions=np.tile(np.array([0.5, -0.5, 0.25, 0.0], np.float32), (length, 1)),
                   success=np.zeros(length, bool)) for _ in range(n)]
    return save_episodes(eps, path)


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    dom = _domain("flow_sde")
    path = _demos(tmp_path_factory.mktemp("replay") / "demos.npz", dom)
    dom.close()
    return path


def test_replay_loss_is_a_function_of_seed_iteration_and_step(demos):
    dom = _domain("flow_sde", replay={"data": str(demos), "batch": 16})
    a, b, c = dom.replay.loss(3, 1), dom.replay.loss(3, 1), dom.replay.loss(3, 2)
    assert a.requires_grad and torch.equal(a, b) and not torch.equal(a, c)
    assert dom.auxiliary_losses(3, 1, 0, 1) == {}  # coef 0: the trainer adds nothing
    dom.cfg.replay.coef = 0.5
    (coef, term), = dom.auxiliary_losses(3, 1, 0, 1).values()
    assert coef == 0.5 and torch.equal(term, a) and list(dom.auxiliary_losses(3, 1, 0, 1)) == ["replay"]
    a.backward()
    # the frozen-encoder setting holds for the anchor too: only trainable parameters get its gradient
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in dom.parameters())
    dom.close()


def test_process_shares_sum_to_the_one_process_loss(demos):
    dom = _domain("discrete", replay={"data": str(demos), "batch": 9})  # cross-entropy: no noise, exact
    whole = dom.replay.loss(0, 0)
    shares = [dom.replay.loss(0, 0, rank=r, world=2) for r in range(2)]
    assert torch.allclose(shares[0] + shares[1], whole, atol=1e-6)
    dom.close()


def test_replay_config_errors(demos, tmp_path):
    data = {"domain": "robotics", "iterations": 1, "logging": {"progress": False},
            "robotics": {"env": ENV, "checkpoint": "", "model": TINY_MODEL, "gifs": False, "replay": {"coef": 1.0}}}
    with pytest.raises(ConfigError, match="robotics.replay.data is empty"):
        load_train_config(data)
    with pytest.raises(ConfigError, match="replay.batch must be >= 1"):
        _domain("flow_sde", replay={"data": str(demos), "batch": 0})
    other = _domain("flow_sde")
    bad = save_episodes([Episode(task="other", instruction="x", images=np.zeros((2, 8, 8, 3), np.uint8),
                                 proprio=np.zeros((2, 4), np.float32), actions=np.zeros((2, 4), np.float32),
                                 success=np.zeros(2, bool))], tmp_path / "other.npz")
    other.close()
    with pytest.raises(ConfigError, match="no demos of the replayed tasks"):
        _domain("flow_sde", replay={"data": str(bad)})
    with pytest.raises(ConfigError, match="replay.coef must be >= 0"):
        _domain("flow_sde", replay={"data": str(demos), "coef": -1.0})
    # the weight is robotics' own setting now, not the core's
    toy = {"domain": "toy", "iterations": 1, "loss": {"replay_coef": 0.5}, "logging": {"progress": False}}
    with pytest.raises(ConfigError, match=r"'loss.replay_coef' was replaced: the domain's own replay settings"):
        load_train_config(toy)


def _rl_config(demos, coef):
    return {"domain": "robotics", "seed": 0, "iterations": 3,
            "rollout": {"groups_per_iteration": 4, "group_size": 4},
            "optim": {"lr": 3e-3, "inner_epochs": 1, "minibatches_per_epoch": 2},
            "eval": {"at_start": False}, "logging": {"progress": False},
            "robotics": {"env": ENV, "checkpoint": "", "model": TINY_MODEL, "head_mode": "flow_sde",
                         "train_states_per_task": 8, "eval_states_per_task": 2, "gifs": False,
                         "replay": {"coef": coef, "data": str(demos), "batch": 32}}}


def test_the_anchor_pulls_rl_training_towards_the_demonstrations(demos):
    """The same RL run with and without the anchor: with it the demos' BC loss falls, and it is logged."""
    out = {}
    for coef in (0.0, 2.0):
        trainer = Trainer(load_train_config(_rl_config(demos, coef)), None, log=lambda s: None)
        with torch.no_grad():
            before = float(trainer.domain.replay.loss(99, 0))
        hist = trainer.fit()
        with torch.no_grad():
            out[coef] = (before, float(trainer.domain.replay.loss(99, 0)))
        assert ("loss/replay" in hist[0]) == (coef > 0)
        trainer.domain.close()
    assert out[0.0][0] == out[2.0][0]  # same start
    # measured: 1.268 -> 1.261 without, -> 1.175 with the anchor (6 optimizer steps)
    assert out[2.0][1] < out[0.0][1] - 0.04 and out[2.0][1] < out[2.0][0] - 0.04, out


def test_replay_tasks_picks_whose_demos_are_replayed(tmp_path):
    """robotics.replay.tasks: [drawer-close-v3] replays that task's demos only (every replayed chunk carries its
    instruction), [] replays every trained task's; a task that is not trained, or replay_tasks without the demo
    replay, is refused."""
    tasks = ["reach-v3", "drawer-close-v3"]
    env = {"tasks": tasks, "horizon": 8}
    dom = _domain("sde_one_step", env=env)
    rng = np.random.default_rng(0)
    e = dom.cfg.env
    eps = [Episode(task=t, instruction=instruction_for(t),
                   images=rng.integers(0, 255, (5, e.image_size, e.image_size, 3 * len(e.cameras)), dtype=np.uint8),
                   proprio=rng.normal(size=(5, dom.policy.cfg.proprio_dim)).astype(np.float32),
                   actions=np.zeros((5, 4), np.float32), success=np.zeros(5, bool)) for t in tasks for _ in range(2)]
    path = save_episodes(eps, tmp_path / "two_tasks.npz")
    dom.close()
    ids = {t: dom.policy.text.token_ids([instruction_for(t)])[0] for t in tasks}
    only = _domain("sde_one_step", env=env, replay={"coef": 1.0, "data": str(path), "tasks": ["drawer-close-v3"]})
    assert len(only.replay.data) == 10 and all(t == ids["drawer-close-v3"] for t in only.replay.data.text_ids)
    only.close()
    both = _domain("sde_one_step", env=env, replay={"data": str(path)})
    assert len(both.replay.data) == 20 and ids["reach-v3"] in both.replay.data.text_ids
    both.close()
    with pytest.raises(ConfigError, match="replay.tasks"):
        _domain("sde_one_step", env=env, replay={"coef": 1.0, "data": str(path), "tasks": ["push-v3"]})
    data = {"domain": "robotics", "iterations": 1, "logging": {"progress": False},
            "robotics": {"env": env, "checkpoint": "", "model": TINY_MODEL, "gifs": False,
                         "replay": {"data": str(path), "tasks": ["reach-v3"]}}}
    with pytest.raises(ConfigError, match="replay.tasks"):
        load_train_config(data)


def test_a_resumed_run_replays_the_same_batches(demos, tmp_path):
    cfg = _rl_config(demos, 1.0)
    cfg["checkpoint"] = {"every": 1, "keep_last": 3}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    assert main(["train", str(path), "--out", str(run)]) == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    want = [{k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"} for r in records]
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_000003")
    assert main(["train", "--resume", str(run), "iterations=3"]) == 0
    again = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    got = [{k: v for k, v in r.items() if not k.startswith(("time/", "resume/")) and k != "samples_per_s"}
           for r in again]
    assert got[-1] == want[-1] and "loss/replay" in got[-1]


def _five_task_recipes():
    """The parsed GRPO and PPO five-task recipe files, in that order."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs" / "robotics"
    return [load_train_config(yaml.safe_load((root / n).read_text()))
            for n in ("metaworld_mt5_rl.yaml", "metaworld_mt5_ppo.yaml")]


def test_the_grpo_and_ppo_recipes_share_one_rollout_budget():
    """``grove bench robotics-sim`` compares metaworld_mt5_rl.yaml with metaworld_mt5_ppo.yaml at equal env steps, so
    the two files must draw the same rollouts: iterations, groups x episodes, training and held-out reset states, the
    asset, adapters, head, start noise and the env. (PPO once kept 200 training states while GRPO moved to 50.)"""
    grpo, ppo = _five_task_recipes()
    assert (grpo.iterations, grpo.rollout, grpo.seed) == (ppo.iterations, ppo.rollout, ppo.seed)
    assert grpo.eval == ppo.eval
    shared = ("checkpoint", "adapters", "balance", "head_mode", "noise_level", "init_noise", "eval_init_noise",
              "train_states_per_task", "eval_states_per_task", "env")
    for name in shared:
        assert getattr(grpo.domain_config, name) == getattr(ppo.domain_config, name), name
    assert ppo.advantage.estimator.name == "gae" and ppo.domain_config.critic.enabled
    assert not grpo.domain_config.critic.enabled


def test_the_observing_assets_load_with_their_proprio_and_are_refused_without():
    """``assets/metaworld-vla-tiny-dart-goal`` reads the goal in its proprio input and
    ``assets/metaworld-vla-tiny-dart-object`` (configs/robotics/metaworld_bc_dart_object.yaml) and
    ``-dart-object-push160`` (metaworld_bc_dart_object_push160.yaml) the object and the goal: the five-task recipes
    parse and start from the 40-push-demo object asset (RL from the push160 one forgot tasks: docs), each asset
    builds with its env, and an env that lacks an input is refused in one line."""
    for cfg in _five_task_recipes():
        env = cfg.domain_config.env
        assert env.include_goal and env.include_object and cfg.domain_config.checkpoint.endswith("dart-object")
        assert cfg.domain_config.balance.enabled and cfg.domain_config.balance.by == "need"
    env = {"tasks": ["reach-v3"], "horizon": 8}
    for asset, extra, dim in (("goal", {"include_goal": True}, 7),
                              ("object", {"include_goal": True, "include_object": True}, 10),
                              ("object-push160", {"include_goal": True, "include_object": True}, 10)):
        dom = _domain("sde_one_step", env={**env, **extra}, checkpoint=f"assets/metaworld-vla-tiny-dart-{asset}")
        assert dom.policy.cfg.proprio_dim == dom.cfg.env.proprio_dim == dim
        dom.close()
    with pytest.raises(ConfigError, match="include_goal=False"):
        _domain("sde_one_step", env=env, checkpoint="assets/metaworld-vla-tiny-dart-goal")
    with pytest.raises(ConfigError, match="include_object=False"):
        _domain("sde_one_step", env={**env, "include_goal": True}, checkpoint="assets/metaworld-vla-tiny-dart-object-push160")


def test_the_fitted_asset_is_the_object_clone_plus_five_task_adapters():
    """``assets/metaworld-vla-tiny-dart-object-fit`` (``python scripts/robotics_adapter_bc.py --steps 12000 --batch 128
    --save ...``): the object clone's weights bit for bit, plus a rank-16 adapter per task of the five-task recipe,
    fitted to the clone's own demos; a five-task run keeps those adapters rather than adding fresh ones."""
    from robotics.envs.metaworld_env import instruction_for
    from robotics.policies.vla import TinyVLA

    clone = TinyVLA.load_pretrained("assets/metaworld-vla-tiny-dart-object").state_dict()
    fit = TinyVLA.load_pretrained("assets/metaworld-vla-tiny-dart-object-fit")
    tasks = ["reach-v3", "push-v3", "door-open-v3", "button-press-topdown-v3", "drawer-close-v3"]
    assert fit.cfg.task_adapters == [instruction_for(t) for t in tasks] and fit.cfg.adapter_rank == 16
    state = fit.state_dict()
    assert set(state) - set(clone) == {"adapters.down", "adapters.up"}
    assert all(torch.equal(state[k], clone[k]) for k in clone)
    assert all(torch.count_nonzero(fit.adapters.up[i]) > 0 for i in range(5))  # every task's adapter was fitted
    up = fit.adapters.up.detach().clone()
    fit.add_task_adapters([instruction_for(t) for t in tasks], 16)  # what the recipe's domain does: a no-op here
    assert torch.equal(fit.adapters.up, up)


def test_the_fitted_recipe_is_the_five_task_recipe_from_the_fitted_clone_with_the_demo_anchor():
    """``metaworld_mt5_rl_fit.yaml`` differs from ``metaworld_mt5_rl.yaml`` only in its start (the fitted asset) and
    the replay anchor to the demos that asset was fitted to, so the two recipes' measurements compare."""
    import dataclasses
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs" / "robotics"
    base, fit = (load_train_config(yaml.safe_load((root / n).read_text()))
                 for n in ("metaworld_mt5_rl.yaml", "metaworld_mt5_rl_fit.yaml"))
    assert fit.domain_config.checkpoint == "assets/metaworld-vla-tiny-dart-object-fit"
    assert (fit.domain_config.replay.coef, fit.domain_config.replay.batch) == (1.0, 1024)
    assert fit.domain_config.replay.data == "runs/robotics-demos/demos40_dart_object.npz"
    fit.domain_config = dataclasses.replace(fit.domain_config, checkpoint=base.domain_config.checkpoint,
                                            replay=base.domain_config.replay)
    assert dataclasses.asdict(fit) == dataclasses.asdict(base)
