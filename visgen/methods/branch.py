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

import torch

from shared_rl.advantages import tree_advantages
from shared_rl.config import ConfigError

from ..engine import Forest, StepSegment, grow_forest
# the settings and the config-time checks are torch-free (visgen.method_settings); their names stay here
from ..method_settings import BranchGRPOMixSpec, BranchGRPOSpec, BranchMixSettings, BranchSettings  # noqa: F401
from .base import Grown, RolloutMethod, register_method


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
class BranchGRPO(BranchGRPOSpec, RolloutMethod):
    """One tree per prompt, branching at ``split_steps``; SDE on every non-final step."""

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
class BranchGRPOMix(BranchGRPOMixSpec, BranchGRPO):
    """BranchGRPO-Mix: SDE only at split steps and in ``sde_windows``; ODE (untrained) elsewhere."""
