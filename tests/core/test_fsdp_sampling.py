"""FSDP2's gather for sampling (``DomainBase.fsdp_sampling_modules``, ``shared_rl.sharding.gather_for_sampling``):
``FSDPShards.gathered()`` — the rollouts, evaluation and ``on_train_end`` — all-gathers only the units of the models
sampling runs, so a frozen KL reference copy stays in its shards (one whole model per process at the rollout peak,
not two). The end-to-end check (2 gloo processes, the LLM with full fine-tuning and ``llm.keep_reference``: the
reference stays sharded during every rollout and the run equals one process within 1e-5) is
``tests/core/test_fsdp.py``'s ``llm_full`` case; here the mechanism on plain modules (which units are gathered, the
default of every unit, a left-out unit's forward refused) and the units the visgen and robotics domains name.
"""
import types

import pytest
import torch
import torch.multiprocessing as mp

from shared_rl.distributed import Dist, FSDPShards, exit_distributed, free_port, is_dtensor
from shared_rl.sharding import gather_for_sampling
from tests.core.test_fsdp import _init


def _models():
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    return policy, reference


def _state(policy, reference):
    """(every policy parameter gathered (plain), every reference parameter a shard smaller than the tensor)."""
    return (not any(is_dtensor(p) for p in policy.parameters()),
            all(is_dtensor(p) and p.to_local().numel() < p.numel() for p in reference.parameters()))


def _worker(rank, world, port, out):
    _init(rank, world, port)
    d = Dist()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    got = {}
    # the default (the hook returns None): every unit gathered, the reference's too — as before the hook
    policy, reference = _models()
    shards = FSDPShards([policy[0], policy, reference[0], reference], d, torch.device("cpu"))
    gather_for_sampling(shards, None)
    with shards.gathered():
        got["default"] = (not any(is_dtensor(p) for p in [*policy.parameters(), *reference.parameters()]),
                          reference(x).detach())
    # the policy named (a module holding units): its units gathered, the reference's left in their shards
    policy, reference = _models()
    shards = FSDPShards([policy[0], policy, reference[0], reference], d, torch.device("cpu"))
    gather_for_sampling(shards, [policy])
    got["units"] = [shards.modules.index(u) for u in shards.sampling]
    with shards.gathered():
        got["inside"] = _state(policy, reference)
        got["policy_out"] = policy(x).detach()
        try:  # the reference's forward would all-gather on this process alone: refused, naming the hook
            reference(x)
            got["refused"] = ""
        except RuntimeError as e:
            got["refused"] = str(e)
    got["after"] = (all(is_dtensor(p) for p in policy.parameters()), _state(policy, reference)[1])
    got["train_out"] = reference(x).detach()  # outside gathered(): a paired (collective) forward, as in log_probs
    # a module inside a unit (the root's first layer is its own unit; the Tanh lies in the root's): its unit gathered
    policy, reference = _models()
    shards = FSDPShards([policy[0], policy, reference], d, torch.device("cpu"))
    gather_for_sampling(shards, [policy[1]])
    got["holding"] = [shards.modules.index(u) for u in shards.sampling]
    torch.save(got, f"{out}.{rank}")
    exit_distributed(0)


def test_gathered_all_gathers_only_the_sampling_units(tmp_path):
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "shared_rl.sharding"])
    out = str(tmp_path / "got.pt")
    mp.start_processes(_worker, args=(2, free_port(), out), nprocs=2, join=True, start_method="forkserver")
    policy, reference = _models()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for rank in range(2):
        got = torch.load(f"{out}.{rank}", weights_only=True)
        assert got["default"][0] and torch.allclose(got["default"][1], reference(x), atol=1e-6)
        assert got["units"] == [0, 1]
        assert got["inside"] == (True, True), got["inside"]
        assert torch.allclose(got["policy_out"], policy(x), atol=1e-6)
        assert "fsdp_sampling_modules" in got["refused"], got["refused"]
        assert got["after"] == (True, True)  # both back in their shards
        assert torch.allclose(got["train_out"], reference(x), atol=1e-6)
        assert got["holding"] == [1]  # the root (which holds the Tanh), not the first layer's unit nor the reference


def _selected(domain):
    """``gather_for_sampling``'s choice among the domain's units (on one process: plain modules)."""
    units = list(domain.fsdp_modules())
    shards = types.SimpleNamespace(modules=units, sampling=list(units))
    gather_for_sampling(shards, domain.fsdp_sampling_modules())
    return units, {id(u) for u in shards.sampling}


# builds a tiny SD3 pipeline and its domain (~10 s)
def test_visgen_gathers_the_transformer_not_its_reference_copy(tmp_path):
    from shared_rl.trainer import Trainer
    from tests.visgen.test_fsdp2_visgen import FULL, _config
    from visgen import tiny
    from visgen.tasks.shapes import vocabulary

    path = tmp_path / "tiny-sd3"
    tiny.save_pipeline(tiny.build_pipeline(vocabulary(), seed=0, sample_size=16, vae_channels=(8, 16), num_layers=2,
                                           num_heads=2, head_dim=8, text_hidden=16), path)
    torch.set_num_threads(1)
    domain = Trainer(_config(str(path), "fsdp2", FULL), None, log=lambda *_: None).domain
    units, chosen = _selected(domain)
    policy = {id(m) for m in domain.policy.transformer.modules()}
    copy = {id(m) for m in domain.policy.reference_copy.modules()}
    assert chosen == {id(u) for u in units if id(u) in policy} and len(chosen) == 3  # 2 blocks + the root
    assert not chosen & copy and any(id(u) in copy for u in units)


def test_robotics_gathers_the_policy_not_its_kl_reference():
    from shared_rl.trainer import Trainer
    from tests.robotics.test_fsdp2_robotics import _config

    domain = Trainer(_config("fsdp2"), None, log=lambda *_: None).domain
    try:
        units, chosen = _selected(domain)
        policy = {id(m) for m in domain.policy.modules()}
        assert chosen == {id(u) for u in units if id(u) in policy} and chosen
        assert len(units) == 2 * len(chosen)  # the reference copy's units: sharded, not gathered
    finally:
        domain.close()
