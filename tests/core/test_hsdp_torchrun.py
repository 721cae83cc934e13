"""HSDP across two "nodes" on one machine, launched the way a cluster launches it: two ``torchrun --nnodes 2
--nproc_per_node 2`` commands on localhost (``--node_rank`` 0 and 1, static rendezvous at 127.0.0.1), each starting
``grove train`` on the toy config with ``distributed.strategy=fsdp2 distributed.replicate=2`` — a 2 x 2 (replicate x
shard) mesh whose shard groups are the two nodes' process pairs. The run's metric records, its sharded checkpoint
(resumed in one process) and its final weights equal one process's within 1e-5. What this adds to
``test_fsdp_policies.py``'s 2 x 2 mesh (spawned processes in one launcher): the CLI path end to end, ranks that
torchrun assigns per node (``RANK`` = node_rank x 2 + ``LOCAL_RANK``), and two launchers meeting at one rendezvous.
``slow`` (~30-60 s: five Python processes start torch)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared_rl.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["configs/toy.yaml", "iterations=3", "rollout.groups_per_call=1", "checkpoint.every=1", "eval.every=0",
          "logging.progress=false"]
KEYS = ("reward/mean", "loss/policy", "grad_norm", "clip_frac", "ratio/mean")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _env() -> dict:
    # one thread per process (2 cores), no GPU, and no launcher variables inherited from the test's own process
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "ACCELERATE_MIXED_PRECISION")}
    return dict(env, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))


@pytest.mark.slow
def test_two_torchrun_nodes_on_localhost_give_the_one_process_run(tmp_path):
    one, two = tmp_path / "one", tmp_path / "hsdp"
    subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", *COMMON, "--out", str(one)], cwd=ROOT,
                   env=_env(), check=True, capture_output=True, timeout=300)
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                               "2", "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port",
                               str(port), "-m", "shared_rl.cli", "train", *COMMON, "distributed.strategy=fsdp2",
                               "distributed.replicate=2", "--out", str(two)],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    outs = [n.communicate(timeout=600)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(o[-3000:] for o in outs)
    # the trainer's own log line: the mesh it built (2 replica groups of 2 shards each)
    log = (two / "train.log").read_text() if (two / "train.log").is_file() else "\n".join(outs)
    assert "a 2 x 2 (replicate x shard) mesh" in log, log[-2000:]
    a, b = _records(one), _records(two)
    assert len(a) == len(b) and sum("grad_norm" in r for r in a) == 3  # the 3 training steps (and evaluations)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys() or ra.keys() - rb.keys() <= {"time/eval"}, (ra.keys(), rb.keys())
        for k in KEYS:
            if k in ra:
                assert abs(ra[k] - rb[k]) <= 1e-5, (ra["step"], k, ra[k], rb[k])
    from shared_rl.checkpoint import is_sharded_checkpoint

    last = two / "checkpoints" / "step_000003"
    assert is_sharded_checkpoint(last)
    # the sharded checkpoint of step 2 resumes in one process to the uninterrupted weights
    import shutil

    import torch
    from safetensors.torch import load_file

    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000003")
    shutil.rmtree(resumed / "final", ignore_errors=True)
    subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", "--resume", str(resumed)], cwd=ROOT, env=_env(),
                   check=True, capture_output=True, timeout=300)
    finals = [load_file(str(run / "final" / "model.safetensors")) for run in (one, two, resumed)]
    for k, v in finals[0].items():
        for other in finals[1:]:
            assert torch.allclose(v, other[k], atol=1e-5, rtol=1e-4), k
