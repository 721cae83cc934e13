"""visgen: group-relative RL post-training of flow-matching image generators over stock diffusers pipelines.

Public sampling API (imported lazily so ``import visgen.tasks`` stays light):

- ``visgen.sample(pipe, prompt, num_inference_steps, guidance_scale, generator, kernel="sde", noise_level=None,
  plan=None, ...) -> Trajectory`` (the flat forest of the one rollout engine, ``visgen.engine``)
- ``visgen.recompute_trajectory(pipe, traj, steps, reference=None) -> RecomputedEdges`` (``visgen.recompute``)
- ``visgen.as_adapter(pipe)``; kernels in ``shared_rl.flow_kernels``; step plans in ``visgen.plans``.
"""
from __future__ import annotations

from shared_rl.lazy import lazy_attributes

_LAZY = {
    "sample": "visgen.trajectory",
    "recompute_trajectory": "visgen.recompute",
    "Trajectory": "visgen.trajectory",
    "RecomputedEdges": "visgen.recompute",
    "as_adapter": "visgen.pipelines",
    "Conditioning": "visgen.pipelines",
    "StepPlan": "visgen.plans",
    "plan_from_config": "visgen.plans",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
