"""FSDP2's mesh and policies as ``distributed.*`` settings, on gloo CPU processes:

- HSDP (``distributed.replicate: 2`` on 4 processes): a 2 x 2 (replicate x shard) mesh, each parameter sharded
  within a pair and replicated across the pairs, gives the 1-process metrics (``grad_norm`` included: a shard held
  by both replica groups is counted once) and weights;
- ``distributed.mixed_precision: bf16`` (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): the
  training forwards see bf16 parameters, the shards, gradients and AdamW state stay fp32, and the run follows the
  fp32 one to bf16 accuracy;
- one-line refusals (exit 2, nothing written): a mesh that does not divide the processes, CPU offload without an
  accelerator, FSDP2 settings under ``replicate``, a launcher ``mixed_precision`` grove would not apply.
"""
import multiprocessing

import pytest
import torch
import torch.multiprocessing as mp

from shared_rl.config import ConfigError, load_train_config
from shared_rl.distributed import exit_distributed, free_port, full_tensors
from shared_rl.sharding import check_settings
from shared_rl.trainer import Trainer
from tests.core.test_fsdp import VARIANTS, _assert_same_records, _config, _init, _records

NAME = "toy_tree"
QUIET = {"log": lambda *_: None}
GROUPS = {4: 5, 2: 3}  # processes -> groups per iteration (one per call): uneven chunks, so some ranks pad


def _cfg(world, strategy, distributed=None):
    rollout = {**VARIANTS[NAME]["rollout"], "groups_per_iteration": GROUPS[world]}
    # smaller steps than the toy's 0.2 for the bf16 run, so that bf16 rounding stays a small perturbation
    optim = {**VARIANTS[NAME]["optim"], "lr": 0.2 if world == 4 else 0.02}
    return _config(NAME, strategy, distributed={"strategy": strategy, **(distributed or {})}, rollout=rollout,
                   optim=optim)


def _spawn(fn, world, *args):
    multiprocessing.set_forkserver_preload(["torch", "shared_rl.trainer"])
    mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=True, start_method="forkserver")


def _worker(rank, world, port, distributed, run_dir, out):
    _init(rank, world, port)
    tr = Trainer(_cfg(world, "fsdp2", distributed), run_dir, **QUIET)
    p = tr.domain.policy.logits
    seen = []
    if distributed.get("mixed_precision") == "bf16":  # the parameter dtype the training forwards compute with
        tr.domain.policy.register_forward_pre_hook(lambda m, args: seen.append(m.logits.dtype))
    tr.fit()
    info = {"state": full_tensors(tr.domain.state_dict()), "mesh": tuple(tr.fsdp.mesh.shape),
            "placements": [str(x) for x in p.placements], "local_rows": p.to_local().shape[0],
            "forward_dtypes": sorted({str(d) for d in seen}), "param_dtype": str(p.dtype),
            "opt_dtypes": sorted({str(v.dtype) for st in tr.optimizer.state.values() for k, v in st.items()
                                  if k != "step"})}
    torch.save(info, f"{out}.{rank}")
    exit_distributed(0)


def _single(tmp_path, world):
    torch.set_num_threads(1)
    tr = Trainer(_cfg(world, "replicate"), tmp_path / "one", **QUIET)
    tr.fit()
    return tmp_path / "one", tr.domain.state_dict()["logits"]


def test_hsdp_two_by_two_matches_one_process(tmp_path):
    run, ref = _single(tmp_path, 4)
    _spawn(_worker, 4, {"replicate": 2}, tmp_path / "hsdp", str(tmp_path / "hsdp.pt"))
    got = [torch.load(tmp_path / f"hsdp.pt.{r}", weights_only=True) for r in range(4)]
    rows = VARIANTS[NAME]["toy"]["num_contexts"]
    for g in got:
        assert g["mesh"] == (2, 2) and g["placements"] == ["R", "S(0)"]  # Replicate(), Shard(0)
        assert g["local_rows"] == rows // 2  # sharded over the pair, not over all four
        assert torch.allclose(g["state"]["logits"], ref, atol=1e-5)
    _assert_same_records(_records(run), _records(tmp_path / "hsdp"), "hsdp")
    # its sharded checkpoint (2-D DTensors: each shard written once, not once per replica group) loads in one process
    one = Trainer(_cfg(4, "replicate"), tmp_path / "hsdp", **QUIET)
    assert one.resume() and one.start_iteration == VARIANTS[NAME]["iterations"]
    assert torch.allclose(one.domain.state_dict()["logits"], ref, atol=1e-5)
    ck = tmp_path / "hsdp" / "checkpoints" / f"step_{one.start_iteration:06d}" / "shards"
    assert sorted(p.name for p in ck.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]


def test_replicate_equal_to_the_processes_is_data_parallel_through_fsdp2(tmp_path):
    """``distributed.replicate`` = the process count: a (2 x 1) mesh, every process holds the whole table (FSDP2
    all-reduces each unit's gradients as backward leaves it: bucketed, overlapped data parallel on torch's engine,
    the alternative to ``replicate``'s flat buffer measured in ``grove bench scale``), and the 1-process run."""
    run, ref = _single(tmp_path, 2)
    _spawn(_worker, 2, {"replicate": 2}, tmp_path / "dp", str(tmp_path / "dp.pt"))
    got = [torch.load(tmp_path / f"dp.pt.{r}", weights_only=True) for r in range(2)]
    for g in got:
        assert g["mesh"] == (2, 1) and g["local_rows"] == VARIANTS[NAME]["toy"]["num_contexts"]  # nothing sharded
        assert torch.allclose(g["state"]["logits"], ref, atol=1e-5)
    _assert_same_records(_records(run), _records(tmp_path / "dp"), "dp")


def test_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_state(tmp_path):
    run, ref = _single(tmp_path, 2)
    _spawn(_worker, 2, {"mixed_precision": "bf16"}, tmp_path / "bf16", str(tmp_path / "bf16.pt"))
    got = torch.load(tmp_path / "bf16.pt.0", weights_only=True)
    assert got["forward_dtypes"] == ["torch.bfloat16"]
    assert got["param_dtype"] == "torch.float32" and got["opt_dtypes"] == ["torch.float32"]
    assert not torch.equal(got["state"]["logits"], ref)  # bf16 forwards: not bitwise the fp32 run ...
    # ... but near it: the weights move by ~0.2, bf16 forwards (8 mantissa bits) leave them ~1e-2 apart
    assert torch.allclose(got["state"]["logits"], ref, atol=3e-2) and ref.abs().max() > 0.15
    one, two = _records(run), _records(tmp_path / "bf16")
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        if "grad_norm" in a:
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)


@pytest.mark.parametrize("settings, world, device, words", [
    ({"strategy": "fsdp2", "replicate": 3}, 4, "cpu", "distributed.replicate=3 does not divide the 4 processes"),
    ({"strategy": "fsdp2", "replicate": 0}, 2, "cpu", "distributed.replicate=0: the number of replica groups"),
    ({"strategy": "fsdp2", "cpu_offload": True}, 2, "cpu", "distributed.cpu_offload: the run is on cpu"),
    ({"strategy": "replicate", "mixed_precision": "bf16"}, 2, "cpu",
     "distributed.mixed_precision: FSDP2 settings, but distributed.strategy is replicate"),
])
def test_bad_layouts_are_refused_in_one_line(settings, world, device, words):
    cfg = load_train_config({"domain": "toy", "distributed": settings})
    with pytest.raises(ConfigError) as err:
        check_settings(cfg, world, torch.device(device))
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    check_settings(load_train_config({"domain": "toy", "distributed": {"strategy": "fsdp2", "replicate": 2}}), 4,
                   torch.device("cpu"))  # a divisor is fine


def test_the_launchers_mixed_precision_is_applied_or_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch` exports from its file
    fsdp2 = {"domain": "toy", "distributed": {"strategy": "fsdp2"}}
    with pytest.raises(ConfigError, match="accelerate mixed_precision: bf16.*distributed.mixed_precision"):
        check_settings(load_train_config(fsdp2), 2, torch.device("cpu"))
    check_settings(load_train_config({**fsdp2, "distributed": {"strategy": "fsdp2", "mixed_precision": "bf16"}}), 2,
                   torch.device("cpu"))


def test_cli_refuses_before_writing_and_one_process_ignores_the_mesh(tmp_path, capsys):
    import yaml

    from shared_rl.cli import main

    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({"domain": "toy", "iterations": 1, "logging": {"progress": False}}))
    out = tmp_path / "run"
    assert main(["train", str(config), "--out", str(out), "distributed.cpu_offload=true"]) == 2  # under replicate
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "distributed.cpu_offload: FSDP2 settings" in err[0]
    assert not out.exists()
    # one process shards nothing: an HSDP run's config still evaluates or resumes there (grove eval, 2 -> 1)
    hsdp = load_train_config({"domain": "toy", "distributed": {"strategy": "fsdp2", "replicate": 2,
                                                               "cpu_offload": True}})
    check_settings(hsdp, 1, torch.device("cpu"))
