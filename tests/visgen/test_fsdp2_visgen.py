"""FSDP2 (``distributed.strategy: fsdp2``) on the visgen domain: 2 CPU processes (gloo) with a tiny SD3 transformer
sharded (its two ``JointTransformerBlock``s, then the root) give the 1-process metrics, weights, checkpoint and
exported ``final/`` LoRA; the FSDP2 checkpoint resumes in one process; the refused settings stop with one line.

The run makes the ranks' forwards uneven on purpose: 3 groups over 2 processes (one rank pads whole micro-batches,
``Trainer.padding_forwards``) and DanceGRPO's per-sample random trained steps with KL (inside a ``log_probs`` call
the ranks run different numbers of velocity calls, padded by ``visgen.fsdp.ForwardPadding``). A forward that is not
paired hangs the collective (the spawn join then times out) or diverges from the 1-process numbers.
"""
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from shared_rl.checkpoint import export_full_checkpoint, is_sharded_checkpoint
from shared_rl.config import ConfigError, load_train_config
from shared_rl.distributed import exit_distributed, free_port, full_tensors, is_dtensor
from shared_rl.trainer import Trainer
from tests.fsdp_layout import assert_same_records, assert_same_weights

METRICS = ("reward/mean", "groups/kept", "nfe/rollout", "nfe/train", "loss/policy", "loss/kl", "clip_frac",
           "ratio/mean", "grad_norm", "eval/score")
ITERATIONS = 2


@pytest.fixture(scope="module")
def sd3_two_blocks(tmp_path_factory):
    """The visgen tests' tiny SD3 (shapes vocabulary, 16x16) with two transformer blocks, so that blocks and root
    are separate FSDP2 units."""
    from visgen import tiny
    from visgen.tasks.shapes import vocabulary

    path = tmp_path_factory.mktemp("fsdp2") / "tiny-sd3"
    pipe = tiny.build_pipeline(vocabulary(), seed=0, sample_size=16, vae_channels=(8, 16), num_layers=2, num_heads=2,
                               head_dim=8, text_hidden=16)
    tiny.save_pipeline(pipe, path)
    return str(path)


def _data(model, strategy, **visgen):
    return {
        "domain": "visgen", "seed": 2, "iterations": ITERATIONS, "logging": {"progress": False},
        "eval": {"every": ITERATIONS, "at_start": False}, "checkpoint": {"every": 1},
        "distributed": {"strategy": strategy},
        "rollout": {"groups_per_iteration": 3, "group_size": 2, "groups_per_call": 1},
        "advantage": {"weights": {"shapes_strict": 0.0}},
        "loss": {"clip_low": 1e-3, "kl_coef": 0.05},
        "optim": {"lr": 2e-2, "minibatches_per_epoch": 2, "micro_batch_size": 2},
        "visgen": {"model": model, "num_inference_steps": 4, "num_threads": 1, "method": {"name": "dance_grpo"},
                   "lora": {"rank": 2, "alpha": 4},
                   "eval": {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}, **visgen},
    }


def _config(model, strategy, visgen=None, **top):
    data = _data(model, strategy, **(visgen or {}))
    data.update(top)
    return load_train_config(data)


def _spawn(fn, *args):
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "shared_rl.trainer", "visgen.domain", "peft", "diffusers"])
    mp.start_processes(fn, args=(2, free_port(), *args), nprocs=2, join=True, start_method="forkserver")


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


def _fsdp_worker(rank, world, port, model, run_dir, out, visgen=None, top=None):
    _init(rank, world, port)
    quiet = {"log": lambda *_: None}
    tr = Trainer(_config(model, "fsdp2", visgen, **(top or {})), run_dir, **quiet)
    # process 0 alone loaded the transformer (and the full-tuning reference copy); process 1 built it on the meta
    # device from its config (no weight file read) and received its shards
    assert tr.fsdp.from_rank0 and not any(t.is_meta for t in tr.domain.policy.transformer.parameters())
    blocks = [m for m in tr.fsdp.modules if type(m).__name__.endswith("JointTransformerBlock")]  # FSDP2 renames FSDP<cls>
    policy = tr.domain.policy
    roots = [policy.transformer] + ([policy.reference_copy] if policy.reference_copy is not None else [])
    # blocks then root, per transformer (full tuning: the reference copy is sharded too, never whole per process)
    assert len(blocks) == 2 * len(roots) and [tr.fsdp.modules[3 * i + 2] for i in range(len(roots))] == roots
    assert tr.domain.parameters() and all(is_dtensor(p) for p in tr.domain.parameters())
    local, full = tr.fsdp.local_parameter_bytes()
    assert local < 0.6 * full  # each process holds about half of the transformer (frozen base included)
    tr.fit()
    state = full_tensors(tr.domain.state_dict())
    torch.save({"state": state, "padding_forwards": tr.padding_forwards,
                "padded_velocity": tr.domain.rollouts.forward_pad.padded}, f"{out}.{rank}")
    exit_distributed(0)  # barrier + destroy + os._exit: gloo can SIGABRT at interpreter teardown


def test_fsdp2_two_processes_match_one_and_resume_in_one(tmp_path, sd3_two_blocks):
    torch.set_num_threads(1)
    model = sd3_two_blocks
    single = Trainer(_config(model, "replicate"), tmp_path / "one", log=lambda *_: None)
    single.fit()
    out = tmp_path / "two.pt"
    _spawn(_fsdp_worker, model, tmp_path / "two", str(out))
    got = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    # both hazards were exercised: whole padded micro-batches and padded velocity calls inside log_probs
    assert got[0]["padding_forwards"] + got[1]["padding_forwards"] > 0
    assert got[0]["padded_velocity"] + got[1]["padded_velocity"] > 0
    live = single.domain.state_dict()
    assert_same_weights(live, [g["state"] for g in got])
    one = assert_same_records(tmp_path / "one", tmp_path / "two", METRICS, 15, last="eval/score")
    assert max(abs(r.get("loss/kl", 0.0)) for r in one) > 0, "the reference pass never ran"
    # the FSDP2 checkpoint is sharded (each process wrote its own shards); exported, it holds the 1-process values
    last = f"checkpoints/step_{ITERATIONS:06d}"
    assert is_sharded_checkpoint(tmp_path / "two" / last)
    exported = export_full_checkpoint(tmp_path / "two" / last, tmp_path / "export" / "checkpoints")
    w1, w2 = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "one" / last, exported))
    assert w1.keys() == w2.keys() and all(torch.allclose(w1[k], w2[k], atol=1e-5, rtol=1e-4) for k in w1)
    # final/: the diffusers LoRA layout, gathered and written once; it loads into a stock pipeline
    a1, a2 = (load_file(str(tmp_path / run / "final" / "pytorch_lora_weights.safetensors")) for run in ("one", "two"))
    assert a1 and a1.keys() == a2.keys()
    for k in a1:
        assert not is_dtensor(a2[k]) and torch.allclose(a1[k], a2[k], atol=1e-5, rtol=1e-4), k
    from peft.utils import get_peft_model_state_dict

    from visgen.domain import load_pipeline

    pipe = load_pipeline(model, torch.float32)[0]
    pipe.load_lora_weights(str(tmp_path / "two" / "final"), adapter_name="grove")
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="grove")
    assert len(loaded) == len(a2) and all(torch.equal(v, a2[f"transformer.{k}"]) for k, v in loaded.items())
    # resume: the FSDP2 run's (sharded) checkpoint at step 1 continues in one process to the uninterrupted result
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed_dir)
    shutil.rmtree(resumed_dir / last)
    tr = Trainer(_config(model, "replicate"), resumed_dir, log=lambda *_: None)
    tr.fit(resume=True)
    assert tr.start_iteration == 1
    for k, v in tr.domain.state_dict().items():
        assert torch.allclose(v, live[k], atol=1e-5, rtol=1e-4), k


REFUSED = [  # (visgen settings, loss settings, the words of the one-line error)
    ({"ema": {"enabled": True}}, None, "visgen.ema.enabled"),
    ({"objective": {"name": "nft"}, "method": None}, {}, "visgen.objective 'nft'"),
    ({"objective": {"name": "dpo"}, "method": None}, {}, "visgen.objective 'dpo'"),
    ({"objective": {"name": "flow_dppo"}}, None, "visgen.objective 'flow_dppo'"),
]


@pytest.mark.parametrize("visgen, loss, words", REFUSED, ids=[r[2].split()[-1] for r in REFUSED])
def test_fsdp2_refuses_what_it_cannot_shard_with_one_line(sd3_two_blocks, visgen, loss, words):
    """Checked in ``fsdp_modules()`` before anything is sharded (also with one process, so a config is refused
    the same way wherever it is launched)."""
    data = _data(sd3_two_blocks, "fsdp2", **visgen)
    data["visgen"] = {k: v for k, v in data["visgen"].items() if v is not None}
    if loss is not None:
        data["loss"] = loss
    if visgen.get("objective", {}).get("name") == "dpo":  # its pairs need whole groups in one call
        data["optim"] = {"minibatches_per_epoch": 1, "micro_batch_size": 0}
    with pytest.raises(ConfigError) as err:
        Trainer(load_train_config(data), None, log=lambda *_: None)
    msg = str(err.value)
    assert words in msg and "distributed.strategy: fsdp2" in msg and "\n" not in msg, msg
    # the same settings under replicate are accepted (the refusal is FSDP2's, not a config error)
    data["distributed"] = {"strategy": "replicate"}
    Trainer(load_train_config(data), None, log=lambda *_: None)


FULL = {"train_mode": "full", "gradient_checkpointing": True}  # full_reference (default): a frozen, sharded copy


def test_fsdp2_full_fine_tuning_matches_one(tmp_path, sd3_two_blocks):
    """Every transformer weight trained and sharded, with gradient checkpointing (each block's forward re-run in
    backward, its shards all-gathered again) and KL to the sharded reference copy; ``final/transformer`` is gathered
    into the diffusers layout and loads as a stock ``SD3Transformer2DModel``."""
    torch.set_num_threads(1)
    model, top = sd3_two_blocks, {"iterations": 1, "optim": {"lr": 1e-3, "minibatches_per_epoch": 2,
                                                             "micro_batch_size": 2}}
    single = Trainer(_config(model, "replicate", FULL, **top), tmp_path / "one", log=lambda *_: None)
    assert single.domain.pipe.transformer.gradient_checkpointing
    single.fit()
    out = tmp_path / "two.pt"
    _spawn(_fsdp_worker, model, tmp_path / "two", str(out), FULL, top)
    got = torch.load(f"{out}.0", weights_only=True)
    live = single.domain.state_dict()
    assert len(live) > 20
    assert_same_weights(live, [got["state"]])
    (a,) = assert_same_records(tmp_path / "one", tmp_path / "two", METRICS, 8)
    assert a["loss/kl"] > 0
    from diffusers import SD3Transformer2DModel

    exported = SD3Transformer2DModel.from_pretrained(str(tmp_path / "two" / "final" / "transformer"))
    reference = SD3Transformer2DModel.from_pretrained(str(tmp_path / "one" / "final" / "transformer"))
    theirs = dict(reference.named_parameters())
    for k, v in exported.named_parameters():
        assert torch.allclose(v, theirs[k], atol=1e-5, rtol=1e-4), k
