"""Layout invariance on the real domains: 2 CPU processes (gloo) give the same rewards, advantages and update as
1 process for the same global batch (visgen on the tiny SD3 asset, the LLM path on the tiny Llama asset)."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from shared_rl.config import load_train_config
from shared_rl.distributed import exit_distributed, free_port
from shared_rl.trainer import Trainer

COMMON = {"seed": 3, "iterations": 2, "logging": {"progress": False}, "eval": {"at_start": False},
          "rollout": {"groups_per_iteration": 2, "group_size": 4, "groups_per_call": 1},
          "optim": {"lr": 1e-3, "minibatches_per_epoch": 2, "micro_batch_size": 2}}
CONFIGS = {
    "visgen": {**COMMON, "domain": "visgen", "loss": {"clip_low": 1e-3},
               "visgen": {"num_inference_steps": 4, "method": {"name": "flow_grpo", "train_fraction": 0.5},
                          "lora": {"rank": 4, "alpha": 8}, "num_threads": 1}},
    "llm": {**COMMON, "domain": "llm", "llm": {"max_new_tokens": 4, "num_threads": 1}},
}
KEYS = ("reward/mean", "groups/kept", "nfe/rollout", "loss/policy", "advantage/abs_mean", "ratio/mean")


def _trainable_state(tr):
    return {k: v.clone() for k, v in tr.domain.state_dict().items()}


def _run(name):
    tr = Trainer(load_train_config(CONFIGS[name]), None, log=lambda *_: None)
    metrics = [tr.iteration(it) for it in range(2)]
    return _trainable_state(tr), metrics


def _worker(rank, world, port, name, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    state, metrics = _run(name)
    if rank == 0:
        torch.save({"state": state, "metrics": [{k: float(m[k]) for k in KEYS if k in m} for m in metrics]}, out)
    exit_distributed(0)  # barrier + destroy + os._exit: gloo can SIGABRT at interpreter teardown


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_processes_match_one(tmp_path, name):
    torch.set_num_threads(1)
    state, metrics = _run(name)
    out = tmp_path / "two.pt"
    mp.spawn(_worker, args=(2, free_port(), name, str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)
    for k, v in state.items():
        assert torch.allclose(v, got["state"][k], atol=1e-5, rtol=1e-4), k
    for a, b in zip(metrics, got["metrics"]):
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (k, a[k], b[k])
