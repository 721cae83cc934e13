"""The flow kernels' settings that a config names, importable without torch (issue 64: ``grove config show`` of a
visgen or robotics recipe builds its typed config without importing torch): the kernels' names, their default noise
levels and the log-prob reductions. ``shared_rl.flow_kernels`` (the tensor code) re-exports them;
tests/core/test_part_index.py checks ``KERNEL_NAMES`` are its ``KERNELS``."""
from __future__ import annotations

#: the Flow-GRPO SDE's noise level ``a`` when none is given: Flow-GRPO's own default (Liu et al. 2025, its configs'
#: ``config.sample.noise_level = 0.7``). Written once here: visgen's kernels and robotics' flow head default to it.
DEFAULT_NOISE_LEVEL = 0.7

#: the noise level each kernel uses when none is given (cps reuses Flow-GRPO's a; DanceGRPO eta = 0.3 for FLUX)
KERNEL_NOISE_LEVELS: dict[str, float] = {"ode": 0.0, "sde": DEFAULT_NOISE_LEVEL, "cps": DEFAULT_NOISE_LEVEL,
                                         "dance": 0.3}

#: the registered kernels of ``shared_rl.flow_kernels.KERNELS``, by name
KERNEL_NAMES = tuple(KERNEL_NOISE_LEVELS)

#: log-prob reductions over the non-batch dims (``mean``: the Flow-GRPO / DDPO convention)
REDUCTIONS = ("mean", "sum")
