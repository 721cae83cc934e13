"""TreeGRPO (Ding & Ye, "TreeGRPO: Tree-Advantage GRPO for Online RL Post-Training of Diffusion Models", 2025).

One shared initial noise per prompt, ODE outside an SDE window of ``len(branch)`` consecutive grid steps, and
window step ``w`` branches ``branch[w]`` ways ([2, 2, 2, 2] -> 16 leaves = ``rollout.group_size``): several children
per forward, leaf rewards backed up the tree. The window start is drawn per rollout call from
``[range_start, range_end - len(branch)]`` (``range_end`` None: the first half of the schedule), or fixed by
``window_start``. No public code exists; the advantage is the configured tree estimator (``tree_leaf_zscore``: see
``shared_rl.advantages``, formula and hand-computed test there; docs/methods/tree_grpo.md).
"""
from __future__ import annotations

import torch

from ..engine import StepSegment, grow_forest
# the settings and the config-time checks are torch-free (visgen.method_settings); their names stay here
from ..method_settings import TreeGRPOSettings, TreeGRPOSpec  # noqa: F401
from .base import Grown, RolloutMethod, register_method


def treegrpo_window(s: TreeGRPOSettings, num_steps: int, generator: torch.Generator | None) -> int:
    if s.window_start is not None:
        return int(s.window_start)
    lo, hi = s.bounds(num_steps)
    return int(torch.randint(lo, hi - len(s.branch) + 1, (1,), generator=generator))


def treegrpo_levels(s: TreeGRPOSettings, sigmas: torch.Tensor, timesteps: torch.Tensor, base_noise: float,
                    start: int) -> list[tuple[int, StepSegment]]:
    """An ODE prefix (factor 1, untrained) to the window, one SDE step per window level branching ``branch[w]``
    ways; the last window level carries the ODE tail to the end of the schedule."""
    T = int(timesteps.numel())
    W = len(s.branch)
    levels = []
    if start > 0:
        levels.append((1, StepSegment.from_grid(sigmas, timesteps, [(i, 1) for i in range(start)],
                                                [False] * start, [False] * start, [0.0] * start)))
    for w in range(W):
        i = start + w
        tail = list(range(i + 1, T)) if w == W - 1 else []
        steps = [(i, 1)] + [(t, 1) for t in tail]
        sde = [True] + [False] * len(tail)
        train = [i < T - 1] + [False] * len(tail)
        noise = [base_noise] + [0.0] * len(tail)
        levels.append((s.branch[w], StepSegment.from_grid(sigmas, timesteps, steps, sde, train, noise)))
    return levels


@register_method
class TreeGRPO(TreeGRPOSpec, RolloutMethod):
    """TreeGRPO (see the module docstring)."""

    def grow(self, adapter, cond, keys, group_size, sigmas, timesteps, generator, iteration, k, first_forward_id):
        x0 = adapter.prepare_latents(len(keys), cond, generator)
        start = treegrpo_window(self.settings, int(timesteps.numel()), generator)
        levels = treegrpo_levels(self.settings, sigmas, timesteps, k.noise_level, start)
        forest = grow_forest(adapter, cond, x0, levels, generator, k.kernel, k.reduction, k.micro_batch,
                             first_forward_id)
        return Grown(forest, cond, torch.arange(len(keys)), list(keys), torch.arange(len(keys)),
                     {"tree/window_start": float(start)})
