"""Rollout engines: the part that samples completions. The trainer-side code only sees the small protocol below,
so a vLLM or SGLang server (sampling in another process, weights pushed by ``sync_weights``) can replace the
plain-PyTorch engines without touching the domain. Two are built in: ``TorchRolloutEngine`` below (any HF causal
LM) and ``fast_llama.FastLlamaEngine`` (Llama / Mistral / Qwen2; a lean forward on a weight snapshot). Behaviour log-probs for the loss are *not* taken from the
engine by default: the domain computes them with its training log-prob function (``recompute`` at rollout time, or
``deferred`` to the trainer's first forward) so the ratio is exactly 1 before the first update
(an engine's own log-probs differ in kernels and batch layout; ``behaviour_logprobs: engine`` opts into them).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .sampling import SamplingFilters, filtered_scores, mark_seen, seen_tokens


@dataclass
class Generation:
    """What one ``generate`` call returns; rows are prompt-major (row = prompt_index * n + j).

    completion_ids: per row, the sampled token ids (EOS included when it was sampled).
    finished: per row, whether EOS was sampled (False: length cap, or stopped at a branch point).
    stopped: per row, whether sampling stopped *before* a high-entropy token (TreeRL-style branch point).
    sample_logprobs: per row, the engine's own log-probs of the sampled tokens (``behaviour_logprobs: engine``).
    nfe: model forward evaluations, counted per row per model call.
    """

    prompt_index: list[int]
    completion_ids: list[list[int]]
    finished: list[bool]
    stopped: list[bool] = field(default_factory=list)
    sample_logprobs: list[list[float]] = field(default_factory=list)
    nfe: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """Sampling backend. ``prompts`` are token-id lists (special tokens and chat template already applied)."""

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 generator: torch.Generator, stop_entropy: float | None = None,
                 min_new_tokens_before_stop: int = 1) -> Generation:
        """Sample ``n`` completions per prompt. ``temperature == 0`` is greedy. ``stop_entropy`` (optional for
        an engine to support): end a row before sampling a token whose distribution has entropy above it."""

    def sync_weights(self) -> None:
        """Make the engine sample from the current trained weights (no-op when it shares the module)."""


def _left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


class TorchRolloutEngine:
    """Batched sampling with the model's KV cache in a plain PyTorch loop (no ``generate`` overhead).

    Works for any ``AutoModelForCausalLM`` and shares the training module, so ``sync_weights`` is a no-op. For
    Llama-family models ``fast_llama.FastLlamaEngine`` samples the same tokens ~3x faster on CPU (``llm.engine:
    fast``; docs/bench/llm.md): most of this loop's time is the HF modules' per-call Python, not arithmetic.
    """

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int] | int,
                 max_batch_rows: int = 256, sampling: SamplingFilters | None = None):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        self.max_batch_rows = max_batch_rows
        self.sampling = sampling or SamplingFilters()  # top-k / top-p / min-p / repetition penalty (sampling.py)

    def sync_weights(self) -> None:
        return None

    def _cache_kwarg(self) -> str:
        # transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns); support both.
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 generator: torch.Generator, stop_entropy: float | None = None,
                 min_new_tokens_before_stop: int = 1) -> Generation:
        rows = [p for p in prompts for _ in range(n)]
        index = [i for i in range(len(prompts)) for _ in range(n)]
        out = Generation(prompt_index=index, completion_ids=[], finished=[], stopped=[], sample_logprobs=[])
        # Rows sampled on an accelerator need a generator on that device; derive it from the caller's so runs
        # stay reproducible from one seed.
        gen = generator
        if self.device.type != generator.device.type:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            gen = torch.Generator(device=self.device).manual_seed(seed)
        was_training = self.model.training
        if was_training:
            self.model.eval()
        try:
            for start in range(0, len(rows), self.max_batch_rows):
                self._generate_chunk(rows[start:start + self.max_batch_rows], max_new_tokens, temperature, gen,
                                     stop_entropy, min_new_tokens_before_stop, out)
        finally:
            if was_training:
                self.model.train()
        return out

    def _generate_chunk(self, rows, max_new_tokens, temperature, gen, stop_entropy, min_tokens, out: Generation):
        device = self.device
        ids, mask = _left_pad(rows, self.pad_token_id, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        b = ids.shape[0]
        eos = torch.tensor(self.eos_token_ids, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        finished = torch.zeros_like(done)
        stopped = torch.zeros_like(done)
        tokens, valid, logps = [], [], []
        cache_name = self._cache_kwarg()
        result = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1)
        out.nfe += b
        next_pos = positions[:, -1] + 1
        filters = self.sampling
        seen = seen_tokens(ids, mask, result.logits.shape[-1]) if filters.penalises_repeats else None
        all_rows = torch.arange(b, device=device)
        for t in range(max_new_tokens):
            logits = result.logits[:, -1].float()
            if temperature > 0:
                logp_all = torch.log_softmax(logits / temperature, -1)
            else:
                logp_all = torch.log_softmax(logits, -1)
            if stop_entropy is not None and t >= min_tokens:
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                branch_here = (~done) & (entropy > stop_entropy)
                stopped |= branch_here
                done |= branch_here
            # the filters pick the token; logp_all (temperature only) stays the density the loss trains on
            scores = filtered_scores(logits, temperature, filters, seen) if filters.active else None
            if temperature > 0:
                probs = logp_all.exp() if scores is None else scores.softmax(-1)
                sample = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            else:
                sample = (logits if scores is None else scores).argmax(-1)
            active = ~done
            if seen is not None:
                mark_seen(seen, all_rows, sample, active)
            tok = torch.where(active, sample, torch.full_like(sample, self.pad_token_id))
            tokens.append(tok)
            valid.append(active)
            logps.append(logp_all.gather(1, sample[:, None]).squeeze(1))
            is_eos = active & torch.isin(tok, eos)
            finished |= is_eos
            done |= is_eos
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], 1)
            result = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                use_cache=True, **{cache_name: getattr(result, cache_name)})
            out.nfe += int(active.sum())
            next_pos = next_pos + 1
        tok_mat = torch.stack(tokens, 1).cpu()
        valid_mat = torch.stack(valid, 1).cpu()
        logp_mat = torch.stack(logps, 1).cpu()
        for i in range(b):
            keep = valid_mat[i]
            out.completion_ids.append(tok_mat[i][keep].tolist())
            out.sample_logprobs.append(logp_mat[i][keep].tolist())
        out.finished += finished.cpu().tolist()
        out.stopped += stopped.cpu().tolist()
