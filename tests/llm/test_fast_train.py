"""``llm.train_forward: fast`` (``fast_train.fast_token_log_probs``): the lean packed forward computes the HF
forward's log-probs, entropies and gradients (float rounding only), a micro-batch split sums to the same gradient,
it is chosen by config (auto falls back, fast refuses with the reason), and through the trainer the first ratio is
still exactly 1 with deferred behaviour log-probs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from shared_rl.config import ConfigError, load_train_config
from shared_rl.domain import RunContext
from shared_rl.llm.domain import LLMConfig, LLMDomain
from shared_rl.llm.fast_train import fast_token_log_probs, unsupported_reason
from shared_rl.llm.model import LLMLoraSettings
from shared_rl.llm.policy import collate, collate_shared, token_log_probs, token_log_probs_shared
from shared_rl.llm.tasks import DatasetSettings
from shared_rl.trainer import Trainer

ASSET = Path(__file__).resolve().parents[2] / "assets" / "llm-arith-tiny"
PAD = 0


def tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    """Random tiny models: GQA (4 query heads over 2 KV heads), non-trivial norms and biases."""
    common = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=2,
                  bos_token_id=1, tie_word_embeddings=kind == "llama_tied", attention_bias=kind == "llama_bias")
    torch.manual_seed(seed)
    if kind == "qwen2":   # q/k/v biases
        common.pop("attention_bias")
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))      # defaults (ones / zeros) would hide a wrong norm or bias
    return model.train()


def rows(seed: int = 0, prompts: int = 4, per_prompt: int = 3):
    """Prompts of different lengths (one of a single token), each continued by completions of 0..5 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 4, 7, 3, 6][:prompts]
    ps = [torch.cat([torch.tensor([1]), torch.randint(3, 100, (n - 1,), generator=g)]) for n in lengths]
    p_rows, c_rows = [], []
    for p in ps:
        for _ in range(per_prompt):
            p_rows.append(p)
            c_rows.append(torch.randint(3, 100, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g))
    c_rows[1] = torch.randint(3, 100, (5,), generator=g)   # the widest completion sets T
    return p_rows, c_rows


def _grads(model, fn, weights=None):
    model.zero_grad(set_to_none=True)
    logp, ent = fn()
    w = weights if weights is not None else torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)
    ((logp * w).sum() + 0.1 * ent.sum()).backward()   # both signs; the entropy with grad (an entropy bonus)
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_gradient(new: dict, ref: dict) -> None:
    """The whole gradient within 1e-6 relative; each tensor within 1e-4 of its own norm plus 1e-8 of the whole
    (measured: <= 2e-9 of the whole per tensor; the k-projection's near-cancelling gradients, ~1e-5 of the others' size,
    carry ~4e-5 relative rounding, as between the HF forward's own one-pass and shared variants). A wrong row,
    position, mask or bias would be of the order of the tensor's norm."""
    total = torch.sqrt(sum(g.norm() ** 2 for g in ref.values()))
    err = torch.sqrt(sum((new[n] - g).norm() ** 2 for n, g in ref.items()))
    assert err <= 1e-6 * total
    for name, g in ref.items():
        assert g.norm() > 0, name
        assert (new[name] - g).norm() <= 1e-4 * g.norm() + 1e-8 * total, name


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied", "llama_bias"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fast_forward_equals_the_hf_forward(kind, temperature):
    torch.set_num_threads(1)
    model = tiny(kind)
    p_rows, c_rows = rows()
    layout = torch.tensor([[9, 6]] * len(p_rows))  # wider than the rows: left and right pads of the rollout layout
    one = collate(p_rows, c_rows, layout, PAD)
    shared = collate_shared(p_rows, c_rows, layout, PAD)
    hf = _grads(model, lambda: token_log_probs(model, one, temperature, True, True))
    hf_shared = _grads(model, lambda: token_log_probs_shared(model, shared, temperature, True, True))
    fast = _grads(model, lambda: fast_token_log_probs(model, shared, temperature, True, True))
    mask = one.completion_mask
    assert fast[0].shape == hf[0].shape == (len(p_rows), 6)
    assert (fast[0][~mask] == 0).all() and (fast[1][~mask] == 0).all()      # pads score nothing
    for ref in (hf, hf_shared):
        assert torch.allclose(fast[0], ref[0], atol=1e-6, rtol=1e-6)        # log-probs
        assert torch.allclose(fast[1], ref[1], atol=1e-6, rtol=1e-6)        # entropies
        _assert_same_gradient(fast[2], ref[2])


def test_micro_batch_split_gives_the_same_gradient():
    torch.set_num_threads(1)
    model = tiny("llama")
    p_rows, c_rows = rows(seed=1)
    layout = torch.tensor([[7, 5]] * len(p_rows))
    weights = torch.randn(len(p_rows), 5, generator=torch.Generator().manual_seed(2))
    whole = _grads(model, lambda: fast_token_log_probs(model, collate_shared(p_rows, c_rows, layout, PAD), 1.0, True),
                   weights)
    split = {n: torch.zeros_like(g) for n, g in whole[2].items()}
    parts = [[0, 5, 7, 11], [1, 2, 3], [4, 6, 8, 9, 10]]   # rows of one prompt in different micro-batches
    for part in parts:
        b = collate_shared([p_rows[i] for i in part], [c_rows[i] for i in part], layout[part], PAD)
        lp, _, g = _grads(model, lambda: fast_token_log_probs(model, b, 1.0, True), weights[part])
        assert torch.allclose(lp, whole[0][part], atol=1e-6)
        for n in split:
            split[n] += g[n]
    _assert_same_gradient(split, whole[2])


def test_no_grad_and_grad_forwards_agree_bitwise():
    # behaviour log-probs (no grad) and the loss forward (grad) are one function: the first ratio is exactly 1
    model = tiny("qwen2")
    p_rows, c_rows = rows(seed=3)
    batch = collate_shared(p_rows, c_rows, None, PAD)
    with torch.no_grad():
        lp0, _ = fast_token_log_probs(model, batch, 1.0)
    lp1, _ = fast_token_log_probs(model, batch, 1.0, True)
    assert lp1.requires_grad and torch.equal(lp0, lp1.detach())


def _domain(model_dir, **overrides) -> LLMDomain:
    cfg = LLMConfig(model=str(model_dir), dataset=DatasetSettings(source="arith", num_train=64, num_eval=16),
                    max_new_tokens=6, logprob_batch_size=16, engine="fast", **overrides)
    cfg.check("llm")
    return LLMDomain(cfg, RunContext(run_dir=None, device=torch.device("cpu"), seed=0, log=lambda s: None))


@pytest.mark.skipif(not (ASSET / "config.json").is_file(), reason="run: grove pretrain configs/llm/arith_sft.yaml")
def test_selection_by_config():
    assert unsupported_reason(tiny("llama")) is None
    assert _domain(ASSET, train_forward="fast")._fast_train
    assert _domain(ASSET, train_forward="auto")._fast_train
    assert not _domain(ASSET)._fast_train                               # the code default: the model's forward
    lora = LLMLoraSettings(enabled=True, rank=4, alpha=8)
    assert not _domain(ASSET, train_forward="auto", lora=lora)._fast_train   # auto: falls back, says why
    with pytest.raises(ConfigError, match="train_forward: fast cannot run .*peft"):
        _domain(ASSET, train_forward="fast", lora=lora)
    with pytest.raises(ConfigError, match="train_forward: fast keeps every activation"):
        LLMConfig(train_forward="fast", gradient_checkpointing=True).check("llm")
    LLMConfig(train_forward="auto", gradient_checkpointing=True).check("llm")   # auto: the model's forward then
    # FSDP2 gathers a unit's shards in its module's own forward, which the lean forward bypasses: back to hf
    sharded = _domain(ASSET, train_forward="fast")
    assert sharded.fsdp_modules() and not sharded._fast_train


@pytest.mark.skipif(not (ASSET / "config.json").is_file(), reason="run: grove pretrain configs/llm/arith_sft.yaml")
def test_domain_log_probs_equal_the_hf_paths_and_the_trainer_ratio_is_one():
    dom = _domain(ASSET, train_forward="fast", share_prompt_forward=True)
    ro = dom.rollout([0, 1, 2, 3], 4, torch.Generator().manual_seed(0), 0)
    idx = torch.tensor([5, 0, 9, 14, 3])
    fast = dom.log_probs(ro, idx, need_kl=False)
    assert torch.equal(fast.logp.detach(), ro.logp_old[idx])          # recompute: the same function, bitwise here
    dom._fast_train = False
    hf = dom.log_probs(ro, idx, need_kl=False)
    assert torch.allclose(fast.logp.detach(), hf.logp.detach(), atol=1e-6)
    # through the trainer, deferred: an lr so small that nothing moves gives a ratio of exactly 1
    cfg = load_train_config({
        "domain": "llm", "seed": 0, "iterations": 1, "rollout": {"groups_per_iteration": 4, "group_size": 4},
        "advantage": {"estimator": "grpo"}, "loss": {"clip_low": 0.2, "aggregation": "seq-mean-token-mean"},
        "optim": {"lr": 1e-30, "micro_batch_size": 5}, "eval": {"at_start": False}, "logging": {"progress": False},
        "llm": {"model": str(ASSET), "max_new_tokens": 6, "engine": "fast", "behaviour_logprobs": "deferred",
                "train_forward": "fast", "dataset": {"source": "arith", "num_train": 64, "num_eval": 16}}})
    tr = Trainer(cfg, None, log=lambda s: None)
    assert tr.domain._fast_train
    m = tr.iteration(0)
    assert m["ratio/max"] == 1.0 and m["ratio/mean"] == 1.0 and m["approx_kl"] == 0.0 and m["grad_norm"] > 0


@pytest.mark.skipif(not (ASSET / "config.json").is_file(), reason="run: grove pretrain configs/llm/arith_sft.yaml")
def test_trainer_iteration_same_loss_and_gradient_as_the_hf_forward():
    """One GRPO iteration through the trainer, the same rollout (same engine and noise), hf vs fast loss forward:
    the same loss terms and gradient norm (float rounding only), in two micro-batches, the entropy with grad."""
    def run(forward: str):
        cfg = load_train_config({
            "domain": "llm", "seed": 3, "iterations": 1, "rollout": {"groups_per_iteration": 4, "group_size": 4},
            # an entropy bonus: at ratio 1 the policy term of group z-scores over equal-length answers is 0
            "advantage": {"estimator": "grpo"},
            "loss": {"clip_low": 0.2, "aggregation": "token-mean", "entropy": {"coef": 0.01}},
            "optim": {"lr": 1e-3, "micro_batch_size": 9}, "eval": {"at_start": False},
            "logging": {"progress": False},
            "llm": {"model": str(ASSET), "max_new_tokens": 6, "engine": "fast", "behaviour_logprobs": "deferred",
                    "share_prompt_forward": True, "train_forward": forward,
                    "dataset": {"source": "arith", "num_train": 64, "num_eval": 16}}})
        return Trainer(cfg, None, log=lambda s: None).iteration(0)

    hf, fast = run("hf"), run("fast")
    assert hf["reward/mean"] == fast["reward/mean"] and hf["completion/tokens"] == fast["completion/tokens"]
    assert hf["grad_norm"] > 0 and hf["loss/entropy_bonus"] > 0
    assert fast["loss/policy"] == pytest.approx(hf["loss/policy"], rel=1e-5, abs=1e-7)
    assert fast["loss/entropy_bonus"] == pytest.approx(hf["loss/entropy_bonus"], rel=1e-6)
    assert fast["grad_norm"] == pytest.approx(hf["grad_norm"], rel=5e-6)   # measured 1.0e-6 apart
    assert fast["entropy"] == pytest.approx(hf["entropy"], rel=1e-6)
