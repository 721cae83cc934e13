"""The error classes of grove, each with one actionable line as its message.

They live in a module that imports nothing of the project, so every module (``config``, ``registry``, the
domains) can raise them without import cycles. ``shared_rl.config`` re-exports ``ConfigError`` and
``ResourceError``, so ``from shared_rl.config import ConfigError`` keeps working.
"""


class ConfigError(ValueError):
    """A config problem; its message is one actionable line (the CLI prints it and exits with code 2)."""


class ResourceError(RuntimeError):
    """The run cannot continue for lack of a resource (out of memory); the message says what to change."""


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had NaN/Inf losses or gradients."""


class RunDirectoryBusy(ConfigError):
    """Another process writes the run directory (its lock is held): exit code 2, the message names the owner."""


class RunDirectoryLost(RuntimeError):
    """The run directory was deleted, moved or replaced while the run was writing it: the run stops (exit code 1)
    instead of recreating it elsewhere or half-empty."""


class WorkerDied(RuntimeError):
    """A helper process the run depends on (an env worker, a reward or world-model server) died or was killed: the
    run stops (exit code 1) with one line naming the worker, what it was doing and the signal, never a traceback
    from a closed pipe; the run directory keeps its newest checkpoint, so ``--resume`` continues it."""
