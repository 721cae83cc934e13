"""The settings of visgen's parts that ``visgen.config.VisgenConfig`` holds (the two-stage rollout, memory controls,
the LoRA adapter, the EMA) and the gold rewards' config check, in a module that imports no torch: ``grove config show``
and the config's checks build ``VisgenConfig`` without the parts' tensor code (issue 64: <= 3 s on a loaded 2-core
machine). Each name is re-exported where it was defined before (``visgen.lowprec.TwoStageSettings`` / ``PRECISIONS``,
``visgen.pipelines.memory.MemorySettings``, ``visgen.policy.LoraSettings`` / ``EmaSettings`` /
``DEFAULT_LORA_TARGETS``, ``visgen.rewards.gold.check_gold_rewards``): one definition, imported by the heavy modules;
tests/core/test_part_index.py checks they are the same objects and that ``config show`` of a visgen recipe imports
no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from shared_rl.errors import ConfigError
from shared_rl.part_index import selector_names

PRECISIONS = ("full", "bf16", "fp8", "mxfp8", "mxfp4", "nvfp4")


@dataclass
class TwoStageSettings:
    """``visgen.two_stage``: Sol-RL's low-precision explore / full-precision train rollout (flat methods)."""

    enabled: bool = field(default=False, metadata={"help": "sample candidates with a low-precision explorer, "
                                                           "regenerate only a contrastive subset at full precision"})
    precision: str = field(default="nvfp4", metadata={"help": "explorer format: full, bf16, fp8 (SM >= 8.9), mxfp8, "
                                                              "mxfp4, nvfp4 (emulated off Blackwell)"})
    candidates: int = field(default=64, metadata={"help": "stage-1 candidates per prompt (ODE from recorded seeds); "
                                                          "rollout.group_size of them are kept"})
    selector: str = field(default="top_bottom", metadata={"help": "which candidates to keep: top_bottom (half the "
                                                                  "best, half the worst) or max_variance"})
    select_reward: Optional[str] = field(default=None, metadata={"help": "reward output the selector ranks by "
                                                                         "(null: the first)"})

    def check(self, where: str) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"{where}.precision {self.precision!r} is unknown; choose one of {list(PRECISIONS)}")
        if self.selector not in selector_names():
            raise ConfigError(f"{where}.selector {self.selector!r} is unknown; choose one of {selector_names()}")
        if self.candidates < 2:
            raise ConfigError(f"{where}.candidates must be >= 2, got {self.candidates}")



@dataclass
class MemorySettings:
    prompt_cache: bool = field(default=True, metadata={
        "help": "cache text embeddings by prompt (exact; text encoders must be frozen)"})
    prompt_cache_size: int = field(default=4096, metadata={"help": "prompts the embedding cache keeps (LRU)"})
    offload_text_encoders: bool = field(default=False, metadata={
        "help": "keep frozen text encoders on the CPU; they visit the device only for prompts not in the cache"})
    offload_rewards: bool = field(default=False, metadata={
        "help": "keep reward models on the CPU between reward calls"})
    vae_slicing: bool = field(default=False, metadata={"help": "decode one sample per VAE call (equal to float "
                                                                  "rounding)"})
    vae_tiling: bool = field(default=False, metadata={
        "help": "decode in spatial tiles (diffusers enable_tiling; approximate at tile seams)"})
    vae_tile_size: int = field(default=0, metadata={
        "help": "tile side in pixels for vae_tiling (stride 3/4 of it); 0: the VAE's default (Wan: 256)"})
    decode_frame_chunk: int = field(default=0, metadata={
        "help": "Wan: post-process this many latent frames at a time into a preallocated video (exact; 0: off)"})

    def check(self, where: str) -> None:
        if self.prompt_cache_size < 1:
            raise ConfigError(f"{where}.prompt_cache_size must be >= 1, got {self.prompt_cache_size}")
        if self.vae_tile_size < 0:
            raise ConfigError(f"{where}.vae_tile_size must be >= 0 (0: the VAE's default), got {self.vae_tile_size}")
        if self.decode_frame_chunk < 0:
            raise ConfigError(f"{where}.decode_frame_chunk must be >= 0 (0: off), got {self.decode_frame_chunk}")



#: attention projections of the MM-DiT blocks (SD3, FLUX) and of SANA's attention; peft matches name suffixes.
DEFAULT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


@dataclass
class LoraSettings:
    rank: int = field(default=8, metadata={"help": "LoRA rank r"})
    alpha: float = field(default=16.0, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)"})
    dropout: float = field(default=0.0,
                           metadata={"help": "LoRA dropout (non-zero makes recomputed log-probs differ from the "
                                             "rollout's: ratio != 1)"})
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS),
                                      metadata={"help": "transformer module names that get an adapter"})
    init: Literal["default", "gaussian"] = field(default="default",
                                                 metadata={"help": "adapter init: 'default' or 'gaussian' (both start "
                                                                   "with B = 0, the adapter is the identity)"})

    def check(self, where: str) -> None:
        if self.rank < 1:
            raise ConfigError(f"{where}.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ConfigError(f"{where}.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{where}.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError(f"{where}.target_modules must name at least one module, e.g. ['to_q', 'to_v']")


@dataclass
class EmaSettings:
    enabled: bool = field(default=False,
                          metadata={"help": "keep an EMA of the trained weights (evaluated and exported when "
                                            "eval.use_ema)"})
    decay: float = field(default=0.9, metadata={"help": "EMA decay per update"})
    update_every: int = field(default=1, metadata={"help": "optimizer steps between EMA updates"})

    def check(self, where: str) -> None:
        if not 0 <= self.decay < 1:
            raise ConfigError(f"{where}.decay must be in [0, 1), got {self.decay}")
        if self.update_every < 1:
            raise ConfigError(f"{where}.update_every must be >= 1, got {self.update_every}")



def check_gold_rewards(cfg, where: str) -> None:
    """Config-time checks: known names (RewardSpec.check), no gold reward that is also a training reward."""
    for i, spec in enumerate(cfg.gold_rewards):
        spec.check(f"{where}.gold_rewards[{i}]")
    trained = {(s.name, repr(sorted(s.kwargs.items()))) for s in cfg.rewards}
    for i, spec in enumerate(cfg.gold_rewards):
        if (spec.name, repr(sorted(spec.kwargs.items()))) in trained:
            raise ConfigError(f"{where}.gold_rewards[{i}] ({spec.name}) is also in {where}.rewards: a gold reward must "
                              "never be trained on; remove it from one list")
