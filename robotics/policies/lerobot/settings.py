"""``robotics.policy``: which policy the robotics domain post-trains (the tiny VLA, or a LeRobot policy) and, for a
LeRobot policy, how Meta-World's observations map onto its features and what RL trains. Light: importing this
module imports neither torch nor LeRobot (the config is checked before anything heavy loads)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shared_rl.errors import ConfigError


@dataclass
class LoraSettings:
    """``robotics.policy.lora``: LoRA adapters (peft) RL trains instead of the policy's own weights."""

    rank: int = field(default=0, metadata={
        "help": "LoRA rank on the action expert (LeRobot's default targets: the expert's q/v projections and the "
                "state/action/time projections); 0 = no LoRA, RL trains what the policy's config leaves trainable "
                "(SmolVLA: train_expert_only)"})
    alpha: float = field(default=16.0, metadata={"help": "LoRA alpha (the update is scaled by alpha / rank)"})
    vlm: bool = field(default=False, metadata={
        "help": "also put LoRA on the VLM's attention q/v projections (then the prefix is recomputed with grad)"})
    targets: str = field(default="", metadata={
        "help": "a regex of module names overriding the targets above ('' = LeRobot's default targets)"})

    def check(self, where: str = "robotics.policy.lora") -> None:
        if self.rank < 0:
            raise ConfigError(f"{where}.rank must be >= 0 (0 = no LoRA), got {self.rank}")
        if self.rank == 0 and (self.vlm or self.targets):
            raise ConfigError(f"{where}: vlm / targets place LoRA adapters; set {where}.rank > 0 too")


@dataclass
class NoiseHeadSettings:
    """``robotics.policy.noise``: the learned exploration std of ``head_mode: flow_noise`` (ReinFlow / πRL's
    flow-noise; defaults RLinf's for π0: std in [0.08, 0.16], MLP [128, 64] with tanh on the expert's tokens)."""

    std_min: float = field(default=0.08, metadata={"help": "flow_noise: lower bound of the learned per-dim std"})
    std_max: float = field(default=0.16, metadata={"help": "flow_noise: upper bound of the learned per-dim std"})
    hidden: list[int] = field(default_factory=lambda: [128, 64], metadata={
        "help": "flow_noise: hidden widths of the std MLP (input: the action expert's output token per chunk step)"})

    def check(self, where: str = "robotics.policy.noise") -> None:
        if not 0 < self.std_min <= self.std_max:
            raise ConfigError(f"{where}: need 0 < std_min <= std_max, got std_min={self.std_min}, "
                              f"std_max={self.std_max}")
        if any(w < 1 for w in self.hidden):
            raise ConfigError(f"{where}.hidden: widths must be >= 1, got {self.hidden}")


@dataclass
class PolicySettings:
    """``robotics.policy``: ``{type: tiny_vla}`` (the default: ``robotics.checkpoint``) or ``{type: lerobot, path:
    DIR_OR_HUB_ID, ...}``."""

    type: Literal["tiny_vla", "lerobot"] = field(default="tiny_vla", metadata={
        "help": "tiny_vla = grove's own VLA (robotics.checkpoint / robotics.model) | lerobot = a LeRobot "
                "PreTrainedPolicy (SmolVLA) from path"})
    path: str = field(default="", metadata={
        "help": "lerobot: a LeRobot policy directory (save_pretrained: config.json, model.safetensors and the "
                "policy_preprocessor / policy_postprocessor files) or a hub id already in the local cache"})
    cameras: dict[str, str] = field(default_factory=dict, metadata={
        "help": "lerobot: the policy's image feature -> env camera, e.g. {observation.images.top: corner}; {} = by "
                "name (observation.images.<camera> for each of env.cameras)"})
    n_action_steps: int = field(default=0, metadata={
        "help": "lerobot: actions of each predicted chunk the env executes before the next chunk is planned; 0 = "
                "the policy's own n_action_steps"})
    lora: LoraSettings = field(default_factory=LoraSettings, metadata={"help": "lerobot: LoRA adapters RL trains"})
    noise: NoiseHeadSettings = field(default_factory=NoiseHeadSettings, metadata={
        "help": "lerobot: the learned noise std of head_mode: flow_noise (ReinFlow / πRL)"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "lerobot: recompute each VLM / expert layer's activations in backward (torch.utils.checkpoint) "
                "instead of keeping them: less memory, about one more forward of compute; same gradients"})

    def check(self, where: str = "robotics.policy") -> None:
        if self.type == "tiny_vla":
            if self != PolicySettings():
                raise ConfigError(f"{where}: path, cameras, n_action_steps, lora, noise and gradient_checkpointing are "
                                  f"read by type: lerobot; the tiny VLA loads robotics.checkpoint (or robotics.model)")
            return
        if not self.path:
            raise ConfigError(f"{where}.path: a LeRobot policy directory or cached hub id is needed with type: lerobot")
        if self.n_action_steps < 0:
            raise ConfigError(f"{where}.n_action_steps must be >= 0 (0 = the policy's own), got {self.n_action_steps}")
