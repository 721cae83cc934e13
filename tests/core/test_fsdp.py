"""FSDP2 (``distributed.strategy: fsdp2``): 2 CPU processes (gloo) with the policy sharded give the same metrics,
parameters and checkpoints as 1 process with the same global batch, and checkpoints move between the layouts.

The variants make the ranks' work uneven on purpose (3 groups over 2 processes, dynamic-sampling refills, deferred
behaviour log-probs with several minibatches, tree rollouts, evaluation on rank 0), so the collective hazards of
FSDP2 (every training forward is an all-gather) are exercised: a mismatch would hang or diverge.
"""
import json
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from shared_rl.checkpoint import export_full_checkpoint
from shared_rl.config import ConfigError, load_train_config
from shared_rl.distributed import (exit_distributed, free_port, full_optimizer_state, full_tensors, is_dtensor,
                                   shards_gathered)
from shared_rl.trainer import Trainer

def even_token_fraction(completion_ids, **_):
    """A dense reward (TRL signature) that an untrained random model already earns unevenly, so that advantages
    and gradients are non-zero; arithmetic accuracy would be 0 everywhere and make the comparison vacuous."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]


TOY = {
    "domain": "toy", "seed": 5, "iterations": 3, "logging": {"progress": False}, "eval": {"every": 1},
    "rollout": {"groups_per_iteration": 3, "group_size": 4, "groups_per_call": 1},
    "optim": {"lr": 0.2, "minibatches_per_epoch": 2, "inner_epochs": 2, "micro_batch_size": 2},
    "loss": {"kl_coef": 0.05},
    "toy": {"num_contexts": 6, "horizon": 3},
}
VARIANTS = {
    # uneven chunks (2 vs 1 per rank) -> padding forwards; refills; deferred log-probs filled before minibatch 1
    # (run 2-process in test_fsdp2_checkpoints_resume_across_layouts, which also checks it against 1 process)
    "toy_refill_deferred": {**TOY, "advantage": {"estimator": "batch_std"},
                            "selection": {"filter": "zero_std", "max_refill_rounds": 2},
                            "toy": {"num_contexts": 6, "horizon": 1, "deferred_logp": True}},
    "toy_tree": {**TOY, "advantage": {"estimator": "depth_zscore"},
                 "toy": {"num_contexts": 6, "horizon": 2, "tree_branch": 2}},
    # LoRA on a tiny Llama (built below), KL to the adapter-disabled base, deferred behaviour log-probs
    "llm_lora": {"domain": "llm", "seed": 3, "iterations": 2, "logging": {"progress": False},
                 "eval": {"at_start": False},
                 "rollout": {"groups_per_iteration": 3, "group_size": 2, "groups_per_call": 1},
                 "optim": {"lr": 1e-3, "minibatches_per_epoch": 2, "micro_batch_size": 2},
                 "loss": {"kl_coef": 0.1},
                 "llm": {"max_new_tokens": 3, "num_threads": 1, "lora": {"enabled": True, "rank": 2, "alpha": 4},
                         "rewards": [{"name": "tests.core.test_fsdp:even_token_fraction"}],
                         "behaviour_logprobs": "deferred",
                         "eval": {"num_prompts": 3, "batch_size": 3, "sampled": False}}},
}
# tree rollouts (TreeRL-style segments) sampled by the fast engine, which re-snapshots the gathered weights
VARIANTS["llm_tree_fast_engine"] = {
    **VARIANTS["llm_lora"], "advantage": {"estimator": "depth_zscore"}, "loss": {"kl_coef": 0.0},
    "optim": {"lr": 0.05, "minibatches_per_epoch": 2, "micro_batch_size": 2},  # big steps: a stale sampler shows
    "llm": {**VARIANTS["llm_lora"]["llm"], "max_new_tokens": 4, "engine": "fast", "behaviour_logprobs": "recompute",
            "tree": {"enabled": True, "branching": [2, 2], "segment_tokens": 2}}}
# full fine-tuning: every weight of the tiny Llama trained and sharded, KL to the frozen (replicated) starting copy
VARIANTS["llm_full"] = {**VARIANTS["llm_lora"],
                        "llm": {**VARIANTS["llm_lora"]["llm"], "lora": {"enabled": False}, "keep_reference": True}}
# gradient checkpointing under FSDP2 (LoRA: the frozen embeddings' output made to require grad): the 2-process run
# checkpoints its decoder layers, the 1-process run it is compared with does not (same gradients, same metrics)
VARIANTS["llm_lora_checkpointed"] = {**VARIANTS["llm_lora"],
                                     "llm": {**VARIANTS["llm_lora"]["llm"], "gradient_checkpointing": True}}
ONE_PROCESS_LLM = {"llm_lora_checkpointed": {"gradient_checkpointing": False}}
# the same with the gathered layers kept after each forward (distributed.reshard_after_forward: false): the policy's
# are freed by its backward, the frozen reference's (no backward) by the domain after its forward
VARIANTS["llm_full_kept_gathered"] = VARIANTS["llm_full"]
TWO_PROCESS_DIST = {"llm_full_kept_gathered": {"reshard_after_forward": False}}
METRICS = ("reward/mean", "groups/drawn", "groups/kept", "nfe/rollout", "nfe/train", "loss/policy", "loss/kl",
           "clip_frac", "ratio/mean", "grad_norm", "entropy", "eval/greedy_accuracy", "eval/expected_reward",
           "eval/accuracy", "eval/reward")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer LlamaForCausalLM built from a config (no download), saved with the embedded tokenizer."""
    from shared_rl.llm.model import build_tiny_llama, load_tokenizer

    out = tmp_path_factory.mktemp("tiny_llama")
    tok = load_tokenizer("assets/llm-arith-tiny")
    build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _config(name, strategy, model=None, **top):
    data = json.loads(json.dumps(VARIANTS[name]))
    data["distributed"] = {"strategy": strategy, **(TWO_PROCESS_DIST.get(name, {}) if strategy == "fsdp2" else {})}
    if strategy == "replicate" and name in ONE_PROCESS_LLM:
        data["llm"].update(ONE_PROCESS_LLM[name])
    if model:
        data["llm"]["model"] = model
    data.update(top)
    return load_train_config(data)


def _spawn(fn, *args):
    """Two workers from a fork server that imported torch/transformers once (not once per worker): on a busy CPU
    this halves the test time. Forking from that clean server is safe (unlike forking pytest after torch ran)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "shared_rl.trainer", "shared_rl.llm.domain", "peft"])
    mp.start_processes(fn, args=(2, free_port(), *args), nprocs=2, join=True, start_method="forkserver")


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


def _fit_worker(rank, world, port, name, model, run_dir, out):
    _init(rank, world, port)
    tr = Trainer(_config(name, "fsdp2", model), run_dir, log=lambda *_: None)
    assert tr.fsdp is not None and all(is_dtensor(p) for p in tr.domain.parameters())
    # the LLM domain loads on process 0 alone: process 1 built its model on the meta device (load_causal_lm)
    assert tr.fsdp.from_rank0 == name.startswith("llm")
    recomputed = [0]  # forwards of the first decoder layer's MLP run inside backward: checkpointing's recomputation
    if name.startswith("llm"):  # (transformers checkpoints a layer's forward, inside FSDP2's hooks on the layer)
        tr.fsdp.modules[0].mlp.register_forward_pre_hook(
            lambda *_: recomputed.__setitem__(0, recomputed[0] + (torch._C._current_graph_task_id() != -1)))
    whole_reference = [0, 0]  # (training forwards of the policy, those that found the reference copy unsharded)
    # (policy forwards inside gathered(): rollouts / evaluation, those with the policy not gathered, those that found
    # a reference parameter gathered or its local shard the whole tensor)
    sampling = [0, 0, 0]
    if name.startswith("llm_full"):
        def check(*_):
            reference = list(tr.domain.reference.parameters())
            if not shards_gathered():
                whole_reference[0] += 1
                whole_reference[1] += not all(is_dtensor(p) for p in reference)
                return
            # rollouts and evaluation gather the policy's units only (fsdp_sampling_modules): the frozen reference
            # copy, which they never run, stays in its shards
            sampling[0] += 1
            sampling[1] += any(is_dtensor(p) for p in tr.domain.model.parameters())
            sampling[2] += not all(is_dtensor(p) and p.to_local().numel() < p.numel() for p in reference)
        tr.domain.model.register_forward_pre_hook(check)
    tr.fit()
    state = full_tensors(tr.domain.state_dict())
    reference = ({**_reference_layout(tr.domain), "seen": whole_reference, "sampling": sampling}
                 if name.startswith("llm_full") else None)
    # the final checkpoint (gathered, one-process layout) loads back into fresh shards exactly
    again = Trainer(_config(name, "fsdp2", model), run_dir, log=lambda *_: None)
    assert again.resume() and again.start_iteration == tr.cfg.iterations
    assert all(torch.equal(v, state[k]) for k, v in full_tensors(again.domain.state_dict()).items())
    opt, opt_again = (full_optimizer_state(t.optimizer.state_dict()) for t in (tr, again))
    assert all(torch.equal(v, opt_again["state"][i][k]) for i, s in opt["state"].items() for k, v in s.items())
    if reference is not None:  # the resumed run rebuilds the reference from the starting weights, sharded again
        reference["resumed"] = _reference_layout(again.domain)["full"]
    if name == "llm_full_kept_gathered":  # stopped after step 1 and resumed: the uninterrupted weights (KL included)
        mid = f"{run_dir}_mid"
        Trainer(_config(name, "fsdp2", model, iterations=1), mid, log=lambda *_: None).fit()
        resumed = Trainer(_config(name, "fsdp2", model), mid, log=lambda *_: None)
        resumed.fit(resume=True)
        assert resumed.start_iteration == 1
        reference["resume_error"] = max(float((v - state[k]).abs().max())
                                        for k, v in full_tensors(resumed.domain.state_dict()).items())
    torch.save({"state": state, "padding_forwards": tr.padding_forwards, "recomputed": recomputed[0],
                "reference": reference}, f"{out}.{rank}")
    exit_distributed(0)  # barrier + destroy + os._exit: gloo can SIGABRT at interpreter teardown


def _reference_layout(domain):
    """The LLM's frozen KL reference copy after training: whether every parameter is a DTensor (and resharded: an
    unsharded FSDP2 module holds plain tensors), the elements this process holds of it, and its gathered weights."""
    params = dict(domain.reference.named_parameters())  # tied weights once
    return {"dtensors": all(is_dtensor(p) for p in params.values()),
            "local": sum((p.to_local() if is_dtensor(p) else p).numel() for p in params.values()),
            "numel": sum(p.numel() for p in params.values()),
            "full": full_tensors({n: p.detach() for n, p in params.items()})}


def _assert_same_records(one, two, where):
    assert [r["step"] for r in one] == [r["step"] for r in two]
    compared = 0
    for a, b in zip(one, two):
        assert a.keys() == b.keys(), (where, a["step"])
        for k in METRICS:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (where, a["step"], k, a[k], b[k])
                compared += 1
    assert compared >= 10
    assert max(r.get("grad_norm", 0.0) for r in one) > 1e-3, "no update happened: the comparison would be vacuous"


@pytest.mark.parametrize("name", ["llm_lora", "llm_full", "llm_tree_fast_engine", "toy_tree",
                                  pytest.param("llm_lora_checkpointed", marks=pytest.mark.slow),
                                  pytest.param("llm_full_kept_gathered", marks=pytest.mark.slow)])
def test_fsdp2_two_processes_match_one(tmp_path, name, tiny_llama):
    model = tiny_llama if name.startswith("llm") else None
    torch.set_num_threads(1)
    single = Trainer(_config(name, "replicate", model), tmp_path / "one", log=lambda *_: None)
    single.fit()
    out = tmp_path / "two.pt"
    _spawn(_fit_worker, name, model, tmp_path / "two", str(out))
    got = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    # process 1 (built on the meta device for the LLM) gathers the same weights, ties kept (no extra output layer)
    assert got[1]["state"].keys() == got[0]["state"].keys()
    assert all(torch.equal(v, got[1]["state"][k]) for k, v in got[0]["state"].items())
    for k, v in single.domain.state_dict().items():
        assert torch.allclose(v, got[0]["state"][k], atol=1e-5, rtol=1e-4), k
    # 3 groups over 2 processes: the rank with fewer sequences padded its micro-batches with weight-0 forwards
    assert got[0]["padding_forwards"] + got[1]["padding_forwards"] > 0
    if name.startswith("llm_full"):  # the KL reference: sharded (~half on each process), the starting weights
        start = load_file(os.path.join(model, "model.safetensors"))
        for r, g in enumerate(got):
            ref = g["reference"]
            assert ref["dtensors"], f"process {r}: the reference copy is not (or no longer) sharded"
            # every training forward after a KL pass found the reference freed again (resharded after its forward)
            assert ref["seen"][0] > 4 and ref["seen"][1] == 0, (r, ref["seen"])
            # rollouts (and rank 0's evaluation) ran the gathered policy with the reference still in its shards
            assert ref["sampling"][0] > 2 and ref["sampling"][1:] == [0, 0], (r, ref["sampling"])
            assert abs(ref["local"] - ref["numel"] / 2) <= 0.05 * ref["numel"], (r, ref["local"], ref["numel"])
            for full in (ref["full"], ref["resumed"]):
                assert {k for k in full} >= set(start) - {"lm_head.weight"}
                assert all(torch.equal(full[k], start[k]) for k in start if k in full)
        assert got[0]["reference"]["local"] + got[1]["reference"]["local"] == got[0]["reference"]["numel"]
        if "resume_error" in got[0]["reference"]:
            assert got[0]["reference"]["resume_error"] <= 1e-5, got[0]["reference"]["resume_error"]
    # checkpointed layers re-run their forward in backward (and only then)
    assert (got[0]["recomputed"] > 0) == name.endswith("_checkpointed"), got[0]["recomputed"]
    _assert_same_records(_records(tmp_path / "one"), _records(tmp_path / "two"), name)
    # the FSDP2 run wrote sharded checkpoints (distributed.checkpoint: auto); exported, they hold the 1-process values
    last = f"checkpoints/step_{single.cfg.iterations:06d}"
    exported = export_full_checkpoint(tmp_path / "two" / last, tmp_path / "export" / "checkpoints")
    w1, w2 = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "one" / last, exported))
    assert w1.keys() == w2.keys() and all(torch.allclose(w1[k], w2[k], atol=1e-5, rtol=1e-4) for k in w1)
    if name.startswith("llm"):  # the exported adapter (full: the whole model) was gathered on rank 0
        exported = "model.safetensors" if name.startswith("llm_full") else "adapter_model.safetensors"
        a1 = load_file(str(tmp_path / "one" / "final" / exported))
        a2 = load_file(str(tmp_path / "two" / "final" / exported))
        if name.startswith("llm_full"):  # the gathered full state dict also names the tied output (the embeddings)
            assert torch.equal(a2.pop("lm_head.weight"), a2["model.embed_tokens.weight"])
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "two" / "final"))
            assert torch.allclose(loaded.model.norm.weight, a1["model.norm.weight"], atol=1e-5)
        assert a1.keys() == a2.keys() and a1
        for k in a1:
            assert torch.allclose(a1[k], a2[k], atol=1e-5, rtol=1e-4), k


def _resume_worker(rank, world, port, fresh_dir, resume_dir, out):
    _init(rank, world, port)
    quiet = {"log": lambda *_: None}
    with pytest.raises(ConfigError, match="needs a rollout chunk on each of the 2 processes.*groups_per_iteration"):
        Trainer(_config("toy_tree", "fsdp2", rollout={"groups_per_iteration": 1, "group_size": 4}), None, **quiet)
    os.environ["ACCELERATE_USE_FSDP"] = "true"  # what `accelerate launch` sets for an FSDP launcher config
    with pytest.raises(ConfigError, match="add distributed.strategy=fsdp2"):
        Trainer(_config("toy_tree", "replicate"), None, **quiet)
    del os.environ["ACCELERATE_USE_FSDP"]
    cfg = _config("toy_refill_deferred", "fsdp2", iterations=2, checkpoint={"every": 1},  # the gathered layout
                  distributed={"strategy": "fsdp2", "checkpoint": "full"})
    fresh = Trainer(cfg, fresh_dir, log=lambda *_: None)
    fresh.fit()  # writes an FSDP2 checkpoint at step 2
    tr = Trainer(_config("toy_refill_deferred", "fsdp2", iterations=4), resume_dir, log=lambda *_: None)
    tr.fit(resume=True)  # from a 1-process checkpoint at step 2
    assert tr.start_iteration == 2
    torch.save({"state": full_tensors(tr.domain.state_dict()), "padding_forwards": fresh.padding_forwards},
               f"{out}.{rank}")
    exit_distributed(0)


def test_fsdp2_checkpoints_resume_across_layouts(tmp_path):
    torch.set_num_threads(1)
    name = "toy_refill_deferred"
    full = Trainer(_config(name, "replicate", iterations=4), tmp_path / "full", log=lambda *_: None)
    full.fit()
    Trainer(_config(name, "replicate", iterations=2, checkpoint={"every": 1}), tmp_path / "one_first",
            log=lambda *_: None).fit()
    shutil.copytree(tmp_path / "one_first", tmp_path / "two_resumed")
    out = tmp_path / "resumed.pt"
    _spawn(_resume_worker, tmp_path / "two_first", tmp_path / "two_resumed", str(out))
    got = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    # the fresh FSDP2 run (uneven chunks: padded micro-batches; refills; deferred log-probs) matches 1 process
    assert got[0]["padding_forwards"] + got[1]["padding_forwards"] > 0
    _assert_same_records(_records(tmp_path / "one_first"), _records(tmp_path / "two_first"), "fresh")
    # the FSDP2 checkpoint has the one-process layout and values (weights and Adam moments, integer param ids)
    ck1, ck2 = tmp_path / "one_first/checkpoints/step_000002", tmp_path / "two_first/checkpoints/step_000002"
    w1, w2 = load_file(str(ck1 / "model.safetensors")), load_file(str(ck2 / "model.safetensors"))
    assert w1.keys() == w2.keys() and all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1)
    o1, o2 = (torch.load(p / "optimizer.pt", weights_only=True) for p in (ck1, ck2))
    assert o1["param_groups"] == o2["param_groups"] and o1["state"].keys() == o2["state"].keys()
    for pid in o1["state"]:
        for k, v in o1["state"][pid].items():
            assert not is_dtensor(o2["state"][pid][k]) and torch.allclose(v, o2["state"][pid][k], atol=1e-5), k
    # FSDP2 checkpoint -> one process, and one-process checkpoint -> FSDP2: both end where the uninterrupted run does
    shutil.copytree(tmp_path / "two_first", tmp_path / "one_resumed")
    one = Trainer(_config(name, "replicate", iterations=4), tmp_path / "one_resumed", log=lambda *_: None)
    one.fit(resume=True)
    assert one.start_iteration == 2
    ref = full.domain.state_dict()["logits"]
    assert torch.allclose(one.domain.state_dict()["logits"], ref, atol=1e-5)
    assert torch.allclose(got[0]["state"]["logits"], ref, atol=1e-5)
    for run in ("one_resumed", "two_resumed"):
        _assert_same_records(_records(tmp_path / "full"), _records(tmp_path / run), run)


def test_fsdp2_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="distributed.strategy: 'fsdp3' is not one of"):
        load_train_config({"domain": "toy", "distributed": {"strategy": "fsdp3"}})
    from shared_rl.toy import ToyDomain

    monkeypatch.setattr(ToyDomain, "fsdp_modules", lambda self: [])
    with pytest.raises(ConfigError, match="fsdp2 is not supported by domain 'toy'"):
        Trainer(_config("toy_tree", "fsdp2"), None, log=lambda *_: None)


def test_llm_estimate_shards_the_reference_copy():
    """``--dry-run``'s memory estimate for full fine-tuning with ``llm.keep_reference``: under fsdp2 the frozen
    reference copy is sharded like the model (``LLMDomain.fsdp_modules``), so 2 processes hold half of everything."""
    from pathlib import Path

    from shared_rl.config import apply_overrides, load_yaml
    from shared_rl.memory_estimate import per_process_bytes

    root = Path(__file__).resolve().parents[2]
    cfg = load_train_config(apply_overrides(load_yaml(root / "configs/llm/arith_grpo.yaml"),
                                            ["llm.keep_reference=true", "llm.lora.enabled=false"]))
    groups = cfg.domain_config.parameter_groups(cfg)
    assert [g.name for g in groups] == ["model", "reference copy"] and all(g.sharded for g in groups)
    assert per_process_bytes(groups, "fsdp2", 2) * 2 == per_process_bytes(groups, "replicate", 1)
