"""The engines' sampling filters (``shared_rl.llm.sampling``) against transformers' logits processors on the same
logits, and the filters inside both rollout engines."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from shared_rl.config import ConfigError
from shared_rl.llm.engine import TorchRolloutEngine
from shared_rl.llm.fast_llama import FastLlamaEngine
from shared_rl.llm.model import build_tiny_llama
from shared_rl.llm.sampling import SamplingFilters, filtered_scores, seen_tokens
from shared_rl.llm.tokenizer import build_char_tokenizer


def _hf(filters: SamplingFilters, temperature: float) -> LogitsProcessorList:
    """The processors transformers' ``generate`` builds for the same settings, in its order."""
    out = LogitsProcessorList()
    if filters.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(filters.repetition_penalty))
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if filters.top_k:
        out.append(TopKLogitsWarper(filters.top_k))
    if filters.top_p < 1.0:
        out.append(TopPLogitsWarper(filters.top_p))
    if filters.min_p:
        out.append(MinPLogitsWarper(filters.min_p))
    return out


@pytest.mark.parametrize("filters,temperature", [
    (SamplingFilters(top_p=0.8), 1.0), (SamplingFilters(top_k=5), 0.7), (SamplingFilters(min_p=0.1), 1.3),
    (SamplingFilters(repetition_penalty=1.7), 1.0),
    (SamplingFilters(top_p=0.9, top_k=12, min_p=0.05, repetition_penalty=1.3), 0.8)])
def test_filters_equal_transformers_logits_processors(filters, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 3
    input_ids = torch.randint(0, 40, (6, 9), generator=g)  # unpadded rows: every id is a real token
    ours = filtered_scores(logits, temperature, filters, seen_tokens(input_ids, torch.ones_like(input_ids), 40))
    theirs = _hf(filters, temperature)(input_ids, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    kept = ~torch.isinf(theirs)
    assert torch.allclose(ours[kept], theirs[kept], rtol=1e-6, atol=1e-6)
    assert bool(kept.any(-1).all())  # a token always survives


def test_top_p_by_hand():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.8 keeps the first two (0.5 + 0.3 reaches 0.8), drops the rest
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = filtered_scores(logits, 1.0, SamplingFilters(top_p=0.8))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    # repetition penalty 2 on a seen positive logit halves it, on a seen negative one doubles it
    pen = filtered_scores(torch.tensor([[2.0, -2.0, 1.0]]), 1.0, SamplingFilters(repetition_penalty=2.0),
                          torch.tensor([[True, True, False]]))
    assert pen.tolist() == [[1.0, -4.0, 1.0]]


def test_bad_filter_values_are_one_line_errors():
    with pytest.raises(ConfigError, match="top_p must be in"):
        SamplingFilters(top_p=0.0).check("llm")
    with pytest.raises(ConfigError, match="repetition_penalty must be > 0"):
        SamplingFilters(repetition_penalty=0.0).check("llm")


@pytest.mark.parametrize("filters", [SamplingFilters(top_k=1), SamplingFilters(min_p=1.0)])
def test_a_one_token_filter_samples_the_greedy_completion(filters):
    """top_k=1 (or min_p=1) leaves only the most likely token, so sampling at temperature 1 is greedy decoding."""
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64, seed=3).eval()
    prompts = [tok("12+3=").input_ids, tok("7+70=").input_ids]
    for cls in (TorchRolloutEngine, FastLlamaEngine):
        engine = cls(model, tok.pad_token_id, tok.eos_token_id)
        greedy = engine.generate(prompts, 1, 6, 0.0, torch.Generator().manual_seed(0)).completion_ids
        engine.sampling = filters
        sampled = engine.generate(prompts, 3, 6, 1.0, torch.Generator().manual_seed(1)).completion_ids
        assert sampled == [greedy[0]] * 3 + [greedy[1]] * 3


def test_both_engines_draw_the_same_filtered_tokens():
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64, seed=1).eval()
    prompts = [tok("12+3=").input_ids, tok("5+5=").input_ids, tok("100+11=").input_ids]
    filters = SamplingFilters(top_p=0.9, top_k=20, min_p=0.02, repetition_penalty=1.5)
    outs = []
    for make in (lambda: TorchRolloutEngine(model, tok.pad_token_id, tok.eos_token_id, sampling=filters),
                 lambda: FastLlamaEngine(model, tok.pad_token_id, tok.eos_token_id),
                 lambda: FastLlamaEngine(model, tok.pad_token_id, tok.eos_token_id, loop="static")):
        engine = make()
        engine.sampling = filters
        outs.append(engine.generate(prompts, 4, 8, 1.0, torch.Generator().manual_seed(7)).completion_ids)
    assert outs[0] == outs[1] == outs[2]
    plain = TorchRolloutEngine(model, tok.pad_token_id, tok.eos_token_id).generate(
        prompts, 4, 8, 1.0, torch.Generator().manual_seed(7)).completion_ids
    assert plain != outs[0]  # the filters changed what was drawn
