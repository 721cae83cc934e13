"""A LeRobot SmolVLA (a tiny one, built from LeRobot's config classes) as grove's robotics policy: the import under
transformers 5, the ODE equal to LeRobot's own action path, per-step log-probs recomputed with ratio exactly 1
(flow-SDE and the flow-noise head), micro-batches, gradient checkpointing, LoRA, export to a directory LeRobot
loads with identical actions, config errors, one RL iteration through the trainer and one PPO iteration with the
value head (docs/methods/lerobot_policies.md)."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import json
import math

import pytest
import torch

from shared_rl.config import ConfigError, from_dict, load_train_config

from robotics.config import RoboticsConfig
from robotics.envs.vector import EnvConfig
from robotics.policies.lerobot import PolicySettings, import_policies
from robotics.policies.lerobot.load import load_lerobot_policy
from robotics.policies.lerobot.tiny import TinySmolVLA, build_tiny_smolvla

ENV = EnvConfig(tasks=["reach-v3", "push-v3"], horizon=8)
TEXTS = ["reach the red goal with the gripper", "push the puck to the green goal", "reach the red goal with the gripper"]
# the model's chunk (8 x 8 padded dims) is wider than what the env executes (4 actions x 4 dims)
TINY = TinySmolVLA(chunk_size=8, n_action_steps=4, max_action_dim=8, num_steps=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("smolvla") / "policy"
    stats = {"observation.state": {"mean": torch.tensor([0.0, 0.6, 0.2, 0.5]), "std": torch.tensor([0.1, 0.1, 0.1, 0.3]),
                                   "min": -torch.ones(4), "max": torch.ones(4)},
             "action": {"mean": torch.tensor([0.1, -0.1, 0.0, 0.2]), "std": torch.tensor([0.5, 0.4, 0.3, 0.6]),
                        "min": -torch.ones(4), "max": torch.ones(4)}}
    build_tiny_smolvla(d, ENV, TINY, stats=stats, seed=0)
    return d


def _load(path, **settings):
    s = from_dict(PolicySettings, {"type": "lerobot", "path": str(path), **settings}, "robotics.policy")
    return load_lerobot_policy(s, ENV, str(path), seed=0)


def _obs(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (b, 64, 64, 3), dtype=torch.uint8, generator=g),
            torch.randn(b, 4, generator=g) * 0.1 + torch.tensor([0.0, 0.6, 0.2, 0.5]))


def _lerobot_chunk(vla, images, proprio, noise):
    """LeRobot's own path: preprocessor -> predict_action_chunk(noise) -> postprocessor, cut to K x 4."""
    batch = vla.preprocessor(vla.observation(images, proprio, TEXTS[: len(images)]))
    actions = vla.postprocessor(vla.policy.predict_action_chunk(batch, noise=noise))
    return actions[:, : vla.cfg.chunk, :4].reshape(len(images), -1)


def test_lerobot_policies_import_with_the_compat_layer():
    """LeRobot 0.6's policy package imports as it is; after ``import_policies`` SmolVLA makes its caches with the
    legacy absolute-length crop it relies on (compat.py item 4), and without it transformers 5.24 refuses that crop."""
    import_policies()
    from lerobot.policies.smolvla import smolvlm_with_expert
    from transformers.cache_utils import DynamicCache

    from robotics.policies.lerobot.compat import legacy_crop_cache

    assert smolvlm_with_expert.DynamicCache is legacy_crop_cache()
    t = torch.zeros(1, 1, 5, 2)
    with pytest.raises(ValueError, match="positive value"):
        DynamicCache(((t, t),)).crop(3)
    cache = legacy_crop_cache()(((t, t),))
    cache.crop(3)
    assert cache.get_seq_length() == 3


def test_ode_is_lerobots_action_path(tiny_dir):
    vla = _load(tiny_dir).eval()
    images, proprio = _obs()
    noise = torch.randn(3, TINY.chunk_size, TINY.max_action_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = vla.encode(images, proprio, vla.text.token_ids(TEXTS))
        ours = vla.flow.sample(h, "ode", None, start_noise=noise.reshape(3, -1))
    theirs = _lerobot_chunk(vla, images, proprio, noise)
    assert ours.actions.shape == (3, 16) and ours.chain.shape == (3, TINY.num_steps + 1, 64)
    assert (ours.actions - theirs).abs().max() <= 1e-5
    # select_action hands out the same chunk one action at a time
    vla.policy.reset()
    batch = vla.preprocessor(vla.observation(images[:1], proprio[:1], TEXTS[:1]))
    first = torch.stack([vla.policy.select_action(dict(batch), noise=noise[:1]) for _ in range(vla.cfg.chunk)], 1)
    first = vla.postprocessor(first)[:, :, :4].reshape(1, -1)
    assert (ours.actions[:1] - first).abs().max() <= 1e-5
    assert not torch.allclose(ours.actions[0], ours.actions[1]), "rows see their own observation"


@pytest.mark.parametrize("mode,trained", [("flow_sde", TINY.num_steps - 1), ("sde_one_step", 1)])
def test_recomputed_log_probs_give_ratio_exactly_one(tiny_dir, mode, trained):
    vla = _load(tiny_dir).eval()
    images, proprio = _obs()
    ids = vla.text.token_ids(TEXTS)
    with torch.no_grad():
        out = vla.flow.sample(vla.encode(images, proprio, ids), mode, torch.Generator().manual_seed(2), 0.7)
    assert (out.stochastic.sum(1) == trained).all() and (out.logp[out.stochastic] != 0).all()
    # the trainer's layout: the prefix of each chunk once, one row per trained step, in another batch order
    rows, steps = torch.nonzero(out.stochastic, as_tuple=True)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(3))
    rows, steps = rows[perm], steps[perm]
    vla.train()
    h = vla.encode(images[[2, 0, 1]], proprio[[2, 0, 1]], [ids[2], ids[0], ids[1]])
    where = torch.tensor([1, 2, 0])[rows]
    logp, ent, _, _ = vla.flow.step_log_prob(h[where], out.chain[rows, steps], out.chain[rows, steps + 1], steps, mode, 0.7)
    assert torch.equal(logp.detach(), out.logp[rows, steps]), "ratio exactly 1 before the first update"
    assert (ent > 0).all()


def test_micro_batches_give_the_same_gradient(tiny_dir):
    vla = _load(tiny_dir, lora={"rank": 4}).eval()
    images, proprio = _obs(4, seed=5)
    ids = vla.text.token_ids(TEXTS + TEXTS[:1])
    with torch.no_grad():
        out = vla.flow.sample(vla.encode(images, proprio, ids), "flow_sde", torch.Generator().manual_seed(4), 0.7)
    params = [p for p in vla.parameters() if p.requires_grad]
    steps = torch.zeros(4, dtype=torch.long) + 1

    def grad(idx):
        vla.zero_grad()
        h = vla.encode(images[idx], proprio[idx], [ids[i] for i in idx])
        lp, *_ = vla.flow.step_log_prob(h, out.chain[idx, 1], out.chain[idx, 2], steps[: len(idx)], "flow_sde", 0.7)
        lp.sum().backward()
        return [p.grad.clone() for p in params]

    whole = grad([0, 1, 2, 3])
    halves = [a + b for a, b in zip(grad([0, 1]), grad([2, 3]))]
    assert any(g.abs().sum() > 0 for g in whole)
    for a, b in zip(whole, halves):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def _load_noisy(path, **settings):
    s = from_dict(PolicySettings, {"type": "lerobot", "path": str(path), **settings}, "robotics.policy")
    return load_lerobot_policy(s, ENV, str(path), seed=0, noise_head=True)


def test_flow_noise_head_ratio_one_and_ode_unchanged(tiny_dir):
    """ReinFlow / πRL flow-noise on the LeRobot policy: every denoising step stochastic with a learned per-dim std
    in [std_min, std_max], recomputed log-probs equal the rollout's bit for bit (ratio exactly 1), the std net gets
    gradient, and the deterministic ODE path is the policy's own (the std net is not on it)."""
    base = _load(tiny_dir).eval()
    vla = _load_noisy(tiny_dir).eval()
    images, proprio = _obs()
    ids = vla.text.token_ids(TEXTS)
    noise = torch.randn(3, TINY.chunk_size * TINY.max_action_dim, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ode = [p.flow.sample(p.encode(images, proprio, ids), "ode", None, start_noise=noise).actions for p in (base, vla)]
        out = vla.flow.sample(vla.encode(images, proprio, ids), "flow_noise", torch.Generator().manual_seed(2))
    assert torch.equal(ode[0], ode[1]), "the noise head leaves the ODE path unchanged"
    assert out.stochastic.all() and (out.logp != 0).all(), "flow_noise: every denoising step is sampled and scored"
    rows, steps = torch.nonzero(out.stochastic, as_tuple=True)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(3))
    rows, steps = rows[perm], steps[perm]
    vla.train()
    h = vla.encode(images[[2, 0, 1]], proprio[[2, 0, 1]], [ids[2], ids[0], ids[1]])
    where = torch.tensor([1, 2, 0])[rows]
    logp, ent, _, std = vla.flow.step_log_prob(h[where], out.chain[rows, steps], out.chain[rows, steps + 1], steps,
                                               "flow_noise")
    assert torch.equal(logp.detach(), out.logp[rows, steps]), "ratio exactly 1 at the first inner step"
    assert std.shape == (len(rows), TINY.chunk_size * TINY.max_action_dim)
    assert (std >= 0.08 - 1e-7).all() and (std <= 0.16 + 1e-7).all() and std.std() > 0
    logp.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in vla.flow.noise_std.parameters())


def test_flow_noise_log_prob_at_the_min_std_is_the_gaussian_formula(tiny_dir):
    """With the std net pushed to its lower bound (tanh -> -1: std = std_min), each step's log-prob is the
    hand-computed Gaussian N(x + v·dt, std_min²) density of the next chain element, v from LeRobot's own
    ``denoise_step`` and dt LeRobot's step -1/num_steps."""
    vla = _load_noisy(tiny_dir, noise={"std_min": 0.05, "std_max": 0.3}).eval()
    last = vla.flow.noise_std.mlp[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(-30.0)
    images, proprio = _obs()
    ids = vla.text.token_ids(TEXTS)
    with torch.no_grad():
        h = vla.encode(images, proprio, ids)
        out = vla.flow.sample(h, "flow_noise", torch.Generator().manual_seed(7))
        d = TINY.chunk_size * TINY.max_action_dim
        for t in range(TINY.num_steps):
            x, x_next = out.chain[:, t], out.chain[:, t + 1]
            sigma = torch.full((3,), 1.0 - t / TINY.num_steps)
            v = vla.policy.model.denoise_step(prefix_pad_masks=h.pad_masks, past_key_values=h.cache(),
                                              x_t=x.view(3, TINY.chunk_size, -1), timestep=sigma).reshape(3, -1)
            mean = x.double() + v.double() * (-1.0 / TINY.num_steps)
            z = (x_next.double() - mean) / 0.05
            expected = (-0.5 * z ** 2).sum(1) - d * (math.log(0.05) + 0.5 * math.log(2 * math.pi))
            assert torch.allclose(out.logp[:, t].double(), expected, rtol=1e-5, atol=1e-3), t
            assert 0.8 < z.std() < 1.2, "the step's noise is std_min times a standard normal"


def test_lora_trains_only_adapters_and_exports_a_lerobot_policy(tiny_dir, tmp_path):
    base = _load(tiny_dir).eval()
    vla = _load(tiny_dir, lora={"rank": 4, "alpha": 8}).eval()
    images, proprio = _obs()
    ids = vla.text.token_ids(TEXTS)
    noise = torch.randn(3, TINY.chunk_size * TINY.max_action_dim, generator=torch.Generator().manual_seed(6))

    def ode(policy):
        with torch.no_grad():
            return policy.flow.sample(policy.encode(images, proprio, ids), "ode", None, start_noise=noise).actions

    assert torch.equal(ode(vla), ode(base)), "LoRA starts at B = 0: the policy is unchanged"
    trained = {n for n, p in vla.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert any("lm_expert" in n for n in trained) and not any(".vlm." in n for n in trained)
    with torch.no_grad():  # a stand-in for RL's update: move every adapter
        for n, p in vla.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    moved = ode(vla)
    assert (moved - ode(base)).abs().max() > 1e-3

    vla.save_pretrained(tmp_path / "final")
    assert {"config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json"} <= {
        p.name for p in (tmp_path / "final").iterdir()}
    assert not json.loads((tmp_path / "final" / "config.json").read_text()).get("use_peft")
    # LeRobot's own loaders, not grove's
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    policy = SmolVLAPolicy.from_pretrained(tmp_path / "final")
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(tmp_path / "final"))
    batch = pre(vla.observation(images, proprio, TEXTS))
    theirs = post(policy.predict_action_chunk(batch, noise=noise.view(3, TINY.chunk_size, -1)))
    assert (moved - theirs[:, :4, :4].reshape(3, -1)).abs().max() <= 1e-5
    # and grove reads its own export back
    assert (ode(_load(tmp_path / "final").eval()) - moved).abs().max() <= 1e-5


def test_config_errors_are_one_line(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"robotics.policy.type: 'smolvla' is not one of \['tiny_vla', 'lerobot'\]"):
        from_dict(RoboticsConfig, {"policy": {"type": "smolvla"}}, "robotics")
    with pytest.raises(ConfigError, match="path, cameras, n_action_steps, lora, noise and gradient_checkpointing are "
                                          "read by type: lerobot"):
        from_dict(RoboticsConfig, {"policy": {"path": str(tiny_dir)}}, "robotics")
    lerobot = {"type": "lerobot", "path": str(tiny_dir)}
    for extra, what in (({"head_mode": "discrete"}, "head_mode"), ({"adapters": {"rank": 4}}, "adapters.rank"),
                        ({"policy": dict(lerobot, noise={"std_min": 0.2, "std_max": 0.1})}, "std_min <= std_max")):
        with pytest.raises(ConfigError, match=what):
            from_dict(RoboticsConfig, {"policy": lerobot, **extra}, "robotics")
    # features the env cannot provide
    config = json.loads((tiny_dir / "config.json").read_text())
    cases = [
        ("observation.images.wrist", {"type": "VISUAL", "shape": [3, 64, 64]}, "'observation.images.wrist' has no env camera"),
        ("observation.velocity", {"type": "STATE", "shape": [4]}, "which the env cannot provide"),
        ("observation.state", {"type": "STATE", "shape": [7]}, "observation.state has 7 dims, the env's proprio 4"),
    ]
    for key, feature, message in cases:
        bad = tmp_path / key.replace(".", "_")
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(dict(config, input_features={**config["input_features"], key: feature})))
        with pytest.raises(ConfigError, match=message) as err:
            _load(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="cameras"):
        _load(tiny_dir, cameras={"observation.images.corner": "topview"})
    pi0 = tmp_path / "pi0"
    pi0.mkdir()
    (pi0 / "config.json").write_text(json.dumps({"type": "pi0"}))
    with pytest.raises(ConfigError, match="declares no image feature"):  # π0 loads now; its features are checked
        _load(pi0)
    with pytest.raises(ConfigError, match="does not exist .a local path, not a hub id.; make this recipe's tiny "
                                          "policy with `python scripts/robotics_lerobot_tiny.py --out "):
        _load(tmp_path / "missing")
    from shared_rl.prechecks import lerobot_tiny_command as make_tiny_command

    assert make_tiny_command("runs/lerobot/pi05-tiny-libero", "libero") == \
        "python scripts/robotics_lerobot_tiny.py --env libero --family pi05 --out runs/lerobot/pi05-tiny-libero"
    assert make_tiny_command("runs/lerobot/smolvla-tiny") == "python scripts/robotics_lerobot_tiny.py --out runs/lerobot/smolvla-tiny"
    with pytest.raises(ConfigError, match="neither a LeRobot policy directory nor a hub id in the local cache"):
        _load("no-such-org/no-such-policy")


def test_one_rl_iteration_and_final_export(tiny_dir, tmp_path):
    """The robotics domain with the LeRobot policy through the trainer: Meta-World rollouts (flow-SDE), ratio 1 at
    the first inner step, an update of the LoRA adapters only, evaluation, and final/ as a LeRobot directory."""
    from shared_rl.trainer import Trainer

    data = {"domain": "robotics", "seed": 0, "iterations": 1,
            "rollout": {"groups_per_iteration": 2, "group_size": 2},
            "optim": {"lr": 1e-3, "inner_epochs": 1, "minibatches_per_epoch": 1},
            "advantage": {"weights": {"success": 1.0, "dense": 1.0}},  # the shaped reward: nonzero advantages
            "selection": {"filter": "none"}, "eval": {"at_start": False, "every": 1}, "logging": {"progress": False},
            "robotics": {"policy": {"type": "lerobot", "path": str(tiny_dir), "lora": {"rank": 4}},
                         "env": {"tasks": ["reach-v3", "push-v3"], "horizon": 8}, "head_mode": "flow_sde",
                         "dense_reward": True, "train_states_per_task": 2, "eval_states_per_task": 1, "gifs": False}}
    trainer = Trainer(load_train_config(data), tmp_path / "run", log=lambda s: None)
    before = {n: p.detach().clone() for n, p in trainer.domain.policy.named_parameters()}
    hist = trainer.fit()
    m = hist[-1]
    assert m["ratio/mean"] == 1.0 and m["approx_kl"] == 0.0, "one update on fresh rollouts: the ratio is exactly 1"
    assert "eval/success" in m and m["env/episodes"] == 4
    changed = {n for n, p in trainer.domain.policy.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    final = tmp_path / "run" / "final"
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    assert SmolVLAPolicy.from_pretrained(final).config.chunk_size == TINY.chunk_size


def test_gradient_checkpointing_gives_the_same_gradient(tiny_dir):
    """``robotics.policy.gradient_checkpointing``: every VLM / expert layer's attention and MLP recomputed in
    backward (torch.utils.checkpoint): the same log-probs and the same gradient of every weight (the tiny policy
    trains all of them, VLM included, so the prefix pass is under grad too) within float tolerance."""
    plain, ckpt = _load(tiny_dir).train(), _load(tiny_dir, gradient_checkpointing=True).train()
    assert type(ckpt.policy.model.vlm_with_expert).__name__.startswith("Checkpointed")
    images, proprio = _obs(3, seed=8)
    ids = plain.text.token_ids(TEXTS)
    with torch.no_grad():
        out = plain.flow.sample(plain.encode(images, proprio, ids), "flow_sde", torch.Generator().manual_seed(9), 0.7)
    steps = torch.tensor([0, 1, 2])

    def grads(vla):
        vla.zero_grad()
        h = vla.encode(images, proprio, ids)
        lp, *_ = vla.flow.step_log_prob(h, out.chain[[0, 1, 2], steps], out.chain[[0, 1, 2], steps + 1], steps,
                                        "flow_sde", 0.7)
        lp.sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in vla.named_parameters() if p.grad is not None}

    (lp_a, ga), (lp_b, gb) = grads(plain), grads(ckpt)
    assert torch.allclose(lp_a, lp_b, rtol=1e-6, atol=1e-5)
    assert ga.keys() == gb.keys() and any(".vlm." in n for n in ga) and any("lm_expert" in n for n in ga)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-4, atol=1e-6), n


def _ppo_config(tiny_dir, **optim):
    """One PPO iteration (gae + the value head on the pooled prefix) with the flow-noise head, LoRA and gradient
    checkpointing on the tiny SmolVLA in Meta-World."""
    return {"domain": "robotics", "seed": 0, "iterations": 1,
            "rollout": {"groups_per_iteration": 2, "group_size": 2},
            "optim": {"lr": 1e-3, "inner_epochs": 1, "minibatches_per_epoch": 1, **optim},
            "advantage": {"weights": {"success": 1.0, "dense": 1.0},
                          "estimator": {"name": "gae", "gamma": 1.0, "lam": 0.95, "value_coef": 0.5}},
            "selection": {"filter": "none"}, "eval": {"at_start": False, "every": 0}, "logging": {"progress": False},
            "robotics": {"policy": {"type": "lerobot", "path": str(tiny_dir), "lora": {"rank": 4},
                                    "gradient_checkpointing": True},
                         "env": {"tasks": ["reach-v3", "push-v3"], "horizon": 8}, "head_mode": "flow_noise",
                         "critic": {"enabled": True}, "dense_reward": True, "train_states_per_task": 2,
                         "eval_states_per_task": 1, "gifs": False}}


def test_ppo_value_head_flow_noise_and_micro_batches(tiny_dir, tmp_path):
    """``advantage.estimator: gae`` with ``robotics.policy.type: lerobot``: the value head reads the pooled VLM
    prefix, trains with a finite value loss next to the flow-noise policy loss (ratio 1 at the first inner step),
    and splitting the update into micro-batches of one episode (optim.micro_batch_size) gives the same update."""
    from shared_rl.trainer import Trainer

    def run(name, **optim):
        tr = Trainer(load_train_config(_ppo_config(tiny_dir, **optim)), tmp_path / name, log=lambda s: None)
        critic0 = [p.detach().clone() for p in tr.domain.critic_parameters()]
        m = tr.iteration(0)
        return tr, critic0, m

    tr, critic0, m = run("whole")
    assert math.isfinite(m["loss/value"]) and m["loss/value"] > 0
    assert m["ratio/mean"] == 1.0 and m["approx_kl"] == 0.0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(critic0, tr.domain.critic_parameters()))
    noise_net = [n for n, p in tr.domain.policy.named_parameters() if p.requires_grad and "noise_std" in n]
    assert noise_net, "the flow-noise std is trained with the policy"
    split, _, m2 = run("micro", micro_batch_size=1)
    for k in ("loss/value", "loss/policy"):
        assert m2[k] == pytest.approx(m[k], rel=1e-4, abs=1e-6), k
    a, b = tr.domain.state_dict(), split.domain.state_dict()
    trained = [k for k in a if "lora_" in k or "noise_std" in k or k.startswith("critic.")]
    assert trained
    for k in trained:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k


def test_grove_lerobot_export_features_map(tiny_dir, tmp_path):
    """A policy fine-tuned on grove's own LeRobot export reads `observation.image` (LeRobot's one-camera key) and
    declares `observation.environment_state`, which SmolVLA never reads: both load."""
    config = json.loads((tiny_dir / "config.json").read_text())
    inputs = dict(config["input_features"])
    inputs["observation.image"] = inputs.pop("observation.images.corner")
    inputs["observation.environment_state"] = {"type": "ENV", "shape": [39]}
    d = tmp_path / "export"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.is_file():
            (d / f.name).write_bytes(f.read_bytes())
    (d / "config.json").write_text(json.dumps(dict(config, input_features=inputs)))
    assert _load(d).cameras == {"observation.image": 0}


def test_lerobot_recipes_build_at_tiny_size(tiny_dir):
    """The LeRobot recipes parse, and their robotics section builds a policy when its path is the tiny SmolVLA."""
    from pathlib import Path

    import yaml

    from robotics.domain import load_policy

    recipes = sorted((Path(__file__).resolve().parents[2] / "configs" / "robotics").glob("lerobot_*.yaml"))
    assert len(recipes) >= 2
    for path in recipes:
        data = yaml.safe_load(path.read_text())
        data["robotics"]["policy"].update(path=str(tiny_dir), n_action_steps=0)
        data["robotics"]["env"]["horizon"] = 8
        cfg = load_train_config(data).domain_config
        vla = load_policy(cfg, 0)
        assert vla.cfg.chunk == TINY.n_action_steps and vla._peft is not None, path.name


@pytest.mark.slow
def test_cpu_recipe_bc_then_grpo_on_metaworld(tmp_path):
    """The CPU recipe end to end (~8 min on 2 cores): the tiny SmolVLA behaviour-cloned on fresh demos with LeRobot's
    loss learns the two tasks from nothing, and GRPO with LoRA keeps or raises its held-out success (recorded per
    task in the run's metrics; the measured seeds are in docs/methods/lerobot_policies.md)."""
    import importlib.util
    from pathlib import Path

    import yaml

    from shared_rl.trainer import Trainer

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("lerobot_tiny", root / "scripts" / "robotics_lerobot_tiny.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    bc = script.main(["--out", str(tmp_path / "policy"), "--demos", str(tmp_path / "demos.npz"), "--steps", "3000"])
    assert bc["eval/success"] >= 0.6 and bc["loss_last_100"] < 0.5 * bc["loss_first_100"], bc
    data = yaml.safe_load((root / "configs" / "robotics" / "lerobot_smolvla_tiny_grpo.yaml").read_text())
    data["robotics"]["policy"]["path"] = str(tmp_path / "policy")
    hist = Trainer(load_train_config(data), tmp_path / "run", log=lambda s: None).fit()
    evals = [h for h in hist if "eval/success" in h]
    before, after = evals[0]["eval/success"], evals[-1]["eval/success"]
    assert before == bc["eval/success"], "iteration 0 evaluates the BC policy on the same held-out states"
    assert after >= before - 0.05, (before, after)
    assert (tmp_path / "run" / "final" / "policy_preprocessor.json").is_file()


def test_tiny_lerobot_script_help_names_both_demo_defaults(capsys):
    """The script's argument parser builds (its help names the Meta-World and the LIBERO default demo files; a help
    text that referred to a removed name once made every invocation a NameError)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("lerobot_tiny", root / "scripts" / "robotics_lerobot_tiny.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as stop:
        script.main(["--help"])
    assert stop.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps long paths at hyphens
    assert "lerobot_tiny_demos.npz" in text and "runs/libero-demos/spatial0_object0_goal1_goal6_dartN.npz" in text
