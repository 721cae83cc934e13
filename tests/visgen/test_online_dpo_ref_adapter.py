"""flow_grpo's online-DPO sampling variant (``visgen.objective: {name: dpo, reference: ref_adapter}``; yifan123/flow_grpo
``scripts/train_sd3_dpo.py``, ``config/dpo.py``): a second copy of the adapter samples the rollouts and is the DPO
loss's reference, replaced by the trained weights before a rollout when the optimizer steps so far are a positive
multiple of ``ref_update_step``. On the tiny pipeline, one optimizer step per iteration: which weights every
sampling forward saw, when the copy refreshed, and the loss — exactly log 2 right after each refresh (policy = its
reference) — against grove's default (the live policy samples, the adapter off is the reference)."""
from __future__ import annotations

import math

import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer

torch.set_num_threads(1)
QUIET = {"logging": {"progress": False}, "eval": {"at_start": False, "every": 0}, "checkpoint": {"every": 0}}
TINY_EVAL = {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}


def _cfg(tiny_dir, objective, iterations=4):
    return load_train_config({
        "domain": "visgen", "seed": 3, "iterations": iterations,
        "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "advantage": {"estimator": "grpo", "weights": {"shapes_strict": 0.0}},
        "loss": {"kl_coef": 0.0}, "optim": {"lr": 1e-2, "minibatches_per_epoch": 1, "micro_batch_size": 0}, **QUIET,
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "objective": objective, "eval": TINY_EVAL},
    })


def _flat(policy) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for _, p in policy._named_trainable()])


def _run(tiny_dir, objective, iterations=4):
    """Per iteration: the trained weights before it, the weights every sampling forward of its rollout saw (all
    equal, checked), and its metrics."""
    tr = Trainer(_cfg(tiny_dir, objective, iterations), None, log=lambda *_: None)
    policy, domain = tr.domain.policy, tr.domain
    state = {"sampling": False, "seen": []}

    def hook(_module, _args, _kwargs):
        if state["sampling"]:
            state["seen"].append(_flat(policy))

    handle = policy.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    rollout = domain.rollout

    def spied(*args, **kwargs):
        state["sampling"] = True
        try:
            return rollout(*args, **kwargs)
        finally:
            state["sampling"] = False

    domain.rollout = spied
    out = []
    try:
        for it in range(iterations):
            live = _flat(policy)
            state["seen"] = []
            metrics = tr.iteration(it)
            seen = state["seen"]
            assert seen and all(torch.equal(s, seen[0]) for s in seen)  # one set of weights sampled the batch
            out.append((live, seen[0], metrics, None if policy.old is None else dict(policy.old)))
    finally:
        handle.remove()
    return out, policy


def test_the_ref_adapter_samples_and_is_refreshed_every_ref_update_step(tiny_dir):
    runs, policy = _run(tiny_dir, {"name": "dpo", "reference": "ref_adapter", "ref_update_step": 2})
    (live0, s0, m0, _), (live1, s1, m1, _), (live2, s2, m2, _), (live3, s3, m3, _) = runs
    assert not torch.equal(live1, live0) and not torch.equal(live2, live1) and not torch.equal(live3, live2)
    # steps so far 0 and 1: the copy made at the start (the adapter's identity init) samples; 2: it is refreshed to
    # the trained weights before the rollout and samples; 3: it keeps those
    assert torch.equal(s0, live0) and torch.equal(s1, live0)
    assert torch.equal(s2, live2) and torch.equal(s3, live2)
    # the loss's reference is the same copy: right after a refresh the policy equals it (log 2), otherwise not
    assert m0["loss/policy"] == pytest.approx(math.log(2), abs=1e-6)
    assert m2["loss/policy"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(m1["loss/policy"] - math.log(2)) > 1e-4 and abs(m3["loss/policy"] - math.log(2)) > 1e-4
    # the copy is checkpointed with the weights it describes
    state = policy.state_dict()
    assert any(k.startswith("old.") for k in state)


def test_the_default_samples_with_the_live_policy_against_the_adapter_off(tiny_dir):
    runs, policy = _run(tiny_dir, {"name": "dpo"}, iterations=3)
    assert policy.old is None  # no copy is kept
    for live, seen, _m, _old in runs:
        assert torch.equal(seen, live)
    assert runs[0][2]["loss/policy"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(runs[2][2]["loss/policy"] - math.log(2)) > 1e-4  # the reference stays the base model


@pytest.mark.parametrize("objective, message", [
    ({"name": "dpo", "reference": "ref_adapter", "ref_update_step": 0}, "ref_update_step must be >= 1"),
    ({"name": "dpo", "reference": "lagging"}, "reference"),
])
def test_bad_reference_settings_are_one_line(tiny_dir, objective, message):
    with pytest.raises(ConfigError, match=message) as info:
        _cfg(tiny_dir, objective)
    assert "\n" not in str(info.value)
