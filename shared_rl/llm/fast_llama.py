"""A lean sampler for Llama-family causal LMs: the rollout side of a vLLM-style split (sampling code separate
from the training forward), in plain PyTorch.

Why: at the sizes RL recipes run on a CPU (the embedded 4-layer, hidden-64 Llama), a decode step of HF's
``LlamaForCausalLM`` spends more time in Python (module dispatch, mask construction, the dynamic cache, output
dataclasses) than in its small kernels. This engine runs the same mathematics with few kernel launches: fused
QKV and gate/up projections, ``F.rms_norm``, rotary tables looked up by position (one ``roll`` instead of
``rotate_half``), a preallocated KV cache that every row writes at the same column (prompts are left-padded),
attention over the filled prefix only (broadcast products for the single decode query on CPU, SDPA otherwise),
and ``torch.inference_mode``.

Work it avoids (none of it changes what is sampled):

* prefix sharing: the ``n`` samples of a prompt share one prefill; its KV is copied to the ``n`` rows;
* finished rows leave the decode batch (the cache is compacted when enough rows have ended);
* sampling stops when every row has ended.

Same tokens as ``TorchRolloutEngine`` for the same generator: rows are sampled with ``torch.multinomial`` over a
``[rows, vocab]`` matrix of exactly the reference's shape and row order, whose noise for one row does not depend
on the other rows' values, so a row gets the reference's token whenever its logits agree (fp32: ~1e-6 here,
checked in ``tests/llm/test_engine_fast.py``). Weights are a snapshot of the trained module taken by
``sync_weights`` (LoRA deltas merged as ``W + scale * B @ A`` through peft's ``get_delta_weight``); ``generate``
re-takes the snapshot by itself if any parameter changed in place since (tensor version counters), so a missed
sync cannot sample from stale weights. Loss log-probs still come from the training model (``behaviour_logprobs:
recompute`` or ``deferred``), so the first-step ratio stays exactly 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .engine import Generation, _left_pad
from .sampling import SamplingFilters, filtered_scores, mark_seen, seen_tokens

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# rope variants whose cos/sin depend on the position only (dynamic NTK and longrope change with the length)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when ``FastLlamaEngine`` can sample from ``model``, else why not (one line)."""
    base = _base_model(model)
    cfg = getattr(base, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model_type {kind!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if not hasattr(base, "model") or not hasattr(base.model, "layers") or not hasattr(base, "lm_head"):
        return "expected a *ForCausalLM with .model.layers and .lm_head"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return f"rope_type {rope_type!r}"
    for name, module in base.named_modules():
        variants = getattr(module, "lora_variant", None)
        if variants:
            return f"LoRA variant (e.g. DoRA) in {name}"
        if getattr(module, "lora_bias", None) and any(module.lora_bias.values()):
            return f"LoRA bias in {name}"
        if hasattr(module, "original_module") and hasattr(module, "modules_to_save"):
            return f"peft modules_to_save wrapper in {name}"
    return None


def _effective(module: torch.nn.Module, attr: str = "weight") -> torch.Tensor | None:
    """The weight (or bias) ``module`` applies now: a peft LoRA layer's base plus its active, unmerged deltas."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return getattr(module, attr)
    value = getattr(base, attr)
    if attr == "weight" and not module.disable_adapters and not module.merged:
        for name in module.active_adapters:
            if name in getattr(module, "lora_A", {}) or name in getattr(module, "lora_embedding_A", {}):
                value = value + module.get_delta_weight(name).to(value.dtype)
    return value


@dataclass
class _DecodeState:
    """KV cache ``[layers, rows, columns, kv_heads, head_dim]`` (every row writes new tokens at the same column
    ``width + t``), additive key mask (-inf on prompt pads), rotary tables and each row's next position."""

    keys: torch.Tensor
    values: torch.Tensor
    key_bias: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    width: int
    next_pos: torch.Tensor

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.keys, self.values = self.keys.index_select(1, keep), self.values.index_select(1, keep)
        self.key_bias, self.next_pos = self.key_bias.index_select(0, keep), self.next_pos.index_select(0, keep)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class FastLlamaEngine:
    """``RolloutEngine`` for Llama / Mistral / Qwen2 ``*ForCausalLM`` (optionally peft-LoRA) models."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int] | int,
                 max_batch_rows: int = 256, compact_below: float = 0.75, loop: str = "static",
                 cuda_graph: bool = False):
        if loop not in ("static", "compact"):
            raise ValueError(f"FastLlamaEngine loop must be 'static' or 'compact', got {loop!r}")
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastLlamaEngine cannot run this model: {reason}")
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        self.max_batch_rows = max_batch_rows
        self.sampling = SamplingFilters()  # top-k / top-p / min-p / repetition penalty (sampling.py); set by the domain
        self.compact_below = compact_below   # compact the decode batch when active rows < this fraction of it
        # "static": every row stays in the batch to the end (no compaction, no per-step host reads but the stop
        # check); "compact": the earlier loop (ended rows leave the batch; kept for the side-by-side bench)
        self.loop = loop
        self.cuda_graph = bool(cuda_graph)   # static loop on CUDA: replay each decode step as a captured graph
        self._graphs: dict[tuple, "_GraphStep"] = {}
        base = _base_model(model)
        cfg = base.config
        self.config = cfg
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self._rotary = base.model.rotary_emb
        # sliding-window attention equals full attention while sequences fit in the window (checked per call)
        uses_window = cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)
        self.sliding_window = getattr(cfg, "sliding_window", None) if uses_window else None
        self._rope_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._fingerprint: tuple | None = None
        self.syncs = 0
        self.sync_weights()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    # ---- weights ---------------------------------------------------------------------------------------------
    def _current_fingerprint(self) -> tuple:
        return tuple(p._version for p in self.model.parameters())

    @torch.no_grad()
    def sync_weights(self, force: bool = False) -> None:
        """Snapshot the current (LoRA-merged) weights into fused inference tensors; skipped when no parameter
        changed in place since the last snapshot (``force`` re-takes it anyway, e.g. after edits via ``.data``)."""
        if not force and self._fingerprint == self._current_fingerprint():
            return
        base = _base_model(self.model)
        layers = []
        for block in base.model.layers:
            att, mlp = block.self_attn, block.mlp
            qkv = torch.cat([_effective(att.q_proj), _effective(att.k_proj), _effective(att.v_proj)])
            biases = [_effective(m, "bias") for m in (att.q_proj, att.k_proj, att.v_proj)]
            qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
            layers.append(_Layer(
                input_norm=block.input_layernorm.weight.detach().clone(),
                qkv=qkv.detach().contiguous(), qkv_bias=None if qkv_bias is None else qkv_bias.detach().clone(),
                o=_effective(att.o_proj).detach().clone(),
                o_bias=None if _effective(att.o_proj, "bias") is None else _effective(att.o_proj, "bias").detach().clone(),
                post_norm=block.post_attention_layernorm.weight.detach().clone(),
                gate_up=torch.cat([_effective(mlp.gate_proj), _effective(mlp.up_proj)]).detach().contiguous(),
                down=_effective(mlp.down_proj).detach().clone(),
            ))
        self.layers = layers
        # in the blocks' dtype: tied to an output layer kept in float32 (llm.lm_head_fp32) the table is float32
        self.embed = _effective(base.model.embed_tokens).detach().to(self.layers[0].o.dtype, copy=True)
        self.final_norm = base.model.norm.weight.detach().clone()
        self.lm_head = _effective(base.lm_head).detach().clone()
        self.lm_head_bias = None if getattr(base.lm_head, "bias", None) is None else base.lm_head.bias.detach().clone()
        self._fingerprint = self._current_fingerprint()
        self.syncs += 1
        self._graphs = {}   # captured graphs hold the old weight tensors

    def _rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[length, head_dim]`` from the model's own rotary module (exact for these rope types)."""
        if self._rope_cache is None or self._rope_cache[0] < length:
            pos = torch.arange(length, device=self.device)[None]
            cos, sin = self._rotary(self.embed[None, :1], pos)
            half = self.head_dim // 2
            # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2]: one roll instead of slice/neg/cat
            signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)
            self._rope_cache = (length, cos[0].contiguous(), signed.contiguous())
        return self._rope_cache[1], self._rope_cache[2]

    # ---- the forward -----------------------------------------------------------------------------------------
    def _prefill(self, ids, mask, positions, cos_t, sin_t, keys, values, rows_index) -> torch.Tensor:
        """Forward the left-padded unique prompts ``ids [u, w]``; their keys/values fan out to the cache rows
        ``rows_index`` (prefix sharing). Returns the last position's logits ``[u, vocab]``."""
        u, w = ids.shape
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # causal attention among real tokens; a pad query sees itself so that no softmax row is empty
        causal = torch.ones((w, w), dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(w, dtype=torch.bool, device=ids.device)
        att_mask = ((causal[None] & mask.bool()[:, None, :]) | eye[None])[:, None]
        cos, sin = cos_t[positions][:, :, None], sin_t[positions][:, :, None]
        x = F.embedding(ids, self.embed)
        for li, layer in enumerate(self.layers):
            hidden = F.rms_norm(x, (x.shape[-1],), layer.input_norm, self.eps)
            qkv = F.linear(hidden, layer.qkv, layer.qkv_bias).view(u, w, h + 2 * kvh, hd)
            qk = qkv[:, :, :h + kvh]
            qk = qk * cos + torch.roll(qk, hd // 2, -1) * sin
            k, v = qk[:, :, h:], qkv[:, :, h + kvh:]
            keys[li, :, :w] = k.index_select(0, rows_index)
            values[li, :, :w] = v.index_select(0, rows_index)
            att = F.scaled_dot_product_attention(qk[:, :, :h].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=att_mask, scale=hd ** -0.5, enable_gqa=h != kvh)
            x = x + F.linear(att.transpose(1, 2).reshape(u, w, h * hd), layer.o, layer.o_bias)
            hidden = F.rms_norm(x, (x.shape[-1],), layer.post_norm, self.eps)
            gate, up = F.linear(hidden, layer.gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return self._logits(x[:, -1])

    def _decode(self, tok, cos, sin, keys, values, key_bias, col) -> torch.Tensor:
        """One token per row: ``tok [b]`` at cache column ``col`` (rotary ``cos``/``sin`` ``[b, 1, head_dim]``);
        ``key_bias [b, total, 1, 1]`` is 0 on real keys and -inf on prompt pads. Returns logits ``[b, vocab]``."""
        b = tok.shape[0]
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        groups = h // kvh
        scale = hd ** -0.5
        # One query against <= a few dozen keys: broadcast products in a [rows, keys, heads, dim] layout beat
        # SDPA's kernels ~2x on CPU at this size (measured); elsewhere (GPU, half precision) SDPA is the choice.
        elementwise = keys.device.type == "cpu" and keys.dtype == torch.float32
        bias = key_bias[:, :col + 1]
        x = F.embedding(tok, self.embed)
        for li, layer in enumerate(self.layers):
            hidden = F.rms_norm(x, (x.shape[-1],), layer.input_norm, self.eps)
            qkv = F.linear(hidden, layer.qkv, layer.qkv_bias).view(b, h + 2 * kvh, hd)
            qk = qkv[:, :h + kvh]
            qk = qk * cos + torch.roll(qk, hd // 2, -1) * sin
            keys[li, :, col] = qk[:, h:]
            values[li, :, col] = qkv[:, h + kvh:]
            k_all, v_all = keys[li, :, :col + 1], values[li, :, :col + 1]          # [b, keys, kvh, hd]
            if elementwise:
                q = qk[:, None, :h].reshape(b, 1, kvh, groups, hd)
                scores = (k_all[:, :, :, None] * q).sum(-1).mul_(scale).add_(bias)  # [b, keys, kvh, groups]
                att = (scores.softmax(1)[..., None] * v_all[:, :, :, None]).sum(1)  # [b, kvh, groups, hd]
            else:
                att = F.scaled_dot_product_attention(qk[:, :h, None], k_all.transpose(1, 2), v_all.transpose(1, 2),
                                                     attn_mask=bias.transpose(1, 3), scale=scale,
                                                     enable_gqa=h != kvh)
            x = x + F.linear(att.reshape(b, h * hd), layer.o, layer.o_bias)
            hidden = F.rms_norm(x, (x.shape[-1],), layer.post_norm, self.eps)
            gate, up = F.linear(hidden, layer.gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return self._logits(x)

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x_last, (x_last.shape[-1],), self.final_norm, self.eps)
        return F.linear(h.to(self.lm_head.dtype), self.lm_head, self.lm_head_bias).float()  # lm_head_fp32: float32

    # ---- sampling --------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 generator: torch.Generator, stop_entropy: float | None = None,
                 min_new_tokens_before_stop: int = 1) -> Generation:
        self.sync_weights()
        rows = [p for p in prompts for _ in range(n)]
        index = [i for i in range(len(prompts)) for _ in range(n)]
        out = Generation(prompt_index=index, completion_ids=[], finished=[], stopped=[], sample_logprobs=[])
        gen = generator
        if self.device.type != generator.device.type:   # as TorchRolloutEngine: one seed from the caller's
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.inference_mode():
            # the reference's chunking, so each chunk's sampling noise has the reference's shape
            for start in range(0, len(rows), self.max_batch_rows):
                stop = start + self.max_batch_rows
                chunk = self._generate_chunk_static if self.loop == "static" else self._generate_chunk
                chunk(rows[start:stop], index[start:stop], max_new_tokens, temperature, gen, stop_entropy,
                      min_new_tokens_before_stop, out)
        return out

    def _start(self, unique_prompts: list[list[int]], row_to_unique: torch.Tensor, new_tokens: int):
        """Prefill ``unique_prompts`` once each and lay out a KV cache for the rows ``row_to_unique`` (a row's
        prompt), with room for ``new_tokens`` more columns. Returns the decode state."""
        device = self.device
        b = row_to_unique.numel()
        ids, mask = _left_pad(unique_prompts, self.pad_token_id, device)
        width = ids.shape[1]
        total = width + new_tokens
        if self.sliding_window is not None and total > self.sliding_window:
            raise ValueError(f"prompt + completion length {total} exceeds the model's sliding window "
                             f"{self.sliding_window}, which FastLlamaEngine does not implement; use llm.engine: torch")
        cos_t, sin_t = self._rope(total)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keys = torch.empty((len(self.layers), b, total, self.num_kv_heads, self.head_dim), dtype=self.embed.dtype,
                           device=device)
        values = torch.empty_like(keys)
        key_bias = torch.zeros((b, total, 1, 1), dtype=self.embed.dtype, device=device)
        key_bias[:, :width, 0, 0].masked_fill_(mask.index_select(0, row_to_unique) == 0, float("-inf"))
        logits = self._prefill(ids, mask, positions, cos_t, sin_t, keys, values, row_to_unique)
        state = _DecodeState(keys=keys, values=values, key_bias=key_bias, cos=cos_t, sin=sin_t, width=width,
                             next_pos=(positions[:, -1] + 1).index_select(0, row_to_unique))
        return logits.index_select(0, row_to_unique), state

    def _step(self, tok: torch.Tensor, state: "_DecodeState", t: int) -> torch.Tensor:
        """Feed the ``t``-th new token of every row in the state; returns the next logits."""
        pos = state.next_pos
        logits = self._decode(tok, state.cos[pos][:, None], state.sin[pos][:, None], state.keys, state.values,
                              state.key_bias, state.width + t)
        state.next_pos = pos + 1
        return logits

    @torch.inference_mode()
    def teacher_forced_logits(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """``[rows, T, vocab]`` next-token logits along given completions of equal length ``T`` (``[:, t]``
        predicts token ``t``), through the same prefill/KV-cache decode code that sampling uses."""
        self.sync_weights()
        device = self.device
        comp = torch.tensor(completions, dtype=torch.long, device=device)
        logits, state = self._start(prompts, torch.arange(len(prompts), device=device), comp.shape[1])
        out = [logits]
        for t in range(comp.shape[1] - 1):
            out.append(self._step(comp[:, t], state, t))
        return torch.stack(out, 1)

    def _generate_chunk(self, rows, row_prompt, max_new_tokens, temperature, gen, stop_entropy, min_tokens,
                        out: Generation):
        device = self.device
        b = len(rows)
        # unique prompts of this chunk (rows are prompt-major, so equal prompts are consecutive runs)
        starts = [i for i in range(b) if i == 0 or row_prompt[i] != row_prompt[i - 1]]
        counts = torch.tensor([e - s for s, e in zip(starts, starts[1:] + [b])], device=device)
        row_to_unique = torch.repeat_interleave(torch.arange(len(starts), device=device), counts)
        logits, state = self._start([rows[i] for i in starts], row_to_unique, max_new_tokens)
        out.nfe += b   # counted per row, as the reference engine does (the shared prefill ran once per prompt)

        eos = torch.tensor(self.eos_token_ids, device=device)
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        stopped = torch.zeros_like(finished)
        tokens = torch.full((b, max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        logps = torch.zeros((b, max_new_tokens), dtype=torch.float32, device=device)
        lengths = torch.zeros(b, dtype=torch.long, device=device)
        cur = torch.arange(b, device=device)          # chunk rows in the decode batch
        cur_done = torch.zeros(b, dtype=torch.bool, device=device)  # ... and which of them have ended
        filters = self.sampling
        seen = seen_tokens(*_left_pad(rows, self.pad_token_id, device), logits.shape[-1]) \
            if filters.penalises_repeats else None
        for t in range(max_new_tokens):
            logp_all = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)
            if stop_entropy is not None and t >= min_tokens:
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                branch_here = (~cur_done) & (entropy > stop_entropy)
                stopped[cur] |= branch_here
                cur_done = cur_done | branch_here
            # the filters pick the token; logp_all (temperature only) stays the density the loss trains on
            scores = None
            if filters.active:
                scores = filtered_scores(logits, temperature, filters,
                                         seen.index_select(0, cur) if seen is not None else None)
            if temperature > 0:
                probs = logp_all.exp() if scores is None else scores.softmax(-1)
                if len(cur) < b:
                    # draw over the reference's full [rows, vocab] shape: a row's noise does not depend on the
                    # other rows' values, so every row gets the reference's token
                    probs = torch.ones((b, probs.shape[1]), dtype=probs.dtype, device=device).index_copy_(0, cur, probs)
                    sample = torch.multinomial(probs, 1, generator=gen).squeeze(1).index_select(0, cur)
                else:
                    sample = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            else:
                sample = (logits if scores is None else scores).argmax(-1)
            active = ~cur_done
            if seen is not None:
                mark_seen(seen, cur, sample, active)
            tok = torch.where(active, sample, self.pad_token_id)
            tokens[cur, t] = tok
            logps[cur, t] = logp_all.gather(1, sample[:, None]).squeeze(1)
            lengths[cur] += active
            is_eos = active & torch.isin(tok, eos)
            finished[cur] |= is_eos
            cur_done = cur_done | is_eos
            if t == max_new_tokens - 1 or bool(cur_done.all()):
                break
            out.nfe += int(active.sum())
            if int((~cur_done).sum()) < self.compact_below * len(cur):   # drop ended rows from the batch
                keep = (~cur_done).nonzero().squeeze(1)
                cur, tok, cur_done = cur[keep], tok[keep], cur_done[keep]
                state.keep_rows(keep)
            logits = self._step(tok, state, t)
        lengths_list = lengths.tolist()
        tok_list, logp_list = tokens.tolist(), logps.tolist()
        for i in range(b):
            out.completion_ids.append(tok_list[i][:lengths_list[i]])
            out.sample_logprobs.append(logp_list[i][:lengths_list[i]])
        out.finished += finished.tolist()
        out.stopped += stopped.tolist()

    # ---- the static decode loop (issue 42) -------------------------------------------------------------------
    def _decode_full(self, tok: torch.Tensor, pos: torch.Tensor, col: torch.Tensor, state: "_DecodeState"
                     ) -> torch.Tensor:
        """One decode step with static shapes, for CUDA-graph capture: ``col`` is a one-element device tensor; the
        new column is opened in the key bias (``-inf`` until then), written with ``index_copy_`` and attention runs
        over the cache's full width (zeros beyond ``col``, masked; exactly the sliced step's values: the extra
        keys add exact zeros after the real ones)."""
        state.key_bias.index_fill_(1, col, 0.0)
        cos, sin = state.cos.index_select(0, pos)[:, None], state.sin.index_select(0, pos)[:, None]
        b = tok.shape[0]
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(tok, self.embed)
        for li, layer in enumerate(self.layers):
            hidden = F.rms_norm(x, (x.shape[-1],), layer.input_norm, self.eps)
            qkv = F.linear(hidden, layer.qkv, layer.qkv_bias).view(b, h + 2 * kvh, hd)
            qk = qkv[:, :h + kvh]
            qk = qk * cos + torch.roll(qk, hd // 2, -1) * sin
            state.keys[li].index_copy_(1, col, qk[:, None, h:])
            state.values[li].index_copy_(1, col, qkv[:, None, h + kvh:])
            att = F.scaled_dot_product_attention(qk[:, :h, None], state.keys[li].transpose(1, 2),
                                                 state.values[li].transpose(1, 2),
                                                 attn_mask=state.key_bias.transpose(1, 3), scale=hd ** -0.5,
                                                 enable_gqa=h != kvh)
            x = x + F.linear(att.reshape(b, h * hd), layer.o, layer.o_bias)
            hidden = F.rms_norm(x, (x.shape[-1],), layer.post_norm, self.eps)
            gate, up = F.linear(hidden, layer.gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return self._logits(x)

    def _static_stepper(self, state: "_DecodeState", b: int):
        """``step(tok, t) -> logits`` for the static loop: the sliced eager step, or (``cuda_graph`` on a CUDA
        device) a captured graph of :meth:`_decode_full` replayed with the token, positions and column copied into
        its static inputs."""
        if not (self.cuda_graph and self.device.type == "cuda"):
            return lambda tok, t: self._step(tok, state, t)
        key = (b, state.keys.shape[2], state.width)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _GraphStep(self, state)
        return graph.bind(state)

    def _generate_chunk_static(self, rows, row_prompt, max_new_tokens, temperature, gen, stop_entropy, min_tokens,
                               out: Generation):
        """The decode loop without per-token host work that scales with the batch: every row stays in the batch
        (ended rows decode padding that nothing reads; a row's sampling noise does not depend on the other rows'
        values, so the tokens equal the compacting loop's), the bookkeeping is whole-batch tensor writes, the
        forward count is kept on the device, and the one host read per step is the all-ended check (stopping
        exactly there keeps the generator's stream the reference's for the next chunk)."""
        device = self.device
        b = len(rows)
        starts = [i for i in range(b) if i == 0 or row_prompt[i] != row_prompt[i - 1]]
        counts = torch.tensor([e - s for s, e in zip(starts, starts[1:] + [b])], device=device)
        row_to_unique = torch.repeat_interleave(torch.arange(len(starts), device=device), counts)
        logits, state = self._start([rows[i] for i in starts], row_to_unique, max_new_tokens)
        step = self._static_stepper(state, b)
        eos = torch.tensor(self.eos_token_ids, device=device)
        one_eos = len(self.eos_token_ids) == 1
        scaled = temperature > 0 and temperature != 1.0   # x / 1.0 == x: skip the op, same bits
        done = torch.zeros(b, dtype=torch.bool, device=device)
        stopped = torch.zeros_like(done)
        # per step only what the next step needs; tokens, log-probs, lengths, EOS flags and the forward count are
        # assembled once after the loop from the per-step tensors (each a fresh tensor, never written in place)
        step_tokens, step_logps, step_done = [], [], []
        filters = self.sampling
        seen = seen_tokens(*_left_pad(rows, self.pad_token_id, device), logits.shape[-1]) \
            if filters.penalises_repeats else None
        all_rows = torch.arange(b, device=device)
        for t in range(max_new_tokens):
            logp_all = torch.log_softmax(logits / temperature if scaled else logits, -1)
            if stop_entropy is not None and t >= min_tokens:
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                branch_here = (~done) & (entropy > stop_entropy)
                stopped = stopped | branch_here
                done = done | branch_here
            scores = filtered_scores(logits, temperature, filters, seen) if filters.active else None
            if temperature > 0:
                sample = _draw_one(logp_all.exp() if scores is None else scores.softmax(-1), gen)   # [b, 1]
            else:
                sample = (logits if scores is None else scores).argmax(-1, keepdim=True)
            if seen is not None:
                mark_seen(seen, all_rows, sample.view(b), ~done)
            tok = sample.view(b).masked_fill(done, self.pad_token_id)
            step_tokens.append(tok)
            step_logps.append(logp_all.gather(1, sample))
            step_done.append(done)
            # ended rows hold the pad token: were pad an EOS id, they are done already, so this changes nothing
            done = done | (tok == self.eos_token_ids[0] if one_eos else torch.isin(tok, eos))
            if t == max_new_tokens - 1 or bool(done.all()):
                break
            logits = step(tok, t)
        if not step_tokens:   # max_new_tokens == 0
            out.nfe += b
            out.completion_ids += [[] for _ in range(b)]
            out.sample_logprobs += [[] for _ in range(b)]
            out.finished += [False] * b
            out.stopped += [False] * b
            return
        sampled_logps = torch.cat(step_logps, 1)
        if not bool(torch.isfinite(sampled_logps).all()):   # what torch.multinomial's per-call check caught
            raise ValueError("probability tensor contains either `inf`, `nan` or element < 0 (the policy's "
                             "logits are not finite)")
        tokens = torch.stack(step_tokens, 1)                 # [b, steps]
        active = ~torch.stack(step_done, 1)                  # a row is active over a prefix of the steps
        lengths = active.sum(1)
        finished = (active & torch.isin(tokens, eos)).any(1)
        # the loop always leaves through its break: every step but the last ran one forward per active row
        out.nfe += b + int(active[:, :-1].sum())
        lengths_list = lengths.tolist()
        tok_list, logp_list = tokens.tolist(), sampled_logps.tolist()
        for i in range(b):
            out.completion_ids.append(tok_list[i][:lengths_list[i]])
            out.sample_logprobs.append(logp_list[i][:lengths_list[i]])
        out.finished += finished.tolist()
        out.stopped += stopped.tolist()


def _draw_one(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator=gen)`` by its own one-sample path (the exponential race: argmax of
    ``p / q`` with ``q ~ Exp(1)`` drawn from ``gen``), without the validity check it runs on every call (four
    reductions and a host read per decode step): the same tokens and the same generator stream afterwards (test).
    Non-finite logits show as non-finite sampled log-probs, which the loop checks once per chunk."""
    q = torch.empty_like(probs).exponential_(1, generator=gen)
    return torch.div(probs, q, out=q).argmax(-1, keepdim=True)


class _GraphStep:
    """A CUDA graph of ``FastLlamaEngine._decode_full`` for one (rows, cache width, prompt width) shape. The graph
    reads and writes fixed buffers: the token / position / column inputs and a KV cache, key bias and rotary tables
    of its own, which ``bind`` fills from a fresh decode state (the prefill's cache) before a chunk's first step.
    Needs a CUDA device (``cuda_graph=True``); not exercised on CPU-only machines."""

    def __init__(self, engine: FastLlamaEngine, state: "_DecodeState") -> None:
        self.engine = engine
        b = state.next_pos.numel()
        self.tok = torch.zeros(b, dtype=torch.long, device=engine.device)
        self.pos = torch.zeros_like(self.tok)
        self.col = torch.zeros(1, dtype=torch.long, device=engine.device)
        self.state = _DecodeState(keys=state.keys.clone(), values=state.values.clone(),
                                  key_bias=state.key_bias.clone(), cos=state.cos, sin=state.sin, width=state.width,
                                  next_pos=self.pos)
        self.col.fill_(state.width)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up outside the graph (allocator, kernels' lazy init)
            for _ in range(2):
                engine._decode_full(self.tok, self.pos, self.col, self.state)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = engine._decode_full(self.tok, self.pos, self.col, self.state)

    def bind(self, state: "_DecodeState"):
        """Load ``state`` (a chunk's prefilled cache) into the graph's buffers; returns ``step(tok, t)``."""
        own = self.state
        load_full_width(own, state)
        self.pos.copy_(state.next_pos)

        def step(tok: torch.Tensor, t: int) -> torch.Tensor:
            self.tok.copy_(tok)
            self.col.fill_(own.width + t)
            self.graph.replay()
            self.pos.add_(1)
            return self.logits.clone()

        return step


def load_full_width(own: "_DecodeState", state: "_DecodeState") -> None:
    """Copy a freshly prefilled ``state`` into ``own`` (same shapes) laid out for :meth:`FastLlamaEngine._decode_full`:
    the completion columns' keys and values zero and their key bias ``-inf`` until a step opens them."""
    w = state.width
    own.keys[:, :, :w] = state.keys[:, :, :w]
    own.values[:, :, :w] = state.values[:, :, :w]
    own.keys[:, :, w:] = 0
    own.values[:, :, w:] = 0
    own.key_bias.copy_(state.key_bias)
    own.key_bias[:, w:] = float("-inf")
