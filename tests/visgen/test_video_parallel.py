"""Context (sequence) parallelism through diffusers' ``_cp_plan``: two CPU processes on gloo (Ulysses degree 2) run
the Wan transformer and its adapter velocity (both CFG branches) with the token sequence split between them and get
the single-process result; the settings are validated."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from shared_rl.distributed import free_port
from shared_rl.errors import ConfigError

from . import tiny_families as tf


def _inputs():
    pipe = tf.build_wan()
    adapter = __import__("visgen.pipelines", fromlist=["as_adapter"]).as_adapter(pipe)
    cond = adapter.encode_prompts(list(tf.PROMPTS), guidance_scale=3.0, **tf.WAN_CALL)
    x = adapter.prepare_latents(2, cond, torch.Generator().manual_seed(0))
    t = torch.tensor([900.0, 400.0])
    return pipe, adapter, cond, x, t


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from visgen.pipelines.memory import enable_context_parallel

        pipe, adapter, cond, x, t = _inputs()
        enable_context_parallel(pipe.transformer, ulysses_degree=world)
        with torch.no_grad():
            v = adapter.velocity(x, t, cond)
        torch.save(v, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_ulysses_context_parallel_on_gloo_equals_one_process(tmp_path):
    torch.set_num_threads(1)
    _, adapter, cond, x, t = _inputs()
    with torch.no_grad():
        expected = adapter.velocity(x, t, cond)
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-6), (got - expected).abs().max()


def test_context_parallel_needs_a_plan_and_a_process_group():
    from visgen.pipelines.memory import enable_context_parallel

    pipe = tf.build_wan()
    with pytest.raises(ConfigError, match="torch.distributed"):
        enable_context_parallel(pipe.transformer, ulysses_degree=2)
    with pytest.raises(ConfigError, match="no _cp_plan"):
        enable_context_parallel(torch.nn.Linear(2, 2), ulysses_degree=2)
