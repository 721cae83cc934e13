"""Layout invariance: 2 CPU processes (gloo) give the same advantages and updates as 1 process."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from shared_rl.config import load_train_config
from shared_rl.distributed import exit_distributed, free_port
from shared_rl.trainer import Trainer

BASE = {
    "domain": "toy", "seed": 5, "iterations": 4, "logging": {"progress": False},
    "rollout": {"groups_per_iteration": 4, "group_size": 4, "groups_per_call": 1},
    "optim": {"lr": 0.2, "minibatches_per_epoch": 2, "inner_epochs": 2, "micro_batch_size": 3},
    "toy": {"num_contexts": 6, "horizon": 3},
}
VARIANTS = {
    "flat": {},
    "batch_std_refill": {"advantage": {"estimator": "batch_std"},
                         "selection": {"filter": "zero_std", "max_refill_rounds": 2},
                         "toy": {"num_contexts": 6, "horizon": 1}},
    "tree": {"advantage": {"estimator": "depth_zscore"}, "toy": {"num_contexts": 6, "horizon": 2, "tree_branch": 2}},
}


def cfg_for(name):
    data = json.loads(json.dumps(BASE))
    data.update(json.loads(json.dumps(VARIANTS[name])))
    return load_train_config(data)


def _worker(rank, world, port, name, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tr = Trainer(cfg_for(name), None, log=lambda *_: None)
    metrics = [tr.iteration(it) for it in range(4)]
    if rank == 0:
        torch.save({"logits": tr.domain.state_dict()["logits"],
                    "metrics": [{k: v for k, v in m.items() if not k.startswith("time") and k != "samples_per_s"}
                                for m in metrics]}, out)
    exit_distributed(0)  # barrier + destroy + os._exit: gloo can SIGABRT at interpreter teardown


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_two_processes_match_one(tmp_path, name):
    single = Trainer(cfg_for(name), None, log=lambda *_: None)
    ref_metrics = [single.iteration(it) for it in range(4)]
    out = tmp_path / "two.pt"
    mp.spawn(_worker, args=(2, free_port(), name, str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)
    assert torch.allclose(got["logits"], single.domain.state_dict()["logits"], atol=1e-5)
    for a, b in zip(ref_metrics, got["metrics"]):
        for k in ("reward/mean", "groups/drawn", "groups/kept", "nfe/rollout", "nfe/train", "loss/policy", "clip_frac"):
            assert a[k] == pytest.approx(b[k], abs=1e-5), (k, a[k], b[k])
