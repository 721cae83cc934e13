"""FSDP2 (``distributed.strategy: fsdp2``) on LeRobot policies: a tiny SmolVLA (full fine-tuning, KL to the sharded
reference copy) and a tiny π0.5 (LoRA, KL to the adapter-off policy), built from LeRobot's config classes (no
download), sharded per transformer layer (``robotics.fsdp.lerobot_units``) on 2 CPU processes (gloo): the same
metrics, weights and exported LeRobot directory as one process for the same global batch (3 groups over 2
processes, so one rank pads whole micro-batches); a tiny π0 with LoRA likewise; the SmolVLA run's sharded checkpoint
resumes in one process to the uninterrupted weights; a tiny π0.5 (LoRA) with gradient checkpointing on the 2
processes equals one process without it (the recomputation seen inside backward). The 2-process runs are
``slow``; the wrap plan of the released π0.5 (on the meta device) and of the tiny SmolVLA are fast. Process 1 of
every 2-process run builds its policy on the meta device (no weight file read) and receives its shards from process
0; its processors' normalisation statistics are read from the policy directory and equal one process's. SmolVLA
(full fine-tuning) with gradient checkpointing on the 2 processes equals one process without it too.
"""
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from shared_rl.config import ConfigError, load_train_config
from shared_rl.distributed import exit_distributed, free_port, full_tensors, is_dtensor
from shared_rl.trainer import Trainer
from tests.fsdp_layout import assert_same_records, assert_same_weights

METRICS = ("reward/mean", "reward/dense/mean", "groups/kept", "nfe/rollout", "nfe/train", "loss/policy", "loss/kl",
           "clip_frac", "ratio/mean", "grad_norm", "eval/success")


def _tiny_dir(root, family) -> str:
    from robotics.envs.vector import EnvConfig
    from robotics.policies.lerobot.tiny import TinySmolVLA, build_tiny_smolvla
    from robotics.policies.lerobot.tiny_pi import TinyPi, build_tiny_pi

    env = EnvConfig(kind="point", tasks=["point-reach"], horizon=8)
    if family == "smolvla":
        build_tiny_smolvla(root, env, TinySmolVLA(num_steps=3), seed=0)
    else:
        build_tiny_pi(root, env, TinyPi(family=family, num_inference_steps=3), seed=0)
    return str(root)


def _config(strategy, policy, iterations=2):
    return load_train_config({
        "domain": "robotics", "seed": 1, "iterations": iterations, "logging": {"progress": False},
        "eval": {"every": iterations, "at_start": False}, "checkpoint": {"every": 1},
        "distributed": {"strategy": strategy},
        "rollout": {"groups_per_iteration": 3, "group_size": 2, "groups_per_call": 1},
        "advantage": {"weights": {"dense": 1.0}}, "selection": {"filter": "none"},
        "loss": {"kl_coef": 0.05}, "optim": {"lr": 1e-3, "minibatches_per_epoch": 2, "micro_batch_size": 1},
        "robotics": {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 8}, "policy": policy,
                     "head_mode": "flow_sde", "dense_reward": True, "train_states_per_task": 6,
                     "eval_states_per_task": 1, "gifs": False}})


def _processor_stats(vla) -> dict:
    """The tensors of the LeRobot pre- and post-processors' steps (the normalisation statistics): real on every
    process, also where the policy itself was built on the meta device."""
    out = {}
    for which, pipe in (("pre", vla.preprocessor), ("post", vla.postprocessor)):
        for i, step in enumerate(pipe.steps):
            for k, v in (step.state_dict() if hasattr(step, "state_dict") else {}).items():
                assert not v.is_meta, (which, i, k)
                out[f"{which}.{i}.{k}"] = v.clone()
    return out


def _worker(rank, world, port, policy, run_dir, out, iterations):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tr = Trainer(_config("fsdp2", policy, iterations), run_dir, log=lambda *_: None)
    assert all(is_dtensor(p) for p in tr.domain.policy.parameters())
    local, full = tr.fsdp.local_parameter_bytes()
    assert local < 0.6 * full  # each process holds about half (frozen base and reference included)
    recomputed = [0]  # forwards inside the layers' MLPs run during backward: checkpointing's recomputation
    # π0 / π0.5: a Gemma layer unit's MLP; SmolVLA: the layer MLPs are units themselves (robotics.fsdp)
    for mlp in (getattr(m, "mlp", m) for m in tr.fsdp.modules if hasattr(m, "mlp") or "MLP" in type(m).__name__):
        inner = next(m for m in mlp.modules() if isinstance(m, torch.nn.Linear))
        inner.register_forward_pre_hook(
            lambda *_: recomputed.__setitem__(0, recomputed[0] + (torch._C._current_graph_task_id() != -1)))
    assert tr.fsdp.from_rank0  # process 1 built the policy on the meta device; process 0 loaded it alone
    stats = _processor_stats(tr.domain.policy)  # before training: the processors' normalisation statistics
    tr.fit()
    torch.save({"state": full_tensors(tr.domain.state_dict()), "padding_forwards": tr.padding_forwards,
                "recomputed": recomputed[0], "stats": stats}, f"{out}.{rank}")
    tr.domain.close()
    exit_distributed(0)


CASES = [  # (family, policy settings, iterations): the first also resumes its sharded checkpoint in one process
    # seconds on 2 CPU cores shared with other work: 95 / 75 / 91 (about a third of that on idle cores)
    pytest.param("smolvla", {}, 2, id="smolvla-full"),
    pytest.param("pi05", {"lora": {"rank": 2}}, 1, id="pi05-lora"),
    pytest.param("pi0", {"lora": {"rank": 2}}, 1, id="pi0-lora"),
    # gradient checkpointing on the 2 processes only: the 1-process run it equals does not checkpoint
    pytest.param("pi05", {"lora": {"rank": 2}, "gradient_checkpointing": True}, 1, id="pi05-lora-checkpointed"),
    # SmolVLA checkpoints around units (its attention calls the projection units inside the checkpoint): FSDP2
    # all-gathers them again in the recomputation, in the same order on every process
    pytest.param("smolvla", {"gradient_checkpointing": True}, 1, id="smolvla-full-checkpointed"),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, extra, iterations", CASES)
def test_fsdp2_lerobot_two_processes_match_one(tmp_path, family, extra, iterations):
    policy = {"type": "lerobot", "path": _tiny_dir(tmp_path / family, family), **extra}
    torch.set_num_threads(1)
    plain = {k: v for k, v in policy.items() if k != "gradient_checkpointing"}
    single = Trainer(_config("replicate", plain, iterations), tmp_path / "one", log=lambda *_: None)
    single.fit()
    single.domain.close()
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "shared_rl.trainer", "robotics.domain"])
    mp.start_processes(_worker, args=(2, free_port(), policy, tmp_path / "two", str(tmp_path / "two.pt"), iterations),
                       nprocs=2, join=True, start_method="forkserver")
    got = [torch.load(tmp_path / f"two.pt.{r}", weights_only=True) for r in range(2)]
    assert got[0]["padding_forwards"] + got[1]["padding_forwards"] > 0
    assert (got[0]["recomputed"] > 0) == bool(extra.get("gradient_checkpointing")), got[0]["recomputed"]
    want = _processor_stats(single.domain.policy)
    assert want and all(g["stats"].keys() == want.keys() for g in got)
    assert all(torch.equal(g["stats"][k], want[k]) for g in got for k in want)
    live = single.domain.state_dict()
    trained = [n for n, p in single.domain.policy.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trained) if "lora" in extra else len(trained) > 50
    assert_same_weights(live, [g["state"] for g in got])
    one = assert_same_records(tmp_path / "one", tmp_path / "two", METRICS, 8, last="eval/success")
    assert max(r["loss/kl"] for r in one) > 0
    # final/: LeRobot's layout (LoRA merged), gathered and written by process 0; it loads in LeRobot
    f1, f2 = (load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("one", "two"))
    assert f1.keys() == f2.keys() and not any("lora_" in k for k in f2)
    for k in f1:
        assert torch.allclose(f1[k], f2[k], atol=1e-5, rtol=1e-4), k
    from robotics.policies.lerobot.compat import policy_class
    from robotics.policies.lerobot.tiny_pi import sizes_context

    final = str(tmp_path / "two" / "final")
    with sizes_context(final):
        exported = policy_class(family).from_pretrained(final, local_files_only=True)
    theirs = exported.state_dict()
    assert all(torch.equal(theirs[k], f2[k]) for k in f2)
    if iterations < 2:
        return
    # the sharded checkpoint of step 1 continues in one process to the uninterrupted result
    import shutil

    from shared_rl.checkpoint import is_sharded_checkpoint

    assert is_sharded_checkpoint(tmp_path / "two" / "checkpoints" / "step_000001")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    tr = Trainer(_config("replicate", policy, iterations), resumed, log=lambda *_: None)
    tr.fit(resume=True)
    tr.domain.close()
    assert tr.start_iteration == 1
    for k, v in tr.domain.state_dict().items():
        assert torch.allclose(v, live[k], atol=1e-5, rtol=1e-4), k


def test_lerobot_wrap_plan_shards_the_transformer_layers():
    """The units of the released π0.5 (PaliGemma 2B + the 300M expert, on the meta device: nothing allocated): one
    per Gemma decoder layer (18 VLM, 18 expert) and SigLIP encoder layer (27), then the parameter owners outside
    them; every parameter in exactly one unit, no unit above the embedding table's size."""
    from robotics.fsdp import lerobot_units
    from robotics.policies.lerobot import import_policies

    import_policies()
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

    with torch.device("meta"):
        model = PI05Pytorch(PI05Config(device="cpu"))
    units = lerobot_units(model, family="pi05")
    kinds = [type(u).__name__ for u in units]
    assert kinds.count("_PiGemmaDecoderLayerBase") == 36 and kinds.count("SiglipEncoderLayer") == 27
    ids = [id(p) for u in units for p in u.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    sizes = sorted(sum(p.numel() for p in u.parameters()) for u in units)
    embed = model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight.numel()
    assert sizes[-1] == embed and sum(sizes) > 4e9  # the largest unit: the 257,152-token table (or lm_head)


def test_lerobot_wrap_plan_of_smolvla_and_the_lora_layers(tmp_path):
    """SmolVLA runs its decoder layers' parts itself, so a layer is sharded as its MLP and its projections and
    norms; with LoRA a peft layer (base + adapters) is one unit. Built on the meta device from the tiny config."""
    from robotics.envs.vector import EnvConfig
    from robotics.fsdp import lerobot_units
    from robotics.policies.lerobot import import_policies
    from robotics.policies.lerobot.tiny import TinySmolVLA, write_tiny_vlm

    import_policies()
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from peft import LoraConfig, get_peft_model

    env, t = EnvConfig(kind="point", tasks=["point-reach"]), TinySmolVLA()
    vlm = write_tiny_vlm(tmp_path / "vlm", t)
    config = SmolVLAConfig(vlm_model_name=str(vlm), load_vlm_weights=False, num_vlm_layers=t.vlm_layers,
                           expert_width_multiplier=t.expert_width_multiplier, chunk_size=t.chunk_size,
                           n_action_steps=t.n_action_steps, max_state_dim=8, max_action_dim=8, device="cpu",
                           input_features={"observation.images.corner": PolicyFeature(FeatureType.VISUAL, (3, 64, 64)),
                                           "observation.state": PolicyFeature(FeatureType.STATE, (env.proprio_dim,))},
                           output_features={"action": PolicyFeature(FeatureType.ACTION, (4,))})
    with torch.device("meta"):
        policy = SmolVLAPolicy(config)
        policy = get_peft_model(policy, LoraConfig(r=2, target_modules=policy._get_default_peft_targets()
                                                   ["target_modules"])).base_model.model
    units = lerobot_units(policy, family="smolvla")
    names = {id(m): n for n, m in policy.named_modules()}
    unit_names = [names[id(u)] for u in units]
    layer = "model.vlm_with_expert.lm_expert.layers.0."
    assert layer + "mlp" in unit_names and layer + "self_attn.q_proj" in unit_names  # q_proj: a peft LoRA layer
    assert not any(n.startswith(layer + "self_attn.q_proj.") for n in unit_names)
    assert sum(type(u).__name__ == "SmolVLMEncoderLayer" for u in units) == 1
    ids = [id(p) for u in units for p in u.parameters()]
    assert len(ids) == len(set(ids)) == len(list(policy.parameters()))


def test_fsdp2_accepts_gradient_checkpointing_of_every_lerobot_family(tmp_path):
    """SmolVLA's gradient checkpointing was refused under FSDP2 until the smolvla-full-checkpointed case above
    showed it equal to one process; π0 / π0.5 were accepted before (pi05-lora-checkpointed)."""
    from robotics.fsdp import refuse_config

    cfg = _config("fsdp2", {"type": "lerobot", "path": str(tmp_path)}).domain_config
    cfg.policy.gradient_checkpointing = True
    refuse_config(cfg)  # no family-dependent refusal left
    cfg.critic.enabled = True  # what stays refused still is, in one line
    with pytest.raises(ConfigError) as err:
        refuse_config(cfg)
    msg = str(err.value)
    assert "robotics.critic.enabled" in msg and "distributed.strategy: fsdp2" in msg and "\n" not in msg
