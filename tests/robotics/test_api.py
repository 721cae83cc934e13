"""``robotics.api.VLAGRPOTrainer``: the policy object the caller holds, tasks, reward functions of episodes."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import json

import numpy as np
import pytest
import torch
import yaml

from shared_rl.config import ConfigError

from robotics.api import VLAGRPOTrainer
from robotics.policies.vla import TinyVLA, VLAConfig

TINY_MODEL = {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64, "num_denoise_steps": 3}
ENV = {"kind": "point", "tasks": ["point-reach"], "horizon": 8}
ARGS = {"seed": 0, "iterations": 2, "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "optim": {"lr": 2e-3, "inner_epochs": 1, "minibatches_per_epoch": 2}, "logging": {"progress": False},
        "eval": {"every": 2}, "checkpoint": {"every": 0},
        "robotics": {"env": {"kind": "point", "horizon": 8}, "train_states_per_task": 8, "eval_states_per_task": 4,
                     "dense_reward": True, "gifs": False}}  # the shaped reward: groups differ, weights move


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A freshly initialised tiny VLA for the point env, saved as a checkpoint directory."""
    torch.manual_seed(0)
    policy = TinyVLA(VLAConfig(**TINY_MODEL, image_channels=3, proprio_dim=4, image_size=64))
    out = tmp_path_factory.mktemp("vla") / "policy"
    policy.save_pretrained(out)
    return out


def _records(run):
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/") and k != "samples_per_s"}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_held_policy_trains_as_grove_train_does_and_is_the_one_trained(ckpt, tmp_path):
    from safetensors.torch import load_file

    from shared_rl.cli import main

    config = {"domain": "robotics", **ARGS,
              "robotics": {**ARGS["robotics"], "checkpoint": str(ckpt), "env": {**ENV}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "cli")]) == 0

    policy = TinyVLA.load_pretrained(ckpt)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = VLAGRPOTrainer(policy=policy, tasks=["point-reach"], args=ARGS, run_dir=tmp_path / "py", log=quiet)
    hist = trainer.train()
    assert trainer.policy is policy and trainer.trainer.domain.policy is policy
    assert _records(tmp_path / "py") == _records(tmp_path / "cli") and len(hist) == 3
    assert "eval/success" in hist[-1] and "reward/success/mean" in hist[-1]
    # the caller's object holds the trained weights: those grove train exported
    exported = load_file(str(tmp_path / "cli" / "final" / "model.safetensors"))
    now = policy.state_dict()
    assert any(not torch.equal(now[k], start[k]) for k in start)
    assert all(torch.equal(now[k], exported[k]) for k in exported)
    ev = trainer.evaluate()
    assert ev["eval/success"] == hist[-1]["eval/success"]  # the same held-out states, the same weights
    # a path is the same as the object loaded from it
    by_path = VLAGRPOTrainer(policy=str(ckpt), tasks=["point-reach"], args=ARGS, log=quiet).train()
    strip = [{k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"} for r in by_path]
    assert strip == _records(tmp_path / "py")


def test_reward_functions_of_episodes_are_rewards_with_weights(ckpt):
    seen = []

    def quick(episodes):  # shorter episodes are better
        seen.append(len(episodes.keys))
        return 1.0 - episodes.length / 8

    args = {**ARGS, "iterations": 1, "eval": {"at_start": False, "every": 1}}
    trainer = VLAGRPOTrainer(policy=TinyVLA.load_pretrained(ckpt), tasks="point-reach",
                             reward_funcs=[quick, "dense"], reward_weights=[0.5, 1.0], args=args, log=quiet)
    cfg = trainer.config
    assert cfg.domain_config.rewards == ["quick"]
    assert cfg.advantage.weights == {"quick": 0.5, "dense": 1.0, "success": 0.0}  # success: logged, not trained on
    m = trainer.train()[-1]
    assert seen == [8] and np.isfinite(m["reward/quick/mean"]) and "reward/dense/mean" in m


def test_bad_inputs_are_one_line_errors(ckpt):
    policy = TinyVLA.load_pretrained(ckpt)
    with pytest.raises(ConfigError, match=r"'sucess' is not a robotics reward \(did you mean 'success'\?\)"):
        VLAGRPOTrainer(policy=policy, tasks=["point-reach"], reward_funcs=["sucess"], args=ARGS)
    with pytest.raises(ConfigError, match="reward_weights has 1 values for 2 reward functions"):
        VLAGRPOTrainer(policy=policy, tasks=["point-reach"], reward_funcs=["success", "dense"], reward_weights=[1.0],
                       args=ARGS)
    with pytest.raises(ConfigError, match="policy must be grove's TinyVLA, a LeRobot PreTrainedPolicy or a path"):
        VLAGRPOTrainer(policy=torch.nn.Linear(2, 2), args=ARGS)
    with pytest.raises(ConfigError, match=r"robotics.rewards \['ghost'\]: these are functions handed over from Python"):
        from shared_rl.api import train

        train({"domain": "robotics", **ARGS, "robotics": {**ARGS["robotics"], "checkpoint": str(ckpt), "env": ENV,
                                                         "rewards": ["ghost"]}}, log=quiet)
    tree = {**ARGS, "robotics": {**ARGS["robotics"], "rollout": {"name": "tree", "branch": {"at_chunks": [0],
                                                                                           "factors": [4]}}}}
    with pytest.raises(ConfigError, match="rewards score the episodes of flat groups"):
        VLAGRPOTrainer(policy=policy, tasks=["point-reach"], reward_funcs=[lambda e: e.length], args=tree)


def test_a_held_lerobot_policy_trains_as_the_same_policy_loaded_from_its_path(tmp_path):
    """A LeRobot SmolVLAPolicy the caller holds (a tiny one) with LeRobot's own processors: LoRA injected into that
    object, the same records as ``robotics.policy: {type: lerobot, path}``."""
    from robotics.policies.lerobot import import_policies

    import_policies()  # LeRobot's policies under transformers 5 (compat.py), before LeRobot's own imports
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    from robotics.envs.vector import EnvConfig
    from robotics.policies.lerobot.tiny import TinySmolVLA, build_tiny_smolvla

    tasks = ["reach-v3"]
    path = tmp_path / "smolvla"
    build_tiny_smolvla(path, EnvConfig(tasks=tasks, horizon=8), TinySmolVLA(num_steps=3), seed=0)
    args = {"seed": 0, "iterations": 1, "rollout": {"groups_per_iteration": 1, "group_size": 2},
            "advantage": {"weights": {"success": 1.0, "dense": 1.0}}, "selection": {"filter": "none"},
            "eval": {"at_start": False, "every": 1}, "logging": {"progress": False},
            "robotics": {"policy": {"lora": {"rank": 2}}, "env": {"horizon": 8}, "dense_reward": True,
                         "train_states_per_task": 2, "eval_states_per_task": 1, "gifs": False}}
    held = SmolVLAPolicy.from_pretrained(path, local_files_only=True)
    pre, post = make_pre_post_processors(held.config, pretrained_path=str(path))
    trainer = VLAGRPOTrainer(policy=held, preprocessor=pre, postprocessor=post, tasks=tasks, args=args, log=quiet)
    hist = trainer.train()
    assert trainer.policy is held and trainer.trainer.domain.policy.policy is held
    lora = {n: p for n, p in held.named_parameters() if "lora_B" in n}
    assert lora and any(p.abs().sum() > 0 for p in lora.values())  # trained adapters live in the caller's object
    by_path = VLAGRPOTrainer(policy=str(path), tasks=tasks, args=args, log=quiet).train()
    strip = [[{k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"} for r in h]
             for h in (hist, by_path)]
    assert strip[0] == strip[1]
    with pytest.raises(ConfigError, match="a held LeRobot policy needs its processors"):
        VLAGRPOTrainer(policy=SmolVLAPolicy.from_pretrained(path, local_files_only=True), tasks=tasks, args=args)
