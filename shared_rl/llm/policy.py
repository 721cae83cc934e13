"""Token log-probs of completions under a causal LM, recomputed in a fixed padding layout.

Layout of one row: ``[left pads | prompt | completion | right pads]`` with width ``P + T`` where ``P`` and ``T``
are the prompt and completion widths *of the rollout that produced the row* (stored in the payload as
``layout``). Recomputing in the very layout the behaviour log-probs were computed in makes the importance ratio
exactly 1 before the first update (PPO/GRPO assume it; a drift here is silent bias). Positions come from the
attention mask, so the left-pad amount does not change what the model sees.

Log-probs are of the temperature-scaled distribution ``softmax(logits / temperature)``, the one sampled from
(as in TRL's GRPO and verl).

Prefix-shared variant (``collate_shared`` + ``token_log_probs_shared``, ``llm.share_prompt_forward``): the G
completions of a prompt share its prefix, so each distinct prompt of a micro-batch is run once (with grad) and its
KV cache is indexed out to its completion rows, which then run on top of it. Same layout (prompt width ``P``,
completion width ``T``, left pads, positions from the mask), same mathematics; the prompt's gradient is the sum
over its rows (the backward of the index). It differs from the one-pass forward only by float rounding (other
matrix shapes), so behaviour log-probs must come from the same function to keep the first-step ratio exactly 1.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence


@dataclass
class SequenceBatch:
    input_ids: torch.Tensor        # [B, P+T]
    attention_mask: torch.Tensor   # [B, P+T]
    position_ids: torch.Tensor     # [B, P+T]
    completion_ids: torch.Tensor   # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool, real completion tokens
    prompt_width: int


def collate(prompt_ids: list[torch.Tensor], completion_ids: list[torch.Tensor], layout: torch.Tensor | None,
            pad_id: int, device: torch.device | str = "cpu") -> SequenceBatch:
    """Rows -> padded tensors. ``layout[i] = (P_i, T_i)``: widths to pad to (the max is used over rows, which
    equals every row's own layout when the rows come from one rollout)."""
    p_width = max(len(p) for p in prompt_ids)
    t_width = max([len(c) for c in completion_ids] + [1])
    if layout is not None and len(layout):
        p_width = max(p_width, int(layout[:, 0].max()))
        t_width = max(t_width, int(layout[:, 1].max()))
    b = len(prompt_ids)
    ids = torch.full((b, p_width + t_width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, p_width + t_width), dtype=torch.long)
    comp_mask = torch.zeros((b, t_width), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[i, p_width - len(p):p_width] = p
        mask[i, p_width - len(p):p_width] = 1
        ids[i, p_width:p_width + len(c)] = c
        mask[i, p_width:p_width + len(c)] = 1
        comp_mask[i, :len(c)] = True
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return SequenceBatch(ids.to(device), mask.to(device), positions.to(device), ids[:, p_width:].to(device),
                         comp_mask.to(device), p_width)


def completion_log_probs(logits: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                          temperature: float, with_entropy: bool,
                          entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits [B, T, V]`` (``[:, t]`` predicts completion token t) -> masked log-probs and optional entropy
    (with grad only when ``entropy_grad``: an entropy bonus trains it; else it is only logged or masks tokens, and
    its full-vocabulary softmax graph is not kept)."""
    logits = logits.float() / temperature
    picked = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    logp = (picked - torch.logsumexp(logits, -1)) * completion_mask
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            all_logp = torch.log_softmax(logits, -1)
            entropy = -(all_logp.exp() * all_logp).sum(-1) * completion_mask
    return logp, entropy


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError("log-probs are defined for temperature > 0 (greedy decoding has no density)")


def token_log_probs(model: torch.nn.Module, batch: SequenceBatch, temperature: float,
                    with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` log-probs of the completion tokens (0 on pads) and optionally the per-token entropy (with grad
    only when ``entropy_grad``)."""
    _check_temperature(temperature)
    t_width = batch.completion_ids.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False, logits_to_keep=t_width + 1)
    # position P-1+t predicts completion token t
    return completion_log_probs(out.logits[:, :-1], batch.completion_ids, batch.completion_mask, temperature,
                                 with_entropy, entropy_grad)


@dataclass
class SharedPrefixBatch:
    """A micro-batch with each distinct prompt stored once: ``B`` rows over ``U`` prompts, same layout as
    ``SequenceBatch`` (prompt width ``P`` left-padded, completion width ``T`` right-padded)."""

    prompt_ids: torch.Tensor            # [U, P]
    prompt_mask: torch.Tensor           # [U, P]
    prompt_positions: torch.Tensor      # [U, P]
    row_prompt: torch.Tensor            # [B] long, which prompt each row continues
    completion_ids: torch.Tensor        # [B, T]
    completion_mask: torch.Tensor       # [B, T] bool, real completion tokens
    attention_mask: torch.Tensor        # [B, P+T], the row's prompt mask then its completion mask
    completion_positions: torch.Tensor  # [B, T]
    prompt_width: int


def collate_shared(prompt_ids: list[torch.Tensor], completion_ids: list[torch.Tensor], layout: torch.Tensor | None,
                   pad_id: int, device: torch.device | str = "cpu") -> SharedPrefixBatch:
    """Rows -> a ``SharedPrefixBatch`` in ``collate``'s layout; prompts are deduplicated by their token ids (rows
    of one group, and of a refilled group drawn twice, share one prompt forward)."""
    p_width = max(len(p) for p in prompt_ids)
    t_width = max([len(c) for c in completion_ids] + [1])
    if layout is not None and len(layout):
        p_width = max(p_width, int(layout[:, 0].max()))
        t_width = max(t_width, int(layout[:, 1].max()))
    index: dict[tuple[int, ...], int] = {}
    unique: list[torch.Tensor] = []
    row_prompt = []
    for p in prompt_ids:
        key = tuple(p.tolist())
        if key not in index:
            index[key] = len(unique)
            unique.append(p)
        row_prompt.append(index[key])
    u = len(unique)
    p_ids = torch.full((u, p_width), pad_id, dtype=torch.long)
    for j, p in enumerate(unique):   # the distinct prompts only (a few); the rows below are padded in one call
        p_ids[j, p_width - len(p):] = p
    p_len = torch.tensor([len(p) for p in unique], dtype=torch.long)
    p_mask = (torch.arange(p_width) >= (p_width - p_len)[:, None]).long()
    # the completions' padding in one call (not a slice assignment per row: this runs for every micro-batch)
    c_len = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)
    c_ids = pad_sequence([c.long() for c in completion_ids], batch_first=True, padding_value=pad_id)
    c_ids = F.pad(c_ids, (0, t_width - c_ids.shape[1]), value=pad_id)
    c_mask = (torch.arange(t_width) < c_len[:, None]).long()
    rows = torch.tensor(row_prompt, dtype=torch.long)
    prompt_len = p_mask.sum(1)
    # collate's positions (mask.cumsum - 1 over the whole row), split at the prompt/completion border
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    c_pos = (prompt_len[rows, None] + c_mask.cumsum(-1) - 1).clamp(min=0)
    att = torch.cat([p_mask[rows], c_mask], 1)
    return SharedPrefixBatch(p_ids.to(device), p_mask.to(device), p_pos.to(device), rows.to(device),
                             c_ids.to(device), c_mask.bool().to(device), att.to(device), c_pos.to(device), p_width)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The KV-cache argument of ``model``'s forward: transformers 5.x renamed ``past_key_values`` to ``cache``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def token_log_probs_shared(model: torch.nn.Module, batch: SharedPrefixBatch, temperature: float,
                           with_entropy: bool = False,
                           entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_log_probs`` with one forward per distinct prompt: the prompts but their last token run with
    ``use_cache``, their KV cache is indexed out to the rows (``Cache.batch_select_indices``, differentiable), and
    each row runs ``[last prompt token, completion tokens :T-1]`` on it, whose T outputs predict the T completion
    tokens. The last prompt token goes with the rows (not the shared pass) so that every logit comes from one
    ``[B*T, hidden]`` output-layer product, as in the one-pass forward: a separate ``[U, hidden]`` product for
    completion token 0 rounds differently with U (CPU GEMM kernels change with the row count), which would make
    the behaviour log-probs depend on how rows are grouped into micro-batches."""
    _check_temperature(temperature)
    p_width = batch.prompt_width
    rows = batch.row_prompt
    last_ids = batch.prompt_ids[:, -1:].index_select(0, rows)                     # left-padded: the real last token
    last_pos = batch.prompt_positions[:, -1:].index_select(0, rows)
    ids = torch.cat([last_ids, batch.completion_ids[:, :-1]], 1)                  # [B, T]
    positions = torch.cat([last_pos, batch.completion_positions[:, :-1]], 1)
    attention = batch.attention_mask[:, :-1]                                      # [B, P + T - 1]
    kwargs = {}
    if p_width > 1:
        name = cache_kwarg(model)
        pre = model(input_ids=batch.prompt_ids[:, :-1], attention_mask=batch.prompt_mask[:, :-1],
                    position_ids=batch.prompt_positions[:, :-1], use_cache=True, logits_to_keep=1)
        cache = getattr(pre, name)
        if cache is None:
            raise RuntimeError("the model returned no KV cache (gradient checkpointing turns it off); "
                               "set llm.share_prompt_forward: false")
        cache.batch_select_indices(rows)
        kwargs[name] = cache
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=p_width > 1, **kwargs)
    return completion_log_probs(out.logits, batch.completion_ids, batch.completion_mask, temperature, with_entropy,
                                 entropy_grad)


def reference_context(model: torch.nn.Module, frozen_copy: torch.nn.Module | None):
    """(module, context) to compute reference log-probs: the LoRA base (adapter disabled) or a frozen copy."""
    if hasattr(model, "disable_adapter") and getattr(model, "peft_config", None):
        return model, model.disable_adapter()
    if frozen_copy is not None:
        return frozen_copy, contextlib.nullcontext()
    raise ValueError("a KL term needs a reference policy: enable LoRA (the base model is the reference) or set "
                     "llm.keep_reference: true to keep a frozen copy")
