"""``RewardGuardConfig`` (the ``reward_guard:`` block of a domain section) in a module that imports no torch, so a
config is read and checked without it; the guard itself is ``shared_rl.rewards.guarded_reward``, which re-exports
the class."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RewardGuardConfig:
    """How a domain calls its reward backends (the ``reward_guard:`` block of a domain section).

    retries: extra attempts after a failure or time-out (exponential back-off from ``backoff_s``);
    timeout_s: seconds one attempt may take, the whole call (0 = no time-out; a stop signal still ends it);
    on_failure: ``nan`` masks the batch (the trainer skips NaN rewards and counts them in ``reward/nan_count``),
    ``fatal`` stops the run with ``RewardFailure``; stop_if_all_fail: stop the run (exit code 1) when every
    reward call of an iteration failed, even under ``nan``.
    Contract errors (``ValueError``/``TypeError``: a malformed batch, a wrong-length answer) are bugs, not
    transient faults: they are raised at once, never retried or masked.
    """

    retries: int = field(default=2, metadata={"help": "extra attempts after a failure or time-out"})
    timeout_s: float = field(default=600.0, metadata={
        "help": "seconds one attempt may take in all (the call is abandoned after it); 0 = no time-out"})
    backoff_s: float = field(default=0.5, metadata={"help": "first retry delay in seconds (doubles each retry)"})
    on_failure: Literal["nan", "fatal"] = field(default="nan", metadata={
        "help": "after the last retry: nan (mask the batch, count it) | fatal (stop the run)"})
    stop_if_all_fail: bool = field(default=True, metadata={
        "help": "stop the run (exit code 1) when every reward call of an iteration failed after its retries"})

    def check(self, where: str) -> None:
        from .errors import ConfigError

        if self.retries < 0:
            raise ConfigError(f"{where}.retries must be >= 0, got {self.retries}")
        if self.retries > 100:
            raise ConfigError(f"{where}.retries must be <= 100, got {self.retries}")
        for key in ("timeout_s", "backoff_s"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{where}.timeout_s and backoff_s must be finite and >= 0 (0 = none), got "
                                  f"{key}={value}")
        if self.backoff_s > 3600:
            raise ConfigError(f"{where}.backoff_s must be <= 3600 s, got {self.backoff_s}")
