"""FastLlamaEngine: logits parity with the HF forward, same samples as the reference engine, LoRA-merged weight
sync after an update, EOS/padding/compaction bookkeeping, and selection by config."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from shared_rl.config import ConfigError
from shared_rl.domain import RunContext
from shared_rl.llm.domain import LLMConfig, LLMDomain
from shared_rl.llm.engine import TorchRolloutEngine
from shared_rl.llm.fast_llama import FastLlamaEngine, unsupported_reason
from shared_rl.llm.model import LLMLoraSettings, build_tiny_llama
from shared_rl.llm.tasks import DatasetSettings
from shared_rl.llm.tokenizer import build_char_tokenizer
from shared_rl.llm.tree import LLMTreeSettings, grow_trees

ASSET = Path(__file__).resolve().parents[2] / "assets" / "llm-arith-tiny"
PAD, EOS = 0, 2


def tiny(kind: str = "llama", seed: int = 0) -> torch.nn.Module:
    """Random tiny models: GQA (4 query heads over 2 KV heads), head_dim 8, non-trivial norms."""
    common = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
                  bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if kind == "qwen2":   # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))      # defaults (ones / zeros) would hide a wrong norm or bias
    return model.eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 100, (n - 1,), generator=g).tolist() for n in lengths]


def hf_logits(model, prompts, completions):
    """Next-token logits of the HF forward along ``completions``: ``[rows, T, vocab]``, left-padded prompts."""
    width = max(len(p) for p in prompts)
    t = len(completions[0])
    ids = torch.full((len(prompts), width + t), PAD)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, width - len(p):] = torch.tensor(p + c)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    return out.logits[:, width - 1:width - 1 + t].float()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_match_hf_forward(kind):
    torch.set_num_threads(1)
    model = tiny(kind)
    eng = FastLlamaEngine(model, PAD, EOS)
    prompts = prompts_of([3, 7, 5, 1])                  # left padding of 4, 0, 2 and 6 columns
    completions = torch.randint(3, 100, (4, 6), generator=torch.Generator().manual_seed(1)).tolist()
    got = eng.teacher_forced_logits(prompts, completions)
    want = hf_logits(model, prompts, completions)
    assert got.shape == want.shape == (4, 6, 100)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())


@pytest.mark.skipif(not (ASSET / "config.json").is_file(), reason="run: grove pretrain configs/llm/arith_sft.yaml")
def test_logits_match_hf_on_the_embedded_asset():
    from shared_rl.llm.model import load_causal_lm, load_tokenizer

    tok, model = load_tokenizer(str(ASSET)), load_causal_lm(str(ASSET)).eval()
    eng = FastLlamaEngine(model, tok.pad_token_id, tok.eos_token_id)
    prompts = [tok(p).input_ids for p in ("12+345=", "7+8=", "999+999=")]
    completions = [tok(c, add_special_tokens=False).input_ids for c in ("357", "15x", "199")]
    got = eng.teacher_forced_logits(prompts, completions)
    assert torch.allclose(got, hf_logits(model, prompts, completions), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_same_tokens_as_reference_engine_with_eos_and_compaction(temperature):
    torch.set_num_threads(1)
    model = tiny()
    eos = list(range(2, 40))            # ~40% of the vocabulary ends a row: rows end at different steps
    ref = TorchRolloutEngine(model, PAD, eos, max_batch_rows=10)
    fast = FastLlamaEngine(model, PAD, eos, max_batch_rows=10)   # chunks of 10 split a prompt's group of 4
    prompts = prompts_of([4, 9, 2, 6, 5])
    for seed in range(3):
        a = ref.generate(prompts, 4, 7, temperature, torch.Generator().manual_seed(seed))
        b = fast.generate(prompts, 4, 7, temperature, torch.Generator().manual_seed(seed))
        assert b.prompt_index == a.prompt_index == [i for i in range(5) for _ in range(4)]
        assert b.completion_ids == a.completion_ids and b.finished == a.finished and b.nfe == a.nfe
        for x, y in zip(a.sample_logprobs, b.sample_logprobs):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
        # EOS ends a row and is kept; nothing after it; unfinished rows ran to the cap; no pad inside a row
        for ids, fin in zip(b.completion_ids, b.finished):
            assert (ids[-1] in eos) == fin and not any(i in eos for i in ids[:-1])
            assert fin or len(ids) == 7
    lengths = {len(c) for c in b.completion_ids}
    assert len(lengths) > 2 or temperature == 0       # the sampled run really ended rows at different steps


def test_entropy_stops_and_trees_match_reference_engine():
    model = tiny()
    ref, fast = TorchRolloutEngine(model, PAD, EOS), FastLlamaEngine(model, PAD, EOS)
    prompts = prompts_of([3, 6])
    a = ref.generate(prompts, 3, 6, 1.0, torch.Generator().manual_seed(0), stop_entropy=4.4,
                     min_new_tokens_before_stop=2)
    b = fast.generate(prompts, 3, 6, 1.0, torch.Generator().manual_seed(0), stop_entropy=4.4,
                      min_new_tokens_before_stop=2)
    assert b.completion_ids == a.completion_ids and b.stopped == a.stopped and any(b.stopped)
    settings = LLMTreeSettings(True, [2, 2], 2, "entropy", 4.4, 1)
    ta = grow_trees(ref, prompts, settings, 6, 1.0, torch.Generator().manual_seed(2))
    tb = grow_trees(fast, prompts, settings, 6, 1.0, torch.Generator().manual_seed(2))
    assert tb.path == ta.path and tb.parent == ta.parent and tb.nfe == ta.nfe


def test_lora_merged_weights_follow_an_optimizer_step():
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(1)
    model = get_peft_model(tiny(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj", "up_proj", "down_proj"]))
    eng = FastLlamaEngine(model, PAD, EOS)
    prompts, completions = prompts_of([5, 3]), [[7, 8, 9], [10, 11, 12]]
    before = eng.teacher_forced_logits(prompts, completions)
    # a real update of the adapter (B starts at 0, so the first step moves the merged weights)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    for _ in range(2):
        loss = hf_logits_grad(model, prompts, completions).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    want = hf_logits(model, prompts, completions)
    assert not torch.allclose(want, before, atol=1e-3)          # the policy moved
    syncs = eng.syncs
    got = eng.teacher_forced_logits(prompts, completions)       # no explicit sync: version counters changed
    assert eng.syncs == syncs + 1
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())
    eng.sync_weights()
    assert eng.syncs == syncs + 1                                # nothing changed since: no second snapshot
    with model.disable_adapter():                                # peft's adapter switch is honoured as well
        eng.sync_weights(force=True)
        base = eng.teacher_forced_logits(prompts, completions)
        assert torch.allclose(base, hf_logits(model, prompts, completions), atol=1e-5, rtol=0)


def hf_logits_grad(model, prompts, completions):
    with torch.enable_grad():
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width + len(completions[0])), PAD)
        mask = torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids[i, width - len(p):] = torch.tensor(p + c)
            mask[i, width - len(p):] = 1
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_fast")
    tok = build_char_tokenizer()
    build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32, seed=0).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def make_domain(model_dir: Path, **overrides) -> LLMDomain:
    cfg = LLMConfig(model=str(model_dir), dataset=DatasetSettings(source="arith", num_train=64, num_eval=16),
                    max_new_tokens=6, **overrides)
    cfg.check("llm")
    return LLMDomain(cfg, RunContext(run_dir=None, device=torch.device("cpu"), seed=0, log=lambda s: None))


def test_engine_selected_by_config_and_ratio_still_exactly_one(tiny_dir):
    assert isinstance(make_domain(tiny_dir).engine, TorchRolloutEngine)          # the default is unchanged
    assert isinstance(make_domain(tiny_dir, engine="auto").engine, FastLlamaEngine)
    dom = make_domain(tiny_dir, engine="fast", lora=LLMLoraSettings(enabled=True, rank=4, alpha=8))
    assert isinstance(dom.engine, FastLlamaEngine)
    ro = dom.rollout([0, 1, 2], 4, torch.Generator().manual_seed(0), 0)
    out = dom.log_probs(ro, torch.arange(len(ro)), need_kl=False)
    # behaviour log-probs are still recomputed by the training model: the first ratio is exactly 1
    assert torch.equal(out.logp.detach()[ro.mask], ro.logp_old[ro.mask])
    with pytest.raises(ConfigError, match="engine must be"):
        LLMConfig(engine="vllm").check("llm")


def test_unsupported_models_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16))
    assert "gpt2" in unsupported_reason(gpt2)
    with pytest.raises(ValueError, match="cannot run"):
        FastLlamaEngine(gpt2, PAD, EOS)
    assert unsupported_reason(tiny()) is None


# ---- issue 42: the static decode loop (no compaction, no per-step host reads but the stop check) -----------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_static_loop_samples_the_compact_loops_tokens(kind, temperature):
    """Same token ids, finished/stopped flags, log-probs and forward count as the earlier compacting loop, greedy
    and sampled with a fixed generator, over several chunks (the generator's stream must carry over exactly), with
    rows ending early on EOS (so the compacting loop compacts) and entropy stops."""
    torch.set_num_threads(1)
    model = tiny(kind)
    eos = [EOS, 54, 62] + list(range(20, 36))   # many EOS ids: rows end at different steps (greedy too)
    prompts = prompts_of([3, 7, 5, 1, 4, 6], seed=2)
    for stop_entropy in (None, 4.4):
        outs = []
        for loop in ("compact", "static"):
            eng = FastLlamaEngine(model, PAD, eos, max_batch_rows=10, loop=loop)
            outs.append(eng.generate(prompts, 4, 12, temperature, torch.Generator().manual_seed(3),
                                     stop_entropy=stop_entropy))
        old, new = outs
        assert new.completion_ids == old.completion_ids
        assert new.finished == old.finished and new.stopped == old.stopped and new.nfe == old.nfe
        if stop_entropy is None:
            assert any(old.finished) and not all(old.finished)   # the compacting loop did compact
        for a, b in zip(old.sample_logprobs, new.sample_logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_full_width_step_equals_the_sliced_step(kind):
    """The CUDA-graph step (static shapes: the column as a tensor, attention over the whole cache, unopened columns
    masked) computes the sliced eager step's logits; run eagerly here (no GPU needed to check its arithmetic)."""
    from shared_rl.llm.fast_llama import _DecodeState, load_full_width

    torch.set_num_threads(1)
    eng = FastLlamaEngine(tiny(kind), PAD, EOS)
    prompts = prompts_of([3, 7, 5, 1], seed=4)
    toks = torch.randint(3, 100, (4, 5), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        logits, state = eng._start(prompts, torch.arange(4), 5)
        full = _DecodeState(keys=torch.full_like(state.keys, float("nan")), values=torch.full_like(state.values,
                            float("nan")), key_bias=state.key_bias.clone(), cos=state.cos, sin=state.sin,
                            width=state.width, next_pos=state.next_pos.clone())
        load_full_width(full, state)
        pos = state.next_pos.clone()
        for t in range(5):
            want = eng._step(toks[:, t], state, t)
            got = eng._decode_full(toks[:, t], pos, torch.tensor([state.width + t]), full)
            pos = pos + 1
            assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())


def test_draw_one_is_torch_multinomials_one_sample_path():
    """The static loop's draw: torch.multinomial(p, 1)'s tokens and the generator's stream after it, bit for bit,
    on peaked and flat rows (the draw reads the stream exactly as multinomial does, so the next chunk's noise is
    the reference's too)."""
    from shared_rl.llm.fast_llama import _draw_one

    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        probs = torch.log_softmax(torch.randn(16, 100, generator=g) * (0.1 + seed), -1).exp()
        ga, gb = torch.Generator().manual_seed(100 + seed), torch.Generator().manual_seed(100 + seed)
        assert torch.equal(_draw_one(probs, ga), torch.multinomial(probs, 1, generator=gb))
        assert torch.equal(torch.rand(4, generator=ga), torch.rand(4, generator=gb))


def test_static_loop_rejects_non_finite_logits():
    """A policy whose logits went non-finite is an error, as torch.multinomial's own check made it."""
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight[5] = float("nan")
    eng = FastLlamaEngine(model, PAD, EOS)
    with pytest.raises(ValueError, match="not finite"):
        eng.generate(prompts_of([3, 4]), 2, 6, 1.0, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_fp32_on_a_bfloat16_model(tied):
    """llm.lm_head_fp32 (TRL's cast_lm_head_to_fp32): the output layer in float32, its product in float32 (the
    bfloat16 model's hidden state cast up), tied embeddings still giving bfloat16 inputs; the fast engine's logits
    match the HF forward's."""
    from shared_rl.llm.model import cast_lm_head_to_fp32

    torch.set_num_threads(1)
    model = tiny()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(torch.bfloat16)
    cast_lm_head_to_fp32(model)
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = torch.tensor([[1, 5, 9, 13]])
    assert model.model.embed_tokens(ids).dtype == torch.bfloat16
    hidden = model.model(input_ids=ids).last_hidden_state
    out = model(input_ids=ids)
    assert out.logits.dtype == torch.float32
    assert torch.equal(out.logits, torch.nn.functional.linear(hidden.float(), model.lm_head.weight))
    eng = FastLlamaEngine(model, PAD, EOS)
    prompts, completions = prompts_of([3, 5]), [[7, 8, 9], [10, 11, 12]]
    got, want = eng.teacher_forced_logits(prompts, completions), hf_logits(model, prompts, completions)
    assert torch.allclose(got, want, atol=0.05, rtol=0), float((got - want).abs().max())  # bfloat16 blocks
