"""Episode storage, LeRobot v3.0 round trip (against the real lerobot package), demos and the BC entry point."""
import json
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch

from robotics.data import Episode, export_lerobot, import_lerobot, load_episodes, save_episodes


def _episodes(n=2, t=5, seed=0):
    rng = np.random.default_rng(seed)
    tasks = ["reach-v3", "drawer-close-v3"]
    from robotics.envs.metaworld_env import instruction_for

    return [
        Episode(task=tasks[i % 2], instruction=instruction_for(tasks[i % 2]),
                images=rng.integers(0, 256, (t + i, 64, 64, 3), dtype=np.uint8),
                proprio=rng.normal(size=(t + i, 4)).astype(np.float32),
                actions=rng.uniform(-1, 1, (t + i, 4)).astype(np.float32),
                success=np.arange(t + i) == t + i - 1, states=rng.normal(size=(t + i, 39)).astype(np.float32), key=10 + i)
        for i in range(n)
    ]


def _assert_same(a: Episode, b: Episode, keys=True):
    assert a.task == b.task and a.instruction == b.instruction
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.proprio, b.proprio)
    np.testing.assert_array_equal(a.actions, b.actions)
    np.testing.assert_array_equal(a.success, b.success)
    np.testing.assert_array_equal(a.states, b.states)
    if keys:
        assert a.key == b.key


def test_npz_roundtrip(tmp_path):
    eps = _episodes(3)
    back = load_episodes(save_episodes(eps, tmp_path / "d.npz"))
    assert len(back) == 3
    for a, b in zip(eps, back):
        _assert_same(a, b)


def test_lerobot_v30_roundtrip_with_the_real_package(tmp_path):
    lerobot_dataset = pytest.importorskip(
        "lerobot.datasets.lerobot_dataset",
        reason="lerobot not installed (pip install --no-deps -c constraints.txt lerobot av; make does this)",
    )
    eps = _episodes(2)
    root = export_lerobot(eps, tmp_path / "lr", repo_id="grove/test")
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"].startswith("v3")
    ds = lerobot_dataset.LeRobotDataset("grove/test", root=root)
    assert ds.meta.total_episodes == 2 and len(ds) == sum(len(e) for e in eps)
    item = ds[len(eps[0]) + 2]  # episode 1, frame 2
    assert int(item["episode_index"]) == 1 and int(item["frame_index"]) == 2
    img = (item["observation.image"].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    np.testing.assert_array_equal(img, eps[1].images[2])
    np.testing.assert_allclose(item["action"].numpy(), eps[1].actions[2])
    np.testing.assert_allclose(item["observation.state"].numpy(), eps[1].proprio[2])
    assert item["task"] == eps[1].instruction
    back = import_lerobot(root)
    for a, b in zip(eps, back):
        _assert_same(a, b)  # the reset-state keys survive too (meta/grove.json)


def test_noisy_expert_demos_and_bc_entry_point(tmp_path):
    pytest.importorskip("metaworld")
    from robotics.bc import run
    from robotics.collect import collect_demos
    from robotics.envs import EnvConfig

    env = {"tasks": ["reach-v3"], "horizon": 40}
    eps = collect_demos(EnvConfig(**env), demos_per_task=2, noise_std=0.3, seed=0, log=lambda s: None)
    assert len(eps) == 2 and all(e.succeeded and e.success[-1] for e in eps)
    assert eps[0].images.shape[1:] == (64, 64, 3) and len(eps[0]) == len(eps[0].actions) <= 40
    assert not np.allclose(eps[0].actions[:5], eps[1].actions[:5])  # noise and reset states differ
    save_episodes(eps, tmp_path / "demos.npz")
    cfg = {"data": str(tmp_path / "demos.npz"), "env": env, "train_steps": 40, "batch_size": 16, "log_every": 10, "lr": 1e-3,
           "model": {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64},
           "eval_states_per_task": 2, "export_dir": str(tmp_path / "asset")}
    out = run(cfg, tmp_path / "run", log=lambda s: None)
    assert 0.0 <= out["eval/success"] <= 1.0 and "eval/success/reach-v3" in out
    losses = [json.loads(line)["loss/bc"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss/bc" in line]
    assert losses[-1] < losses[0], "BC loss must go down"
    assert (tmp_path / "asset" / "model.safetensors").is_file() and (tmp_path / "asset" / "config.json").is_file()
    assert list((tmp_path / "run" / "gifs").glob("*.gif"))


def test_per_task_demo_counts_override_the_default():
    """``task_demos`` gives a task more demos than ``demos_per_task`` (the object clone's 160 push demos); the
    other tasks keep the default, and the reset states of the extra demos are all distinct."""
    pytest.importorskip("metaworld")
    from robotics.collect import collect_demos
    from robotics.envs import EnvConfig

    cfg = EnvConfig(tasks=["reach-v3", "drawer-close-v3"], horizon=10, image_size=16)
    eps = collect_demos(cfg, demos_per_task=1, noise_std=0.1, seed=0, log=lambda s: None, task_demos={"reach-v3": 3},
                        only_successful=False)
    assert [e.task for e in eps] == ["reach-v3"] * 3 + ["drawer-close-v3"]
    assert len({e.key for e in eps}) == 4


def test_bc_keeps_its_weights_when_the_final_evaluation_dies(tmp_path, monkeypatch):
    """The weights are written before the final evaluation (which pools one env per held-out state and has been
    killed for memory): a long BC run does not lose its model; nothing is exported without an evaluation."""
    import robotics.bc as bc

    def dies(*a, **k):
        raise MemoryError("evaluation ran out of memory")

    monkeypatch.setattr(bc, "evaluate_policy", dies)
    pytest.importorskip("metaworld")
    demos = save_episodes(_episodes(n=2, t=12), tmp_path / "demos.npz")
    cfg = {"data": str(demos), "env": {"tasks": ["reach-v3", "drawer-close-v3"], "horizon": 8}, "train_steps": 4,
           "batch_size": 8, "log_every": 2, "gifs": False,
           "model": {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64},
           "eval_states_per_task": 2, "export_dir": str(tmp_path / "asset")}
    with pytest.raises(MemoryError):
        bc.run(cfg, tmp_path / "run", log=lambda s: None)
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert not (tmp_path / "asset").exists()


def test_bc_auxiliary_object_loss_trains_the_encoder_and_needs_states(tmp_path, monkeypatch):
    """``aux_object_coef``: a linear head predicts the object's xyz from the image features; its gradient moves the
    encoder (different weights from the same run without it), it is not saved, and demos without states are
    refused in one line."""
    pytest.importorskip("metaworld")
    import robotics.bc as bc
    from safetensors.torch import load_file

    from shared_rl.config import ConfigError

    monkeypatch.setattr(bc, "evaluate_policy", lambda *a, **k: {"eval/success": 0.0})
    eps = _episodes(n=2, t=12)
    demos = save_episodes(eps, tmp_path / "demos.npz")
    base = {"data": str(demos), "env": {"tasks": ["reach-v3", "drawer-close-v3"], "horizon": 8}, "train_steps": 3,
            "batch_size": 8, "log_every": 1, "gifs": False, "eval_states_per_task": 1,
            "model": {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64}}
    weights = {}
    for coef in (0.0, 1.0):
        bc.run({**base, "aux_object_coef": coef}, tmp_path / f"run{coef}", log=lambda s: None)
        weights[coef] = load_file(str(tmp_path / f"run{coef}" / "model" / "model.safetensors"))
    assert weights[0.0].keys() == weights[1.0].keys()  # the auxiliary head is not part of the model
    assert not torch.equal(weights[0.0]["cnn.0.weight"], weights[1.0]["cnn.0.weight"])
    for e in eps:
        e.states = None
    bare = save_episodes(eps, tmp_path / "bare.npz")
    with pytest.raises(ConfigError, match="needs demos with Meta-World states"):
        bc.run({**base, "data": str(bare), "aux_object_coef": 1.0}, tmp_path / "run-bare", log=lambda s: None)
