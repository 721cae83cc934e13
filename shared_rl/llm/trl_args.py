"""TRL's ``GRPOConfig`` as a grove config: every field with a grove meaning is translated, the rest must be left at
TRL's default (a field the user set that grove cannot honour is a ``ConfigError`` naming it, never ignored).

``translate(args, num_train_rows)`` returns a ``Translation``: the grove config sections (``TrainConfig`` mapping with
an ``llm:`` section), what ``shared_rl.llm.api.GRPOTrainer`` applies itself (logging cadence, evaluation, reference
sync, dropout, model loading), and ``notes``: one line per TRL default that grove runs differently (bf16 autocast,
say), which the trainer prints. The table of docs/methods/llm.md lists each field; TRL 1.16's own definitions are
in ``trl/trainer/grpo_config.py`` and ``grpo_trainer.py`` (``_compute_loss``, ``_generate_and_score_completions``).

Batch arithmetic (TRL: ``generation_batch_size`` completions are sampled per generation and used for
``steps_per_generation`` micro-batches of ``per_device_train_batch_size``, ``num_iterations`` times; an optimizer
step every ``gradient_accumulation_steps`` micro-batches) maps onto one grove iteration per generation:
``groups_per_iteration = generation_batch_size / num_generations``, ``group_size = num_generations``,
``inner_epochs = num_iterations``, ``minibatches_per_epoch = steps_per_generation / gradient_accumulation_steps``,
``micro_batch_size = per_device_train_batch_size`` (memory only: the same gradient). ``max_steps`` (optimizer
steps) or ``num_train_epochs`` over the ``len(train) // prompts per generation`` whole generations of an epoch
give the number of iterations (rounded up).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

# TRL's loss_type -> grove's loss section (aggregation names as verl's, shared_rl.losses)
_AGGREGATION = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean",
                "dr_grpo": "seq-mean-token-sum-norm", "cispo": "token-mean", "sapo": "token-mean",
                "luspo": "seq-mean-token-sum-norm"}

# the fields translate() reads, and those that change nothing grove computes (bookkeeping of HF's Trainer, Hub and
# vLLM plumbing while use_vllm is off, data loading); any other field the user changed is an error
_HANDLED = {
    "output_dir", "overwrite_output_dir", "run_name", "report_to", "logging_dir", "logging_strategy", "logging_nan_inf_filter",
    "disable_tqdm", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "dataloader_drop_last", "remove_unused_columns", "label_names", "pad_to_multiple_of",
    "log_completions", "num_completions_to_print", "log_unique_prompts", "log_multimodal", "log_level",
    "log_level_replica", "log_on_each_node", "do_train", "do_eval", "do_predict", "prediction_loss_only",
    "ds3_gather_for_generation", "cache_implementation", "include_num_input_tokens_seen", "skip_memory_metrics",
    "save_safetensors", "save_only_model", "save_on_each_node", "shuffle_dataset", "accelerator_config",
    "use_cpu", "local_rank", "ddp_backend", "ddp_timeout", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
    "ddp_broadcast_buffers", "seed_data", "data_seed", "full_determinism", "hub_model_id", "hub_strategy",
    "hub_token", "hub_private_repo", "hub_always_push", "hub_revision", "project", "trackio_space_id",
    "trackio_static_space_id", "trackio_bucket_id", "eval_do_concat_batches", "eval_accumulation_steps",
    "eval_delay", "per_device_eval_batch_size", "restore_callback_states_from_checkpoint", "jit_mode_eval",
    "average_tokens_across_devices", "dispatch_batches", "split_batches", "batch_eval_metrics", "eval_use_gather_object",
    "include_for_metrics", "include_inputs_for_metrics", "length_column_name", "group_by_length",
    "ignore_data_skip", "resume_from_checkpoint", "dataset_kwargs", "tf32", "dataloader_drop_last",
    "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_server_base_url", "vllm_server_host",
    "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size", "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap", "transformers_continuous_batching_config", "model_init_kwargs",
    "trust_remote_code", "disable_dropout", "num_generations_eval", "sync_ref_model", "ref_model_mixup_alpha",
    "ref_model_sync_steps", "eval_strategy", "eval_steps", "eval_on_start", "logging_steps", "logging_first_step",
    "save_strategy", "save_steps", "save_total_limit", "chat_template_kwargs", "gradient_checkpointing_kwargs",
    "sapo_temperature_pos", "sapo_temperature_neg", "generation_kwargs", "bf16", "fp16", "bf16_full_eval",
    "fp16_full_eval", "half_precision_backend", "use_bias_correction_kl", "torch_empty_cache_steps",
    "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "lr_scheduler_kwargs",
    "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm", "warmup_ratio",
    "warmup_steps", "lr_scheduler_type", "optim", "num_train_epochs", "max_steps", "per_device_train_batch_size",
    "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size", "num_generations",
    "max_completion_length", "num_iterations", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "beta", "epsilon", "epsilon_high", "importance_sampling_level", "reward_weights", "multi_objective_aggregation",
    "scale_rewards", "loss_type", "mask_truncated_completions", "learning_rate", "seed", "gradient_checkpointing",
    "use_liger_kernel", "activation_checkpointing", "activation_checkpointing_kwargs", "delta", "entropy_coef",
    "use_adaptive_entropy", "entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max",
    "top_entropy_quantile", "cast_lm_head_to_fp32", "off_policy_mask_threshold",
}
_GENERATION_KWARGS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample", "max_new_tokens"}


@dataclass
class Translation:
    """What ``translate`` made of a ``GRPOConfig``: ``config`` (grove sections), ``trainer`` (what the TRL-shaped
    trainer applies itself) and ``notes`` (TRL defaults grove runs differently, one line each)."""

    config: dict[str, Any]
    trainer: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def is_grpo_config(args: Any) -> bool:
    return type(args).__name__ == "GRPOConfig" and dataclasses.is_dataclass(args)


def trl_field_names() -> set[str]:
    from trl import GRPOConfig

    return {f.name for f in dataclasses.fields(GRPOConfig)}


def from_mapping(mapping: dict[str, Any]):
    """A ``GRPOConfig`` from a mapping of its field names (``output_dir`` defaults to a temporary folder's name)."""
    from trl import GRPOConfig

    unknown = sorted(set(mapping) - trl_field_names())
    if unknown:
        raise ConfigError(f"args: {unknown} are not GRPOConfig fields")
    return GRPOConfig(**{"report_to": "none", "use_cpu": _no_gpu(), **mapping})


def _no_gpu() -> bool:
    """TrainingArguments refuses its bf16 default without a GPU unless use_cpu is set."""
    import torch

    return not torch.cuda.is_available()


def _changed(args) -> dict[str, Any]:
    """The fields of ``args`` that differ from a default ``GRPOConfig`` (after both ran ``__post_init__``)."""
    from trl import GRPOConfig

    default = GRPOConfig(output_dir=args.output_dir, report_to="none", use_cpu=args.use_cpu)
    out = {}
    for f in dataclasses.fields(args):
        if not f.init:
            continue
        mine, theirs = getattr(args, f.name, None), getattr(default, f.name, None)
        try:
            same = mine == theirs
            same = bool(same)
        except Exception:  # noqa: BLE001 - objects without a plain equality (accelerator configs)
            same = repr(mine) == repr(theirs)
        if not same:
            out[f.name] = mine
    return out


def _fail(name: str, value: Any, why: str) -> None:
    raise ConfigError(f"GRPOConfig.{name}={value!r}: {why}")


def translate(args, num_train_rows: int, has_peft: bool = False) -> Translation:
    """The grove config of ``args`` (a TRL ``GRPOConfig``); ``num_train_rows`` sizes an epoch."""
    changed = _changed(args)
    for name, value in changed.items():  # what has no grove meaning at all, when the user set it
        if name not in _HANDLED:
            _fail(name, value, "grove has no equivalent of this TRL setting (docs/methods/llm.md lists the "
                               "translated fields); leave it at TRL's default")
    a = args
    if a.use_vllm:
        _fail("use_vllm", True, "grove samples with its own engines (llm.engine: torch | fast)")
    if getattr(a, "use_liger_kernel", False):
        _fail("use_liger_kernel", True, "grove computes the loss itself; drop the liger kernel")
    if a.loss_type not in _AGGREGATION:
        _fail("loss_type", a.loss_type, f"grove has {sorted(_AGGREGATION)}")
    eps_high = a.epsilon_high if a.epsilon_high is not None else a.epsilon
    delta = a.delta if a.loss_type not in ("cispo", "sapo") else None  # TRL's two-sided clip: clipped losses only
    if delta is not None and delta <= 1 + eps_high:
        # INTELLECT-2's cap of the unclipped ratio: for delta > 1 + epsilon_high it changes only negative-advantage
        # steps, -A * min(rho, delta) beyond 1 + epsilon_high, which is exactly the dual clip
        _fail("delta", delta, f"grove runs TRL's two-sided clip as loss.dual_clip, which needs delta > 1 + "
                              f"epsilon_high ({1 + eps_high:g}), as TRL recommends")
    if a.loss_type == "luspo" and a.importance_sampling_level != "sequence":
        _fail("loss_type", "luspo", "LUSPO is a sequence-level loss: set importance_sampling_level='sequence' (TRL "
                                    "warns and runs a token-level variant that averages over pad positions)")
    if a.importance_sampling_level not in ("token", "sequence"):
        _fail("importance_sampling_level", a.importance_sampling_level, "token or sequence")
    if a.importance_sampling_level == "sequence" and a.loss_type not in ("grpo", "dapo", "bnpo", "dr_grpo", "cispo",
                                                                          "luspo"):
        _fail("importance_sampling_level", "sequence", f"grove's sequence ratio (GSPO) is a clipped loss, not "
                                                      f"{a.loss_type}")
    gen_kwargs = dict(a.generation_kwargs or {})
    bad = sorted(set(gen_kwargs) - _GENERATION_KWARGS)
    if bad:
        _fail("generation_kwargs", gen_kwargs, f"{bad} have no grove meaning (grove samples with temperature, top_p, "
                                               f"top_k, min_p, repetition_penalty)")
    if gen_kwargs.get("do_sample") is False:
        _fail("generation_kwargs", gen_kwargs, "GRPO samples; do_sample=False has no RL meaning")
    sampling = {k: gen_kwargs.get(k, getattr(a, k)) for k in ("temperature", "top_p", "top_k", "min_p",
                                                             "repetition_penalty")}
    max_new = int(gen_kwargs.get("max_new_tokens", a.max_completion_length))

    world = 1  # one process (a launch through accelerate gives grove's own distributed sections)
    per_step = a.per_device_train_batch_size * world
    gen_batch = a.generation_batch_size or per_step * a.steps_per_generation
    G = a.num_generations
    if gen_batch % G:
        _fail("generation_batch_size", gen_batch, f"must be a multiple of num_generations {G}")
    steps_per_gen = gen_batch // per_step
    ga = a.gradient_accumulation_steps
    if steps_per_gen % ga:
        _fail("steps_per_generation", steps_per_gen, f"grove takes whole optimizer steps per generation: make it a "
                                                     f"multiple of gradient_accumulation_steps {ga}")
    prompts = gen_batch // G
    minibatches = steps_per_gen // ga
    steps_per_iteration = minibatches * a.num_iterations
    if a.max_steps and a.max_steps > 0:
        iterations = math.ceil(a.max_steps / steps_per_iteration)
    else:
        whole = num_train_rows // prompts
        if whole == 0:
            raise ConfigError(f"train_dataset has {num_train_rows} rows, fewer than the {prompts} prompts of one "
                              f"generation (generation_batch_size / num_generations)")
        iterations = math.ceil(a.num_train_epochs * whole)

    def in_iterations(steps: float) -> int:
        if steps < 1:  # a fraction of the run, as transformers reads it
            steps = math.ceil(steps * iterations * steps_per_iteration)
        return max(1, math.ceil(steps / steps_per_iteration))

    scale = {True: "group", False: "none"}.get(a.scale_rewards, a.scale_rewards)
    if a.multi_objective_aggregation == "normalize_then_sum":
        estimator = "grpo"  # each reward's group z-score; the trainer re-normalises the sum over the batch (TRL)
    else:
        estimator = {"group": "grpo", "batch": "batch_std", "none": "dr_grpo"}.get(scale)
        if estimator is None:
            _fail("scale_rewards", a.scale_rewards, "group, batch or none")
    loss: dict[str, Any] = {"aggregation": _AGGREGATION[a.loss_type], "clip_low": a.epsilon, "clip_high": eps_high,
                            "kl_coef": a.beta, "kl_estimator": "k3"}
    if delta is not None:
        loss["dual_clip"] = delta
    if a.off_policy_mask_threshold is not None:
        loss["off_policy_mask"] = a.off_policy_mask_threshold
    if a.loss_type == "dr_grpo":
        loss["max_steps_norm"] = max_new
    if a.loss_type == "luspo":  # GSPO's loss, each sequence weighted by its length: Σ_i |y_i|·L_i / N_seqs
        loss["max_steps_norm"] = 1
    if a.loss_type == "cispo":  # TRL caps the IS weight at epsilon_high (an absolute value), no lower cap
        loss.update(policy_loss={"name": "cispo", "max_weight": eps_high, "level": (
            "sequence" if a.importance_sampling_level == "sequence" else "step")}, clip_low=1.0)
    elif a.loss_type == "sapo":
        loss["policy_loss"] = {"name": "sapo", "tau_pos": a.sapo_temperature_pos, "tau_neg": a.sapo_temperature_neg}
    elif a.importance_sampling_level == "sequence":
        loss["policy_loss"] = "gspo"
    schedule = {"linear": "linear", "cosine": "cosine", "constant": "constant",
                "constant_with_warmup": "constant"}.get(str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type)))
    if schedule is None:
        _fail("lr_scheduler_type", a.lr_scheduler_type, "grove has linear, cosine, constant(_with_warmup)")
    if str(getattr(a.optim, "value", a.optim)) not in ("adamw_torch", "adamw_torch_fused", "adamw_hf"):
        _fail("optim", a.optim, "grove's optimizer is AdamW (torch)")
    total_steps = iterations * steps_per_iteration
    # transformers 5 reads a warmup_steps below 1 as a fraction of the run (older versions had warmup_ratio)
    warmup = a.warmup_steps if a.warmup_steps >= 1 else math.ceil(
        (a.warmup_steps or getattr(a, "warmup_ratio", 0.0) or 0.0) * total_steps)
    report = a.report_to if isinstance(a.report_to, list) else [a.report_to]
    report = [r for r in report if r not in (None, "none")]
    if set(report) - {"tensorboard", "wandb"}:
        _fail("report_to", a.report_to, "grove writes metrics.jsonl and reports to tensorboard or wandb")
    eval_every = 0
    if str(getattr(a.eval_strategy, "value", a.eval_strategy)) == "steps":
        eval_every = in_iterations(a.eval_steps if a.eval_steps is not None else a.logging_steps)
    elif str(getattr(a.eval_strategy, "value", a.eval_strategy)) == "epoch":
        eval_every = max(1, math.ceil(iterations / max(a.num_train_epochs, 1)))
    save = str(getattr(a.save_strategy, "value", a.save_strategy))
    kl_correction = a.importance_sampling_level if a.beta != 0 and a.use_bias_correction_kl else "off"
    checkpointing = bool(getattr(a, "activation_checkpointing", a.gradient_checkpointing))
    config = {
        "seed": a.seed, "iterations": iterations,
        "rollout": {"groups_per_iteration": prompts, "group_size": G},
        "advantage": {"estimator": estimator, "clip": None, "eps": 1e-4,
                      "multi_reward": a.multi_objective_aggregation},
        "loss": loss,
        "optim": {"lr": a.learning_rate, "weight_decay": a.weight_decay, "betas": [a.adam_beta1, a.adam_beta2],
                  "eps": a.adam_epsilon, "grad_clip": a.max_grad_norm if a.max_grad_norm else None,
                  "warmup_steps": warmup, "schedule": schedule, "inner_epochs": a.num_iterations,
                  "minibatches_per_epoch": minibatches, "micro_batch_size": a.per_device_train_batch_size},
        "eval": {"at_start": False, "every": 0},  # TRL's evaluation runs in the TRL-shaped trainer
        "checkpoint": {"every": in_iterations(a.save_steps) if save == "steps" else 0,
                       "keep_last": a.save_total_limit or 2},
        "logging": {"progress": not a.disable_tqdm if a.disable_tqdm is not None else True,
                    "tensorboard": "tensorboard" in report, "wandb": "wandb" in report},
        # grove's engine where it runs the model (the fused Llama/Qwen2 sampler, else the torch one) and the
        # behaviour log-probs from the first loss forward before any update: TRL's own old log-probs when
        # num_iterations is 1, without a separate no-grad pass; each prompt's forward once for its completions
        # (its KV cache shared; gradient checkpointing drops caches, so not with it); the loss log-probs from
        # grove's lean packed forward where it runs the model (fast_train.py; the model's own forward else)
        "llm": {"engine": "auto", "behaviour_logprobs": "deferred" if kl_correction == "off" else "recompute",
                "share_prompt_forward": not checkpointing, "train_forward": "auto",
                "max_new_tokens": max_new, **sampling, "min_p": sampling["min_p"] or 0.0,
                "gradient_checkpointing": checkpointing,
                "keep_reference": a.beta != 0 and not has_peft, "none_rewards": "zero_unless_all",
                "mask_truncated": bool(a.mask_truncated_completions), "chat_template": "never",
                "kl_ratio_correction": kl_correction},
    }
    checkpoint_kwargs = getattr(a, "activation_checkpointing_kwargs", None) or a.gradient_checkpointing_kwargs
    if checkpoint_kwargs not in (None, {}, {"use_reentrant": False}, {"use_reentrant": True}):
        _fail("gradient_checkpointing_kwargs", checkpoint_kwargs, "grove takes none")
    if a.entropy_coef != 0 or a.use_adaptive_entropy or a.top_entropy_quantile < 1:
        loss["entropy"] = {"coef": a.entropy_coef, "top_quantile": a.top_entropy_quantile,
                           **({"target": a.entropy_target, "coef_step": a.entropy_coef_delta,
                               "coef_min": a.entropy_coef_min, "coef_max": a.entropy_coef_max}
                              if a.use_adaptive_entropy else {})}
    if a.cast_lm_head_to_fp32:
        config["llm"]["lm_head_fp32"] = True
    if a.reward_weights is not None:
        config["_reward_weights"] = list(a.reward_weights)
    if a.chat_template_kwargs:
        config["llm"]["dataset"] = {"chat_template_kwargs": dict(a.chat_template_kwargs)}
    notes = []
    if a.bf16 or a.fp16:
        notes.append(f"GRPOConfig.{'bf16' if a.bf16 else 'fp16'}=True (mixed-precision autocast): grove trains in "
                     f"the model's own dtype (llm.dtype); pass a bfloat16 model for bfloat16 weights")
    if a.loss_type == "bnpo" and ga > 1:
        notes.append("GRPOConfig.loss_type='bnpo' normalises by each micro-batch's tokens; grove normalises by the "
                     "optimizer step's tokens (dapo), equal when gradient_accumulation_steps is 1")
    if a.multi_objective_aggregation == "normalize_then_sum" and len(a.reward_weights or [0, 0]) > 1:
        notes.append("GRPOConfig.multi_objective_aggregation='normalize_then_sum': grove sums the per-reward group "
                     "z-scores without TRL's last division by the sum's batch std (one positive scale per batch)")
    if a.importance_sampling_level == "sequence" and a.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        notes.append(f"GRPOConfig.importance_sampling_level='sequence' with loss_type={a.loss_type!r} weights each "
                     f"sequence by its completion length (the token sum); GSPO's objective is loss_type='grpo'")
    if a.num_generations_eval not in (None, G):
        notes.append(f"GRPOConfig.num_generations_eval={a.num_generations_eval}: evaluation samples that many "
                     f"completions per prompt")
    trainer = {
        "steps_per_iteration": steps_per_iteration, "logging_steps": a.logging_steps,
        "logging_first_step": a.logging_first_step, "eval_every": eval_every, "eval_on_start": a.eval_on_start,
        "num_generations_eval": a.num_generations_eval or G, "sync_ref_model": a.sync_ref_model,
        "ref_model_mixup_alpha": a.ref_model_mixup_alpha,
        "ref_sync_every": in_iterations(a.ref_model_sync_steps) if a.sync_ref_model else 0,
        "disable_dropout": a.disable_dropout, "model_init_kwargs": dict(a.model_init_kwargs or {}),
        "trust_remote_code": a.trust_remote_code, "output_dir": a.output_dir, "num_train_epochs": a.num_train_epochs,
        "max_steps": iterations * steps_per_iteration, "loss_type": a.loss_type, "max_completion_length": max_new,
        "normalize_then_sum": a.multi_objective_aggregation == "normalize_then_sum",
        # transformers' default optim: AdamW's fused kernel (one kernel per step instead of ~10 ops per tensor)
        "fused_adamw": str(getattr(a.optim, "value", a.optim)) == "adamw_torch_fused",
    }
    return Translation(config=config, trainer=trainer, notes=notes)
