"""The loss forward's variants: prefix-shared (``llm.share_prompt_forward``) vs one pass, and behaviour log-probs
recomputed at rollout time vs deferred to the trainer's first forward. Whatever the variant, the behaviour log-probs
come from the very function the loss uses, so the first ratio is exactly 1."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.domain import RunContext
from shared_rl.llm.domain import LLMConfig, LLMDomain
from shared_rl.llm.model import LLMLoraSettings, build_tiny_llama
from shared_rl.llm.policy import collate, collate_shared
from shared_rl.llm.tasks import DatasetSettings
from shared_rl.llm.tokenizer import build_char_tokenizer
from shared_rl.llm.tree import LLMTreeSettings
from shared_rl.trainer import Trainer

ASSET = Path(__file__).resolve().parents[2] / "assets" / "llm-arith-tiny"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("tiny_paths")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32, seed=0)
    with torch.no_grad():   # non-trivial norms, so a wrong position or row mapping cannot hide behind symmetry
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def make_domain(model_dir, **overrides) -> LLMDomain:
    cfg = LLMConfig(model=str(model_dir), dataset=DatasetSettings(source="arith", num_train=64, num_eval=16),
                    max_new_tokens=6, logprob_batch_size=16, engine="fast", **overrides)
    cfg.check("llm")
    return LLMDomain(cfg, RunContext(run_dir=None, device=torch.device("cpu"), seed=0, log=lambda s: None))


def test_collate_shared_is_collate_split_at_the_prompt():
    prompts = [torch.tensor(p) for p in ([1, 5, 6], [1, 7], [1, 5, 6], [1, 7])]
    comps = [torch.tensor(c) for c in ([9, 2], [8], [], [9, 9, 9])]
    layout = torch.tensor([[4, 3]] * 4)
    one = collate(prompts, comps, layout, 0)
    sh = collate_shared(prompts, comps, layout, 0)
    assert sh.prompt_ids.tolist() == [[0, 1, 5, 6], [0, 0, 1, 7]]   # 2 distinct prompts, left-padded to P = 4
    assert sh.row_prompt.tolist() == [0, 1, 0, 1]
    # each row reassembled from its prompt and completion is collate's row: ids, mask, positions
    assert torch.equal(torch.cat([sh.prompt_ids[sh.row_prompt], sh.completion_ids], 1), one.input_ids)
    assert torch.equal(sh.attention_mask, one.attention_mask)
    assert torch.equal(torch.cat([sh.prompt_positions[sh.row_prompt], sh.completion_positions], 1), one.position_ids)
    assert torch.equal(sh.completion_mask, one.completion_mask)
    # hand values: row 1 = prompt [1, 7] at positions 0, 1 and completion [8] at 2, right pads stay at 2
    assert sh.completion_positions[1].tolist() == [2, 2, 2] and sh.completion_positions[3].tolist() == [2, 3, 4]


def _loss_and_grads(dom: LLMDomain, ro, idx: torch.Tensor, share: bool, need_kl: bool = False):
    dom.cfg.share_prompt_forward = share
    dom.model.zero_grad(set_to_none=True)
    out = dom.log_probs(ro, idx, need_kl)
    weights = torch.linspace(-1.0, 1.0, out.logp.numel()).view_as(out.logp)   # a loss with signs of both kinds
    loss = (out.logp * weights).sum()
    loss.backward()
    named = {n: p.grad.clone() for n, p in dom.model.named_parameters() if p.requires_grad}
    return out, named


@pytest.mark.parametrize("variant", ["flat", "tree", "lora_kl"])
def test_shared_prompt_forward_matches_one_pass(tiny_dir, variant):
    kwargs = {}
    if variant == "tree":
        kwargs["tree"] = LLMTreeSettings(enabled=True, branching=[2, 2], segment_tokens=2)
    if variant == "lora_kl":
        kwargs["lora"] = LLMLoraSettings(enabled=True, rank=4, alpha=8)
    dom = make_domain(tiny_dir, **kwargs)
    if variant == "lora_kl":   # move the adapter off zero so the policy differs from the reference
        with torch.no_grad():
            for n, p in dom.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    ro = dom.rollout([0, 1, 2, 3], 4, torch.Generator().manual_seed(2), 0)
    # a shuffled minibatch: rows of several prompts interleaved, some prompts once
    idx = torch.randperm(len(ro), generator=torch.Generator().manual_seed(3))[: max(3, len(ro) - 3)]
    one, g_one = _loss_and_grads(dom, ro, idx, share=False, need_kl=variant == "lora_kl")
    shared, g_shared = _loss_and_grads(dom, ro, idx, share=True, need_kl=variant == "lora_kl")
    m = ro.mask[idx]
    assert torch.allclose(shared.logp.detach(), one.logp.detach(), atol=2e-5)
    assert torch.allclose(shared.entropy, one.entropy, atol=2e-5)
    if variant == "lora_kl":
        assert torch.allclose(shared.ref_logp, one.ref_logp, atol=2e-5)
        assert not torch.allclose(shared.ref_logp[m], shared.logp.detach()[m], atol=1e-3)
    assert g_one.keys() == g_shared.keys()
    for name, g in g_one.items():
        assert g.norm() > 0, name
        # float rounding only (other matrix shapes): relative error ~1e-5; a wrong row/position would be ~1
        assert (g_shared[name] - g).norm() <= 1e-4 * g.norm() + 1e-7, name


@pytest.mark.parametrize("share", [False, True])
def test_recomputed_behaviour_logp_bitwise_with_sharing(tiny_dir, share):
    dom = make_domain(tiny_dir, share_prompt_forward=share)
    ro = dom.rollout([0, 1, 2, 3], 4, torch.Generator().manual_seed(0), 0)
    assert not torch.isnan(ro.logp_old).any()
    for idx in (torch.tensor([3, 0, 9]), torch.arange(16), torch.tensor([15]), torch.tensor([7, 8])):
        out = dom.log_probs(ro, idx, need_kl=False)
        assert out.logp.requires_grad
        assert torch.equal(out.logp.detach(), ro.logp_old[idx]), "behaviour log-probs must be bitwise equal"


def test_deferred_rollout_leaves_nan_on_trained_tokens(tiny_dir):
    dom = make_domain(tiny_dir, behaviour_logprobs="deferred",
                      tree=LLMTreeSettings(enabled=True, branching=[2, 2], segment_tokens=2))
    ro = dom.rollout([0, 1], 0, torch.Generator().manual_seed(0), 0)
    assert torch.equal(torch.isnan(ro.logp_old), ro.mask)
    assert (ro.logp_old[~ro.mask] == 0).all()
    roots = ro.parent < 0
    assert roots.any() and not torch.isnan(ro.logp_old[roots]).any()   # no forward is asked for the roots
    recompute = make_domain(tiny_dir, tree=LLMTreeSettings(enabled=True, branching=[2, 2], segment_tokens=2))
    ro_r = recompute.rollout([0, 1], 0, torch.Generator().manual_seed(0), 0)
    assert ro_r.nfe - ro.nfe == len(ro_r)                               # the saved forward, counted per row


def _train_cfg(model_dir, behaviour: str, share: bool, minibatches: int, lr: float = 5e-3, iterations: int = 2):
    return load_train_config({
        "domain": "llm", "seed": 0, "iterations": iterations,
        "rollout": {"groups_per_iteration": 4, "group_size": 4},
        "advantage": {"estimator": "grpo"},
        "loss": {"clip_low": 0.2, "aggregation": "seq-mean-token-mean"},
        "optim": {"lr": lr, "inner_epochs": 1, "minibatches_per_epoch": minibatches},
        "eval": {"at_start": False}, "logging": {"progress": False},
        "llm": {"model": str(model_dir), "max_new_tokens": 6, "engine": "fast", "behaviour_logprobs": behaviour,
                "share_prompt_forward": share, "logprob_batch_size": 16,
                "dataset": {"source": "arith", "num_train": 64, "num_eval": 16}},
    })


@pytest.mark.skipif(not (ASSET / "config.json").is_file(), reason="run: grove pretrain configs/llm/arith_sft.yaml")
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_deferred_ratio_exactly_one_and_same_training_as_recompute(share, minibatches):
    # the embedded checkpoint (accuracy ~0.4), so groups have reward variance and the updates are not zero
    # lr so small that no parameter moves: every minibatch's ratio must then be exactly 1, also the second one's,
    # whose behaviour log-probs came from the trainer's up-front pass over other rows
    tr = Trainer(_train_cfg(ASSET, "deferred", share, minibatches, lr=1e-30, iterations=1), None, log=lambda s: None)
    m = tr.iteration(0)
    assert m["ratio/max"] == 1.0 and m["ratio/mean"] == 1.0 and m["clip_frac"] == 0.0
    assert m["approx_kl"] == 0.0 and m["grad_norm"] > 0
    # with a real lr: deferred and recompute give bitwise the same training (same logp_old, same updates)
    states, metrics = [], []
    for behaviour in ("recompute", "deferred"):
        tr = Trainer(_train_cfg(ASSET, behaviour, share, minibatches), None, log=lambda s: None)
        start = tr.domain.state_dict()
        metrics.append([tr.iteration(it) for it in range(2)])
        states.append(tr.domain.state_dict())
    (rec, dfr), (m_rec, m_dfr) = states, metrics
    assert any(not torch.equal(start[k], rec[k]) for k in rec)          # training moved the weights
    assert all(torch.equal(rec[k], dfr[k]) for k in rec)
    for a, b in zip(m_rec, m_dfr):
        assert a["ratio/max"] == b["ratio/max"] and a["loss/policy"] == b["loss/policy"]
        # the behaviour forward moved from the rollout to the first loss forward (or the up-front pass)
        extra = 16 if minibatches > 1 else 0
        assert a["nfe/rollout"] - b["nfe/rollout"] == 16 and b["nfe/train"] - a["nfe/train"] == extra


def test_share_prompt_forward_config_checks():
    LLMConfig(share_prompt_forward=True, behaviour_logprobs="deferred").check("llm")
    with pytest.raises(ConfigError, match="share_prompt_forward needs the model's KV cache"):
        LLMConfig(share_prompt_forward=True, gradient_checkpointing=True).check("llm")
    with pytest.raises(ConfigError, match="behaviour_logprobs"):
        load_train_config({"domain": "llm", "llm": {"behaviour_logprobs": "sampler"}})
