"""FSDP2 on a Wan 2.2-style pipeline with two experts (``transformer`` trained with LoRA, ``transformer_2`` frozen,
boundary 0.7): each expert sharded on its own (its blocks, then its root) on 2 CPU processes (gloo) gives the
1-process metrics, weights and exported LoRA. DanceGRPO's per-sample trained steps make the ranks' rows go to
different experts inside a velocity call; the adapter then runs the expert without rows on a weight-0 row
(``WanAdapter._velocity_both_experts``), which the test sees happen. Without it the collectives do not pair (the
2-process run fails; checked). ~10 s. Full fine-tuning of ``transformer`` likewise (its KL reference copy sharded
as a third root; ``-m slow``). Process 1 builds every expert on the meta device and receives its shards from
process 0 (``load_pipeline(meta_transformers=True)``)."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from shared_rl.config import load_train_config
from shared_rl.distributed import exit_distributed, free_port, full_tensors, is_dtensor
from shared_rl.trainer import Trainer
from tests.fsdp_layout import assert_same_records, assert_same_weights

from . import tiny_families as tf

METRICS = ("reward/mean", "groups/kept", "nfe/rollout", "nfe/train", "loss/policy", "loss/kl", "clip_frac",
           "ratio/mean", "grad_norm")


@pytest.fixture(scope="module")
def wan_two_experts_dir(tmp_path_factory):
    from visgen.tasks import video as vtask

    path = tmp_path_factory.mktemp("fsdp2-wan") / "tiny-wan22"
    pipe = tf.build_wan(two_experts=True)
    # boundary 0.7: of the 4 steps (t = 1000, 858, 602, 9) the first two go to the trained expert, the others to the
    # frozen one; every sample DanceGRPO trains has a step of each, so every micro-batch's loss has a gradient, and
    # the ranks' calls (per trained step, in step order, then padding) reach the experts in different orders
    pipe.register_to_config(boundary_ratio=0.7)
    pipe.save_pretrained(path, safe_serialization=True)
    (path / "grove.json").write_text(json.dumps({"num_frames": 5, "resolution": 16, "max_sequence_length": 8,
                                                 "fps": 4}))
    vtask.write_prompt_files(path)
    return path


def _config(path, strategy, mode="lora"):
    return load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1, "logging": {"progress": False},
        "eval": {"every": 0, "at_start": False}, "checkpoint": {"every": 0}, "distributed": {"strategy": strategy},
        "rollout": {"groups_per_iteration": 3, "group_size": 2, "groups_per_call": 1},
        "advantage": {"weights": {"video_shapes": 0.0}},
        "loss": {"clip_low": 1e-3, "kl_coef": 0.05},
        "optim": {"lr": 2e-2, "minibatches_per_epoch": 2, "micro_batch_size": 2},
        "visgen": {"model": str(path), "task": "file", "train_prompts": str(path / "video_shapes_train.jsonl"),
                   "eval_prompts": str(path / "video_shapes_eval.jsonl"), "num_inference_steps": 4,
                   "num_threads": 1, "lora": {"rank": 2, "alpha": 4}, "kernel": "dance", "train_mode": mode,
                   "method": {"name": "dance_grpo", "train_fraction": 0.5},
                   "rewards": [{"name": "video_motion"}, {"name": "video_shapes"}],
                   "eval": {"max_prompts": 1, "samples_per_prompt": 1, "grid_prompts": 0}}})


def _worker(rank, world, port, path, run_dir, out, mode):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tr = Trainer(_config(path, "fsdp2", mode), run_dir, log=lambda *_: None)
    pipe = tr.domain.pipe
    assert tr.fsdp.from_rank0  # process 1 built both experts (and the reference copy) on the meta device
    roots = [m for m in tr.fsdp.modules if type(m).__name__.endswith("WanTransformer3DModel")]
    reference = [tr.domain.policy.reference_copy] if mode == "full" else []  # full tuning's KL reference copy
    assert roots == [pipe.transformer, *reference, pipe.transformer_2]  # each its own root, after its blocks
    assert all(is_dtensor(p) for e in roots for p in e.parameters())
    tr.fit()
    torch.save({"state": full_tensors(tr.domain.state_dict()), "idle": tr.domain.adapter.idle_expert_calls,
                "padded_velocity": tr.domain.rollouts.forward_pad.padded}, f"{out}.{rank}")
    exit_distributed(0)


@pytest.mark.parametrize("mode", ["lora", pytest.param("full", marks=pytest.mark.slow)])
def test_fsdp2_wan_two_experts_match_one(tmp_path, wan_two_experts_dir, mode):
    """LoRA on ``transformer``, or full fine-tuning of it (every weight trained; the frozen KL reference copy and
    the frozen ``transformer_2`` sharded too)."""
    torch.set_num_threads(1)
    single = Trainer(_config(wan_two_experts_dir, "replicate", mode), tmp_path / "one", log=lambda *_: None)
    single.fit()
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "shared_rl.trainer", "visgen.domain", "peft", "diffusers"])
    mp.start_processes(_worker, args=(2, free_port(), wan_two_experts_dir, tmp_path / "two", str(tmp_path / "two.pt"),
                                      mode), nprocs=2, join=True, start_method="forkserver")
    got = [torch.load(tmp_path / f"two.pt.{r}", weights_only=True) for r in range(2)]
    assert got[0]["idle"] + got[1]["idle"] > 0  # some velocity call had rows for one expert only
    assert_same_weights(single.domain.state_dict(), [g["state"] for g in got])
    (a,) = assert_same_records(tmp_path / "one", tmp_path / "two", METRICS, 8)
    assert a["loss/kl"] > 0
    if mode == "full":  # every weight of the trained expert moved; final/transformer is its diffusers layout
        trained = [n for n, p in single.domain.policy.transformer.named_parameters() if p.requires_grad]
        assert trained and not any("lora_" in n for n in trained)
        f1, f2 = (load_file(str(tmp_path / run / "final" / "transformer" / "diffusion_pytorch_model.safetensors"))
                  for run in ("one", "two"))
        assert f1 and f1.keys() == f2.keys()
        assert all(torch.allclose(f1[k], f2[k], atol=1e-5, rtol=1e-4) for k in f1)
        from diffusers import WanTransformer3DModel

        loaded = WanTransformer3DModel.from_pretrained(tmp_path / "two" / "final" / "transformer")
        assert all(torch.equal(v, f2[k]) for k, v in loaded.state_dict().items())
        return
    a1, a2 = (load_file(str(tmp_path / run / "final" / "pytorch_lora_weights.safetensors")) for run in ("one", "two"))
    assert a1 and a1.keys() == a2.keys()
    assert all(torch.allclose(a1[k], a2[k], atol=1e-5, rtol=1e-4) for k in a1)
