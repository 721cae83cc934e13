"""Calling reward backends safely: retries, time-outs, then NaN (masked and counted by the trainer) or a clear
error, per config. Domains wrap their reward functions with ``guarded_reward``.
"""
from __future__ import annotations

import concurrent.futures as cf
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch


class RewardFailure(RuntimeError):
    """A reward backend failed at run time after all retries and the config says failures are fatal (a bad
    reward *input* is the domain's own ``ValueError``, e.g. ``visgen.rewards.RewardInputError``, never retried)."""


@dataclass
class RewardGuardConfig:
    """How a domain calls its reward backends (the ``reward_guard:`` block of a domain section).

    retries: extra attempts after a failure or time-out (exponential back-off from ``backoff_s``);
    timeout_s: seconds per attempt (0 = no time-out); on_failure: ``nan`` masks the batch (the trainer skips NaN
    rewards and counts them in ``reward/nan_count``), ``fatal`` stops the run with ``RewardFailure``.
    Contract errors (``ValueError``/``TypeError``: a malformed batch, a wrong-length answer) are bugs, not
    transient faults: they are raised at once, never retried or masked.
    """

    retries: int = field(default=2, metadata={"help": "extra attempts after a failure or time-out"})
    timeout_s: float = field(default=0.0, metadata={"help": "seconds per attempt; 0 = no time-out"})
    backoff_s: float = field(default=0.5, metadata={"help": "first retry delay in seconds (doubles each retry)"})
    on_failure: Literal["nan", "fatal"] = field(default="nan", metadata={
        "help": "after the last retry: nan (mask the batch, count it) | fatal (stop the run)"})

    def check(self, where: str) -> None:
        from .config import ConfigError

        if self.retries < 0:
            raise ConfigError(f"{where}.retries must be >= 0, got {self.retries}")
        if self.timeout_s < 0 or self.backoff_s < 0:
            raise ConfigError(f"{where}.timeout_s and backoff_s must be >= 0 (0 = none)")


def guarded_reward(fn: Callable[..., dict[str, torch.Tensor]], name: str, cfg: RewardGuardConfig,
                   batch_size: Callable[..., int], log=print,
                   output_names: list[str] | None = None) -> Callable[..., dict[str, torch.Tensor]]:
    """Wrap ``fn(*args) -> {name: tensor[B]}``: retry on exceptions and time-outs; after the last retry return
    NaN for the whole batch (``on_failure: nan``) or raise ``RewardFailure`` (``fatal``). Non-finite values that
    the backend itself returns are passed through as NaN (the trainer masks and counts them). ``ValueError`` and
    ``TypeError`` (contract errors) propagate at once. The NaN batch carries ``output_names`` or, when not
    given, the names of the backend's last successful answer (else ``[name]``)."""
    seen_names: list[str] = list(output_names or [])

    def call(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        last: BaseException | None = None
        for attempt in range(cfg.retries + 1):
            try:
                if cfg.timeout_s > 0:
                    # not ``with``: leaving that block joins the worker, i.e. waits for the hung backend anyway
                    ex = cf.ThreadPoolExecutor(max_workers=1)
                    try:
                        out = ex.submit(fn, *args, **kwargs).result(timeout=cfg.timeout_s)
                    finally:
                        ex.shutdown(wait=False, cancel_futures=True)
                else:
                    out = fn(*args, **kwargs)
                result = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in out.items()}
                if not output_names:
                    seen_names[:] = list(result)
                return result
            except cf.TimeoutError as e:
                last = TimeoutError(f"reward {name!r} timed out after {cfg.timeout_s:g}s")
                last.__cause__ = e
            except (ValueError, TypeError):
                raise
            except Exception as e:  # noqa: BLE001 — any other backend failure is retried
                last = e
            if attempt < cfg.retries:
                log(f"WARNING: reward {name!r} failed ({last}); retry {attempt + 1}/{cfg.retries}")
                time.sleep(cfg.backoff_s * (2**attempt))
        if cfg.on_failure == "fatal":
            raise RewardFailure(f"reward {name!r} failed after {cfg.retries + 1} attempts: {last}") from last
        log(f"WARNING: reward {name!r} failed after {cfg.retries + 1} attempts ({last}); its values are NaN "
            "for this batch (masked, counted in reward/nan_count)")
        n = batch_size(*args, **kwargs)
        return {k: torch.full((n,), math.nan) for k in (seen_names or [name])}

    return call
