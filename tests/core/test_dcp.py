"""Sharded checkpoints (``distributed.checkpoint: sharded``, the default under FSDP2 with several processes): every
process writes and reads its own shards through ``torch.distributed.checkpoint``, and a checkpoint written by N
processes resumes on M — 2 -> 1, 1 -> 2, 2 -> 2, 4 -> 1 and 4 -> 2 here, on gloo CPU processes — ending where the
uninterrupted run ends (weights and every metric record within 1e-5). The checksums and the atomic rename are those
of the one-process layout (a missing shard file makes the checkpoint unusable: ``--resume`` says so in one line and
exits 2), and ``export_full_checkpoint`` turns a sharded checkpoint into the one-process layout with the values the
one-process run wrote.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from shared_rl.checkpoint import (SHARDS, is_sharded_checkpoint, list_checkpoints,
                                  verify_checkpoint)
from shared_rl.distributed import Dist, exit_distributed, full_tensors
from shared_rl.trainer import Trainer
from tests.core.test_fsdp import VARIANTS, _assert_same_records, _config, _init, _records, _spawn

NAME = "toy_refill_deferred"  # uneven chunks (padding forwards), refills, deferred log-probs, AdamW moments
QUIET = {"log": lambda *_: None}


def _worker(rank, world, port, tmp, out):
    _init(rank, world, port)
    # a fresh 2-process FSDP2 run: `auto` writes the sharded layout, one shard file per process
    fresh = Trainer(_config(NAME, "fsdp2", iterations=2, checkpoint={"every": 1}), tmp / "two_first", **QUIET)
    fresh.fit()
    if rank == 0:
        shutil.copytree(tmp / "two_first", tmp / "two_from_two")
        shutil.copytree(tmp / "one_first", tmp / "two_from_one")
    Dist().barrier()
    got = {}
    for run in ("two_from_two", "two_from_one"):  # 2 -> 2 and 1 -> 2
        tr = Trainer(_config(NAME, "fsdp2", iterations=4), tmp / run, **QUIET)
        tr.fit(resume=True)
        assert tr.start_iteration == 2
        got[run] = full_tensors(tr.domain.state_dict())["logits"]
    torch.save(got, f"{out}.{rank}")
    exit_distributed(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    torch.set_num_threads(1)
    full = Trainer(_config(NAME, "replicate", iterations=4, checkpoint={"every": 1, "keep_last": 4}), tmp / "full",
                   **QUIET)
    full.fit()
    # one process writing the sharded layout (no process group: DCP in one process)
    Trainer(_config(NAME, "replicate", iterations=2, checkpoint={"every": 1}, distributed={"checkpoint": "sharded"}),
            tmp / "one_first", **QUIET).fit()
    _spawn(_worker, tmp, str(tmp / "out.pt"))
    return tmp, full.domain.state_dict()["logits"], [torch.load(tmp / f"out.pt.{r}", weights_only=True)
                                                     for r in range(2)]


def test_the_sharded_layout_and_its_checksums(runs):
    tmp, _, _ = runs
    for run, shard_files in (("two_first", {"__0_0.distcp", "__1_0.distcp"}), ("one_first", {"__0_0.distcp"})):
        ckpts = list_checkpoints(tmp / run / "checkpoints")
        assert [p.name for p in ckpts] == ["step_000001", "step_000002"]
        for ck in ckpts:
            assert is_sharded_checkpoint(ck) and verify_checkpoint(ck) is None
            assert {p.name for p in ck.iterdir()} == {SHARDS, "state.json", "manifest.json"}
            assert {p.name for p in (ck / SHARDS).iterdir()} == shard_files | {".metadata"}
            manifest = json.loads((ck / "manifest.json").read_text())
            assert set(manifest) == {f"{SHARDS}/{f}" for f in shard_files | {".metadata"}} | {"state.json"}
    assert not list((tmp / "two_first" / "checkpoints").glob(".tmp-*"))  # renamed into place
    # a one-process run keeps the one-file layout by default
    assert not is_sharded_checkpoint(tmp / "full" / "checkpoints" / "step_000002")


def test_two_to_one_one_to_two_and_two_to_two_resume_the_uninterrupted_run(runs):
    tmp, ref, got = runs
    shutil.copytree(tmp / "two_first", tmp / "one_from_two")
    one = Trainer(_config(NAME, "replicate", iterations=4), tmp / "one_from_two", **QUIET)
    one.fit(resume=True)  # 2 -> 1, no process group
    assert one.start_iteration == 2
    finals = {"one_from_two": one.domain.state_dict()["logits"], **got[0]}
    for run, logits in finals.items():
        assert torch.allclose(logits, ref, atol=1e-5), run
        _assert_same_records(_records(tmp / "full"), _records(tmp / run), run)
    assert torch.equal(got[0]["two_from_one"], got[1]["two_from_one"])  # both ranks gathered the same weights


def test_export_gives_the_one_process_checkpoint(runs, tmp_path):
    tmp, _, _ = runs
    from shared_rl.checkpoint import main as checkpoint_main

    # python -m shared_rl.checkpoint export STEP_DIR OUT_ROOT
    assert checkpoint_main(["export", str(tmp / "two_first" / "checkpoints" / "step_000002"),
                            str(tmp_path / "run" / "ckpts")]) == 0
    exported = tmp_path / "run" / "ckpts" / "step_000002"
    assert exported.name == "step_000002" and verify_checkpoint(exported) is None
    one = tmp / "full" / "checkpoints" / "step_000002"
    w1, w2 = (load_file(str(p / "model.safetensors")) for p in (one, exported))
    assert w1.keys() == w2.keys() and all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1)
    o1, o2 = (torch.load(p / "optimizer.pt", weights_only=True) for p in (one, exported))
    assert o1["state"].keys() == o2["state"].keys() and len(o1["param_groups"]) == len(o2["param_groups"])
    for pid, st in o1["state"].items():
        for k, v in st.items():
            assert torch.allclose(v.float(), o2["state"][pid][k].float(), atol=1e-5), (pid, k)
    s1, s2 = (json.loads((p / "state.json").read_text()) for p in (one, exported))
    assert s1["iteration"] == s2["iteration"] == 2 and s1["sampler"] == s2["sampler"]  # (rng: process 0's)
    # the export resumes like any one-process checkpoint
    shutil.copy(tmp / "two_first" / "config.yaml", tmp_path / "run" / "config.yaml")
    tr = Trainer(_config(NAME, "replicate", iterations=4), tmp_path / "run", **QUIET)
    assert tr.resume(tmp_path / "run" / "ckpts") and tr.start_iteration == 2


def test_a_missing_shard_is_refused_in_one_line(runs, tmp_path, capsys):
    from shared_rl.cli import main

    tmp, _, _ = runs
    run = tmp_path / "run"
    shutil.copytree(tmp / "two_first", run)
    for ck in list_checkpoints(run / "checkpoints"):
        (ck / SHARDS / "__1_0.distcp").unlink()
        assert verify_checkpoint(ck) == f"{SHARDS}/__1_0.distcp is missing"
    before = sorted(p.name for p in run.rglob("*"))
    assert main(["train", "--resume", str(run), "iterations=4"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "no usable checkpoint" in err[0] and f"{SHARDS}/__1_0.distcp is missing" in err[0]
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing written
    from shared_rl.checkpoint import main as checkpoint_main

    assert checkpoint_main(["export", str(list_checkpoints(run / "checkpoints")[-1]), str(tmp_path / "x")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"{SHARDS}/__1_0.distcp is missing" in err[0] and not (tmp_path / "x").exists()


FIVE = {**VARIANTS[NAME]["rollout"], "groups_per_iteration": 5}  # a rollout chunk for each of 4 processes


def _four_worker(rank, world, port, tmp):
    _init(rank, world, port)
    Trainer(_config(NAME, "fsdp2", iterations=2, checkpoint={"every": 1}, rollout=FIVE), tmp / "four", **QUIET).fit()
    exit_distributed(0)


def _two_from_four_worker(rank, world, port, tmp, out):
    _init(rank, world, port)
    tr = Trainer(_config(NAME, "fsdp2", iterations=4, rollout=FIVE), tmp / "two_from_four", **QUIET)
    tr.fit(resume=True)
    assert tr.start_iteration == 2
    torch.save(full_tensors(tr.domain.state_dict())["logits"], f"{out}.{rank}")
    exit_distributed(0)


def test_four_processes_resume_on_one_and_on_two(tmp_path):
    import multiprocessing

    import torch.multiprocessing as mp

    from shared_rl.distributed import free_port

    def spawn(fn, world, *args):
        multiprocessing.set_forkserver_preload(["torch", "shared_rl.trainer"])
        mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=True, start_method="forkserver")

    torch.set_num_threads(1)
    full = Trainer(_config(NAME, "replicate", iterations=4, rollout=FIVE), tmp_path / "full", **QUIET)
    full.fit()
    spawn(_four_worker, 4, tmp_path)
    ck = tmp_path / "four" / "checkpoints" / "step_000002"
    assert {p.name for p in (ck / SHARDS).glob("*.distcp")} == {f"__{r}_0.distcp" for r in range(4)}
    for run in ("one_from_four", "two_from_four"):
        shutil.copytree(tmp_path / "four", tmp_path / run)
    spawn(_two_from_four_worker, 2, tmp_path, str(tmp_path / "two.pt"))
    one = Trainer(_config(NAME, "replicate", iterations=4, rollout=FIVE), tmp_path / "one_from_four", **QUIET)
    one.fit(resume=True)
    ref = full.domain.state_dict()["logits"]
    finals = {"one_from_four": one.domain.state_dict()["logits"],
              "two_from_four": torch.load(tmp_path / "two.pt.0", weights_only=True)}
    for run, logits in finals.items():
        assert torch.allclose(logits, ref, atol=1e-5), run
        _assert_same_records(_records(tmp_path / "full"), _records(tmp_path / run), run)


def _plain_worker(rank, world, port, root):
    _init(rank, world, port)
    from shared_rl.checkpoint import save_sharded_checkpoint

    d = Dist()
    # a tensor every process holds whole but with its own value and size (a part's per-process history)
    # ("big" first: DCP's default balancing would then give the later tensors to process 1)
    state = {"big": torch.zeros(1000), "history": torch.full((rank + 2,), float(rank)), "w": torch.arange(4.0)}
    save_sharded_checkpoint(root, 1, state, None, {"iteration": 1}, d)
    exit_distributed(0)


def test_plain_tensors_are_process_zeros(tmp_path):
    """As in the one-process layout (written by process 0), a plain tensor of the sharded layout is process 0's."""
    from shared_rl.checkpoint import load_sharded_checkpoint

    (tmp_path / "run").mkdir()
    _spawn(_plain_worker, tmp_path / "run" / "checkpoints")
    ck = tmp_path / "run" / "checkpoints" / "step_000001"
    assert verify_checkpoint(ck) is None
    model, opt, state = load_sharded_checkpoint(ck, {}, [])
    assert torch.equal(model["history"], torch.zeros(2)) and torch.equal(model["w"], torch.arange(4.0))
    assert opt is None and state == {"iteration": 1}


def _save_then_resume_worker(rank, world, port, tmp):
    _init(rank, world, port)
    for layout in ("full", "sharded"):
        tr = Trainer(_config(NAME, "fsdp2", distributed={"strategy": "fsdp2", "checkpoint": layout}),
                     tmp / layout, **QUIET)
        tr.iteration(0)
        tr.save(1)
        # every process finds the checkpoint as soon as save returns (a resume reads it collectively)
        assert tr.resume() and tr.start_iteration == 1, (rank, layout)
    exit_distributed(0)


def test_a_checkpoint_exists_on_every_process_when_save_returns(tmp_path):
    for layout in ("full", "sharded"):
        (tmp_path / layout).mkdir()
    _spawn(_save_then_resume_worker, tmp_path)
