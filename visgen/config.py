"""The ``visgen:`` section of a training YAML (:class:`VisgenConfig`) and its checks, in a module that imports no
torch: ``grove config show`` and the config's checks build and validate it without the pipelines, the rollout engine
or the reward models (issue 64: <= 3 s on a loaded 2-core machine, ``grove bench cold-start``).

Its sections come from torch-free modules (``visgen.part_settings``: two-stage, memory, LoRA, EMA;
``visgen.method_settings``: the rollout methods; ``visgen.objective_settings``: the objectives), and a method or an
objective is built from the live registry (``visgen.methods.METHODS``, ``visgen.objectives.OBJECTIVES``) once its
module is imported — a training run, a Python caller that registered its own — else from the built-ins' specs, the
same classes the live entries subclass. The reward names are read from the reward modules' ``@register`` lines
(``reward_names_registered``) until ``visgen.rewards`` is imported. ``visgen.domain`` re-exports every name here, and
``shared_rl.registry.DOMAIN_CONFIGS`` points the config loader at this module; tests/core/test_part_index.py checks
``config show`` of visgen recipes imports no torch, and the specs equal the live registries.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from shared_rl.domain_config import DomainConfig
from shared_rl.errors import ConfigError
from shared_rl.kernel_settings import KERNEL_NOISE_LEVELS
from shared_rl.reward_guard import RewardGuardConfig

from .method_settings import METHOD_SPECS, KernelSettings, method_from_registry
from .objective_settings import OBJECTIVE_SPECS, check_offline, objective_from_registry
from .part_settings import EmaSettings, LoraSettings, MemorySettings, TwoStageSettings, check_gold_rewards
from .tasks import get_task
from .tasks.files import read_prompt_file

def _live(module: str, attr: str, specs: dict) -> dict:
    """The live registry ``module.attr`` once ``module`` is imported (it holds what a caller registered too), else the
    built-ins' torch-free ``specs``."""
    mod = sys.modules.get(module)
    return getattr(mod, attr) if mod is not None else specs

# why an objective with ObjectiveSpec.whole_groups needs each group in one forward call (its one-line refusal)
WHOLE_GROUPS_WHY = {"dpo": "pairs the best and the worst sample of each group",
                    "dgpo": "weighs each sample by its whole group's preference",
                    "crd": "centres each group's implicit rewards"}


def reward_names_registered() -> list[str]:
    """``visgen.rewards.available_rewards()`` with the optional reward modules (``_import_optional_rewards``), sorted:
    the live registry once ``visgen.rewards`` is imported, else the names the reward modules register with
    ``@register("name", ...)``, read from their source (``visgen.catalog.reward_names``, ``grove list``'s: nothing
    is imported, so a config names its rewards without torch)."""
    if "visgen.rewards" in sys.modules:
        from .rewards import available_rewards

        _import_optional_rewards()
        return available_rewards()
    from .catalog import reward_names  # the same reading grove list gives

    return reward_names()


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
        names = reward_names_registered()  # the reward modules' own names, read without importing them
        if self.name not in names:
            from shared_rl.registry import did_you_mean

            raise ConfigError(f"{where}.name: unknown reward {self.name!r}{did_you_mean(self.name, names)}; "
                              f"available: {', '.join(names)}")


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
        the kernel's default (``shared_rl.flow_kernels.KERNEL_NOISE_LEVELS``, which is ``shared_rl.kernel_settings``')."""
        level = KERNEL_NOISE_LEVELS[self.kernel] if self.noise_level is None else float(self.noise_level)
        return KernelSettings(self.kernel, level, self.reduction, self.rollout_micro_batch, self.shared_noise)

    def method_config(self) -> dict[str, Any]:
        """``method``, or the objective's default sampler when it is null (derived, never stored)."""
        return self.method if self.method is not None else dict(self.training_objective().default_method)

    def rollout_method(self, where: str = "visgen.method", train_cfg=None):
        """The configured ``visgen.methods`` method (a fresh object built from ``method_config()``); with the
        trainer's sections ``train_cfg``, as they complete it (``RolloutMethod.with_trainer``: e.g. branch pruning
        ranks by the training estimator when it names none)."""
        method = method_from_registry(_live("visgen.methods", "METHODS", METHOD_SPECS), self.method_config(), where)
        return method if train_cfg is None else method.with_trainer(train_cfg, f"{where}[{method.name}]")

    def training_objective(self, where: str = "visgen.objective"):
        """The configured ``visgen.objectives`` objective (a fresh object built from ``objective``)."""
        return objective_from_registry(_live("visgen.objectives", "OBJECTIVES", OBJECTIVE_SPECS), self.objective, where)

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
        OBJECTIVES = _live("visgen.objectives", "OBJECTIVES", OBJECTIVE_SPECS)
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
        if self.two_stage.enabled and self.two_stage.precision == "fp8":  # the one format that asks the GPU (torch)
            import torch

            from .lowprec import check_precision

            check_precision(self.two_stage.precision, "cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available()
                            else (cfg.device if cfg.device != "auto" else "cpu"))
        if self.two_stage.enabled and self.two_stage.candidates < cfg.rollout.group_size:
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
            check_offline(objective, cfg.rollout.group_size)
        if objective.whole_groups and (cfg.optim.minibatches_per_epoch != 1 or cfg.optim.micro_batch_size != 0):
            # before anything loads: the loss's own check (CRD's) would stop the run only after its first rollout
            why = WHOLE_GROUPS_WHY.get(objective.name, "needs every member of a group in one forward call")
            raise ConfigError(f"visgen.objective {objective.name} {why}, so one forward call must hold whole groups: "
                              "set optim.minibatches_per_epoch: 1 and optim.micro_batch_size: 0 (optim.backward_steps "
                              "may split the timesteps)")
        if cfg.loss.kl_coef > 0 and self.train_mode == "full" and not self.full_reference:
            raise ConfigError("loss.kl_coef > 0 with visgen.train_mode: full needs visgen.full_reference: true "
                              "(a frozen copy of the transformer is the KL reference)")
        if cfg.loss.kl_estimator not in ("domain",) and cfg.loss.kl_coef > 0:
            raise ConfigError("visgen computes its KL itself (Flow-GRPO Gaussian-mean or velocity KL); set "
                              "loss.kl_estimator: domain and choose visgen.kl_type")


    def _check_differentiable_rewards(self, cfg, objective: str, method) -> None:
        """DiffusionOPSD follows the trained reward's gradient: every reward with a trained output must offer one
        (``RewardInfo.differentiable``), the rollout must be flat, the pipeline's decode differentiable."""
        from .preflight import needs_live_registry, reward_differentiable, reward_outputs

        if needs_live_registry(spec.name for spec in self.rewards):
            _import_optional_rewards()
        weights = dict(cfg.advantage.weights or {})
        for spec in self.rewards:
            outputs = reward_outputs(spec.name, spec.kwargs)
            trained = outputs is None or any(weights.get(o, 1.0) != 0 for o in outputs)
            if trained and not reward_differentiable(spec.name):
                raise ConfigError(f"visgen.objective {objective} follows the reward's gradient, but reward "
                                  f"{spec.name!r} is not differentiable; train on a differentiable one (shapes_colour, "
                                  f"pickscore, hps, clipscore, aesthetic, imagereward) or give {spec.name!r}'s outputs "
                                  "weight 0 in advantage.weights")
        if method.structure != "flat":
            raise ConfigError(f"visgen.objective {objective} queries one state of each flat trajectory; visgen.method "
                              f"{method.name!r} grows trees (use dpm2, ode or a flat method)")


def _import_optional_rewards() -> None:
    """Register the reward-model rewards (they import nothing heavy until built)."""
    from .rewards import hps, pickscore, shapes_soft, video  # noqa: F401
