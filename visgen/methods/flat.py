"""Flat methods: a GRPO group of ``group_size`` independent chains per prompt, a forest of depth one.

Flow-GRPO (Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025), DanceGRPO (Xue et al.,
"DanceGRPO: Unleashing GRPO on Visual Generation", 2025), Flow-GRPO-Fast and MixGRPO (Li et al., "MixGRPO:
Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE", 2025) differ only in their *step plan* — which steps of
each chain are stochastic and which are trained — so each is the step-plan dataclass of ``visgen.plans`` used as
the method's settings (``visgen.method: {name: mix_grpo, window_size: 4, ...}``).
"""
from __future__ import annotations

import torch

from .. import plans
from ..engine import flat_forest
# check / trains_steps come from the torch-free FlatSpec (the plan's own check_fits / trains_any)
from ..method_settings import FLAT_SPECS, FlatSpec
from .base import Grown, RolloutMethod, register_method


class FlatMethod(FlatSpec, RolloutMethod):
    """``group_size`` chains per prompt from independent initial noise (or one shared noise per prompt with
    ``visgen.shared_noise``, DanceGRPO's choice), every chain running the plan's SDE/ODE steps."""

    def grow(self, adapter, cond, keys, group_size, sigmas, timesteps, generator, iteration, k, first_forward_id):
        P = len(keys)
        B = P * group_size
        cond = cond[torch.arange(P).repeat_interleave(group_size)]  # one row per chain, prompt-major
        if k.shared_noise:
            x = adapter.prepare_latents(P, cond[torch.arange(0, B, group_size).to(adapter.device)], generator)
            x = x.repeat_interleave(group_size, 0)
        else:
            x = adapter.prepare_latents(B, cond, generator)
        plan = self.settings.build(int(timesteps.numel()), B, generator, iteration)
        forest = flat_forest(adapter, cond, x, plan.sde, plan.train, sigmas, timesteps, generator, k.kernel,
                             k.noise_level, k.reduction, k.micro_batch, first_forward_id,
                             ode_solver=getattr(self.settings, "ode_solver", "euler"))
        return Grown(forest, cond, torch.arange(P).repeat_interleave(group_size), list(keys), torch.arange(P))


# one method per plan, each the subclass of its torch-free spec (visgen.method_settings.FLAT_SPECS) whose settings are
# the plan with ``build`` (``ode``: deterministic chains, nothing stochastic — the sampler of the likelihood-free
# objectives, NFT / AWM; ``dpm2``: the same by DPM-Solver++(2M), DiffusionOPSD)
for _plan in (plans.FlowGRPOPlan, plans.DanceGRPOPlan, plans.FlowGRPOFastPlan, plans.MixGRPOPlan, plans.ExplicitPlan,
              plans.ODEPlan, plans.DPM2Plan):
    register_method(type(f"{_plan.__name__[:-4]}Method", (FLAT_SPECS[_plan.name], FlatMethod),
                         {"name": _plan.name, "settings_class": _plan, "__doc__": FLAT_SPECS[_plan.name].__doc__}))
