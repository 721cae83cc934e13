"""Calling reward backends safely: retries, time-outs, then NaN (masked and counted by the trainer) or a clear
error, per config. Domains wrap their reward functions with ``guarded_reward``.

Every call runs in a *daemon* thread of its own, which the caller waits for at most ``timeout_s`` (default 600 s):
a backend that hangs (a deadlocked library, a socket that never answers, user code that sleeps) is abandoned, not
joined. Why a daemon thread and not a ``ThreadPoolExecutor``: the executor's workers are joined when the
interpreter exits, so one hung reward kept grove from ever exiting after its error line or its last checkpoint.
An abandoned call keeps running in its thread until it returns (Python cannot kill a thread); its result is
dropped, and the process exits without waiting for it. The thread gets the caller's grad mode, inference mode,
autocast and CUDA device and stream, so a reward computes exactly what it would in the caller's thread.

Stopping: ``interrupt_rewards`` (the trainer calls it from its SIGTERM/SIGINT handler) makes a call that is still
running ``STOP_GRACE_S`` later raise ``RewardInterrupted``, so a scheduler's SIGTERM is never stuck behind a reward;
the trainer then checkpoints the state from before the interrupted iteration.

A run whose rewards all fail: ``RewardCalls`` counts, per iteration, the guarded calls that failed after their
retries; ``check`` raises ``RewardFailure`` (exit code 1) when every call of the iteration failed and the reward's
guard says ``stop_if_all_fail`` (the default), instead of training on nothing but NaN and exiting 0.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any, Callable

import torch

from .reward_guard import RewardGuardConfig  # noqa: F401  (shared_rl.rewards.RewardGuardConfig, as before)

STOP_GRACE_S = 5.0  # how long a running reward call may still finish after SIGTERM/SIGINT before it is abandoned
_POLL_S = 0.05  # how often a waiting caller looks at the stop request

_stop = threading.Event()


class RewardFailure(RuntimeError):
    """A reward backend failed at run time after all retries and the config says failures are fatal (a bad
    reward *input* is the domain's own ``ValueError``, e.g. ``visgen.rewards.RewardInputError``, never retried)."""


class RewardInterrupted(RuntimeError):
    """A stop signal arrived while a reward call was running and it did not finish within ``STOP_GRACE_S``."""


def interrupt_rewards() -> None:
    """Ask running and future guarded reward calls to give up (after ``STOP_GRACE_S``); signal-handler safe."""
    _stop.set()


def clear_interrupt() -> None:
    """Forget an earlier ``interrupt_rewards`` (a new run in the same process starts clean)."""
    _stop.clear()


class RewardCalls:
    """Per-iteration tally of guarded reward calls: ``begin`` at an iteration's start, ``check`` after its
    rollouts (the trainer calls both)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.begin()

    def begin(self) -> None:
        with self._lock:
            self.calls, self.failed, self.stopping, self.last = 0, 0, False, ""

    def record(self, ok: bool, cfg: RewardGuardConfig, why: str = "") -> None:
        with self._lock:
            self.calls += 1
            if not ok:
                self.failed += 1
                self.stopping = self.stopping or cfg.stop_if_all_fail
                self.last = why

    def check(self, iteration: int) -> None:
        """Raise ``RewardFailure`` when every guarded call since ``begin`` failed (and a guard says stop)."""
        with self._lock:
            calls, failed, stopping, last = self.calls, self.failed, self.stopping, self.last
        if calls and failed == calls and stopping:
            raise RewardFailure(f"every reward call of iteration {iteration} failed ({failed} of {calls}; last: "
                                f"{last}); the run stops rather than train on no reward (the newest checkpoint is "
                                f"kept; set reward_guard.stop_if_all_fail=false to keep going on NaN)")


reward_calls = RewardCalls()


def _callers_torch_state() -> Callable[[], contextlib.AbstractContextManager]:
    """What torch keeps per thread, as the caller has it, to be entered in the worker thread."""
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    autocast = [(dev, torch.get_autocast_dtype(dev)) for dev in ("cuda", "cpu") if torch.is_autocast_enabled(dev)]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None
    stream = torch.cuda.current_stream() if cuda else None

    @contextlib.contextmanager
    def enter():
        with contextlib.ExitStack() as stack:
            if device is not None:
                torch.cuda.set_device(device)
                stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(torch.inference_mode() if inference else torch.set_grad_enabled(grad))
            for dev, dtype in autocast:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
            yield

    return enter


def call_abandonable(fn: Callable[..., Any], args: tuple, kwargs: dict, timeout_s: float, name: str) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread; ``TimeoutError`` after ``timeout_s`` (0 = never) and
    ``RewardInterrupted`` ``STOP_GRACE_S`` after ``interrupt_rewards``, both leaving the thread behind."""
    box: dict[str, Any] = {}
    done = threading.Event()
    state = _callers_torch_state()

    def run() -> None:
        try:
            with state():
                box["out"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 — handed to the caller's thread
            box["err"] = e
        finally:
            done.set()

    worker = threading.Thread(target=run, name=f"grove-reward-{name}", daemon=True)
    worker.start()
    start = time.monotonic()
    stop_seen: float | None = None
    while not done.wait(_POLL_S):
        now = time.monotonic()
        if _stop.is_set():
            stop_seen = stop_seen if stop_seen is not None else now
            if now - stop_seen >= STOP_GRACE_S:
                raise RewardInterrupted(f"reward {name!r} was still running {STOP_GRACE_S:g}s after the stop "
                                        f"signal; abandoned")
        if timeout_s > 0 and now - start >= timeout_s:
            raise TimeoutError(f"reward {name!r} timed out after {timeout_s:g}s")
    if "err" in box:
        raise box["err"]
    return box["out"]


def guarded_reward(fn: Callable[..., dict[str, torch.Tensor]], name: str, cfg: RewardGuardConfig,
                   batch_size: Callable[..., int], log=print,
                   output_names: list[str] | None = None) -> Callable[..., dict[str, torch.Tensor]]:
    """Wrap ``fn(*args) -> {name: tensor[B]}``: each attempt runs abandonably (``call_abandonable``) within
    ``cfg.timeout_s``; retry on exceptions and time-outs; after the last retry return NaN for the whole batch
    (``on_failure: nan``) or raise ``RewardFailure`` (``fatal``). Non-finite values that the backend itself
    returns are passed through as NaN (the trainer masks and counts them). ``ValueError`` and ``TypeError``
    (contract errors) propagate at once. The NaN batch carries ``output_names`` or, when not given, the names of
    the backend's last successful answer (else ``[name]``). Every call is counted in ``reward_calls``."""
    seen_names: list[str] = list(output_names or [])

    def call(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        last: BaseException | None = None
        for attempt in range(cfg.retries + 1):
            try:
                out = call_abandonable(fn, args, kwargs, cfg.timeout_s, name)
                result = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in out.items()}
                if not output_names:
                    seen_names[:] = list(result)
                reward_calls.record(True, cfg)
                return result
            except (ValueError, TypeError, RewardInterrupted):
                raise
            except Exception as e:  # noqa: BLE001 — any other backend failure (a time-out too) is retried
                last = e
            if attempt < cfg.retries:
                log(f"WARNING: reward {name!r} failed ({last}); retry {attempt + 1}/{cfg.retries}")
                _sleep(cfg.backoff_s * (2**attempt))
        reward_calls.record(False, cfg, f"reward {name!r}: {last}")
        if cfg.on_failure == "fatal":
            raise RewardFailure(f"reward {name!r} failed after {cfg.retries + 1} attempts: {last}") from last
        log(f"WARNING: reward {name!r} failed after {cfg.retries + 1} attempts ({last}); its values are NaN "
            "for this batch (masked, counted in reward/nan_count)")
        n = batch_size(*args, **kwargs)
        return {k: torch.full((n,), math.nan) for k in (seen_names or [name])}

    return call


def _sleep(seconds: float) -> None:
    """A back-off pause that a stop signal cuts short (the next attempt then finds the stop request)."""
    _stop.wait(seconds)
