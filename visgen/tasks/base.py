"""The task registry: what a visgen run trains on, one small registered class per task.

``visgen.task`` (RL) and a pretraining config's ``task:`` (``visgen.pretrain``) name a :class:`Task` in
:data:`TASKS`. A task says where its prompts come from (an embedded train/held-out split, or prompt files), which
reward measures it in every evaluation and what else its evaluation reports; an embedded task also brings what
pretraining its tiny model needs: its settings (a :class:`PretrainConfig` subclass and the defaults that differ from
the shared ones), its ground-truth renderer, the pipeline it starts from, how samples are scored and what the saved
asset records. The tasks live beside their renderers and checkers (``shapes.py``, ``words.py``, ``video.py``) and
the prompt-file task in ``files.py``; adding one is a subclass with ``@register_task``.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Optional

from shared_rl.config import ConfigError

__all__ = ["Task", "EmbeddedTask", "ImageTask", "ImagePretrainConfig", "TASKS", "register_task", "get_task", "Prompts", "PretrainConfig", "VaeStage",
           "TransformerStage", "PretrainEvalSettings"]


# -------------------------------------------------------------------------------------------- pretraining settings
def _help(text: str, default: Any = None, factory: Any = None) -> Any:
    if factory is not None:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


@dataclass
class VaeStage:
    steps: int = _help("VAE optimizer steps", 1500)
    batch_size: int = _help("samples per VAE step", 64)
    lr: float = _help("VAE learning rate (AdamW, 50-step warm-up, cosine decay to 10%)", 2e-3)
    kl_weight: float = _help("weight of the posterior KL per pixel", 1e-6)


@dataclass
class TransformerStage:
    steps: int = _help("transformer + text-encoder optimizer steps", 6000)
    batch_size: int = _help("samples per step", 64)
    lr: float = _help("learning rate (AdamW)", 1e-3)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    warmup_steps: int = _help("linear warm-up steps", 200)
    empty_prompt_prob: float = _help("prompts replaced by '' (so classifier-free guidance works)", 0.1)
    logit_normal_mean: float = _help("mean of the logit-normal t distribution", 0.0)
    logit_normal_std: float = _help("std of the logit-normal t distribution", 1.0)
    ema_decay: float = _help("EMA decay of the evaluated and saved weights", 0.999)
    grad_clip: float = _help("gradient-norm clip", 1.0)
    # "constant" (after warm-up) makes the step-k snapshot of a long run equal to a k-step run's result.
    lr_schedule: str = _help("'constant' after warm-up (a step-k snapshot equals a k-step run) or 'cosine' to 10%",
                             "constant")

    def check(self, where: str) -> None:
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"{where}.lr_schedule: 'constant' or 'cosine', got {self.lr_schedule!r}")


@dataclass
class PretrainEvalSettings:
    every: int = _help("evaluate (and snapshot) every this many transformer steps (0: only at the end)", 1000)
    samples_per_prompt: int = _help("samples per prompt in the periodic evaluations", 1)
    final_samples_per_prompt: Optional[int] = _help("samples per prompt in the final evaluation (null: "
                                                    "samples_per_prompt)", 4)
    num_inference_steps: int = _help("Euler ODE steps of the stock pipeline", 10)
    guidance_scales: list = _help("CFG scales evaluated", factory=lambda: [1.0, 3.0])
    batch_size: int = _help("samples per sampling call", 64)
    train_prompts: int = _help("training (RL) prompts scored alongside the held-out ones (0: none)", 64)
    save_snapshots: bool = _help("save the EMA pipeline at every periodic evaluation under run_dir/step_<k>", True)


@dataclass
class PretrainConfig:
    """The settings every task's pretraining shares; a task's ``pretrain_config`` subclass adds its own."""

    task: str = _help("the task (visgen.tasks.TASKS) whose tiny model is pretrained", "shapes")
    seed: int = _help("seed of data, initialisation and training", 0)
    threads: int = _help("torch CPU threads (one was ~10x faster than two on 2 shared cores)", 1)
    split_seed: int = _help("train/held-out prompt split seed", 0)
    dataset_size: int = _help("pre-rendered ground-truth samples of training prompts", 16384)
    output_dir: Optional[str] = _help("where the final pipeline is saved (null: run_dir/pipeline)")
    log_every: int = _help("a metrics.jsonl row every this many transformer steps", 50)
    vae: VaeStage = _help("VAE stage", factory=VaeStage)
    transformer: TransformerStage = _help("transformer + text-encoder stage", factory=TransformerStage)
    eval: PretrainEvalSettings = _help("evaluation", factory=PretrainEvalSettings)


# ------------------------------------------------------------------------------------------------------ tasks
class Prompts(NamedTuple):
    """A run's prompts and their per-prompt metadata (what the rewards read), train and held out."""

    train: list[str]
    train_meta: list[dict]
    eval: list[str]
    eval_meta: list[dict]

    @classmethod
    def of_specs(cls, train: list, held_out: list) -> "Prompts":
        """From task specs (objects with ``.prompt`` and ``.to_dict()``)."""
        return cls([s.prompt for s in train], [s.to_dict() for s in train],
                   [s.prompt for s in held_out], [s.to_dict() for s in held_out])


class Task:
    """One visgen task. The RL domain asks it for prompts, the reward that measures it and its extra evaluation
    metrics; ``visgen.pretrain`` asks an embedded task for its data and scoring (the hooks below the line)."""

    name: ClassVar[str] = ""
    # reward (name, factory kwargs) that measures the task: evaluated even when the run trains on other rewards
    eval_reward: ClassVar[Optional[tuple[str, dict]]] = None
    # pretraining: the settings class (None: nothing to pretrain), the defaults that differ from PretrainConfig's
    # (merged under the YAML, so a partial section keeps them) and the tiny model family (visgen.pretrain.MODELS)
    pretrain_config: ClassVar[Optional[type]] = None
    pretrain_defaults: ClassVar[dict] = {}
    model: ClassVar[str] = ""

    # ---- RL (visgen.domain) ----------------------------------------------------------------------------------
    def check(self, cfg, where: str) -> None:
        """Validate the visgen section's prompt settings for this task (ConfigError, one line)."""

    def prompt_files(self, cfg) -> list[tuple[str, str]]:
        """``(key, path)`` of the prompt files this task reads (``visgen.preflight`` checks them early)."""
        return []

    def prompts(self, cfg, settings: dict) -> Prompts:
        """The train and held-out prompts; ``settings``: the asset's grove.json (its recorded split)."""
        raise NotImplementedError

    def eval_metrics(self, scores: dict) -> dict[str, float]:
        """Task metrics beyond each reward output's mean, from the evaluation scores (name -> ``[N]``)."""
        return {}

    # ---- pretraining (visgen.pretrain) -----------------------------------------------------------------------
    def check_pretrain(self, conf) -> None:
        """Cross-field checks of the task's pretraining settings (ConfigError, one line)."""

    def split(self, conf) -> tuple[list, list]:
        """``(train specs, held-out specs)`` for pretraining."""
        raise NotImplementedError

    def render(self, spec, rng, conf):
        """One ground-truth sample of ``spec`` (numpy float32 in [0, 1]; images ``[3, H, W]``, clips
        ``[F, 3, H, W]``), its randomness drawn from ``rng``."""
        raise NotImplementedError

    def build_pipeline(self, conf):
        """The randomly initialised tiny pipeline, deterministic given ``conf.seed``."""
        raise NotImplementedError

    def score(self, samples, specs: list) -> dict[str, float]:
        """Metric name -> mean over ``samples`` (the pipeline's output, in [0, 1]) of ``specs``."""
        raise NotImplementedError

    def after_vae(self, vae, held_out: list, conf) -> dict[str, float]:
        """Metrics of the trained VAE (logged at the VAE's last step and kept in the result)."""
        return {}

    def asset_settings(self, conf) -> dict:
        """What the saved pipeline's grove.json records about the task (the RL domain reads its split from it);
        the model family adds the sampling settings."""
        return {"task": self.name, "split_seed": conf.split_seed}


class EmbeddedTask(Task):
    """A task with its own prompts: a seeded train/held-out split, recorded in the pretrained asset."""

    def check(self, cfg, where: str) -> None:
        if cfg.train_prompts or cfg.eval_prompts:
            raise ConfigError(f"{where}: train_prompts/eval_prompts are for task: file; the {self.name} task has its own")

    def prompts(self, cfg, settings: dict) -> Prompts:
        seed = cfg.split_seed if cfg.split_seed is not None else int(settings.get("split_seed", 0))
        fraction = cfg.eval_fraction if cfg.eval_fraction is not None else float(settings.get("eval_fraction", 0.2))
        return Prompts.of_specs(*self.split_prompts(seed, fraction))

    def split_prompts(self, seed: int, eval_fraction: float) -> tuple[list, list]:
        """The task's seeded split (its module's ``split_prompts``)."""
        raise NotImplementedError


@dataclass
class ImagePretrainConfig(PretrainConfig):
    """Pretraining settings of an embedded image task (the tiny SD3)."""

    eval_fraction: float = _help("held-out fraction of the task's prompts (seeded by split_seed)", 0.2)


class ImageTask(EmbeddedTask):
    """An embedded image task pretrained on the tiny SD3 (``visgen.tiny``), split by a held-out fraction."""

    pretrain_config = ImagePretrainConfig
    model = "tiny_sd3"

    def split(self, conf) -> tuple[list, list]:
        return self.split_prompts(conf.split_seed, conf.eval_fraction)

    def asset_settings(self, conf) -> dict:
        return {**super().asset_settings(conf), "eval_fraction": conf.eval_fraction}


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in TASKS:
        raise ValueError(f"visgen task {cls.name!r} is already registered by {TASKS[cls.name].__module__}")
    TASKS[cls.name] = cls
    return cls


def get_task(name: str, where: str = "visgen.task") -> Task:
    """The registered task ``name`` (a fresh object); an unknown name is a one-line ConfigError."""
    if name not in TASKS:
        close = difflib.get_close_matches(str(name), list(TASKS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}: unknown task {name!r}{hint}; choose one of {sorted(TASKS)}")
    return TASKS[name]()
