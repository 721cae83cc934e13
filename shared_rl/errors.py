"""Run-time errors with actionable messages (config errors live in ``shared_rl.config``)."""


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had NaN/Inf losses or gradients."""
