"""A lean, differentiable log-prob forward for Llama-family causal LMs (``llm.train_forward: fast``): the loss side
of the split whose sampling side is ``fast_llama.FastLlamaEngine``.

Why: at the sizes RL recipes run on a CPU the loss forward + backward through transformers' modules is most of a
GRPO step, and much of it is work that decides nothing: every row is padded to the longest completion of the
micro-batch, attention runs SDPA's flash kernels on a handful of keys, and the module tree adds mask construction,
the dynamic cache and its index copies, and separate q/k/v and gate/up products. This forward computes the same
log-probs from the same parameters (autograd reaches them through the same tensors) with:

* **packed tokens**: the projections, the MLP, the output layer and the log-softmax run only on the positions
  that score a real completion token (``len(completion)`` per row) and on the real prompt tokens, never on pads,
  prompts and rows as one token set (one call per op for both);
* **the prompt once** (as ``share_prompt_forward``): each distinct prompt's tokens but its last run once, and their
  keys / values are indexed out to the prompt's rows; in the last layer only the keys / values of the prompt are
  computed (nothing reads its outputs there);
* **fused products**: q/k/v and gate/up as one product each (the weights concatenated per forward, so gradients
  reach the original parameters), ``F.rms_norm``, rotary tables looked up by position with one ``roll``;
* **attention as two batched products** over a head-major layout (contiguous ``[heads·rows]`` batches) with an
  additive mask over the few keys and a whole-tensor softmax (on a CPU cheaper than SDPA's kernels at these
  lengths, forward and backward; SDPA elsewhere, a branch not yet run against the HF forward, so
  ``train_forward: auto`` picks this forward on the CPU only).

The layout is ``collate_shared``'s (``policy.SharedPrefixBatch``): positions from the attention mask, the last
prompt token run with the rows, so the mathematics is ``token_log_probs`` / ``token_log_probs_shared``'s; results
differ from them by float rounding only (``tests/llm/test_fast_train.py``: log-probs, entropies and every gradient
against the HF forward). Behaviour, training and reference log-probs all use this one function when it is on,
so the first-step ratio is still exactly 1 with ``behaviour_logprobs: deferred``.

Supported: what ``FastLlamaEngine`` supports (Llama / Mistral / Qwen2, SiLU MLP without bias, position-only rope),
without a peft wrapper, attention dropout or gradient checkpointing; ``unsupported_reason`` names what is not.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fast_llama import _base_model
from .fast_llama import unsupported_reason as _engine_reason
from .policy import SharedPrefixBatch, _check_temperature


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when ``fast_token_log_probs`` computes ``model``'s log-probs, else why not (one line)."""
    reason = _engine_reason(model)
    if reason is not None:
        return reason
    if getattr(model, "peft_config", None) or hasattr(model, "get_base_model"):
        return "a peft-wrapped model (the adapter's own layers run through its modules)"
    cfg = _base_model(model).config
    if getattr(cfg, "attention_dropout", 0.0):
        return f"attention_dropout {cfg.attention_dropout}"
    if getattr(_base_model(model), "is_gradient_checkpointing", False):
        return "gradient checkpointing (this forward keeps every activation)"
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class _Spec:
    """The model's shapes, read once per forward (cheap attribute reads)."""

    def __init__(self, base: torch.nn.Module):
        cfg = base.config
        self.h = cfg.num_attention_heads
        self.kvh = getattr(cfg, "num_key_value_heads", None) or self.h
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.h
        self.eps = cfg.rms_norm_eps
        uses_window = cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)
        self.window = getattr(cfg, "sliding_window", None) if uses_window else None


class _SoftmaxLastDim(torch.autograd.Function):
    """Softmax over a short last dimension (a few dozen keys): the same function as ``Tensor.softmax(-1)``, as
    whole-tensor ops, because the library kernel walks such short rows one at a time (measured ~4x slower here,
    forward and backward)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        e = (scores - scores.amax(-1, keepdim=True)).exp_()
        p = e.div_(e.sum(-1, keepdim=True))
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        return p * (grad - (grad * p).sum(-1, keepdim=True))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """Head-major ``q [h, n, w, hd]`` over ``k, v [kvh, n, keys, hd]`` with the additive ``bias [n, w, keys]`` (0 or
    -inf) -> ``[n * w, h * hd]``. Head-major so that the batched products read contiguous ``[h·n]`` batches (no
    hidden copies of q, k and v)."""
    _, n, w, _ = q.shape
    if q.device.type == "cpu":
        if spec.kvh != spec.h:   # query head i reads kv head i // (h / kvh), as transformers' repeat_kv
            k = k.repeat_interleave(spec.h // spec.kvh, 0)
            v = v.repeat_interleave(spec.h // spec.kvh, 0)
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(spec.hd ** -0.5) + bias
        out = torch.matmul(_SoftmaxLastDim.apply(scores), v)                       # [h, n, w, hd]
        return out.permute(1, 2, 0, 3).reshape(n * w, spec.h * spec.hd)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=bias[:, None], scale=spec.hd ** -0.5,
                                         enable_gqa=spec.h != spec.kvh)            # [n, h, w, hd]
    return out.transpose(1, 2).reshape(n * w, spec.h * spec.hd)


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean ``[n, w, keys]`` -> additive ``[n, w, keys]``."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.tensor(float("-inf"), dtype=dtype, device=allowed.device))


def fast_token_log_probs(model: torch.nn.Module, batch: SharedPrefixBatch, temperature: float,
                         with_entropy: bool = False,
                         entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_log_probs_shared``'s ``[B, T]`` log-probs (0 on pads) and optional entropy, computed on the packed
    real tokens (see the module docstring)."""
    _check_temperature(temperature)
    base = _base_model(model)
    spec = _Spec(base)
    h, kvh, hd = spec.h, spec.kvh, spec.hd
    dev = batch.completion_ids.device
    embed = base.model.embed_tokens.weight
    dtype = base.model.layers[0].self_attn.o_proj.weight.dtype
    u, p_width = batch.prompt_ids.shape
    b, t_width = batch.completion_ids.shape
    n_pre = p_width - 1
    if spec.window is not None and p_width + t_width > spec.window:
        raise ValueError(f"sequences of {p_width + t_width} tokens exceed the sliding window ({spec.window}); "
                         f"set llm.train_forward: hf")
    rows = batch.row_prompt
    # rows: [last prompt token, completion[:T-1]]; position t scores completion token t, so a row needs its first
    # len(completion) positions (they are also the only keys its scored positions read)
    lengths = batch.completion_mask.sum(1)
    row_real = torch.arange(t_width, device=dev)[None] < lengths[:, None]           # [B, T]
    ids = torch.cat([batch.prompt_ids[:, -1:].index_select(0, rows), batch.completion_ids[:, :-1]], 1)
    pos = torch.cat([batch.prompt_positions[:, -1:].index_select(0, rows), batch.completion_positions[:, :-1]], 1)
    pre_real = batch.prompt_mask[:, :-1].bool()                                     # [U, P-1]
    # One token set for every per-token op (norms, projections, MLP): the prompts' real tokens, then the rows' real
    # positions; "grid" = the padded layouts attention reads, [U·(P-1) prompt cells | B·T row cells]
    n_grid_pre = u * n_pre
    row_flat = torch.nonzero(row_real.flatten()).flatten()
    pre_flat = torch.nonzero(pre_real.flatten()).flatten()
    flat = torch.cat([pre_flat, row_flat + n_grid_pre])
    n_pre_tokens = pre_flat.numel()
    grid_ids = torch.cat([batch.prompt_ids[:, :-1].flatten(), ids.flatten()])
    grid_pos = torch.cat([batch.prompt_positions[:, :-1].flatten(), pos.flatten()])
    # rotary tables for every position in the batch, from the model's own rotary module
    cos_t, sin_t = base.model.rotary_emb(embed[None, :1].to(dtype), torch.arange(int(pos.max()) + 1, device=dev)[None])
    cos_t, sin_t = cos_t[0].to(dtype), sin_t[0].to(dtype)
    half = hd // 2
    sin_t = torch.cat([-sin_t[:, :half], sin_t[:, half:]], -1)  # rotate_half(x)·sin = roll(x, hd/2)·[-sin₁, sin₂]
    cos_g, sin_g = cos_t.index_select(0, grid_pos), sin_t.index_select(0, grid_pos)   # [grid, hd]
    x = embed.index_select(0, grid_ids.index_select(0, flat)).to(dtype)             # [N, hidden]
    # keys: a row sees its prompt's real tokens, then its own real positions causally; a prompt token sees the real
    # tokens up to it; a pad query sees itself so that no softmax row is empty (its output is never read)
    eye_t = torch.eye(t_width, dtype=torch.bool, device=dev)
    own = eye_t | (torch.ones_like(eye_t).tril() & row_real[:, None, :])            # [B, T, T]
    if n_pre > 0:
        eye_p = torch.eye(n_pre, dtype=torch.bool, device=dev)
        pre_bias = _bias((torch.ones_like(eye_p).tril()[None] & pre_real[:, None, :]) | eye_p[None], dtype)
        own = torch.cat([pre_real.index_select(0, rows)[:, None, :].expand(b, t_width, n_pre), own], 2)
    row_bias = _bias(own, dtype)
    layers = base.model.layers
    for li, layer in enumerate(layers):
        a, m = layer.self_attn, layer.mlp
        w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        b_qkv = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
        qkv = F.linear(_rms(x, layer.input_layernorm.weight, spec.eps), w_qkv, b_qkv).view(-1, h + 2 * kvh, hd)
        # head-major grid [heads, cells, hd]: every attention operand below is a contiguous view of it
        grid = qkv.new_zeros((h + 2 * kvh, n_grid_pre + b * t_width, hd)).index_copy(1, flat, qkv.transpose(0, 1))
        qk = grid[:h + kvh]
        qk = qk * cos_g + torch.roll(qk, half, -1) * sin_g
        q, k, v = qk[:h], qk[h:], grid[h + kvh:]
        q_r = q[:, n_grid_pre:].view(h, b, t_width, hd)
        k_r, v_r = k[:, n_grid_pre:].view(kvh, b, t_width, hd), v[:, n_grid_pre:].view(kvh, b, t_width, hd)
        last = li + 1 == len(layers)
        if n_pre > 0:
            k_p, v_p = k[:, :n_grid_pre].view(kvh, u, n_pre, hd), v[:, :n_grid_pre].view(kvh, u, n_pre, hd)
            att_p = None if last else _attend(q[:, :n_grid_pre].view(h, u, n_pre, hd), k_p, v_p, pre_bias, spec)
            k_r = torch.cat([k_p.index_select(1, rows), k_r], 2)
            v_r = torch.cat([v_p.index_select(1, rows), v_r], 2)
        att_r = _attend(q_r, k_r, v_r, row_bias, spec)
        if last:   # the prompts' outputs of the last layer are read by nothing: only the rows go on
            x, att = x[n_pre_tokens:], att_r.index_select(0, row_flat)
        elif n_pre > 0:
            att = torch.cat([att_p, att_r]).index_select(0, flat)
        else:
            att = att_r.index_select(0, row_flat)
        x = x + F.linear(att, a.o_proj.weight, a.o_proj.bias)
        w_gu = torch.cat([m.gate_proj.weight, m.up_proj.weight])
        gate, up = F.linear(_rms(x, layer.post_attention_layernorm.weight, spec.eps), w_gu).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, m.down_proj.weight)
    x_r = x
    head = base.lm_head
    hidden = _rms(x_r, base.model.norm.weight, spec.eps)
    logits = F.linear(hidden.to(head.weight.dtype), head.weight, head.bias).float() / temperature  # [Nr, V]
    picked_ids = batch.completion_ids.flatten().index_select(0, row_flat)
    picked = logits.gather(-1, picked_ids[:, None]).squeeze(-1)
    logp = logits.new_zeros(b * t_width).index_copy(0, row_flat, picked - torch.logsumexp(logits, -1))
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            all_logp = torch.log_softmax(logits, -1)
            ent = -(all_logp.exp() * all_logp).sum(-1)
            entropy = logits.new_zeros(b * t_width).index_copy(0, row_flat, ent).view(b, t_width)
    return logp.view(b, t_width), entropy
