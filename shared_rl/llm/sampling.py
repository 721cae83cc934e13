"""Sampling filters of the rollout engines: repetition penalty, temperature, top-k, top-p (nucleus) and min-p, in the
order and with the arithmetic of transformers' logits processors (``RepetitionPenaltyLogitsProcessor``, then the
warpers ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``), which is what
TRL's ``GRPOTrainer`` samples with (``tests/llm/test_sampling.py`` compares them on the same logits).

The filters change only which token is *drawn*. The log-probs the loss trains on stay those of
``softmax(logits / temperature)`` (``policy.token_log_probs``), as in TRL, whose ``_get_per_token_logps`` divides by
the temperature only; so the first-step ratio is still exactly 1.

Repetition penalty (Keskar et al. 2019, "CTRL"): a token already in the row (its prompt tokens and what it has
generated, padding excluded) has its logit divided by the penalty when positive and multiplied by it when negative.
transformers' processor reads the padded ``input_ids``, so a left-padded batch there also penalises the pad token;
here padding is not part of a row, so a row's draw does not depend on how it was batched.
"""
from __future__ import annotations

import torch

from .config import SamplingFilters  # noqa: F401  (shared_rl.llm.sampling.SamplingFilters, as before)


def seen_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` bool: which vocabulary ids occur among the real (``mask`` 1) tokens of each row of ``ids``."""
    counts = torch.zeros((ids.shape[0], vocab_size), dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, mask.to(torch.int32))
    return counts > 0


def mark_seen(seen: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, active: torch.Tensor) -> None:
    """Add ``tokens[j]`` to row ``rows[j]`` of ``seen`` where ``active[j]`` (in place)."""
    seen[rows[active], tokens[active]] = True


def filtered_scores(logits: torch.Tensor, temperature: float, filters: SamplingFilters,
                    seen: torch.Tensor | None = None) -> torch.Tensor:
    """The scores a token is drawn from (``softmax`` of them) or picked by (``argmax``, greedy): ``logits [B, V]``
    penalised on ``seen`` tokens, divided by ``temperature`` (when > 0), then top-k, top-p and min-p set what they
    remove to ``-inf`` (at least one token always stays)."""
    scores = logits.float()
    if filters.penalises_repeats and seen is not None:
        p = filters.repetition_penalty
        scores = torch.where(seen, torch.where(scores < 0, scores * p, scores / p), scores)
    if temperature > 0 and temperature != 1.0:
        scores = scores / temperature
    neg_inf = float("-inf")
    if filters.top_k > 0:
        k = min(filters.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, neg_inf)
    if filters.top_p < 1.0:
        # drop the least likely tokens whose total probability stays within 1 - top_p; the most likely token stays
        ordered, order = torch.sort(scores, descending=False)
        below = ordered.softmax(-1).cumsum(-1) <= 1 - filters.top_p
        below[..., -1] = False
        scores = scores.masked_fill(below.scatter(-1, order, below), neg_inf)
    if filters.min_p > 0:
        probs = scores.softmax(-1)
        drop = probs < filters.min_p * probs.amax(-1, keepdim=True)
        drop.scatter_(-1, probs.argmax(-1, keepdim=True), False)
        scores = scores.masked_fill(drop, neg_inf)
    return scores
