"""Episode storage, LeRobot v3.0 round trip (against the real lerobot package), demos and the BC entry point."""
import json
import math
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
    # the held-out episodes travel with the clone, tagged with its weights: an RL run from it pairs with them
    from robotics.evaluation import EvalOutcomes, policy_digest
    from robotics.policies.vla import TinyVLA

    base = EvalOutcomes.from_json(json.loads((tmp_path / "asset" / "eval_episodes.json").read_text()))
    assert base.success.mean() == out["eval/success"] and len(base.success) == 2
    assert base.policy == policy_digest(TinyVLA.load_pretrained(tmp_path / "asset"))


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


def test_bc_keeps_the_model_of_the_lowest_validation_loss(tmp_path, monkeypatch):
    """``val_demos_per_task``: the last demos of each task are held out; the validation loss is measured every
    ``val_every`` steps with fixed noise (the same weights give the same number), and the model saved is the one of
    the lowest; a split that leaves a task no training demo is one line."""
    pytest.importorskip("metaworld")
    import robotics.bc as bc
    from safetensors.torch import load_file

    from robotics.policies.vla import TinyVLA
    from shared_rl.config import ConfigError

    monkeypatch.setattr(bc, "evaluate_policy", lambda *a, **k: {"eval/success": 0.0})
    eps = _episodes(n=4, t=12)  # two demos per task
    train_eps, val_eps = bc.split_validation(eps, 1)
    assert len(val_eps) == 2 and {e.task for e in val_eps} == {"reach-v3", "drawer-close-v3"}
    assert not {id(e) for e in val_eps} & {id(e) for e in train_eps}
    demos = save_episodes(eps, tmp_path / "demos.npz")
    snapshots = []
    real_loss = bc.ValidationLoss.__call__
    scripted = iter([3.0, 1.0, 2.0, 4.0])  # the best is the second measurement (step 6), not the last

    def recording(self, policy):
        value = real_loss(self, policy)
        assert math.isfinite(value) and real_loss(self, policy) == value  # fixed noise: a function of the weights
        snapshots.append({k: t.clone() for k, t in policy.state_dict().items()})
        return next(scripted)

    monkeypatch.setattr(bc.ValidationLoss, "__call__", recording)
    cfg = {"data": str(demos), "env": {"tasks": ["reach-v3", "drawer-close-v3"], "horizon": 8}, "train_steps": 12,
           "batch_size": 8, "log_every": 3, "gifs": False, "eval_states_per_task": 1, "lr": 3e-3,
           "val_demos_per_task": 1, "val_every": 3,
           "model": {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64}}
    out = bc.run(cfg, tmp_path / "run", log=lambda s: None)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = {r["step"]: r["loss/val"] for r in recs if "loss/val" in r}
    assert vals == {3: 3.0, 6: 1.0, 9: 2.0, 12: 4.0} and len(snapshots) == 4
    assert out["bc/best_step"] == 6
    saved = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    for k, t in snapshots[1].items():
        assert torch.equal(saved[k], t), k
    assert any(not torch.equal(saved[k], t) for k, t in snapshots[-1].items())  # not the last step's weights
    assert TinyVLA.load_pretrained(tmp_path / "run" / "model") is not None
    with pytest.raises(ConfigError, match="leaves no training demo"):
        bc.run({**cfg, "val_demos_per_task": 2}, tmp_path / "run2", log=lambda s: None)


def _corrupt_copies(root, tmp_path):
    """A good LeRobot v3 export and copies with one file each that is not what its name says."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    data = sorted((root / "data").glob("chunk-*/file-*.parquet"))[0]
    cases = {
        "info.json not UTF-8": ("meta/info.json", lambda p: p.write_bytes(p.read_bytes().replace(b"{", b"{\xe9", 1)),
                                "not UTF-8 text"),
        "info.json not JSON": ("meta/info.json", lambda p: p.write_text("{features: nope"), "not valid JSON"),
        "info.json features not a mapping": ("meta/info.json", lambda p: p.write_text(json.dumps(
            {**json.loads(p.read_text()), "features": {"observation.state": 3, "action": 4}})), "'features' must map"),
        "tasks.parquet is text": ("meta/tasks.parquet", lambda p: p.write_text("task_index,task\n0,reach\n"),
                                  "is not a readable Parquet file"),
        "tasks.parquet without task_index": ("meta/tasks.parquet", lambda p: pq.write_table(
            pa.table({"other": [1]}), p), "has no column 'task_index'"),
        "data parquet truncated": (str(data.relative_to(root)), lambda p: p.write_bytes(p.read_bytes()[:100]),
                                   "is not a readable Parquet file"),
        "data parquet without action": (str(data.relative_to(root)), lambda p: pq.write_table(
            pq.read_table(p).drop_columns(["action"]), p), "has no column 'action'"),
        "grove.json garbage": ("meta/grove.json", lambda p: p.write_bytes(b"\x00\x01"), "is not text"),
        "image cell garbage": (str(data.relative_to(root)), lambda p: pq.write_table(
            pq.read_table(p).set_column(pq.read_table(p).column_names.index("observation.image"), "observation.image",
                                        pa.array([{"bytes": b"not a png", "path": None}] * pq.read_table(p).num_rows)),
            p), "cannot be read"),
    }
    out = {}
    for i, (name, (rel, corrupt, message)) in enumerate(cases.items()):
        copy = tmp_path / f"bad{i}"
        shutil.copytree(root, copy)
        corrupt(copy / rel)
        out[name] = (copy, message)
    return out


def test_hostile_lerobot_dataset_files_are_one_line_errors(tmp_path):
    """Each LeRobot meta or data file that is not what its name says — not UTF-8, not JSON, not Parquet, a missing
    column, an undecodable image — answers `grove robotics from-lerobot` with exit 2 and one line naming the file
    or episode, and writes nothing."""
    pytest.importorskip("lerobot.datasets.lerobot_dataset")
    import subprocess
    import sys

    root = export_lerobot(_episodes(2), tmp_path / "good", repo_id="grove/test")
    assert len(import_lerobot(root)) == 2
    for name, (bad, message) in _corrupt_copies(root, tmp_path).items():
        out = tmp_path / f"{bad.name}.npz"
        proc = subprocess.run([sys.executable, "-m", "shared_rl", "robotics", "from-lerobot", str(bad), str(out)],
                              capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (name, proc.stderr[-1500:])
        assert len(lines) == 1 and lines[0].startswith("grove: error:") and message in lines[0], (name, lines)
        assert "Traceback" not in proc.stderr and not out.exists(), name


def test_damaged_episode_files_are_one_line_errors(tmp_path):
    """An episodes .npz that is a truncated zip, whose per-episode arrays disagree in length, whose episodes do not
    tile its frames, or whose images are not uint8: one ConfigError line each (was BadZipFile / IndexError, or
    silently empty episodes)."""
    from shared_rl.errors import ConfigError

    good = save_episodes(_episodes(2), tmp_path / "good.npz")
    raw = good.read_bytes()
    z = dict(np.load(good))
    cases = {"truncated": (raw[: len(raw) // 2], "not a NumPy .npz archive"),
             "short tasks": ({**z, "tasks": z["tasks"][:1]}, r"arrays of different lengths \(tasks"),
             "bad starts": ({**z, "episode_starts": z["episode_starts"] + 3}, "do not tile its"),
             "float images": ({**z, "images": z["images"].astype(np.float64)}, "images must be uint8")}
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.npz"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            np.savez(path, **content)
        with pytest.raises(ConfigError, match=message) as err:
            load_episodes(path)
        assert "\n" not in str(err.value), name
    assert len(load_episodes(good)) == 2
