"""What differs between the LeRobot flow-matching families grove drives — SmolVLA, π0, π0.5 — in one small class
each: how the VLM prefix (images, instruction, state) becomes a KV cache, how the action expert's velocity is asked
for at (x_σ, σ), the name of the denoising-step count, the VLM's width, the VLM attention LoRA may target, and
which layers gradient checkpointing wraps. Everything else (the chain, the kernels, log-probs, LoRA, export) is
shared by :class:`~.adapter.LeRobotVLA`.

All calls are LeRobot's own (``embed_prefix``, ``make_att_2d_masks``, the VLM-with-expert forward, ``denoise_step``),
in the order its ``sample_actions`` makes them, so the ODE is LeRobot's ``predict_action_chunk`` with the same noise.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .prefix import Prefix

LANG_TOKENS = "observation.language.tokens"
LANG_MASK = "observation.language.attention_mask"


def _pooled(out: torch.Tensor, pad_masks: torch.Tensor) -> torch.Tensor:
    """Mean of the prefix's final hidden states over its non-pad tokens (πRL's ``mean_token`` value input)."""
    keep = pad_masks[..., None].to(out.dtype)
    return (out * keep).sum(1).float() / keep.sum(1).clamp(min=1).float()


class SmolVLAFamily:
    """SmolVLA (``lerobot.policies.smolvla``): state in the prefix, a SmolVLM + expert with interleaved cross-attention."""

    name = "smolvla"

    @staticmethod
    def make_batch_invariant(policy) -> None:
        """Nothing to do: the state is in the prefix (see :meth:`PiFamily.make_batch_invariant`)."""
    vlm_attention = r"model\.vlm_with_expert\.vlm\.model\.text_model\.layers\.\d+\.self_attn\.(q|v)_proj"

    @staticmethod
    def num_steps(config) -> int:
        return config.num_steps

    @staticmethod
    def vlm_hidden(policy) -> int:
        return policy.model.vlm_with_expert.config.text_config.hidden_size

    @staticmethod
    def prefix(policy, batch: dict):
        from lerobot.policies.common.vla_utils import make_att_2d_masks

        m = policy.model
        images, img_masks = policy.prepare_images(batch)
        state = policy.prepare_state(batch)
        embs, pad_masks, att_masks = m.embed_prefix(images, img_masks, batch[LANG_TOKENS], batch[LANG_MASK], state=state)
        att_2d = make_att_2d_masks(pad_masks, att_masks)
        positions = torch.cumsum(pad_masks, dim=1) - 1
        (out, _), cache = m.vlm_with_expert.forward(attention_mask=att_2d, position_ids=positions, past_key_values=None,
                                                    inputs_embeds=[embs, None], use_cache=True)
        return Prefix(Prefix.cache_tensors(cache), pad_masks, _pooled(out, pad_masks))

    @staticmethod
    def velocity(policy, h, xt: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return policy.model.denoise_step(prefix_pad_masks=h.pad_masks, past_key_values=h.cache(), x_t=xt, timestep=sigma)

    @staticmethod
    def enable_gradient_checkpointing(policy) -> None:
        """SmolVLA runs its VLM + expert layers in its own loop (``SmolVLMWithExpertModel.forward`` calls each layer's
        attention and MLP itself), so transformers' per-layer checkpointing never fires there: both halves of every
        layer are wrapped (attention with its cache restored before a recomputation), and the VLM's SigLIP encoder
        gets transformers' own."""
        vwe = policy.model.vlm_with_expert
        checkpoint_methods(vwe, ("forward_attn_layer", "forward_cross_attn_layer"), cache_layer=_smolvla_cache_layer)
        for model in (vwe.get_vlm_model().text_model, vwe.lm_expert):
            for layer in model.layers:
                checkpoint_methods(layer.mlp, ("forward",))
        if getattr(vwe.vlm, "supports_gradient_checkpointing", False):
            vwe.vlm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _smolvla_cache_layer(module, args, kwargs):
    """(cache, layer index) of a ``forward_attn_layer`` / ``forward_cross_attn_layer`` call."""
    layer_idx = args[2] if len(args) > 2 else kwargs["layer_idx"]
    return kwargs.get("past_key_values"), layer_idx


def _gemma_cache_layer(module, args, kwargs):
    """(cache, layer index) of a Gemma attention call."""
    return kwargs.get("cache", kwargs.get("past_key_values")), module.layer_idx


class PiFamily:
    """π0 (``lerobot.policies.pi0``) and π0.5 (``pi05``) on LeRobot's ``pi_gemma`` (PaliGemma + a Gemma action expert).
    π0 puts the state in the expert's suffix (``state_proj``, so :class:`~.prefix.Prefix` carries it); π0.5
    writes it into the prompt as 256-bin integers (its preprocessor) and conditions the expert on the time through
    adaRMS norms (``use_adarms=[False, True]``), both inside LeRobot's calls below."""

    vlm_attention = (r"model\.paligemma_with_expert\.paligemma\.model\.language_model\.layers\.\d+\.self_attn\."
                     r"(q|v)_proj")

    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def num_steps(config) -> int:
        return config.num_inference_steps

    @staticmethod
    def vlm_hidden(policy) -> int:
        return policy.model.paligemma_with_expert.paligemma.config.text_config.hidden_size

    def prefix(self, policy, batch: dict):
        from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d

        m = policy.model
        pwe = m.paligemma_with_expert
        images, img_masks = policy._preprocess_images(batch)
        state = policy.prepare_state(batch) if self.name == "pi0" else None
        embs, pad_masks, att_masks = m.embed_prefix(images, img_masks, batch[LANG_TOKENS], batch[LANG_MASK])
        att_4d = prepare_attention_masks_4d(make_att_2d_masks(pad_masks, att_masks))
        positions = torch.cumsum(pad_masks, dim=1) - 1
        pwe.paligemma.model.language_model.config._attn_implementation = "eager"  # as sample_actions sets it
        (out, _), cache = pwe.forward(attention_mask=att_4d, position_ids=positions, past_key_values=None,
                                      inputs_embeds=[embs, None], use_cache=True)
        return Prefix(Prefix.cache_tensors(cache), pad_masks, _pooled(out, pad_masks), state)

    def velocity(self, policy, h, xt: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        m = policy.model
        m.paligemma_with_expert.gemma_expert.model.config._attn_implementation = "eager"
        extra = {"state": h.state} if self.name == "pi0" else {}
        return m.denoise_step(prefix_pad_masks=h.pad_masks, past_key_values=h.cache(), x_t=xt, timestep=sigma, **extra)

    def make_batch_invariant(self, policy) -> None:
        """π0 projects the state inside every denoising step (``embed_suffix``: ``state_proj(state)`` on a [B, D]
        matrix), and a 2-d ``nn.Linear`` (addmm) gives results that depend on the batch size by ~1e-7 on this CPU's
        BLAS, so a step recomputed in the trainer's batch would not reproduce the rollout's log-prob bit for bit.
        Every ``nn.Linear`` under ``state_proj`` (the layer, and LoRA's A/B once added) computes row by row instead
        (:class:`RowwiseLinear`: the same weights and math, a broadcast multiply and a sum per row), which does not
        depend on the batch. The sequence-shaped layers (3-d inputs) already do not. π0.5 and SmolVLA read the state
        in the prefix, computed once per chunk: nothing to do."""
        if self.name != "pi0":
            return
        for module in policy.model.state_proj.modules():
            if type(module) is nn.Linear:
                module.__class__ = RowwiseLinear

    @staticmethod
    def enable_gradient_checkpointing(policy) -> None:
        """LeRobot's own switch (``PI0Pytorch.gradient_checkpointing_enable``) only acts in its joint training forward
        and in module train mode; grove's prefix / denoising calls run the VLM and the expert apart, so grove wraps
        each Gemma decoder layer's attention (its cache restored before a recomputation) and MLP, and each SigLIP
        encoder layer, in ``torch.utils.checkpoint`` while grad is on."""
        pwe = policy.model.paligemma_with_expert
        for model in (pwe.paligemma.model.language_model, pwe.gemma_expert.model):
            for layer in model.layers:
                checkpoint_methods(layer.self_attn, ("forward",), cache_layer=_gemma_cache_layer)
                checkpoint_methods(layer.mlp, ("forward",))
        for layer in pwe.paligemma.model.vision_tower.encoder.layers:
            checkpoint_methods(layer, ("forward",))


class RowwiseLinear(nn.Linear):
    """``nn.Linear`` computed as Σ_k x[b, k]·W[o, k] + bias per row (broadcast multiply and sum): the result of a row
    does not depend on the other rows of the batch (a 2-d addmm's does, by rounding). For small layers only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.unsqueeze(-2) * self.weight).sum(-1)
        return y if self.bias is None else y + self.bias


def family_of(name: str):
    """The family object of a LeRobot policy ``name`` (config.json's ``type``)."""
    if name == "smolvla":
        return SmolVLAFamily()
    if name in ("pi0", "pi05"):
        return PiFamily(name)
    raise ValueError(f"no grove family for LeRobot policy type {name!r}")


_CHECKPOINTED: dict[tuple, type] = {}


def _restore_layer(cache, layer_idx: int, length: int) -> None:
    """Cut one cache layer back to ``length`` tokens (what it held before a checkpointed call appended to it)."""
    if cache is None or layer_idx >= len(cache.layers):
        return
    layer = cache.layers[layer_idx]
    keys = getattr(layer, "keys", None)
    if keys is not None and keys.numel() and keys.shape[-2] > length:
        layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


def checkpoint_methods(module: nn.Module, names: tuple[str, ...], cache_layer=None) -> None:
    """Swap ``module``'s class for a cached subclass whose methods ``names`` run under ``torch.utils.checkpoint``
    (non-reentrant) while grad is enabled. ``cache_layer(module, args, kwargs) -> (cache, layer index)`` names the
    KV-cache layer a call appends to: its length is recorded before the call and restored before the backward's
    recomputation, so the recomputed call sees the cache the first one saw (weights' names, ``save_pretrained``
    and deep copies are unchanged)."""
    base = type(module)
    if getattr(base, "_grove_checkpointed", False):
        return
    key = (base, names, cache_layer)
    if key not in _CHECKPOINTED:
        def wrap(name):
            inner = getattr(base, name)

            def method(self, *args, **kwargs):
                if not torch.is_grad_enabled():
                    return inner(self, *args, **kwargs)
                if cache_layer is None:
                    return checkpoint(inner, self, *args, use_reentrant=False, **kwargs)
                cache, layer_idx = cache_layer(self, args, kwargs)
                layer = cache.layers[layer_idx] if cache is not None and layer_idx < len(cache.layers) else None
                keys = getattr(layer, "keys", None)
                length = keys.shape[-2] if keys is not None and keys.numel() else 0

                def run(*a, **k):
                    _restore_layer(cache, layer_idx, length)
                    return inner(self, *a, **k)
                return checkpoint(run, *args, use_reentrant=False, **kwargs)
            method.__name__ = name
            return method
        _CHECKPOINTED[key] = type(f"Checkpointed{base.__name__}", (base,),
                                  {"_grove_checkpointed": True, **{n: wrap(n) for n in names}})
    module.__class__ = _CHECKPOINTED[key]
