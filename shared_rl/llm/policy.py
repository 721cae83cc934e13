"""Token log-probs of completions under a causal LM, recomputed in a fixed padding layout.

Layout of one row: ``[left pads | prompt | completion | right pads]`` with width ``P + T`` where ``P`` and ``T``
are the prompt and completion widths *of the rollout that produced the row* (stored in the payload as
``layout``). Recomputing in the very layout the behaviour log-probs were computed in makes the importance ratio
exactly 1 before the first update (PPO/GRPO assume it; a drift here is silent bias). Positions come from the
attention mask, so the left-pad amount does not change what the model sees.

Log-probs are of the temperature-scaled distribution ``softmax(logits / temperature)``, the one sampled from
(as in TRL's GRPO and verl).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


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


def token_log_probs(model: torch.nn.Module, batch: SequenceBatch, temperature: float,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` log-probs of the completion tokens (0 on pads) and optionally the per-token entropy (no grad)."""
    if temperature <= 0:
        raise ValueError("log-probs are defined for temperature > 0 (greedy decoding has no density)")
    t_width = batch.completion_ids.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False, logits_to_keep=t_width + 1)
    logits = out.logits[:, :-1].float() / temperature          # position P-1+t predicts completion token t
    picked = logits.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    logp = (picked - torch.logsumexp(logits, -1)) * batch.completion_mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            all_logp = torch.log_softmax(logits, -1)
            entropy = -(all_logp.exp() * all_logp).sum(-1) * batch.completion_mask
    return logp, entropy


def reference_context(model: torch.nn.Module, frozen_copy: torch.nn.Module | None):
    """(module, context) to compute reference log-probs: the LoRA base (adapter disabled) or a frozen copy."""
    if hasattr(model, "disable_adapter") and getattr(model, "peft_config", None):
        return model, model.disable_adapter()
    if frozen_copy is not None:
        return frozen_copy, contextlib.nullcontext()
    raise ValueError("a KL term needs a reference policy: enable LoRA (the base model is the reference) or set "
                     "llm.keep_reference: true to keep a frozen copy")
