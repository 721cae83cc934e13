"""The toy bandit's settings (the ``toy:`` section), importable without torch (``shared_rl.registry.DOMAIN_CONFIGS``;
the domain is ``shared_rl.toy``, which re-exports it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .domain_config import DomainConfig


@dataclass
class ToyConfig(DomainConfig):
    num_contexts: int = field(default=8, metadata={"help": "contexts (keys) of the bandit"})
    num_actions: int = field(default=4, metadata={"help": "actions per step"})
    horizon: int = field(default=4, metadata={"help": "actions per sequence (per tree edge with tree_branch > 1)"})
    tree_branch: int = field(default=1, metadata={
        "help": "> 1: tree rollouts, this many children per node (group_size is then ignored)"})
    tree_depth: int = field(default=2, metadata={"help": "tree rollouts: levels of branching"})
    init_scale: float = field(default=0.0, metadata={"help": "std of the initial logits (0 = uniform policy)"})
    reward_noise: float = field(default=0.0, metadata={"help": "std of Gaussian noise added to the reward"})
    deferred_logp: bool = field(default=False, metadata={
        "help": "leave logp_old NaN: the trainer fills it from its first forward"})

    def rollout_structure(self, train_cfg) -> str:
        """Tree rollouts when ``tree_branch > 1`` (the hook of ``shared_rl.domain``: tree estimators need them)."""
        return "tree" if self.tree_branch > 1 else "flat"

    def reward_names(self, train_cfg) -> list[str]:
        """The one reward a rollout emits (the core checks ``advantage.weights`` names against it)."""
        return ["correct"]

    def parameter_groups(self, train_cfg) -> list:
        """The logit table (trained, fsdp2 shards it) and its frozen start copy (the KL reference), float32."""
        from .memory_estimate import ParameterGroup

        n = self.num_contexts * self.num_actions
        return [ParameterGroup("logit table", n, True), ParameterGroup("reference copy", n, False, sharded=False)]

    def check(self, where: str) -> None:
        from .config import ConfigError

        for name in ("num_contexts", "num_actions", "horizon", "tree_branch", "tree_depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
