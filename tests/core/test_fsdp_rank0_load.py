"""Loading without a full model per process (``shared_rl.sharding.meta_unless_rank0`` + ``shard_from_rank0``): on 2
gloo processes, process 1 builds the model on the meta device (no weights), process 0 loads it, and after
``fully_shard`` torch's ``set_model_state_dict(..., broadcast_from_rank0=True)`` gives each process its shards. For a
tiny Llama (the LLM domain's units: decoder layers, then the model) and the tiny VLA (its units): every local shard,
every buffer (the rotary frequencies, which no state dict holds, included) and a training step's loss and local
gradient shards equal the plain path's (every process loads the whole model, then shards) exactly. The Llama case is
``slow`` (~25 s), the tiny VLA's ~6 s."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from shared_rl.distributed import Dist, exit_distributed, free_port, is_dtensor
from shared_rl.sharding import meta_unless_rank0, shard_from_rank0


def _llama(path, rank, rank0_only):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not rank0_only:
        return AutoModelForCausalLM.from_pretrained(path)
    with meta_unless_rank0(rank):
        if rank == 0:
            return AutoModelForCausalLM.from_pretrained(path)
        return AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(path))


def _llama_units(model):
    return [m for m in model.modules() if type(m).__name__ in set(model._no_split_modules)] + [model]


def _llama_step(model):
    ids = torch.arange(12).view(2, 6) % 50
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def _vla(_path, rank, rank0_only):
    from robotics.policies.vla import TinyVLA, VLAConfig

    cfg = VLAConfig(cnn_channels=[8, 8, 8, 8], feature_dim=32, text_dim=8, hidden=64)
    torch.manual_seed(0)
    if not rank0_only:
        return TinyVLA(cfg)
    with meta_unless_rank0(rank):
        return TinyVLA(cfg)


def _vla_units(policy):
    from robotics.fsdp import _units

    return _units(policy)


def _vla_step(policy):
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 255, (3, 64, 64, 3), generator=g, dtype=torch.uint8)
    h = policy.encode(images, torch.randn(3, 4, generator=g), [[1, 2], [3], [4, 5, 6]])
    x, sigma = torch.randn(3, policy.flow.action_dim, generator=g), torch.rand(3, generator=g)
    loss = policy.flow.velocity_at(h, x, sigma).pow(2).mean()
    loss.backward()
    return loss.detach()


def _snapshot(model, loss):
    local = lambda t: (t.to_local() if is_dtensor(t) else t).detach().clone()  # noqa: E731
    return {"params": {n: local(p) for n, p in model.named_parameters()},
            "grads": {n: local(p.grad) for n, p in model.named_parameters() if p.grad is not None},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}, "loss": loss}


def _worker(rank, world, port, kind, path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    d = Dist()
    build, units, step = {"llama": (_llama, _llama_units, _llama_step), "vla": (_vla, _vla_units, _vla_step)}[kind]
    got = {}
    for rank0_only in (False, True):
        model = build(path, rank, rank0_only)
        assert any(p.is_meta for p in model.parameters()) == (rank0_only and rank == 1)
        shard_from_rank0(units(model), d, torch.device("cpu"), roots=[model])
        still = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        assert not still, (rank0_only, still)
        got[rank0_only] = _snapshot(model, step(model))
    torch.save(got, f"{out}.{rank}")
    exit_distributed(0)


def _run(tmp_path, kind, path=None):
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "shared_rl.sharding"] + (["transformers"] if path else
                                                                              ["robotics.policies.vla"]))
    mp.start_processes(_worker, args=(2, free_port(), kind, path, str(tmp_path / "got")), nprocs=2, join=True,
                       start_method="forkserver")
    for rank in range(2):
        got = torch.load(tmp_path / f"got.{rank}", weights_only=True)
        plain, rank0 = got[False], got[True]
        assert torch.equal(plain["loss"], rank0["loss"])
        for part in ("params", "grads", "buffers"):
            assert plain[part].keys() == rank0[part].keys() and plain[part], part
            for k, v in plain[part].items():
                assert torch.equal(v, rank0[part][k]), (rank, part, k)


@pytest.mark.slow  # ~25 s: transformers in each process
def test_rank0_load_of_a_llama_equals_every_process_loading(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    _run(tmp_path, "llama", str(tmp_path / "llama"))


def test_rank0_load_of_the_tiny_vla_equals_every_process_building(tmp_path):
    _run(tmp_path, "vla")


def _mismatch_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    d = Dist()
    with meta_unless_rank0(rank):
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    if rank == 1:  # a meta skeleton whose loader forgot a dtype the real load sets
        model[1].to(torch.bfloat16)
    try:
        shard_from_rank0([model[0], model[1], model], d, torch.device("cpu"), roots=[model])
        message = ""
    except RuntimeError as exc:
        message = str(exc)
    torch.save(message, f"{out}.{rank}")
    exit_distributed(0)


def test_a_meta_skeleton_unlike_rank0s_model_is_refused_on_every_process(tmp_path):
    """Process 1 built its meta model with another dtype than process 0 loaded: without the check, process 0's
    values would be cast into its shards silently; with it, every process raises (none is left in a collective)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "shared_rl.sharding"])
    mp.start_processes(_mismatch_worker, args=(2, free_port(), str(tmp_path / "msg")), nprocs=2, join=True,
                       start_method="forkserver")
    for rank in range(2):
        message = torch.load(tmp_path / f"msg.{rank}", weights_only=True)
        assert "shapes or dtypes than process 0" in message, (rank, message)
