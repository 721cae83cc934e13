"""The tiny VLA's architecture settings (``VLAConfig``, saved as ``config.json`` next to the weights; the
``robotics.model`` section) and its vocabulary helpers, in a module that imports no torch: ``grove config show``
and the config's checks build ``RoboticsConfig`` without the network code (issue 64). ``robotics.policies.vla``
re-exports them, where they were defined before."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal


def default_vocab() -> list[str]:
    from ..envs.settings import TASK_INSTRUCTIONS

    words = {w for text in TASK_INSTRUCTIONS.values() for w in tokenize(text)}
    return ["<unk>"] + sorted(words)


def vocab_with(base: list[str], texts: list[str]) -> list[str]:
    """``base`` grown by the words of ``texts`` (``<unk>`` first, then sorted, as :func:`default_vocab`)."""
    words = (set(base) - {"<unk>"}) | {w for text in texts for w in tokenize(text)}
    return ["<unk>"] + sorted(words)


def libero_vocab(base: list[str]) -> list[str]:
    """``base`` with every LIBERO instruction's words (all suites, so one model reads any of them)."""
    from ..envs.libero_tasks import all_languages

    return vocab_with(base, all_languages())


def tokenize(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


@dataclass
class VLAConfig:
    """Architecture of the tiny VLA (saved as ``config.json`` next to the weights)."""

    image_size: int = field(default=64, metadata={"help": "input frame side in pixels (a multiple of 16)"})
    image_channels: int = field(default=3, metadata={"help": "input channels (3 per camera)"})
    proprio_dim: int = field(default=4, metadata={"help": "proprioception vector length"})
    action_dim: int = field(default=4, metadata={"help": "action dims (Meta-World: hand xyz + gripper)"})
    chunk: int = field(default=4, metadata={"help": "actions predicted per chunk (K)"})
    head: Literal["flow", "discrete"] = field(
        default="flow", metadata={"help": "flow (flow matching, pi0-style) | discrete (256 bins, OpenVLA-style)"})
    cnn_channels: list[int] = field(default_factory=lambda: [32, 64, 128, 128],
                                    metadata={"help": "channels of the 4 stride-2 conv layers"})
    feature_dim: int = field(default=256, metadata={"help": "image feature width"})
    text_dim: int = field(default=64, metadata={"help": "instruction bag-of-words embedding width"})
    hidden: int = field(default=256, metadata={"help": "fusion MLP and flow head width"})
    num_denoise_steps: int = field(default=5, metadata={"help": "flow head denoising steps per chunk (>= 2)"})
    num_bins: int = field(default=256, metadata={"help": "discrete head bins per action dim"})
    std_min: float = field(default=0.02, metadata={"help": "ReinFlow noise head: lower bound of the std"})
    std_max: float = field(default=0.3, metadata={"help": "ReinFlow noise head: upper bound of the std"})
    std_init: float = field(default=0.1, metadata={"help": "ReinFlow noise head: initial std"})
    vocab: list[str] = field(default_factory=default_vocab,
                             metadata={"help": "instruction vocabulary of the bag-of-words encoder"})
    proprio_mean: list[float] = field(default_factory=list, metadata={
        "help": "proprio normalisation mean, filled from the BC data; [] = no normalisation"})
    proprio_std: list[float] = field(default_factory=list, metadata={
        "help": "proprio normalisation std, filled from the BC data; [] = no normalisation"})
    task_adapters: list[str] = field(default_factory=list, metadata={
        "help": "instructions that own a low-rank residual adapter on the fused features (per-task heads for "
                "multi-task RL, added by robotics.task_adapters); [] = none"})
    adapter_rank: int = field(default=16, metadata={"help": "rank of each task adapter"})

    def check(self, where: str = "model") -> None:
        from shared_rl.config import ConfigError

        if self.image_size % 16:
            raise ConfigError(f"{where}.image_size must be a multiple of 16 (4 stride-2 convs), got {self.image_size}")
        if len(self.cnn_channels) != 4:
            raise ConfigError(f"{where}.cnn_channels must list 4 channel counts, got {self.cnn_channels}")
        if self.chunk < 1 or self.num_denoise_steps < 2:
            raise ConfigError(f"{where}: chunk must be >= 1 and num_denoise_steps >= 2")
        if self.task_adapters and self.adapter_rank < 1:
            raise ConfigError(f"{where}.adapter_rank must be >= 1 with task adapters, got {self.adapter_rank}")
        if len(set(self.task_adapters)) != len(self.task_adapters):
            raise ConfigError(f"{where}.task_adapters lists an instruction twice: {self.task_adapters}")
