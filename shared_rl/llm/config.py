"""The ``llm:`` section's settings (``LLMConfig`` and its parts), in a module that imports no torch or transformers, so
a config is read and checked (``grove config show``, the CLI's checks) without them (``shared_rl.registry.
DOMAIN_CONFIGS``). The domain is ``shared_rl.llm.domain``; the modules the parts used to live in (``domain``,
``model``, ``tree``, ``sampling``) re-export them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..domain_config import DomainConfig
from ..errors import ConfigError
from ..reward_guard import RewardGuardConfig
from .rewards import LLMRewardSpec, build_reward
from .tasks import DatasetSettings, load_task, prompt_token_ids, prompt_token_limit


@dataclass
class LLMLoraSettings:
    """LoRA adapter settings (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models"): the ``llm.lora``
    section. ``LLM``-prefixed because the image domain has LoRA settings of its own; one name, one meaning."""

    moved_keys = {"r": "use llm.lora.rank (the name every other LoRA section uses)"}

    enabled: bool = field(default=False, metadata={"help": "train a peft LoRA adapter instead of all weights"})
    rank: int = field(default=8, metadata={"help": "adapter rank (peft's r)"})
    alpha: int = field(default=16, metadata={"help": "LoRA alpha (the update is scaled by alpha / rank)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the adapter input"})
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "names of the linear modules that get adapters"},
    )


@dataclass
class LLMTreeSettings:
    """The ``llm.tree`` section (``LLM``-prefixed: the image domain has tree settings of its own)."""

    enabled: bool = field(default=False, metadata={"help": "tree rollouts (TreePO / TreeRL) instead of flat groups"})
    branching: list[int] = field(default_factory=lambda: [2, 2, 2],
                                 metadata={"help": "children per node at each depth (leaves = their product)"})
    segment_tokens: int = field(default=2, metadata={"help": "new tokens per segment at most (last depth: to the cap)"})
    branch_on: str = field(default="fixed", metadata={
        "help": "fixed (at segment boundaries) | entropy (also before a high-entropy token)"})
    entropy_threshold: float = field(default=1.0, metadata={
        "help": "branch_on entropy: next-token entropy (nats) that ends a segment"})
    min_segment_tokens: int = field(default=1, metadata={"help": "branch_on entropy: tokens before a segment may end"})


@dataclass(frozen=True)
class SamplingFilters:
    """``top_k`` 0 = off, ``top_p`` 1 = off, ``min_p`` 0 = off, ``repetition_penalty`` 1 = off (TRL's defaults)."""

    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def active(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0 or self.repetition_penalty != 1.0

    @property
    def penalises_repeats(self) -> bool:
        return self.repetition_penalty != 1.0

    def check(self, where: str) -> None:
        from ..errors import ConfigError

        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{where}.top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"{where}.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"{where}.min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"{where}.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")


@dataclass
class LLMEvalSettings:
    """Held-out evaluation: greedy decoding on ``num_prompts`` eval prompts (``eval/accuracy`` is the mean of
    ``accuracy_reward``, default the first reward), plus one sample per prompt at the training temperature
    (``eval/sampled_accuracy``, the quantity GRPO's group variance depends on) when ``sampled``."""

    num_prompts: int = field(default=500, metadata={"help": "held-out prompts per evaluation"})
    batch_size: int = field(default=256, metadata={"help": "prompts per evaluation generate call"})
    sampled: bool = field(default=True, metadata={
        "help": "also sample once per prompt at the training temperature (eval/sampled_accuracy)"})
    accuracy_reward: str = field(default="", metadata={
        "help": "reward label that is eval/accuracy; '' = the first reward"})
    num_samples_logged: int = field(default=8, metadata={"help": "evaluation completions written to the log"})


@dataclass
class LLMConfig(DomainConfig):
    """Settings of the ``llm:`` section.

    model / tokenizer: a local directory (relative paths resolve against the repository, e.g. the embedded
        ``assets/llm-arith-tiny``) or a hub id. ``lora`` adds a peft adapter; the reference policy for a KL term
        is then the base model (adapter disabled); without LoRA, ``keep_reference`` keeps a frozen copy.
    dataset: the task (``arith`` embedded, or JSONL/CSV/``datasets`` with columns passed to reward functions).
    chat_template: ``auto`` uses the tokenizer's chat template when it has one.
    rewards: TRL-signature reward functions with weights (copied into ``advantage.weights`` unless set there).
    tree: tree rollouts (TreePO / TreeRL); the trainer's ``advantage.estimator`` must then be a tree estimator.
    engine: ``torch`` (built-in KV-cache sampler over the HF module), ``fast`` (``fast_llama.FastLlamaEngine``: a
        lean Llama/Mistral/Qwen2 sampler on a snapshot of the current weights, same tokens for the same noise),
        ``auto`` (fast when the model is supported, else torch) or ``module:Class`` implementing ``RolloutEngine``
        (constructed as ``Class(model=..., tokenizer=..., config=...)``).
    behaviour_logprobs: ``recompute`` (default) runs one no-grad forward in the training layout at rollout time,
        so the ratio is exactly 1 before the first update; ``deferred`` leaves them NaN and the trainer fills them
        from its first loss forward (one minibatch per epoch: no extra forward, ratio exactly 1) or from one
        no-grad ``log_probs`` pass before the first update (several minibatches); unlike ``recompute`` that pass
        runs in train mode, so with LoRA dropout > 0 the behaviour log-probs carry dropout noise, as in TRL.
        ``engine`` takes the sampler's own log-probs (saves that forward; ratio 1 only to ~1e-6 with the built-in
        engines, and an external engine's kernels may differ more).
    share_prompt_forward: run each distinct prompt of a micro-batch once and its G completions on its expanded
        KV cache (``policy.token_log_probs_shared``), in the training forward, the behaviour recompute and the
        reference forward alike; equal to the one-pass forward up to float rounding. Needs the model's KV cache,
        so not with ``gradient_checkpointing``.
    train_forward: how the loss's log-probs are computed: ``hf`` (the model's own forward, one-pass or prefix-shared
        by ``share_prompt_forward``), ``fast`` (``fast_train.fast_token_log_probs``: a lean differentiable Llama /
        Mistral / Qwen2 forward on the packed real tokens, each prompt once, equal to ``hf`` up to float rounding;
        a ``ConfigError`` names what a model lacks) or ``auto`` (fast where it runs the model on the CPU, else hf,
        with a log line). Behaviour, training and reference log-probs all use the chosen one.
    """

    model: str = field(default="assets/llm-arith-tiny", metadata={"help": "causal LM directory or hub id"})
    tokenizer: str = field(default="", metadata={"help": "tokenizer directory or hub id; '' = the model's"})
    dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "parameter dtype: float32 | bfloat16 | float16"})
    lm_head_fp32: bool = field(default=False, metadata={
        "help": "keep the output layer in float32 and compute the logits in float32 under a bfloat16/float16 "
                "model (ScaleRL; TRL's cast_lm_head_to_fp32)"})
    lora: LLMLoraSettings = field(default_factory=LLMLoraSettings)
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute activations in backward (less memory, slower)"})
    keep_reference: bool = field(default=False, metadata={
        "help": "without LoRA: keep a frozen copy of the start policy as the KL reference"})
    dataset: DatasetSettings = field(default_factory=DatasetSettings)
    chat_template: Literal["auto", "always", "never"] = field(
        default="auto", metadata={"help": "use the chat template: auto (if the tokenizer has one) | always | never"})
    max_new_tokens: int = field(default=8, metadata={"help": "completion length cap in tokens"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of the rollouts"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling: keep the most likely tokens up to this "
                                                        "probability mass; 1 = off (sampling.py)"})
    top_k: int = field(default=0, metadata={"help": "sample among the k most likely tokens; 0 = off"})
    min_p: float = field(default=0.0, metadata={"help": "drop tokens below min_p x the top token's probability; 0 = off"})
    repetition_penalty: float = field(default=1.0, metadata={
        "help": "divide (multiply, if negative) the logits of tokens already in the row by this; 1 = off"})
    none_rewards: Literal["missing", "zero_unless_all"] = field(default="missing", metadata={
        "help": "a reward function's None: missing = the sample's reward is missing (NaN: masked and counted) | "
                "zero_unless_all = TRL's: that term counts 0 when another function scored the sample, missing only "
                "when every function returned None"})
    mask_truncated: bool = field(default=False, metadata={
        "help": "completions cut by max_new_tokens (no EOS) get no loss (TRL's mask_truncated_completions); they still "
                "count in their group's advantages"})
    kl_ratio_correction: Literal["off", "token", "sequence"] = field(default="off", metadata={
        "help": "multiply the k3 KL of each token by the importance ratio (with its gradient), per token or per "
                "sequence (TRL's use_bias_correction_kl); off = the trainer's loss.kl_estimator"})
    rewards: list[LLMRewardSpec] = field(default_factory=lambda: [LLMRewardSpec("numeric_match", 1.0)], metadata={
        "help": "reward terms: [{name, weight, args, label}] (names: built-in or module:function)"})
    reward_guard: RewardGuardConfig = field(default_factory=RewardGuardConfig)  # retries / time-out / NaN or fatal
    tree: LLMTreeSettings = field(default_factory=LLMTreeSettings)
    eval: LLMEvalSettings = field(default_factory=LLMEvalSettings)
    engine: str = field(default="torch", metadata={"help": "rollout sampler: torch | fast | auto | module:Class"})
    behaviour_logprobs: Literal["recompute", "engine", "deferred"] = field(default="recompute", metadata={
        "help": "where behaviour log-probs come from: recompute | engine | deferred"})
    share_prompt_forward: bool = field(default=False, metadata={
        "help": "forward each distinct prompt once and its completions on its KV cache"})
    train_forward: Literal["hf", "fast", "auto"] = field(default="hf", metadata={
        "help": "loss log-prob forward: hf (the model's modules) | fast (lean packed Llama-family forward) | auto"})
    engine_batch_rows: int = field(default=256, metadata={"help": "sequences per sampler batch at most"})
    logprob_batch_size: int = field(default=64, metadata={"help": "sequences per no-grad log-prob forward"})
    num_threads: int = field(default=0, metadata={"help": "torch CPU threads; 0 = torch's default"})

    def check(self, where: str) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"{where}.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ConfigError(f"{where}.temperature must be > 0 for RL sampling, got {self.temperature}")
        if not self.rewards:
            raise ConfigError(f"{where}.rewards is empty; add e.g. {{name: numeric_match, weight: 1.0}}")
        labels = [build_reward(r)[0] for r in self.rewards]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"{where}.rewards has duplicate labels {labels}; set 'label' to tell them apart")
        if self.tree.enabled:
            if not self.tree.branching or any(b < 1 for b in self.tree.branching):
                raise ConfigError(f"{where}.tree.branching must be positive ints, got {self.tree.branching}")
            if self.tree.branch_on not in ("fixed", "entropy"):
                raise ConfigError(f"{where}.tree.branch_on must be 'fixed' or 'entropy', got {self.tree.branch_on!r}")
            if self.tree.segment_tokens < 1 or self.tree.min_segment_tokens < 1:
                raise ConfigError(f"{where}.tree.segment_tokens and min_segment_tokens must be >= 1")
        if self.dataset.source not in ("arith", "jsonl", "csv", "json", "hf"):
            raise ConfigError(f"{where}.dataset.source must be one of arith, jsonl, csv, json, hf; "
                              f"got {self.dataset.source!r}")
        if self.engine not in ("torch", "fast", "auto") and ":" not in self.engine:
            raise ConfigError(f"{where}.engine must be torch, fast, auto or 'module:Class'; got {self.engine!r}")
        self.sampling_filters().check(where)
        if self.kl_ratio_correction != "off" and self.behaviour_logprobs == "deferred":
            raise ConfigError(f"{where}.kl_ratio_correction needs the behaviour log-probs at rollout time; set "
                              f"{where}.behaviour_logprobs: recompute")
        if self.logprob_batch_size < 1 or self.engine_batch_rows < 1:
            raise ConfigError(f"{where}.logprob_batch_size and engine_batch_rows must be >= 1")
        if self.train_forward == "fast" and self.gradient_checkpointing:
            raise ConfigError(f"{where}.train_forward: fast keeps every activation, which gradient checkpointing is "
                              f"there to avoid; set {where}.train_forward: hf (or auto)")
        if self.share_prompt_forward and self.gradient_checkpointing:
            raise ConfigError(f"{where}.share_prompt_forward needs the model's KV cache, which gradient checkpointing "
                              f"turns off; set one of {where}.share_prompt_forward / gradient_checkpointing to false")

    def sampling_filters(self):
        """The engines' token filters (``sampling.SamplingFilters``) from top_p / top_k / min_p / repetition_penalty."""
        return SamplingFilters(self.top_p, self.top_k, self.min_p, self.repetition_penalty)

    def reward_names(self, cfg: Any) -> list[str]:
        """The reward labels a rollout emits (the core checks ``advantage.weights`` / ``selection.band_reward``)."""
        return [build_reward(r)[0] for r in self.rewards]

    def preflight(self, cfg: Any) -> None:
        """Before the model loads: the dataset reads, each built-in reward finds the column it scores in every
        row, and ``eval.accuracy_reward`` is one of the rewards (else the first held-out evaluation fails)."""
        from .rewards import required_columns

        labels = self.reward_names(cfg)
        if self.eval.accuracy_reward and self.eval.accuracy_reward not in labels:
            raise ConfigError(f"llm.eval.accuracy_reward {self.eval.accuracy_reward!r} is not a reward label; "
                              f"labels: {labels}")
        if self.dataset.source == "hf":  # may download; the domain reads it after the model
            return
        task = load_task(self.dataset)
        self._preflight_prompt_lengths(task)
        for spec in self.rewards:
            for column in required_columns(spec):
                for split, rows in (("train", task.train), ("eval", task.eval)):
                    bad = next((i for i, row in enumerate(rows) if row.get(column) is None), None)
                    if bad is not None:
                        why = "lacks" if column not in rows[bad] else "leaves empty (null)"
                        raise ConfigError(f"llm.rewards: {spec.name} scores column {column!r}, which {split} row "
                                          f"{bad} {why} (columns: {sorted(rows[bad])}); set "
                                          f"llm.dataset.answer_column or the reward's args.column")

    def prompt_limit(self, context: int | None) -> tuple[int | None, str]:
        """The longest prompt in tokens and why: ``dataset.max_prompt_tokens``, else the model's context minus
        ``max_new_tokens``."""
        why = ("llm.dataset.max_prompt_tokens" if self.dataset.max_prompt_tokens > 0 else
               f"the model's context {context} minus llm.max_new_tokens {self.max_new_tokens}")
        return prompt_token_limit(self.dataset, context, self.max_new_tokens), why

    def _preflight_prompt_lengths(self, task) -> None:
        """Outsized prompts before the run directory exists: the tokenizer and the model's config (local files only;
        when either cannot be read here the domain checks after loading)."""
        from ..prechecks import resolve_llm_model
        from .tasks import load_tokenizer

        model, tok = resolve_llm_model(self.model), resolve_llm_model(self.tokenizer or self.model)
        if not (Path(model).exists() and Path(tok).exists()):  # a hub id: checked after loading, never a Hub call here
            return
        try:
            from transformers import AutoConfig

            tokenizer = load_tokenizer(tok)
            config = AutoConfig.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError):
            return
        limit, why = self.prompt_limit(_context_length(config))
        if limit is not None and self.dataset.long_prompts == "error":
            prompt_token_ids(task, tokenizer, self.dataset, self.chat_template, limit, why)

    def parameter_groups(self, cfg: Any) -> list | None:
        """The model built from its ``config.json`` on the meta device (no weights read; a local model only — a hub
        id is counted once loaded): trained whole, or LoRA adapters (``rank x (in + out)`` per targeted linear
        layer) over the frozen base, plus the frozen copy ``keep_reference`` makes (sharded like the model under
        fsdp2: ``LLMDomain.fsdp_modules``)."""
        from ..memory_estimate import DTYPE_BYTES, ParameterGroup
        from ..prechecks import resolve_llm_model

        path = Path(resolve_llm_model(self.model))
        if not (path / "config.json").is_file():
            return None
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True))
        n, size = sum(p.numel() for p in model.parameters()), DTYPE_BYTES[self.dtype]
        if self.lora.enabled:
            adapters = sum(self.lora.rank * (m.in_features + m.out_features) for name, m in model.named_modules()
                           if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in self.lora.target_modules)
            return [ParameterGroup("LoRA adapters", adapters, True, size),
                    ParameterGroup("frozen base (also the KL reference)", n, False, size)]
        groups = [ParameterGroup("model", n, True, size)]
        if self.keep_reference:
            groups.append(ParameterGroup("reference copy", n, False, size))
        return groups

    def rollout_structure(self, cfg: Any) -> str:
        """Tree rollouts when ``tree.enabled`` (the hook of ``shared_rl.domain``: tree estimators need them)."""
        return "tree" if self.tree.enabled else "flat"

    def check_with(self, cfg: Any) -> None:
        """Cross-checks against the trainer config (called by ``shared_rl.config.load_train_config``, after the core
        check that a tree estimator has tree rollouts)."""
        from ..part_index import estimator_names

        est = cfg.advantage.estimator.name
        if self.tree.enabled and cfg.advantage.kind != "tree":
            raise ConfigError(f"llm.tree.enabled needs a tree advantage estimator; set advantage.estimator to one of "
                              f"{estimator_names('tree')} (got {est!r})")
        unknown = set(cfg.advantage.weights) - set(self.default_reward_weights())
        if unknown:
            raise ConfigError(f"advantage.weights names {sorted(unknown)}, which are not llm.rewards labels "
                              f"{sorted(self.default_reward_weights())}")

    def default_reward_weights(self) -> dict[str, float]:
        """Reward label -> ``llm.rewards[].weight``: the trainer's weights when ``advantage.weights`` is empty."""
        return {build_reward(r)[0]: r.weight for r in self.rewards}


def _context_length(config) -> int | None:
    """The model's context in tokens (``max_position_embeddings`` of its text config), None when it declares none."""
    return getattr(config.get_text_config(), "max_position_embeddings", None)
