"""The visgen training domain: GRPO-family RL of a flow-matching text-to-image pipeline against reward models.

One class covers every visgen method; they differ only in ``visgen.method`` (a tagged union over the registry in
``visgen.methods``) and ``visgen.kernel``:

| method          | ``kernel`` | ``method``                                          | rollout shape                          |
|-----------------|------------|-----------------------------------------------------|----------------------------------------|
| Flow-GRPO       | ``sde``    | ``{name: flow_grpo, train_fraction: 0.3}``           | flat: group_size chains per prompt     |
| DanceGRPO       | ``dance``  | ``{name: dance_grpo}`` (random 60% of steps/sample)  | flat                                   |
| Flow-GRPO-Fast  | ``sde``    | ``{name: flow_grpo_fast}`` (SDE in a 1-3 step window)| flat, ODE elsewhere                    |
| MixGRPO         | ``sde``    | ``{name: mix_grpo}`` (sliding SDE window)            | flat                                   |
| BranchGRPO(-Mix)| ``sde``    | ``{name: branch_grpo, split_steps: [0, 2, 4, 6]}``   | one tree per prompt, pruning           |
| TreeGRPO        | ``sde``    | ``{name: tree_grpo, branch: [2, 2, 2, 2]}``          | one tree per prompt, SDE window        |
| E-GRPO          | ``sde``    | ``{name: egrpo}``                                    | one group per (prompt, merged step)    |

An iteration, as the shared trainer drives it: ``rollout`` encodes the prompts, lets the method grow its forest on
the one engine (``visgen.engine``: one batched transformer forward per level and step, SDE where the method says
so, log-probs recorded), decodes and scores the leaves with the reward registry, lets the method prune, and returns
the trainable edges; the trainer turns rewards into group-relative (or tree) advantages; ``log_probs`` recomputes
the trained steps' log-probs with grad (``visgen.recompute``) for the policy loss and, with ``loss.kl_coef > 0``,
the Flow-GRPO Gaussian-mean KL to the base model (the LoRA adapter switched off). ``evaluate`` samples held-out
prompts with the deterministic ODE and fixed seeds. The model stays in eval mode throughout (no dropout), so the
first inner step's importance ratio is exactly 1 when the training batch layout equals the rollout's.

Config: see :class:`VisgenConfig` (``grove config show`` prints every field with its help); recipes in
``configs/visgen/``; method pages in ``docs/methods/``.
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import torch

from shared_rl.config import ConfigError
from shared_rl.domain import DomainBase, DomainConfig, RunContext, StepLogProbs
# the model's location is checked torch-free, so the CLI answers a typo'd path before importing this module
from shared_rl.rewards import RewardGuardConfig, guarded_reward
from shared_rl.rollout import Rollout
from shared_rl.sharding import loads_on_meta

from .fsdp import place_pipeline
from .lowprec import TwoStageSettings
from .pipelines.load import load_pipeline  # noqa: F401  (visgen.domain.load_pipeline, as before)
from .pipelines.memory import MemorySettings
from .policy import EmaSettings, FlowPolicy, LoraSettings
from .rollout import VisgenRollouts
from .tasks import get_task
from .tasks.files import read_prompt_file  # noqa: F401  (visgen.domain.read_prompt_file, as before)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# display names of the shapes reward outputs in evaluation metrics
EVAL_NAMES = {"shapes": "score", "shapes_strict": "strict"}


# ------------------------------------------------------------------------------------------------------ config
def _help(text: str, default: Any = None, factory: Any = None) -> Any:
    """A dataclass field with help text (shown by ``grove config show``)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


@dataclass
class RewardSpec:
    """A reward from ``visgen.rewards`` by name, with its factory's keyword arguments. Each reward may emit several
    named outputs (``shapes`` emits ``shapes`` and ``shapes_strict``); all go into the rollout's rewards, and
    ``advantage.weights`` (trainer section) decides which train (weight 0 = logged only)."""

    name: str = _help("registered reward name (visgen.rewards.available_rewards())", "shapes")
    kwargs: dict[str, Any] = _help("keyword arguments of the reward's factory", factory=dict)

    def check(self, where: str) -> None:
        from .rewards import available_rewards

        _import_optional_rewards()
        if self.name not in available_rewards():
            from shared_rl.registry import did_you_mean

            raise ConfigError(f"{where}.name: unknown reward {self.name!r}{did_you_mean(self.name, available_rewards())}; "
                              f"available: {', '.join(available_rewards())}")


@dataclass
class EvalSettings:
    guidance_scale: Optional[float] = _help("CFG scale of evaluation sampling; null: the training guidance_scale")
    num_inference_steps: Optional[int] = _help("denoising steps of evaluation; null: the training num_inference_steps")
    samples_per_prompt: int = _help("images per held-out prompt (ODE, fixed seeds)", 2)
    max_prompts: int = _help("evaluate at most this many held-out prompts, evenly spaced (0: all)", 0)
    seed: int = _help("seed of the evaluation noise (the same before and after training)", 1234)
    batch_size: int = _help("images per evaluation sampling call", 64)
    use_ema: bool = _help("evaluate (and export) the EMA weights when ema.enabled", True)
    grid_prompts: int = _help("prompts in the before/after sample grid written at the end (0: no grid)", 8)
    grid_samples: int = _help("images per prompt in that grid", 4)

    def check(self, where: str) -> None:
        for name in ("samples_per_prompt", "batch_size", "grid_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prompts", "grid_prompts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_inference_steps is not None and self.num_inference_steps < 1:
            raise ConfigError(f"{where}.num_inference_steps must be >= 1, got {self.num_inference_steps}")


@dataclass
class VisgenConfig(DomainConfig):
    """Settings of the ``visgen:`` section of a training YAML (validated without loading any model)."""

    # keys of earlier configs and what replaced them (shared_rl.config.from_dict reports them in one line)
    moved_keys: ClassVar[dict[str, str]] = {
        "plan": "use visgen.method: {name: flow_grpo, train_fraction: ...} (the plan's fields go into method)",
        "tree": "use visgen.method: {name: branch_grpo | branch_grpo_mix | tree_grpo | egrpo, ...that method's fields}",
        "sampler": "the SDE kernel is visgen.kernel (sde, cps or dance)",
    }

    model: str = _help("local diffusers pipeline directory (relative: the working directory, then the repo) or a "
                       "Hugging Face hub id", "assets/shapes-sd3-tiny")
    dtype: Literal["float32", "bfloat16", "float16"] = _help("dtype the pipeline is loaded in", "float32")
    task: str = _help("the task (visgen.tasks): 'shapes' / 'words' / 'video_shapes' = an embedded task (its "
                      "train/held-out split, as in pretraining); 'file' = train_prompts / eval_prompts files", "shapes")
    train_prompts: Optional[str] = _help(".txt (one prompt a line) or .jsonl (objects with 'prompt' and reward "
                                         "metadata) for task: file")
    eval_prompts: Optional[str] = _help("held-out prompt file for task: file (null: no evaluation)")
    split_seed: Optional[int] = _help("seed of the shapes train/held-out split; null: the asset's grove.json (else 0)")
    eval_fraction: Optional[float] = _help("held-out fraction of the shapes prompts; null: the asset's grove.json")
    train_subset: Optional[list[int]] = _help("train on these prompt indices only (overfitting checks, debugging)")
    resolution: Optional[int] = _help("image size in pixels; null: the asset's grove.json, else the pipeline default")
    max_sequence_length: Optional[int] = _help("text tokens; null: the asset's grove.json, else the pipeline default")
    num_inference_steps: int = _help("denoising steps of a rollout (the last one is never trained)", 10)
    guidance_scale: float = _help("CFG in training rollouts (1 = off, as Flow-GRPO recommends); FLUX: the "
                                  "guidance embedding", 1.0)
    method: Optional[dict[str, Any]] = _help("the rollout method and its own fields, e.g. {name: flow_grpo, "
                                             "train_fraction: 0.3} (visgen.methods: flow_grpo, dance_grpo, "
                                             "flow_grpo_fast, mix_grpo, explicit, ode, branch_grpo, branch_grpo_mix, "
                                             "tree_grpo, egrpo); null: the objective's (flow_grpo for log_prob, the "
                                             "ODE sampler for nft / awm / dgpo)")
    objective: dict[str, Any] = _help("what training recomputes (visgen.objectives): {name: log_prob} (Flow-GRPO "
                                      "family, any ratio-based loss.policy_loss), {name: nft, beta: 1.0, adv_max: "
                                      "5.0} (DiffusionNFT), {name: awm} or {name: dgpo}; nft / awm / dgpo bring their "
                                      "policy loss and the ODE sampler (leave loss.policy_loss and method null)",
                                      factory=lambda: {"name": "log_prob"})
    kernel: Literal["sde", "cps", "dance"] = _help("SDE kernel of the stochastic steps (shared_rl.flow_kernels)", "sde")
    two_stage: TwoStageSettings = _help("Sol-RL two-stage rollout: low-precision explore, full-precision train "
                                        "(visgen.lowprec)", factory=TwoStageSettings)
    noise_level: Optional[float] = _help("the kernel's noise level: sde/cps a, dance eta (null: the kernel's "
                                          "default, shared_rl.flow_kernels.KERNEL_NOISE_LEVELS)")
    reduction: Literal["mean", "sum"] = _help("log-prob reduction over latent elements (mean: Flow-GRPO)", "mean")
    rollout_micro_batch: int = _help("samples per transformer forward while sampling (0: the whole call)", 0)
    shared_noise: bool = _help("flat methods: one initial noise per prompt for its whole group (DanceGRPO), so "
                               "samples differ only by their trained SDE steps", False)
    rewards: list[RewardSpec] = _help("rewards by name; their outputs are weighted by advantage.weights",
                                      factory=lambda: [RewardSpec("shapes")])
    reward_guard: RewardGuardConfig = _help("retries / time-out / NaN-or-fatal for every reward call",
                                            factory=RewardGuardConfig)
    gold_rewards: list[RewardSpec] = _help("held-out 'gold' rewards: scored on the evaluation images only, never "
                                           "trained on (eval/gold/<output>); a warning when a trained reward rises "
                                           "while one falls (reward hacking, visgen.rewards.gold)", factory=list)
    score_chunks: int = _help("split each rollout call into this many sub-chunks, each sampled with its own "
                              "generator seeded from the call's (1: one batch, the default path)", 1)
    overlap_rewards: bool = _help("score sub-chunk i in a worker thread while sub-chunk i+1 samples (needs "
                                  "score_chunks >= 2; same metrics as without)", False)
    kl_type: Literal["mean", "velocity"] = _help("KL when loss.kl_coef > 0: Gaussian-mean (Flow-GRPO) or velocity",
                                                 "mean")
    train_mode: Literal["lora", "full"] = _help("train a LoRA adapter or the whole transformer", "lora")
    lora: LoraSettings = _help("LoRA adapter settings (peft)", factory=LoraSettings)
    ema: EmaSettings = _help("EMA of the trained weights", factory=EmaSettings)
    full_reference: bool = _help("full fine-tuning: keep a frozen copy as the KL reference", True)
    gradient_checkpointing: bool = _help("recompute transformer activations in backward (saves memory)", False)
    num_frames: Optional[int] = _help("video pipelines: frames per clip; null: the asset's grove.json, else the "
                                      "pipeline default")
    encode_options: dict[str, Any] = _help("model-specific prompt-encoding options for the adapter, e.g. "
                                           "{negative_prompt: ' ', true_cfg_scale: 4.0} (Qwen-Image)", factory=dict)
    memory: MemorySettings = _help("memory controls: prompt cache, offloading, VAE slicing/tiling, frame-chunked "
                                   "decode (visgen.pipelines.memory)", factory=MemorySettings)
    eval: EvalSettings = _help("held-out evaluation", factory=EvalSettings)
    num_threads: int = _help("torch CPU threads (0: leave as is)", 0)

    def check(self, where: str) -> None:
        if self.num_inference_steps < 2:
            raise ConfigError(f"{where}.num_inference_steps must be >= 2 (the last step is never trained), "
                              f"got {self.num_inference_steps}")
        if self.guidance_scale < 0:
            raise ConfigError(f"{where}.guidance_scale must be >= 0, got {self.guidance_scale}")
        if self.noise_level is not None and self.noise_level < 0:
            raise ConfigError(f"{where}.noise_level must be >= 0, got {self.noise_level}")
        if self.rollout_micro_batch < 0 or self.num_threads < 0:
            raise ConfigError(f"{where}.rollout_micro_batch and num_threads must be >= 0")
        if self.resolution is not None and self.resolution < 8:
            raise ConfigError(f"{where}.resolution must be >= 8 pixels, got {self.resolution}")
        if self.eval_fraction is not None and not 0 < self.eval_fraction < 1:
            raise ConfigError(f"{where}.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if not self.rewards:
            raise ConfigError(f"{where}.rewards must list at least one reward, e.g. [{{name: shapes}}]")
        get_task(self.task, f"{where}.task").check(self, where)
        if self.score_chunks < 1:
            raise ConfigError(f"{where}.score_chunks must be >= 1, got {self.score_chunks}")
        if self.overlap_rewards and self.score_chunks < 2:
            raise ConfigError(f"{where}.overlap_rewards needs score_chunks >= 2 (sub-chunks to overlap), got "
                              f"{self.score_chunks}; e.g. visgen.score_chunks=4")
        from .rewards.gold import check_gold_rewards

        check_gold_rewards(self, where)
        method = self.rollout_method(f"{where}.method")
        if self.shared_noise and method.structure != "flat":
            raise ConfigError(f"{where}.shared_noise is for flat methods; {method.name} shares each tree's initial "
                              "noise by construction")
        method.check(self.num_inference_steps, None, f"{where}.method[{method.name}]")
        if self.two_stage.enabled and method.structure != "flat":
            raise ConfigError(f"{where}.two_stage works with flat methods (independent candidates per prompt); "
                              f"{method.name} grows trees")
        objective = self.training_objective(f"{where}.objective")
        if not objective.likelihood_free and not method.trains_steps(self.num_inference_steps):
            raise ConfigError(f"{where}.method {method.name!r} trains nothing under the log_prob objective (no trained "
                              f"SDE step of {self.num_inference_steps}); widen it, or use visgen.objective nft/awm, "
                              "which train on clean samples from any sampler")
        if objective.likelihood_free:
            objective.check_steps(self.num_inference_steps, f"{where}.objective")

    def kernel_settings(self):
        """How the stochastic steps are drawn and scored (``visgen.methods.KernelSettings``); a null noise level is
        the kernel's default (``shared_rl.flow_kernels.KERNEL_NOISE_LEVELS``)."""
        from shared_rl.flow_kernels import KERNEL_NOISE_LEVELS

        from .methods import KernelSettings

        level = KERNEL_NOISE_LEVELS[self.kernel] if self.noise_level is None else float(self.noise_level)
        return KernelSettings(self.kernel, level, self.reduction, self.rollout_micro_batch, self.shared_noise)

    def method_config(self) -> dict[str, Any]:
        """``method``, or the objective's default sampler when it is null (derived, never stored)."""
        return self.method if self.method is not None else dict(self.training_objective().default_method)

    def rollout_method(self, where: str = "visgen.method", train_cfg=None):
        """The configured ``visgen.methods`` method (a fresh object built from ``method_config()``); with the
        trainer's sections ``train_cfg``, as they complete it (``RolloutMethod.with_trainer``: e.g. branch pruning
        ranks by the training estimator when it names none)."""
        from .methods import method_from_config

        method = method_from_config(self.method_config(), where)
        return method if train_cfg is None else method.with_trainer(train_cfg, f"{where}[{method.name}]")

    def training_objective(self, where: str = "visgen.objective"):
        """The configured ``visgen.objectives`` objective (a fresh object built from ``objective``)."""
        from .objectives import objective_from_config

        return objective_from_config(self.objective, where)

    def policy_loss(self, train_cfg):
        """The loss a likelihood-free objective trains with (``nft`` with its ``adv_max``, ``awm``), which the
        trainer uses when ``loss.policy_loss`` is null; None for the log_prob objective (any ratio-based loss)."""
        return self.training_objective().loss_choice()

    def trained_outputs(self, train_cfg) -> list[str]:
        """The reward outputs with a non-zero ``advantage.weights`` entry (all when no weights are given: the
        trainer's default weight is 1); ``train_cfg`` None (a domain built by hand): all."""
        weights = dict(train_cfg.advantage.weights or {}) if train_cfg is not None else {}
        return [n for n in self.reward_names(train_cfg) if weights.get(n, 1.0) != 0]

    def granular_base_outputs(self, train_cfg) -> list[str] | None:
        """The trained reward outputs a method scores again at coarser ODE granularities (E-GRPO: each as
        ``<output>@g<stride>``); none for every other method. When the rewards' outputs cannot be known before
        loading: the outputs ``advantage.weights`` trains, or None (every output) without weights."""
        if not self.rollout_method().reward_granularities():
            return []
        from .preflight import reward_names

        weights = dict(train_cfg.advantage.weights or {}) if train_cfg is not None else {}
        names = reward_names(self, _import_optional_rewards)
        if names is None:
            return [n for n, w in weights.items() if w != 0 and "@g" not in n] if weights else None
        return [n for n in names if weights.get(n, 1.0) != 0]

    def rollout_structure(self, train_cfg) -> str:
        """``flat`` or ``tree``: what the core checks the advantage estimator against."""
        return self.rollout_method().structure

    def reward_names(self, train_cfg) -> list[str] | None:
        """The outputs the configured rewards emit (``advantage.weights`` may name only these), with the method's
        coarse-granularity copies of the trained ones (E-GRPO: ``shapes@g2``); None: unknowable."""
        from .preflight import reward_names

        names = reward_names(self, _import_optional_rewards)
        if names is None:
            return None
        strides = self.rollout_method().reward_granularities()
        return names + [f"{n}@g{g}" for n in self.granular_base_outputs(train_cfg) for g in strides]

    def parameter_groups(self, train_cfg):
        """The pipeline's components counted on the meta device, split as ``FlowPolicy`` holds them (LoRA adapters
        or the whole transformer trained, the rest frozen; ``visgen.parameter_count``)."""
        from .parameter_count import parameter_groups

        return parameter_groups(self)

    def preflight(self, train_cfg) -> None:
        """Prompt files, reward arguments and reward/prompt fit, before a pipeline loads (``visgen.preflight``)."""
        from .preflight import preflight

        preflight(self, train_cfg, read_prompt_file, _import_optional_rewards)

    def check_with(self, cfg) -> None:
        """Checks that need the trainer sections too (pure: nothing here changes the config)."""
        from .objectives import OBJECTIVES

        method = self.rollout_method(train_cfg=cfg)
        method.check(self.num_inference_steps, cfg.rollout.group_size, f"visgen.method[{method.name}]")
        objective = self.training_objective()
        implied, written = objective.loss_choice(), cfg.loss.policy_loss
        brings_loss = objective.likelihood_free or objective.policy_loss is not None  # flow_dppo brings its own too
        if brings_loss and written is not None and written != implied:
            raise ConfigError(f"loss.policy_loss {written.to_config()!r} contradicts visgen.objective "
                              f"{objective.name!r}, which trains with {implied.to_config()!r}; remove "
                              "loss.policy_loss (the objective brings its loss and its settings)")
        loss_name = cfg.policy_loss_choice().name
        if not objective.likelihood_free and loss_name in {c.policy_loss for c in OBJECTIVES.values()
                                                           if c.likelihood_free}:
            raise ConfigError(f"loss.policy_loss {loss_name!r} needs visgen.objective: {{name: {loss_name}}} (which "
                              "brings the loss itself; remove loss.policy_loss)")
        if loss_name != objective.policy_loss and loss_name in {c.policy_loss for c in OBJECTIVES.values()
                                                                if not c.likelihood_free and c.policy_loss}:
            raise ConfigError(f"loss.policy_loss {loss_name!r} needs visgen.objective: {{name: {loss_name}}} (which "
                              "computes the step-mean KL to the old policy it masks with; remove loss.policy_loss)")
        if self.two_stage.enabled:
            from .lowprec import check_precision

            check_precision(self.two_stage.precision, "cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available()
                            else (cfg.device if cfg.device != "auto" else "cpu"))
            if self.two_stage.candidates < cfg.rollout.group_size:
                raise ConfigError(f"visgen.two_stage.candidates ({self.two_stage.candidates}) must be >= "
                                  f"rollout.group_size ({cfg.rollout.group_size}), the candidates kept per prompt")
        if method.reward_granularities() and cfg.advantage.multi_reward != "normalize_then_sum":
            raise ConfigError(f"visgen.method {method.name}: its advantage sums the z-scores of the rewards at ODE "
                              f"granularities {[1] + method.reward_granularities()} (the reference's "
                              "multi-granularity rewards): set advantage.multi_reward: normalize_then_sum, or "
                              "visgen.method.granularities: [1] for one granularity")
        if objective.builds_targets:
            self._check_differentiable_rewards(cfg, objective.name, method)
        if objective.name == "dpo" and objective.settings.pairs:
            from .offline_dpo import check_offline

            check_offline(objective, cfg.rollout.group_size)
        if objective.name == "dpo" and (cfg.optim.minibatches_per_epoch != 1 or cfg.optim.micro_batch_size != 0):
            raise ConfigError("visgen.objective dpo pairs the best and the worst sample of each group, so one forward "
                              "call must hold whole groups: set optim.minibatches_per_epoch: 1 and "
                              "optim.micro_batch_size: 0 (optim.backward_steps may split the timesteps)")
        if objective.name == "dgpo" and (cfg.optim.minibatches_per_epoch != 1 or cfg.optim.micro_batch_size != 0):
            raise ConfigError("visgen.objective dgpo weighs each sample by its whole group's preference, so one "
                              "forward call must hold whole groups: set optim.minibatches_per_epoch: 1 and "
                              "optim.micro_batch_size: 0 (the reference's layout; optim.backward_steps may split "
                              "the timesteps)")
        if cfg.loss.kl_coef > 0 and self.train_mode == "full" and not self.full_reference:
            raise ConfigError("loss.kl_coef > 0 with visgen.train_mode: full needs visgen.full_reference: true "
                              "(a frozen copy of the transformer is the KL reference)")
        if cfg.loss.kl_estimator not in ("domain",) and cfg.loss.kl_coef > 0:
            raise ConfigError("visgen computes its KL itself (Flow-GRPO Gaussian-mean or velocity KL); set "
                              "loss.kl_estimator: domain and choose visgen.kl_type")


    def _check_differentiable_rewards(self, cfg, objective: str, method) -> None:
        """DiffusionOPSD follows the trained reward's gradient: every reward with a trained output must offer one
        (``RewardInfo.differentiable``), the rollout must be flat, the pipeline's decode differentiable."""
        from .preflight import reward_outputs
        from .rewards import reward_info

        _import_optional_rewards()
        weights = dict(cfg.advantage.weights or {})
        for spec in self.rewards:
            outputs = reward_outputs(spec.name, spec.kwargs)
            trained = outputs is None or any(weights.get(o, 1.0) != 0 for o in outputs)
            if trained and not reward_info(spec.name).differentiable:
                raise ConfigError(f"visgen.objective {objective} follows the reward's gradient, but reward "
                                  f"{spec.name!r} is not differentiable; train on a differentiable one (shapes_colour, "
                                  f"pickscore) or give {spec.name!r}'s outputs weight 0 in advantage.weights")
        if method.structure != "flat":
            raise ConfigError(f"visgen.objective {objective} queries one state of each flat trajectory; visgen.method "
                              f"{method.name!r} grows trees (use dpm2, ode or a flat method)")


def _import_optional_rewards() -> None:
    """Register the reward-model rewards (they import nothing heavy until built)."""
    from .rewards import hps, pickscore, shapes_soft, video  # noqa: F401


# ------------------------------------------------------------------------------------------------------ domain
class VisgenDomain(DomainBase):
    """GRPO-family RL of a diffusers flow-matching pipeline (see the module docstring)."""

    config_class = VisgenConfig

    def __init__(self, cfg: VisgenConfig, ctx: RunContext) -> None:
        from .pipelines import as_adapter
        from .pipelines.memory import apply_memory_settings
        from .rewards import get_reward
        from .rewards.video import OffloadedReward

        self.cfg, self.ctx = cfg, ctx
        self.task = get_task(cfg.task)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if ctx.device.type == "cpu":
            torch.set_flush_denormal(True)  # denormal floats make CPU kernels crawl as LoRA deltas shrink
        held = ctx.objects.get("pipeline")  # a pipeline the caller holds (visgen.api), trained in place
        if held is not None:
            self.pipe, self.model_location, local = held, cfg.model, False
            self.pipe.set_progress_bar_config(disable=True)
        else:
            # FSDP2 with several processes: the transformers on the meta device on processes > 0 (process 0 alone
            # loads them; setup_fsdp fills the others' shards: visgen/fsdp.py)
            self.pipe, self.model_location, local = load_pipeline(cfg.model, DTYPES[cfg.dtype],
                                                                  meta_transformers=loads_on_meta(ctx))
        place_pipeline(self.pipe, ctx.device)
        self.adapter = as_adapter(self.pipe)
        settings = self._asset_settings(local)
        self.max_sequence_length = cfg.max_sequence_length or settings.get("max_sequence_length")
        resolution = cfg.resolution or settings.get("resolution")
        self.height = self.width = int(resolution) if resolution else None
        if self.height:
            multiple = self.adapter.size_multiple()  # VAE downsampling x patch size (x 2 for 2x2-packed latents)
            if self.height % multiple:
                raise ConfigError(f"visgen.resolution {self.height} must be a multiple of {multiple} for this "
                                  f"pipeline (VAE downsampling x transformer patch size); try "
                                  f"{max(multiple, round(self.height / multiple) * multiple)}")
        self.policy = FlowPolicy(self.pipe, cfg.train_mode, cfg.lora, cfg.ema, cfg.gradient_checkpointing,
                                 cfg.full_reference)
        self.num_frames = cfg.num_frames or settings.get("num_frames")
        if cfg.num_frames and not self.adapter.is_video:
            raise ConfigError(f"visgen.num_frames is for video pipelines; {type(self.pipe).__name__} makes images")
        self.fps = int(settings.get("fps", 8))
        self.memory = apply_memory_settings(self.pipe, self.adapter, cfg.memory)
        self._load_prompts(settings)
        _import_optional_rewards()
        def guarded(name: str, fn: Any) -> Any:
            fn = OffloadedReward(fn, ctx.device) if cfg.memory.offload_rewards else fn
            return guarded_reward(fn, name, cfg.reward_guard, lambda images, prompts, metas: len(prompts), log=ctx.log)

        raw = [(spec.name, get_reward(spec.name, **spec.kwargs)) for spec in cfg.rewards]
        self.rewards = [(name, guarded(name, fn)) for name, fn in raw]
        self.eval_rewards = list(self.rewards)
        if self.task.eval_reward and not any(name == self.task.eval_reward[0] for name, _ in self.rewards):
            name, kwargs = self.task.eval_reward  # the task's own metric, always reported
            self.eval_rewards.append((name, guarded(name, get_reward(name, **kwargs))))
        self.gold_rewards = [(spec.name, guarded(spec.name, get_reward(spec.name, **spec.kwargs)))
                             for spec in cfg.gold_rewards]
        self.method = cfg.rollout_method(train_cfg=ctx.train_cfg)
        self.objective = cfg.training_objective()
        schedule = self.objective.old_policy()
        if schedule is not None:  # DiffusionNFT's lagging "old" adapter (v_old, the sampler), AWM's EMA copy
            self.policy.enable_old_policy(schedule.decay_max, schedule.ramp, schedule.flat, schedule.update)
        self.rollouts = VisgenRollouts.from_config(cfg, self.adapter, self.policy, self.method, self.objective,
                                                   self.train_prompts, self.train_meta, self.score,
                                                   self._sample_kwargs(),
                                                   granular_outputs=cfg.granular_base_outputs(ctx.train_cfg))
        if getattr(self.objective.settings, "pairs", None):  # offline DPO: the stored pairs are the training data
            from .offline_dpo import StoredPairRollouts, read_pairs

            self.rollouts = StoredPairRollouts(self.rollouts, read_pairs(self.objective.settings.pairs))
            self.train_prompts, self.train_meta = self.rollouts.prompts, self.rollouts.metas
        from .objectives import Objective

        if self.objective.builds_targets:  # DiffusionOPSD: the trained reward with its gradient to the images
            self.rollouts.grad_reward = self._grad_reward(raw)
            vae = getattr(self.pipe, "vae", None)
            if cfg.gradient_checkpointing and hasattr(vae, "enable_gradient_checkpointing"):
                vae.enable_gradient_checkpointing()  # the reference's: the reward gradient runs through the decode
        if type(self.objective).select_rows is not Objective.select_rows:  # DPO ranks its pairs by the trained reward
            weights = dict(ctx.train_cfg.advantage.weights or {}) if ctx.train_cfg is not None else {}
            self.rollouts.reward_weights = {n: float(weights.get(n, 1.0)) for n in cfg.trained_outputs(ctx.train_cfg)}
        # inner epochs of the current iteration (a likelihood-free objective may draw fresh noise per epoch)
        self._minibatches = ctx.train_cfg.optim.minibatches_per_epoch if ctx.train_cfg is not None else 1
        self._iteration, self._iteration_steps = None, 0
        self._before_grid: torch.Tensor | None = None
        if not self.policy.has_base_switch and cfg.eval.grid_prompts and not loads_on_meta(ctx):
            # (only the main process plots the grid: a process on the meta device has no weights to sample with)
            self._before_grid = self._grid_images()  # full tuning: no adapter to switch off later

    def _grad_reward(self, raw: list[tuple[str, Any]]):
        """``(images, prompts, metas) -> [n]``: the weighted sum of the trained outputs (``advantage.weights``) of the
        rewards' ``differentiable`` calls, with the graph to the images (the reference's training-reward ascent)."""
        weights = dict(self.ctx.train_cfg.advantage.weights or {}) if self.ctx.train_cfg is not None else {}
        trained = set(self.cfg.trained_outputs(self.ctx.train_cfg))
        from .preflight import reward_outputs

        fns = []
        for spec, (name, fn) in zip(self.cfg.rewards, raw):
            outputs = reward_outputs(spec.name, spec.kwargs)
            if outputs is not None and not trained.intersection(outputs):
                continue  # logged only
            if not hasattr(fn, "differentiable"):
                raise ConfigError(f"visgen.objective {self.objective.name}: reward {name!r} has no differentiable call")
            fns.append(fn)
        from .rewards.video import OffloadedReward

        # visgen.memory.offload_rewards: the models come to the device for each call, as the scoring path's
        places = [OffloadedReward(fn, self.ctx.device).offload if self.cfg.memory.offload_rewards else None for fn in fns]

        def reward(images: torch.Tensor, prompts: list[str], metas: list[dict]) -> torch.Tensor:
            total = images.new_zeros(images.shape[0])
            for fn, place in zip(fns, places):
                with place if place is not None else contextlib.nullcontext():
                    outputs = fn.differentiable(images, prompts, metas)
                for out, value in outputs.items():
                    if out in trained:
                        total = total + float(weights.get(out, 1.0)) * value.to(total)
            return total

        return reward

    # -------------------------------------------------------------------------------------------- setup helpers
    def _asset_settings(self, local: bool) -> dict:
        if not local:
            return {}
        path = Path(self.model_location) / "grove.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def _load_prompts(self, settings: dict) -> None:
        cfg = self.cfg
        self.train_prompts, self.train_meta, self.eval_prompts, self.eval_meta = self.task.prompts(cfg, settings)
        if cfg.train_subset is not None:
            bad = [i for i in cfg.train_subset if not 0 <= i < len(self.train_prompts)]
            if bad or not cfg.train_subset:
                raise ConfigError(f"visgen.train_subset must list prompt indices in 0..{len(self.train_prompts) - 1}, "
                                  f"got {cfg.train_subset}")
            self.train_prompts = [self.train_prompts[i] for i in cfg.train_subset]
            self.train_meta = [self.train_meta[i] for i in cfg.train_subset]
        if cfg.eval.max_prompts and len(self.eval_prompts) > cfg.eval.max_prompts:
            # evenly spaced, so a short evaluation still covers every prompt kind of a sorted file
            step = len(self.eval_prompts) / cfg.eval.max_prompts
            keep = [int(i * step) for i in range(cfg.eval.max_prompts)]
            self.eval_prompts = [self.eval_prompts[i] for i in keep]
            self.eval_meta = [self.eval_meta[i] for i in keep]
        if not self.eval_prompts:
            self.ctx.log("visgen: no evaluation prompts (visgen.eval_prompts, or eval_prompts= in the Python API): "
                         "held-out evaluation is off; the summary reports the training rewards")

    def _sample_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_sequence_length": self.max_sequence_length}
        if self.height:
            kw.update(height=self.height, width=self.width)
        if getattr(self, "num_frames", None) and self.adapter.is_video:
            kw["num_frames"] = int(self.num_frames)
        kw.update(self.cfg.encode_options)
        return kw

    # -------------------------------------------------------------------------------------------- protocol
    def train_keys(self) -> list[int]:
        return list(range(len(self.train_prompts)))

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.policy.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.policy.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.policy.load_state_dict(state)

    def extra_state(self) -> dict[str, Any]:
        return self.policy.extra_state()

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.policy.load_extra_state(state)

    def after_optimizer_step(self) -> None:
        self.policy.update_ema()
        self.policy.old_policy_step()  # no-op unless the objective keeps an old policy (NFT, AWM)
        self._iteration_steps += 1
        self.rollouts.epoch = self._iteration_steps // max(self._minibatches, 1)

    def score(self, images: torch.Tensor, prompts: list[str], metas: list[dict],
              rewards: list[tuple[str, Any]] | None = None) -> dict[str, torch.Tensor]:
        """Every output of every reward for a batch of images (name -> ``[N]`` float32 on CPU)."""
        out: dict[str, torch.Tensor] = {}
        for name, fn in rewards if rewards is not None else self.rewards:
            for key, value in fn(images, prompts, metas).items():
                if key in out:
                    raise ConfigError(f"two rewards emit the output {key!r}; list each reward once")
                out[key] = torch.as_tensor(value, dtype=torch.float32).detach().cpu().reshape(-1)
        return out

    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        """The configured method's rollout on the one engine (``visgen.rollout.VisgenRollouts.rollout``). The first
        call of an iteration soft-updates the old policy (NFT / AWM, ``FlowPolicy.sync_old_policy``) and restarts
        the inner-epoch count."""
        if iteration != self._iteration:
            self._iteration, self._iteration_steps, self.rollouts.epoch = iteration, 0, 0
            self.policy.sync_old_policy(iteration)
        return self.rollouts.rollout(keys, group_size, generator, iteration)

    supports_step_subsets = True  # optim.backward_steps: the recompute forwards only the asked steps

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool, steps: torch.Tensor | None = None
                  ) -> StepLogProbs:
        """Recompute the trained steps of edges ``idx`` (those of ``steps`` when given) with grad
        (``visgen.recompute``), plus the KL when asked."""
        return self.rollouts.log_probs(rollout, idx, need_kl, steps)

    def fsdp_modules(self) -> list[torch.nn.Module]:
        """FSDP2 units: the transformer's repeated blocks (its ``_no_split_modules``), then the transformer (and the
        full-tuning reference copy likewise); the refused settings raise ConfigError (``visgen.fsdp``)."""
        from .fsdp import fsdp_units

        return fsdp_units(self)

    def trained_outputs(self) -> list[str]:
        """The reward outputs this run trains on (``VisgenConfig.trained_outputs`` under the trainer's sections)."""
        return self.cfg.trained_outputs(self.ctx.train_cfg)

    # -------------------------------------------------------------------------------------------- evaluation
    def _eval_settings(self) -> tuple[int, float]:
        e = self.cfg.eval
        steps = e.num_inference_steps or self.cfg.num_inference_steps
        guidance = self.cfg.guidance_scale if e.guidance_scale is None else e.guidance_scale
        return steps, guidance

    @torch.no_grad()
    def sample_ode(self, prompts: list[str], seed: int, batch_size: int | None = None) -> torch.Tensor:
        """Deterministic (ODE) images ``[N, 3, H, W]`` in [0, 1]; chunk j uses the generator seeded ``seed + j``,
        so the same prompts and seed give the same initial noise before and after training."""
        from .trajectory import sample as visgen_sample

        from shared_rl.metrics import Progress

        steps, guidance = self._eval_settings()
        batch_size = batch_size or self.cfg.eval.batch_size
        images = []
        progress = Progress(self.ctx.log, "ODE sampling (evaluation)", len(prompts), "images")
        for j, start in enumerate(range(0, len(prompts), batch_size)):
            generator = torch.Generator().manual_seed(seed + j)
            traj = visgen_sample(self.pipe, prompts[start:start + batch_size], steps, guidance, generator, "ode",
                                 decode=True, **self._sample_kwargs())
            images.append(traj.images.float().cpu())
            progress.update(min(len(prompts), start + batch_size))
        return torch.cat(images) if images else torch.zeros(0, 3, 1, 1)

    def evaluate(self, iteration: int) -> dict[str, float]:
        """Held-out prompts, ODE sampling, fixed seeds: mean of every reward output (``eval/score``,
        ``eval/strict`` for the shapes reward, plus strict accuracy per prompt kind, and the task's own metrics)."""
        e = self.cfg.eval
        if not self.eval_prompts:
            return {}
        prompts = [p for p in self.eval_prompts for _ in range(e.samples_per_prompt)]
        metas = [m for m in self.eval_meta for _ in range(e.samples_per_prompt)]
        with self.policy.ema_weights() if e.use_ema else contextlib.nullcontext():
            images = self.sample_ode(prompts, e.seed)
        scores = self.score(images, prompts, metas, self.eval_rewards)
        out = {}
        for name, values in scores.items():
            ok = torch.isfinite(values)
            out[f"eval/{EVAL_NAMES.get(name, name)}"] = float(values[ok].mean()) if ok.any() else float("nan")
        out.update(self.task.eval_metrics(scores))
        if self.gold_rewards:  # held-out gold rewards on the same images (never trained on)
            from .rewards.gold import gold_metrics

            out.update(gold_metrics(self.score(images, prompts, metas, self.gold_rewards)))
        if "shapes_strict" in scores:
            kinds = [m.get("kind") for m in metas]
            for kind in ("single", "count", "pair"):
                sel = torch.tensor([k == kind for k in kinds])
                if sel.any():
                    out[f"eval/strict_{kind}"] = float(scores["shapes_strict"][sel].nanmean())
        return out

    # -------------------------------------------------------------------------------------------- outputs
    def _grid_prompts(self) -> list[str]:
        g = self.cfg.eval.grid_prompts
        pool = self.eval_prompts or self.train_prompts
        if not g or not pool:
            return []
        step = max(1, len(pool) // g)
        return pool[::step][:g]

    def _grid_images(self) -> torch.Tensor:
        prompts = [p for p in self._grid_prompts() for _ in range(self.cfg.eval.grid_samples)]
        return self.sample_ode(prompts, self.cfg.eval.seed + 777) if prompts else torch.zeros(0, 3, 1, 1)

    def _grid_captions(self, prompts: list[str], before: torch.Tensor, after: torch.Tensor) -> list[str]:
        """``prompt | reward before -> after`` per grid row: the evaluation rewards' outputs (at most three), each
        the mean over the row's samples."""
        pool = dict(zip(self.train_prompts, self.train_meta)) | dict(zip(self.eval_prompts, self.eval_meta))
        n = self.cfg.eval.grid_samples
        reps = [p for p in prompts for _ in range(n)]
        metas = [pool.get(p, {}) for p in reps]
        b, a = (self.score(x, reps, metas, self.eval_rewards) for x in (before, after))
        names = [k for k in b if k in a][:3]
        return [f"{p}  |  " + ", ".join(f"{k} {b[k][i * n:(i + 1) * n].nanmean():.2f} -> "
                                        f"{a[k][i * n:(i + 1) * n].nanmean():.2f}" for k in names)
                for i, p in enumerate(prompts)]

    def save_pretrained(self, out_dir: Path) -> None:
        # the resolved location: a path relative to the repo would not load from anywhere else; a base inside the
        # checkout (the project's assets) is also named relative to it, so the export loads in a checkout elsewhere
        from .export import checkout_relative

        info = {"base_model": self.model_location, "method": self.cfg.method_config(), "kernel": self.cfg.kernel,
                **({"base_model_in_checkout": rel} if (rel := checkout_relative(self.model_location)) else {}),
                "num_inference_steps": self.cfg.num_inference_steps, "guidance_scale": self.cfg.guidance_scale,
                "max_sequence_length": self.max_sequence_length, "resolution": self.height}
        self.policy.save_pretrained(Path(out_dir), use_ema=self.cfg.eval.use_ema, info=info)

    def on_train_end(self, run_dir: Path | None, history: list[dict[str, float]]) -> None:
        """Before/after sample grid (same prompts and seeds; "before" = the base model) and a short summary."""
        if run_dir is None:
            return
        run_dir = Path(run_dir)
        prompts = self._grid_prompts()
        if prompts:
            if self._before_grid is not None:
                before = self._before_grid
            else:
                with torch.no_grad(), self.policy.reference():
                    before = self._grid_images()
            with self.policy.ema_weights() if self.cfg.eval.use_ema else contextlib.nullcontext():
                after = self._grid_images()
            if before.dim() == 5:  # video clips [N, F, 3, H, W]: a GIF (and an MP4 when an encoder is installed)
                from .tasks.video import save_before_after_clips

                save_before_after_clips(before, after, prompts, self.cfg.eval.grid_samples, run_dir, fps=self.fps)
            else:
                save_before_after(before, after, prompts, self.cfg.eval.grid_samples,
                                  run_dir / "samples_before_after.png", self._grid_captions(prompts, before, after))
        evals = [r for r in history if any(k.startswith("eval/") for k in r)]
        lines = [f"visgen: {self.cfg.model} | kernel {self.cfg.kernel} | method {self.method.name} | "
                 f"{self.cfg.train_mode} ({sum(p.numel() for p in self.parameters()):,} trainable parameters)"]
        if len(evals) >= 2:
            first, last = evals[0], evals[-1]
            for k in sorted(last):
                if k.startswith("eval/") and isinstance(first.get(k), (int, float)) and isinstance(last.get(k), (int, float)):
                    lines.append(f"{k}: {first[k]:.3f} (step {first['step']}) -> {last[k]:.3f} (step {last['step']})")
        from .pipelines.cache import prompt_cache

        stats = prompt_cache(self.pipe).stats()
        if stats["hits"] + stats["misses"]:
            lines.append(f"prompt cache: {stats['hits']:.0f} hits, {stats['misses']:.0f} misses (hit rate "
                         f"{stats['hit_rate']:.3f}), {stats['prompts']:.0f} prompts kept")
        timed = [r for r in history if "time/rollout" in r]
        if timed:
            total = sum(r.get("time/rollout", 0) + r.get("time/train", 0) + r.get("time/eval", 0) for r in timed)
            lines.append(f"iterations: {len(timed)}, rollout+train+eval time {total:.0f} s")
        if prompts:
            grid = "samples_before_after.gif/.mp4" if self.adapter.is_video else "samples_before_after.png"
            lines.append(f"grid: {grid} (left: before, right: after; one prompt per row, captioned)")
        if self.cfg.gold_rewards:  # the hacking guard: trained vs gold rewards, in curves.png and here
            from .rewards.gold import hacking_report

            lines += hacking_report(run_dir, history, self.trained_outputs(), self.ctx.log)
        (run_dir / "visgen_summary.txt").write_text("\n".join(lines) + "\n")


def save_before_after(before: torch.Tensor, after: torch.Tensor, prompts: list[str], per_prompt: int, path: Path,
                      captions: list[str] | None = None) -> None:
    """One row per prompt under its caption (default: the prompt): ``per_prompt`` "before" samples, a gap, the same
    seeds "after"; small images upscaled."""
    from shared_rl.report import captioned_rows

    rows = []
    h, w = before.shape[-2:]
    scale = max(1, math.ceil(128 / max(h, w)))
    gap = torch.full((3, h, max(2, w // 4)), 0.5)
    for i in range(len(prompts)):
        b = torch.cat(list(before[i * per_prompt:(i + 1) * per_prompt]), dim=2)
        a = torch.cat(list(after[i * per_prompt:(i + 1) * per_prompt]), dim=2)
        rows.append(torch.cat([b, gap, a], dim=2))
    grid = torch.stack(rows)
    if scale > 1:
        grid = torch.nn.functional.interpolate(grid, scale_factor=scale, mode="nearest")
    pixels = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    captioned_rows(list(pixels), captions or list(prompts),
                   f"left: {per_prompt} before training | right: the same seeds after").save(path)
    path.with_suffix(".txt").write_text("left: before training, right: after (same seeds)\n" + "\n".join(
        f"row {i}: {c}" for i, c in enumerate(captions or prompts)) + "\n")
