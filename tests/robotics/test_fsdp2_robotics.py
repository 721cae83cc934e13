"""FSDP2 (``distributed.strategy: fsdp2``) on the robotics domain: 2 CPU processes (gloo) with the tiny VLA sharded
(its encoder, fusion, adapter and head modules, and the KL reference copy's) give the 1-process metrics, weights and
exported ``final/`` model, for full fine-tuning and for the task adapters (the tiny VLA's low-rank adapters, the
base frozen); the run's sharded checkpoint resumes in one process; the refused settings stop with one line.

3 groups over 2 processes make one rank pad whole micro-batches (``Trainer.padding_forwards``); a forward that is
not paired hangs the collective (the spawn join then fails) or diverges from the 1-process numbers.
"""
import json
import os
import shutil

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from shared_rl.checkpoint import is_sharded_checkpoint
from shared_rl.config import ConfigError, load_train_config
from shared_rl.distributed import exit_distributed, free_port, full_tensors, is_dtensor
from shared_rl.trainer import Trainer
from tests.fsdp_layout import assert_same_records, assert_same_weights

TINY_MODEL = {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64, "num_denoise_steps": 3}
METRICS = ("reward/mean", "reward/dense/mean", "groups/kept", "nfe/rollout", "nfe/train", "loss/policy", "loss/kl",
           "clip_frac", "ratio/mean", "grad_norm", "eval/success")
FULL = {}  # every weight trained (robotics.train_encoder defaults to true)
ADAPTERS = {"adapters": {"rank": 2}}  # only the task adapters train; the base is frozen (and sharded)


def _data(strategy, robotics=None, **top):
    data = {"domain": "robotics", "seed": 1, "iterations": 2, "logging": {"progress": False},
            "eval": {"every": 2, "at_start": False}, "checkpoint": {"every": 1},
            "distributed": {"strategy": strategy},
            "rollout": {"groups_per_iteration": 3, "group_size": 2, "groups_per_call": 1},
            "advantage": {"weights": {"dense": 1.0}},  # dense: the tiny policy's groups differ, so updates happen
            "loss": {"kl_coef": 0.05}, "optim": {"lr": 1e-2, "minibatches_per_epoch": 2, "micro_batch_size": 2},
            "robotics": {"env": {"kind": "point", "tasks": ["point-reach"], "horizon": 8}, "checkpoint": "",
                         "model": TINY_MODEL, "head_mode": "flow_sde", "dense_reward": True,
                         "train_states_per_task": 8, "eval_states_per_task": 2, "gifs": False, **(robotics or {})}}
    data.update(top)
    return data


def _config(strategy, robotics=None, **top):
    return load_train_config(_data(strategy, robotics, **top))


def _worker(rank, world, port, robotics, run_dir, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tr = Trainer(_config("fsdp2", robotics), run_dir, log=lambda *_: None)
    assert tr.fsdp.from_rank0  # process 1 built the tiny VLA on the meta device, its shards came from process 0
    policy = tr.domain.policy
    assert all(is_dtensor(p) for p in policy.parameters()) and all(is_dtensor(p) for p in tr.domain._ref.parameters())
    assert len(tr.fsdp.modules) % 2 == 0 and tr.fsdp.modules[0] is policy.cnn  # the policy's units, then the ref's
    local, full = tr.fsdp.local_parameter_bytes()
    assert local < 0.6 * full  # each process holds about half of both copies (frozen parts included)
    tr.fit()
    torch.save({"state": full_tensors(tr.domain.state_dict()), "padding_forwards": tr.padding_forwards},
               f"{out}.{rank}")
    tr.domain.close()
    exit_distributed(0)  # barrier + destroy + os._exit: gloo can SIGABRT at interpreter teardown


def _spawn(robotics, run_dir, out):
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "shared_rl.trainer", "robotics.domain"])
    mp.start_processes(_worker, args=(2, free_port(), robotics, run_dir, out), nprocs=2, join=True,
                       start_method="forkserver")


@pytest.mark.parametrize("robotics", [FULL, ADAPTERS], ids=["full", "adapters"])
def test_fsdp2_two_processes_match_one(tmp_path, robotics):
    torch.set_num_threads(1)
    single = Trainer(_config("replicate", robotics), tmp_path / "one", log=lambda *_: None)
    single.fit()
    single.domain.close()
    _spawn(robotics, tmp_path / "two", str(tmp_path / "two.pt"))
    got = [torch.load(tmp_path / f"two.pt.{r}", weights_only=True) for r in range(2)]
    assert got[0]["padding_forwards"] + got[1]["padding_forwards"] > 0
    live = single.domain.state_dict()
    trained = {n for n, p in single.domain.policy.named_parameters() if p.requires_grad}
    assert (len(trained) > 10) if robotics is FULL else (trained == {"adapters.down", "adapters.up"})
    assert_same_weights(live, [g["state"] for g in got])
    one = assert_same_records(tmp_path / "one", tmp_path / "two", METRICS, 15, last="eval/success")
    assert min(r["grad_norm"] for r in one) > 1e-3 and max(r["loss/kl"] for r in one) > 0
    # final/: gathered on every process, written once, loads as a TinyVLA equal to the one-process export
    from robotics.policies.vla import TinyVLA

    f1, f2 = (load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("one", "two"))
    assert f1.keys() == f2.keys() and all(torch.allclose(f1[k], f2[k], atol=1e-5, rtol=1e-4) for k in f1)
    exported = TinyVLA.load_pretrained(tmp_path / "two" / "final")
    # the last evaluation's episodes name the weights they are of (digest of the gathered weights = the export's)
    from robotics.evaluation import policy_digest

    saved = json.loads((tmp_path / "two" / "eval_episodes" / "it0002.json").read_text())
    assert saved["policy"] == policy_digest(exported)
    # the sharded checkpoint of step 1 continues in one process to the uninterrupted result
    assert is_sharded_checkpoint(tmp_path / "two" / "checkpoints" / "step_000001")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    tr = Trainer(_config("replicate", robotics), resumed, log=lambda *_: None)
    tr.fit(resume=True)
    tr.domain.close()
    assert tr.start_iteration == 1
    for k, v in tr.domain.state_dict().items():
        assert torch.allclose(v, live[k], atol=1e-5, rtol=1e-4), k


REFUSED = [  # (section, field, value, the words of the one-line error)
    ("critic", "enabled", True, "robotics.critic.enabled"),
    ("replay", "coef", 0.5, "robotics.replay.coef"),
    ("adapters", "keep_best", True, "robotics.adapters.keep_best"),
    ("adapters", "steps", "by_episodes", "robotics.adapters.steps"),
    ("rollout", "name", "world_model", "robotics.rollout.name 'world_model'"),
]


@pytest.mark.parametrize("section, name, value, words", REFUSED, ids=[r[3].split()[0] for r in REFUSED])
def test_fsdp2_refuses_what_it_does_not_shard_with_one_line(section, name, value, words):
    """Checked from the config when the domain lists its units (``fsdp_modules``), before anything is sharded."""
    from robotics.fsdp import refuse_config

    cfg = _config("fsdp2").domain_config
    refuse_config(cfg)  # the tested settings pass
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError) as err:
        refuse_config(cfg)
    msg = str(err.value)
    assert words in msg and "distributed.strategy: fsdp2" in msg and "\n" not in msg, msg


def test_fsdp2_with_one_process_is_replicate():
    tr = Trainer(_config("fsdp2"), None, log=lambda *_: None)  # nothing to shard: the units are listed, not sharded
    assert tr.fsdp is None and not any(is_dtensor(p) for p in tr.domain.policy.parameters())
    tr.domain.close()
