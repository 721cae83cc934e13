"""``grove train --dry-run``'s memory estimate for robotics (``robotics.parameter_count``): the tiny VLA counted on
the meta device, split as the domain trains it, its KL reference and the value head; the expected bytes of a tiny
config computed here by hand, layer by layer (issue 64)."""
from __future__ import annotations

import pytest

from shared_rl.config import load_train_config
from shared_rl.memory_estimate import per_process_bytes

pytest.importorskip("mujoco")

# a fresh tiny VLA (robotics.checkpoint: ''), sized for the env (16x16 RGB frames, 4-d proprio, 4-d actions): a discrete
# head over a 1-action chunk
MODEL = {"image_size": 16, "cnn_channels": [2, 2, 2, 2], "feature_dim": 4, "text_dim": 2, "hidden": 4, "chunk": 1,
         "head": "discrete", "num_bins": 3, "vocab": ["<unk>", "move", "point"]}
CNN = (3 * 2 * 16 + 2) + 3 * (2 * 2 * 16 + 2)  # four 4x4 stride-2 convs, 3 -> 2 -> 2 -> 2 -> 2 channels
IMAGE_PROJ = 2 * 1 * 1 * 4 + 4  # 16 px / 16 = 1x1 spatial, 2 channels -> feature_dim 4
TEXT = 3 * 2  # bag of words: 3 words x text_dim 2
PROPRIO = 4 * 64 + 64  # the point env's 4-d proprio -> 64
FUSE = ((4 + 2 + 64) * 4 + 4) + (4 * 4 + 4)  # [image, text, proprio] -> hidden 4 -> 4
BINS = 4 * (1 * 4 * 3) + 3 * 4  # hidden 4 -> 1 action x 4 dims x 3 bins
VLA = CNN + IMAGE_PROJ + TEXT + PROPRIO + FUSE + BINS
VALUE_HEAD = (4 + 16) * 5 + 5 + (5 * 5 + 5) + (5 + 1)  # [features 4, time 16] -> critic.hidden 5 -> 5 -> 1


def _cfg(**robotics):
    data = {"domain": "robotics", "rollout": {"groups_per_iteration": 2, "group_size": 2},
            "robotics": {"checkpoint": "", "head_mode": "discrete", "model": dict(MODEL),
                         "env": {"kind": "point", "tasks": ["point-reach"], "image_size": 16}, **robotics}}
    if robotics.get("critic", {}).get("enabled"):
        data["advantage"] = {"estimator": {"name": "gae", "value_coef": 0.5}}
    return load_train_config(data)


def test_the_tiny_vla_counted_by_hand_frozen_encoders_and_a_critic():
    cfg = _cfg(train_encoder=False, critic={"enabled": True, "hidden": 5})
    groups = cfg.domain_config.parameter_groups(cfg)
    encoders = CNN + IMAGE_PROJ + TEXT + PROPRIO
    assert [(g.name, g.count, g.trainable, g.sharded) for g in groups] == [
        ("tiny VLA (trained)", FUSE + BINS, True, True), ("tiny VLA (frozen)", encoders, False, True),
        ("KL reference copy", VLA, False, True), ("value head", VALUE_HEAD, True, False)]
    # float32: trained 16 B (weight, gradient, 2 AdamW moments), frozen 4 B
    expected = (FUSE + BINS) * 16 + encoders * 4 + VLA * 4 + VALUE_HEAD * 16
    assert per_process_bytes(groups) == expected == 14608
    assert per_process_bytes(groups, "fsdp2", 2) == ((FUSE + BINS) * 16 + encoders * 4 + VLA * 4) // 2 + VALUE_HEAD * 16


def test_task_adapters_are_all_rl_trains():
    cfg = _cfg(adapters={"rank": 2})
    adapters = 2 * (1 * 4 * 2)  # one task: down [1, hidden 4, rank 2] and up [1, 2, 4]
    groups = cfg.domain_config.parameter_groups(cfg)
    assert [(g.name, g.count, g.trainable) for g in groups] == [
        ("tiny VLA (trained)", adapters, True), ("tiny VLA (frozen)", VLA, False),
        ("KL reference copy", VLA + adapters, False)]


def test_the_meta_count_equals_the_built_policy():
    import torch

    from robotics.domain import load_policy

    cfg = _cfg()
    (trained, *_), policy = cfg.domain_config.parameter_groups(cfg), load_policy(cfg.domain_config, 0)
    assert trained.count == sum(p.numel() for p in policy.parameters()) == VLA
    assert all(p.device == torch.device("cpu") for p in policy.parameters())


def test_no_estimate_for_a_lerobot_policy():
    cfg = load_train_config({"domain": "robotics", "robotics": {"policy": {"type": "lerobot", "path": "held/x"}}})
    assert cfg.domain_config.parameter_groups(cfg) is None


@pytest.mark.parametrize("robotics", [{}, {"train_encoder": False}, {"adapters": {"rank": 2}},
                                      {"head_mode": "flow_noise", "model": {**MODEL, "head": "flow"}},
                                      {"head_mode": "flow_sde", "model": {**MODEL, "head": "flow"}}])
def test_the_count_trains_what_the_domain_trains(robotics):
    from robotics import domain, parameter_count
    from robotics.adapters import add_adapters

    cfg = _cfg(**robotics).domain_config
    policy = domain.load_policy(cfg, 0)
    if cfg.adapters.rank:
        add_adapters(policy, cfg.adapters, cfg.env.tasks, 0)
    assert domain.trainable is parameter_count.trains  # one rule, not a copy
    names = [n for n, _ in policy.named_parameters()]
    trained = {n for n in names if parameter_count.trains(n, cfg)}
    std = {n for n in names if n.startswith("flow.noise_std")}  # ReinFlow's learned std: trained in its mode only
    assert (std <= trained) if cfg.head_mode == "flow_noise" else not (std & trained)
    if cfg.adapters.rank:  # the adapters alone
        assert trained - std and all(n.startswith("adapters.") for n in trained - std)
    else:  # everything but the encoders, unless they train
        frozen_modules = {n.split(".")[0] for n in set(names) - trained - std}
        assert frozen_modules <= (set() if cfg.train_encoder else set(parameter_count.ENCODER_MODULES))
