"""BranchGRPO and BranchGRPO-Mix (Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured Branching in
Diffusion Models", 2025).

Every prompt grows one tree: at each split step (grid step indices) every node branches ``factor`` ways, so 10
steps with splits [0, 2, 4, 6] and factor 2 give 16 leaves (``rollout.group_size`` must be 16). Node value = the
mean of its leaf rewards (reward fusion); the advantage of an edge is the configured tree estimator
(``advantage.estimator``, ``depth_zscore`` in the paper: the child's value z-scored among the nodes of its depth
in the same tree). BranchGRPO runs SDE (trained) on every step but the last; -Mix runs SDE only at split steps and
inside ``sde_windows`` and ODE (untrained) elsewhere. Split steps may draw with a scaled noise level and then store
the log-prob of that scaled Gaussian.

Pruning (after the rewards): *width* — train only the top ``width_keep`` fraction (by |advantage|) or the best and
worst of the leaf edges of each tree; *depth* — do not train the edges into depths ``[lo, hi)``, optionally sliding
one depth deeper every ``depth_prune_slide_every`` iterations. Both rank by the configured estimator.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from shared_rl.advantages import estimator_names, tree_advantages
from shared_rl.config import ConfigError

from ..engine import Forest, StepSegment, grow_forest
from .base import Grown, RolloutMethod, register_method, require


@dataclass
class BranchSettings:
    """BranchGRPO. ``split_steps`` branch ``factor`` ways (one number for all, or one per split)."""

    split_steps: list[int] = field(default_factory=lambda: [0, 2, 4, 6],
                                   metadata={"help": "grid steps where every node branches (strictly increasing, "
                                                     "before the final step)"})
    factor: list[int] = field(default_factory=lambda: [2],
                              metadata={"help": "children per split: one number for all splits, or one per split"})
    split_noise_scale: float = field(default=1.0,
                                     metadata={"help": "noise-level multiplier on split steps (the stored log-prob "
                                                       "uses the scaled std)"})
    fusion: Literal["mean", "logp_softmax"] = field(default="mean",
                                                    metadata={"help": "node value from the leaves below: 'mean' of "
                                                                      "their rewards (the reference's default), or "
                                                                      "'logp_softmax' (its --tree_prob_weighted: "
                                                                      "children weighted by a softmax of their split "
                                                                      "step's log-prob / fusion_temperature)"})
    fusion_temperature: float = field(default=1.0,
                                      metadata={"help": "logp_softmax: softmax temperature over siblings' split-step "
                                                        "log-probs (the reference's 1); larger = closer to the "
                                                        "mean"})
    width_prune: Literal["none", "ratio", "best_worst"] = field(default="none",
                                                                metadata={"help": "train only some leaf edges: 'ratio' "
                                                                                  "(top width_keep by |advantage|) or "
                                                                                  "'best_worst'"})
    width_keep: float = field(default=0.5,
                              metadata={"help": "fraction of leaf edges trained per tree with width_prune: ratio"})
    depth_prune: list[int] = field(default_factory=list,
                                   metadata={"help": "[lo, hi): edges into depths lo..hi-1 are not trained ([] = none)"})
    depth_prune_slide_every: int = field(default=0,
                                         metadata={"help": "> 0: the depth window moves one depth deeper every this "
                                                           "many iterations"})
    prune_reward: Optional[str] = field(default=None,
                                        metadata={"help": "reward output pruning ranks by (null: the first)"})
    # tree estimator that pruning ranks edges by; None: advantage.estimator (BranchGRPO.with_trainer)
    prune_estimator: Optional[str] = field(default=None,
                                           metadata={"help": "tree estimator pruning ranks edges by (null: "
                                                             "advantage.estimator)"})

    def factors(self) -> list[int]:
        f = list(self.factor)
        return f * len(self.split_steps) if len(f) == 1 else f

    def leaves(self) -> int:
        return math.prod(self.factors())

    def check(self, where: str) -> None:
        require(len(self.split_steps) >= 1, f"{where}.split_steps must list at least one grid step, e.g. [0, 2, 4, 6]")
        require(sorted(set(self.split_steps)) == list(self.split_steps),
             f"{where}.split_steps must be strictly increasing, got {self.split_steps}")
        require(len(self.factor) in (1, len(self.split_steps)),
             f"{where}.factor must be one number or one per split step ({len(self.split_steps)}), got {self.factor}")
        require(all(f >= 1 for f in self.factor), f"{where}.factor values must be >= 1, got {self.factor}")
        require(self.split_noise_scale > 0, f"{where}.split_noise_scale must be > 0, got {self.split_noise_scale}")
        require(0 < self.width_keep <= 1, f"{where}.width_keep must be in (0, 1], got {self.width_keep}")
        require(len(self.depth_prune) in (0, 2), f"{where}.depth_prune must be [] or [lo, hi), got {self.depth_prune}")
        if self.depth_prune:
            require(1 <= self.depth_prune[0] < self.depth_prune[1],
                 f"{where}.depth_prune must be [lo, hi) with 1 <= lo < hi (depth 1 = the first edges), got {self.depth_prune}")
        require(self.fusion_temperature > 0, f"{where}.fusion_temperature must be > 0, got {self.fusion_temperature}")
        if self.prune_estimator is not None:
            require(self.prune_estimator in estimator_names("tree"), f"{where}.prune_estimator must be a tree estimator "
                 f"({estimator_names('tree')}), got {self.prune_estimator!r}")


@dataclass
class BranchMixSettings(BranchSettings):
    """BranchGRPO-Mix: SDE (trained) only at split steps and in ``sde_windows``; ODE (untrained) elsewhere."""

    sde_windows: list[list[int]] = field(default_factory=list,
                                         metadata={"help": "[[lo, hi), ...] extra SDE (trained) grid steps besides the "
                                                           "split steps"})

    def check(self, where: str) -> None:
        super().check(where)
        for w in self.sde_windows:
            require(len(w) == 2 and 0 <= w[0] < w[1], f"{where}.sde_windows entries must be [lo, hi), got {w}")


def edge_logp_logits(forest: Forest, temperature: float) -> torch.Tensor:
    """BranchGRPO's fusion logits: the log-prob of the split step that created each node (the first executed step
    of the edge into it) over ``temperature``; roots (no steps) 0. As the reference
    (Fredreic1849/BranchGRPO ``compute_node_rewards_from_leaves`` with ``--tree_prob_weighted``: siblings weighted
    by the softmax of ``child.log_prob``, the one step from their parent, temperature 1), not by the edge's steps
    after the split. The trainer's tree values then weight siblings by their softmax
    (``shared_rl.advantages.tree_values(..., fusion_logit)``)."""
    split = forest.logp[:, 0]
    return (torch.where(forest.sde[:, 0], split, torch.zeros_like(split)) / temperature).float().cpu()


def branch_levels(s: BranchSettings, sigmas: torch.Tensor, timesteps: torch.Tensor, base_noise: float,
                  mix: bool = False) -> list[tuple[int, StepSegment]]:
    """BranchGRPO levels: segments between split steps (a factor-1 prefix when the first split is not step 0).

    Non-mix: every grid step SDE and trained except the final one. Mix: SDE (trained) only at split steps and
    inside ``sde_windows``; ODE (untrained) elsewhere. Split steps use ``base_noise * split_noise_scale``.
    """
    T = int(timesteps.numel())
    splits = list(s.split_steps)
    factor = dict(zip(splits, s.factors()))
    bounds = sorted(set([0] + splits + [T]))
    in_window = torch.zeros(T, dtype=torch.bool)
    for lo, hi in getattr(s, "sde_windows", []):
        in_window[lo:min(hi, T)] = True
    levels = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        steps = [(i, 1) for i in range(a, b)]
        sde = [(not mix) or (i in factor) or bool(in_window[i]) for i in range(a, b)]
        train = [sd and i < T - 1 for sd, i in zip(sde, range(a, b))]
        noise = [base_noise * (s.split_noise_scale if i in factor else 1.0) for i in range(a, b)]
        levels.append((factor.get(a, 1), StepSegment.from_grid(sigmas, timesteps, steps, sde, train, noise)))
    return levels


@register_method
class BranchGRPO(RolloutMethod):
    """One tree per prompt, branching at ``split_steps``; SDE on every non-final step."""

    name = "branch_grpo"
    settings_class = BranchSettings
    mix = False

    def check(self, num_steps: int, group_size: int, where: str) -> None:
        s = self.settings
        require(all(0 <= st < num_steps - 1 for st in s.split_steps),
             f"{where}.split_steps must lie in 0..{num_steps - 2} (the final step cannot branch), got {s.split_steps}")
        require(group_size is None or group_size == s.leaves(), f"rollout.group_size is {group_size} but {where} grows {s.leaves()} leaves per "
             f"tree (factors {s.factors()}); set rollout.group_size: {s.leaves()}")

    def with_trainer(self, train_cfg, where: str) -> "BranchGRPO":
        """Width pruning without its own ``prune_estimator`` ranks edges by the training estimator (pruning =
        training), which must then be a tree estimator."""
        s = self.settings
        if s.prune_estimator is not None or s.width_prune == "none":
            return self
        if train_cfg.advantage.kind != "tree":
            raise ConfigError(f"{where}.width_prune ranks edges by a tree estimator; advantage.estimator is "
                              f"{train_cfg.advantage.estimator.name!r}: set prune_estimator (one of "
                              f"{estimator_names('tree')})")
        return type(self)(dataclasses.replace(s, prune_estimator=train_cfg.advantage.estimator.name))

    def grow(self, adapter, cond, keys, group_size, sigmas, timesteps, generator, iteration, k, first_forward_id):
        x0 = adapter.prepare_latents(len(keys), cond, generator)
        levels = branch_levels(self.settings, sigmas, timesteps, k.noise_level, self.mix)
        forest = grow_forest(adapter, cond, x0, levels, generator, k.kernel, k.reduction, k.micro_batch,
                             first_forward_id)
        return Grown(forest, cond, torch.arange(len(keys)), list(keys), torch.arange(len(keys)))

    def after_rewards(self, forest, rewards, iteration):
        """Width / depth pruning: edges whose steps are not trained this iteration."""
        b = self.settings
        tree = forest.tree
        if b.depth_prune:
            lo, hi = b.depth_prune
            if b.depth_prune_slide_every:
                D = int(tree.depth.max())
                shift = iteration // b.depth_prune_slide_every
                lo = 1 + (lo - 1 + shift) % D
                hi = lo + (b.depth_prune[1] - b.depth_prune[0])
            tree.mask_depth_window(lo, hi)
        if b.width_prune != "none":
            name = b.prune_reward or next(iter(rewards))
            if name not in rewards:
                raise ConfigError(f"prune_reward {name!r} is not a reward output; outputs are {sorted(rewards)}")
            adv = tree_advantages(tree.parent, rewards[name], b.prune_estimator or "depth_zscore",
                                  fusion_logit=self.fusion_logit(forest))
            keep = "best_worst" if b.width_prune == "best_worst" else b.width_keep
            tree.mask_width(adv, int(tree.depth.max()), keep)
        return {}

    def fusion_logit(self, forest: Forest) -> torch.Tensor | None:
        if self.settings.fusion == "mean":
            return None
        return edge_logp_logits(forest, self.settings.fusion_temperature)


@register_method
class BranchGRPOMix(BranchGRPO):
    """BranchGRPO-Mix: SDE only at split steps and in ``sde_windows``; ODE (untrained) elsewhere."""

    name = "branch_grpo_mix"
    settings_class = BranchMixSettings
    mix = True
