"""The FSDP2 recipes of docs/scaling.md, parsed as shipped and run at tiny size with their own ``distributed``
settings:

- ``configs/visgen/flux_dev_full_fsdp2.yaml`` (FLUX.1-dev full fine-tuning on 8 GPUs): its settings fit 8 processes
  (and the preflight's checks), and the recipe with a tiny ``FluxPipeline`` (one double and one single block) runs
  one iteration on 2 gloo processes with its own sharding, bf16 mixed precision, full fine-tuning, gradient
  checkpointing and the sharded reference copy; process 1 never loads the transformer's weights; the sharded
  checkpoint and a ``final/transformer`` that loads as ``FluxTransformer2DModel`` are written.
- ``configs/visgen/wan22_a14b_hsdp.yaml`` (Wan 2.2 A14B on 2 nodes x 8 GPUs, HSDP): its settings fit 16 processes,
  and the recipe with a tiny two-expert ``WanPipeline`` runs one iteration through the CLI on two ``torchrun``
  "nodes" of 2 CPU processes each on localhost (a 2 x 2 replicate x shard mesh, both experts sharded), writing its
  sharded checkpoint and the exported LoRA.

Only the model, the data sizes, the rewards (a CPU reward instead of HPS / VideoAlign) and the device are replaced.
Both runs are ``slow`` (~30 s / ~60 s on 2 busy cores); the settings checks are fast."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from shared_rl.config import apply_overrides, load_train_config, load_yaml
from shared_rl.distributed import exit_distributed, free_port, is_dtensor

ROOT = Path(__file__).resolve().parents[2]
FLUX = ROOT / "configs/visgen/flux_dev_full_fsdp2.yaml"
WAN = ROOT / "configs/visgen/wan22_a14b_hsdp.yaml"


@pytest.mark.parametrize("path, world", [(FLUX, 8), (WAN, 16)])
def test_the_recipes_fit_their_launch(path, world):
    """As shipped: FSDP2 settings valid for the launch the header names (``check_settings`` for that many
    processes on GPUs), a rollout chunk for every process, and what FSDP2 refuses from the config alone (EMA, old
    copies, ...) absent."""
    from shared_rl.sharding import check_settings
    from visgen.fsdp import refuse_config

    cfg = load_train_config(load_yaml(path))
    assert cfg.distributed.strategy == "fsdp2"
    check_settings(cfg, world, torch.device("cuda"))
    refuse_config(cfg.domain_config)
    r = cfg.rollout
    assert -(-r.groups_per_iteration // r.groups_per_call) >= world  # setup_fsdp's chunk check
    if path == WAN:
        assert cfg.distributed.replicate == 2 and world // cfg.distributed.replicate == 8  # 8-way within a node


def _tiny(cfg_path: Path, overrides: list[str]):
    return load_train_config(apply_overrides(load_yaml(cfg_path), overrides))


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    from .conftest import PROMPTS, build_flux, ready

    path = tmp_path_factory.mktemp("recipe-flux") / "flux"
    ready(build_flux()).save_pretrained(path)
    (path / "train.txt").write_text("\n".join(PROMPTS * 2) + "\n")
    (path / "eval.txt").write_text(PROMPTS[0] + "\n")
    return path


def _flux_overrides(path: Path) -> list[str]:
    return [f"visgen.model={path}", "device=cpu", "iterations=1", "eval.every=1", "eval.at_start=false",
            "checkpoint.every=1", "logging.progress=false", "rollout.groups_per_iteration=2", "rollout.group_size=2",
            "optim.minibatches_per_epoch=1", "optim.micro_batch_size=2", f"visgen.train_prompts={path}/train.txt",
            f"visgen.eval_prompts={path}/eval.txt", "visgen.resolution=16", "visgen.max_sequence_length=8",
            "visgen.num_inference_steps=4", "visgen.rollout_micro_batch=0", "visgen.num_threads=1",
            "visgen.rewards=[{name: jpeg_compressibility}]",
            "visgen.eval={samples_per_prompt: 1, batch_size: 2, grid_prompts: 0, num_inference_steps: 4}"]


def _flux_worker(rank, world, port, path, run_dir, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from shared_rl.trainer import Trainer

    tr = Trainer(_tiny(FLUX, _flux_overrides(path)), run_dir, log=lambda *_: None)
    policy = tr.domain.policy
    kinds = {type(m).__name__.removeprefix("FSDP") for m in tr.fsdp.modules}
    info = {"from_rank0": tr.fsdp.from_rank0, "kinds": sorted(kinds),
            "reference_sharded": all(is_dtensor(p) for p in policy.reference_copy.parameters()),
            "trained_sharded": all(is_dtensor(p) for p in policy.parameters()),
            "train_mode": policy.train_mode}
    tr.fit()
    info["records"] = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    torch.save(info, f"{out}.{rank}")
    exit_distributed(0)


@pytest.mark.slow
def test_flux_full_fine_tuning_recipe_runs_sharded_at_tiny_size(tmp_path, tiny_flux):
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "shared_rl.trainer", "visgen.domain", "peft", "diffusers"])
    run = tmp_path / "run"
    mp.start_processes(_flux_worker, args=(2, free_port(), tiny_flux, run, str(tmp_path / "got")), nprocs=2,
                       join=True, start_method="forkserver")
    got = [torch.load(tmp_path / f"got.{r}", weights_only=True) for r in range(2)]
    for g in got:
        assert g["from_rank0"] and g["train_mode"] == "full" and g["trained_sharded"] and g["reference_sharded"]
        assert {"FluxTransformerBlock", "FluxSingleTransformerBlock", "FluxTransformer2DModel"} <= set(g["kinds"])
    train = [r for r in got[0]["records"] if "grad_norm" in r]
    assert len(train) == 1 and all(torch.isfinite(torch.tensor(train[0][k])) for k in ("loss/policy", "grad_norm"))
    assert train[0]["loss/kl"] >= 0 and "eval/jpeg_compressibility" in got[0]["records"][-1]
    from shared_rl.checkpoint import is_sharded_checkpoint

    assert is_sharded_checkpoint(run / "checkpoints" / "step_000001")
    from diffusers import FluxTransformer2DModel

    exported = FluxTransformer2DModel.from_pretrained(run / "final" / "transformer")
    assert sum(p.numel() for p in exported.parameters()) > 0


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    from visgen.tasks import video as vtask

    from . import tiny_families as tf

    path = tmp_path_factory.mktemp("recipe-wan") / "wan22"
    pipe = tf.build_wan(two_experts=True)
    pipe.register_to_config(boundary_ratio=0.7)  # of the 4 steps, two for each expert
    pipe.save_pretrained(path, safe_serialization=True)
    vtask.write_prompt_files(path)
    return path


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "ACCELERATE_MIXED_PRECISION")}
    return dict(env, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")


@pytest.mark.slow
def test_wan22_a14b_hsdp_recipe_runs_on_two_torchrun_nodes_at_tiny_size(tmp_path, tiny_wan):
    run = tmp_path / "run"
    p = tiny_wan
    overrides = [f"visgen.model={p}", "device=cpu", "iterations=1", "eval.every=0", "eval.at_start=false",
                 "checkpoint.every=1", "logging.progress=false", "rollout.groups_per_iteration=4",
                 "rollout.group_size=2", "optim.minibatches_per_epoch=1", "optim.micro_batch_size=2",
                 f"visgen.train_prompts={p}/video_shapes_train.jsonl", f"visgen.eval_prompts={p}/video_shapes_eval.jsonl",
                 "visgen.resolution=16", "visgen.num_frames=5", "visgen.max_sequence_length=8",
                 "visgen.encode_options={}", "visgen.num_inference_steps=4", "visgen.rollout_micro_batch=0",
                 "visgen.num_threads=1", "visgen.lora={rank: 2, alpha: 4, target_modules: [to_q, to_k, to_v, to_out.0]}",
                 "visgen.rewards=[{name: video_motion}]",
                 "visgen.eval={samples_per_prompt: 1, batch_size: 1, grid_prompts: 0, num_inference_steps: 4}"]
    _tiny(WAN, overrides)  # the overridden recipe parses here first (a clear failure rather than 4 workers' logs)
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                               "2", "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port",
                               str(port), "-m", "shared_rl.cli", "train", str(WAN), *overrides, "--out", str(run)],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    outs = [n.communicate(timeout=900)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(o[-3000:] for o in outs)
    log = (run / "train.log").read_text() if (run / "train.log").is_file() else "\n".join(outs)
    assert "a 2 x 2 (replicate x shard) mesh" in log and "loaded by process 0 alone" in log, log[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "grad_norm" in r]
    assert len(train) == 1 and train[0]["loss/kl"] >= 0 and train[0]["grad_norm"] > 0
    from shared_rl.checkpoint import is_sharded_checkpoint

    assert is_sharded_checkpoint(run / "checkpoints" / "step_000001")
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()
