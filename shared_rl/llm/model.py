"""Building and loading causal LMs: the tiny Llama the embedded recipe starts from, any ``AutoModelForCausalLM``
from a path or hub id, and optional LoRA through peft (the reference policy is then the base model with the
adapter disabled, as DESIGN §4 asks: no second model copy)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config import LLMLoraSettings  # noqa: F401  (shared_rl.llm.model.LLMLoraSettings, as before)
from .tasks import load_tokenizer  # noqa: F401  (shared_rl.llm.model.load_tokenizer, as before)

if TYPE_CHECKING:  # transformers is imported where a model is built: config checks stay free of its ~2 s import
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 64,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A small ``LlamaForCausalLM`` whose special ids match ``tokenizer`` (bos/eos/pad), built offline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def resolve_model_path(path: str) -> str:
    """A local path relative to the repository root (where assets/ lives) or the working directory, else a hub id."""
    from ..prechecks import resolve_llm_model  # torch-free: the CLI runs the same check before importing torch

    return resolve_llm_model(path)


def load_causal_lm(path: str, dtype: str = "float32", device: torch.device | str = "cpu", lora: LLMLoraSettings | None = None,
                   gradient_checkpointing: bool = False, lm_head_fp32: bool = False,
                   meta: bool = False) -> torch.nn.Module:
    """Load any ``AutoModelForCausalLM``; wrap it with a peft LoRA adapter when ``lora.enabled``. ``meta``: build
    it on the meta device from its ``config.json`` instead (no weight read or allocated; LoRA added there too), for
    a process of an FSDP2 run that receives its shards from process 0 (``shared_rl.sharding.shard_from_rank0``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if meta:
        config = AutoConfig.from_pretrained(resolve_model_path(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).eval()  # as from_pretrained
        try:  # what from_pretrained reads besides the weights (the domain's EOS ids come from it)
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(resolve_model_path(path))
        except OSError:
            pass
        with torch.device("meta"):
            return prepare_causal_lm(model, "meta", lora, gradient_checkpointing, path, lm_head_fp32)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=DTYPES[dtype])
    return prepare_causal_lm(model, device, lora, gradient_checkpointing, path, lm_head_fp32)


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """The output layer's weights in float32 and its product computed in float32 (ScaleRL, arXiv 2510.13786; TRL's
    ``cast_lm_head_to_fp32``): a bfloat16 model's logits, and so its log-probs and ratios, otherwise round in
    bfloat16. With tied embeddings the shared weight becomes float32 and the embedding's output is cast back to the
    model's dtype (as TRL does)."""
    head = model.get_output_embeddings()
    dtype = head.weight.dtype
    if dtype == torch.float32:
        return
    head.float()
    head.register_forward_pre_hook(lambda _m, args: tuple(
        a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    embed = model.get_input_embeddings()
    if embed.weight is head.weight:
        embed.register_forward_hook(lambda _m, _args, out: out.to(dtype))


def prepare_causal_lm(model: torch.nn.Module, device: torch.device | str = "cpu", lora: LLMLoraSettings | None = None,
                      gradient_checkpointing: bool = False, path: str = "the model",
                      lm_head_fp32: bool = False) -> torch.nn.Module:
    """A causal LM the caller holds, ready to train: on ``device``, optionally checkpointed, LoRA-wrapped when
    ``lora.enabled`` (the returned peft model shares the caller's weights; without LoRA it is the same object);
    ``lm_head_fp32``: ``cast_lm_head_to_fp32``."""
    model.to(device)
    if lm_head_fp32:
        if lora is not None and lora.enabled and "lm_head" in lora.target_modules:
            raise ValueError("llm.lm_head_fp32 casts the output layer, which lora.target_modules adapts: drop "
                             "lm_head from the targets or set llm.lm_head_fp32: false")
        cast_lm_head_to_fp32(model)
    if gradient_checkpointing:
        # transformers >= 5.2x calls it activation checkpointing; older versions only know the old name
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.config.use_cache = False
        if lora is not None and lora.enabled:
            model.enable_input_require_grads()  # frozen embeddings + checkpointed blocks still need input grads
    if lora is not None and lora.enabled:
        from peft import LoraConfig, get_peft_model

        available = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        targets = [t for t in lora.target_modules if t in available]
        if not targets:
            raise ValueError(f"lora.target_modules {lora.target_modules} match no module of {path}; "
                             f"available leaf names include {sorted(available)[:20]}")
        cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                         task_type="CAUSAL_LM")
        model = get_peft_model(model, cfg)
    return model
