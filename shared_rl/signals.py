"""How a training run answers SIGINT / SIGTERM / SIGHUP (``Trainer.fit``): during the iterations, finish the current
one, checkpoint and exit (a second Ctrl-C aborts at once); after the last one, finish the export and report and exit
as a complete run. SIGHUP also detaches standard output and error from the closed terminal.
"""
from __future__ import annotations

import contextlib
import os
import signal

from .rewards import clear_interrupt, interrupt_rewards


@contextlib.contextmanager
def stop_on_signals(trainer):
    """SIGINT / SIGTERM / SIGHUP: finish the current iteration, checkpoint, exit; a second Ctrl-C aborts at
    once. SIGHUP (the terminal was closed) also points standard output and error at /dev/null where they were
    that terminal, so the checkpoint is not lost to a write error on the vanished terminal."""
    old_handlers = stop_signal_handlers()
    clear_interrupt()

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if name == "SIGINT" and trainer.stop_signal is not None:
            raise KeyboardInterrupt
        if name == "SIGHUP":
            detach_terminal()
        if trainer.stop_signal is None and trainer.dist.is_main:
            trainer.log(f"{name}: finishing this iteration, then checkpointing"
                        + (" (Ctrl-C again to abort without saving)" if name == "SIGINT" else ""))
        trainer._stop_requested = True
        trainer.stop_signal = trainer.stop_signal or name
        interrupt_rewards()  # a reward still running STOP_GRACE_S from now is abandoned

    with handling(old_handlers, on_signal):
        yield

@contextlib.contextmanager
def after_the_last_iteration(trainer):
    """SIGTERM / SIGINT / SIGHUP while a finished run writes its end (export, plot, report): the run is complete
    and its last checkpoint saved, so the writes (seconds) finish and the process exits 0 as a complete run; the
    signal is said, not obeyed. A second SIGINT aborts at once (``final/`` is written aside and renamed last, so
    it is then absent, and ``--resume`` exports it again)."""
    old_handlers = stop_signal_handlers()
    seen: list[str] = []

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if name == "SIGINT" and seen:
            raise KeyboardInterrupt
        if name == "SIGHUP":
            detach_terminal()
        if not seen and trainer.dist.is_main:
            trainer.log(f"{name}: every iteration is done and checkpointed; finishing the final export and report "
                        f"(seconds), then exiting"
                        + (" (Ctrl-C again to abort them; --resume exports again)" if name == "SIGINT" else ""))
        seen.append(name)

    with handling(old_handlers, on_signal):
        yield
    if seen and trainer.dist.is_main:
        trainer.log(f"{seen[0]}: the run is complete ({trainer.run_dir})")


def stop_signal_handlers() -> dict:
    """The current handlers of the signals that stop a run: SIGTERM, SIGINT and (not on Windows) SIGHUP."""
    stops = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    return {sig: signal.getsignal(sig) for sig in stops}


@contextlib.contextmanager
def handling(old_handlers: dict, on_signal):
    """``on_signal`` handles the signals of ``old_handlers`` inside the block; their handlers are put back after it
    (outside the main thread nothing is installed)."""
    try:
        for sig in old_handlers:
            signal.signal(sig, on_signal)
    except ValueError:  # not in the main thread
        pass
    try:
        yield
    finally:
        try:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
        except (ValueError, TypeError):
            pass


def detach_terminal() -> None:
    """Point file descriptors 1 and 2 at /dev/null where they are a terminal (after SIGHUP the terminal is gone and
    every write to it fails); a log file or a pipe is left alone."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            if os.isatty(fd):
                os.dup2(null, fd)
    finally:
        os.close(null)
