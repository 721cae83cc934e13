"""The ``grove`` command line.

    grove train [CONFIG] [--out DIR] [--dry-run] [key=value ...]     RL (or supervised, by the config's kind)
    grove train --resume RUN_DIR [key=value ...]                       continue a run from its newest valid checkpoint
    grove pretrain CONFIG [--out DIR] [--dry-run] [key=value ...]      supervised pretraining (kind: supervised)
    grove eval RUN_DIR [--out DIR] [key=value ...]                     evaluate a run's newest checkpoint -> DIR
    grove bench NAME [--out DIR] [--quick]                             a benchmark -> DIR/results.json
    grove config show [CONFIG] [key=value ...]                         the resolved config, each field with its
                                                                       help text and default (default: as train)
    grove list                                                         rewards, estimators, losses, methods,
                                                                       benchmarks, domains, recipes
    grove --version
    grove GROUP ...                                                    a domain's command group, e.g.
    grove robotics collect|to-lerobot|from-lerobot ...                 robotics tools (demonstrations, datasets)

Command groups are found by name like domains and benchmarks (``shared_rl.registry.COMMANDS`` and the
``grove.commands`` entry-point group), so this module never imports a domain package; a domain that needs
process-wide settings (``robotics``: the MuJoCo/OpenGL backend) sets them in its own package.

The error contract, for every command: a user mistake raises ``ConfigError`` and becomes exit code 2 and one line
``grove: error: ...`` naming what to change, and is found before anything is created (config, machine and input
checks run before a model loads: ``shared_rl.preflight``; the config's model and checkpoint paths even before the
typed config imports torch: ``shared_rl.prechecks``). A failure after the run directory exists leaves it in
a state ``--resume`` understands. Programming errors stay tracebacks.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .config import apply_overrides, describe, dump_train_config, load_train_config, load_yaml, to_dict
from .errors import ConfigError, NonFiniteError, ResourceError, RunDirectoryBusy, RunDirectoryLost, WorkerDied
from .part_index import registered_names  # noqa: F401  (shared_rl.cli.registered_names, as before)
from .rundir import RunLock, atomic_write_text, holder, is_empty_run_dir

# This module imports no torch and no domain at import time: `grove list`, `grove --version`, `grove config show`
# and the command groups' listings start in the time their own work takes (tests/core/test_first_hour.py checks).

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "visgen" / "shapes_grpo.yaml"
FALLBACK_CONFIG = REPO_ROOT / "configs" / "toy.yaml"
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by Ctrl-C (128 + SIGINT)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with grove's error contract: a bad command line raises ConfigError (one line, exit code 2) instead
    of printing the usage and exiting. Command groups (``grove robotics ...``) use it too."""

    def error(self, message: str) -> None:
        raise ConfigError(message)


_Parser = ArgumentParser


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _launch_marker() -> Path | None:
    """Under ``torchrun`` / ``accelerate launch`` with several local workers: a file name shared by this launch's
    workers on this machine (their launcher's pid, its run id and restart count), else None."""
    try:
        workers = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return None
    if workers <= 1 or "LOCAL_RANK" not in os.environ:
        return None
    import tempfile

    key = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                                   "MASTER_PORT"))
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    return Path(tempfile.gettempdir()) / f"grove-error-{os.getppid()}-{safe}"


def _error_line(text: str) -> None:
    """``grove: error: ...`` on stderr, once per launch: with several workers on this machine (a config error is
    the same on every rank), only the first worker to report prints it — the first, not rank 0, because the launcher
    stops the others as soon as one exits. The others exit with the same code, silently."""
    marker = _launch_marker()
    if marker is not None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return  # another worker of this launch has printed it
        except OSError:
            pass  # no shared temporary directory: print it, as a single process does
        else:
            _remove_stale_markers(marker.parent)
    print(f"grove: error: {' '.join(str(text).split())}", file=sys.stderr, flush=True)


def _remove_stale_markers(folder: Path, age_s: float = 3600.0) -> None:
    """The empty marker files of launches more than ``age_s`` old (their workers are long gone)."""
    now = time.time()
    for old in folder.glob("grove-error-*"):
        with contextlib.suppress(OSError):
            if now - old.stat().st_mtime > age_s:
                old.unlink()


def _default_run_dir(config_path: Path) -> Path:
    return Path("runs") / f"{config_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_output_dir(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as a directory grove can create or fill: not empty text, not a file, not under a file, in a
    writable place. Checked before anything loads, so a typo costs no model load."""
    text = str(path)
    if not text.strip():
        raise ConfigError(f"{flag} is empty; give a directory, e.g. {flag} runs/my-run")
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {text!r} is a file, not a directory; choose another {flag}")
    existing = p.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {text!r} is under {str(existing)!r}, which is a file; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {text!r}: {str(existing)!r} is not writable; choose another {flag}")
    if not p.exists() and int(os.environ.get("RANK", "0")) == 0:
        # os.access cannot see read-only mounts or pseudo file systems: make a folder of this process's own there,
        # and remove it (never the target's own first folder: a run started beside this one may be filling it)
        probe = existing / f".grove-probe-{os.getpid()}-{time.monotonic_ns()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(f"{flag} {text!r} cannot be created in {str(existing)!r} ({e.strerror}); choose "
                              f"another {flag}") from None
    return p


def check_output_file(path: str | Path, flag: str, suffix: str = "", overwrite: bool = False) -> Path:
    """``path`` as a new file grove may write: not empty text, the right suffix, not an existing file (unless
    ``overwrite``) or directory, its parent creatable and writable."""
    text = str(path)
    if not text.strip():
        raise ConfigError(f"{flag} is empty; give a file name, e.g. {flag} out{suffix}")
    p = Path(text)
    if suffix and p.suffix != suffix:
        raise ConfigError(f"{flag} {text!r} must end in {suffix}")
    if p.is_dir():
        raise ConfigError(f"{flag} {text!r} is a directory; give a file name")
    if p.exists() and not overwrite:
        raise ConfigError(f"{flag} {text!r} already exists; remove it or choose another {flag}")
    existing = p.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {text!r} is under {str(existing)!r}, which is a file; choose another {flag}")
    check_output_dir(p.parent, flag=flag)  # the folder it goes into: creatable and writable
    return p


class _RunDir:
    """Create the run directory lazily (after validation and model loading) and lock it (one writer per run
    directory: ``shared_rl.rundir``); remove what was created again when setup fails before anything useful is
    written. ``release`` drops the lock (``_fit`` and the commands call it when they end)."""

    def __init__(self, path: Path, resume: bool, if_not_empty: str = "", command: str = "grove train") -> None:
        self.path = Path(path)
        self.resume = resume
        self.command = command
        self.created: Path | None = None  # the outermost directory this process created
        self.lock: RunLock | None = None
        self.main = int(os.environ.get("RANK", "0")) == 0  # under accelerate/torchrun only rank 0 writes
        self.if_not_empty = if_not_empty or f"pass --resume {path} to continue that run or choose another --out"
        if not resume:
            check_output_dir(path)
            if self.main and self.path.exists() and not is_empty_run_dir(self.path):
                self._refuse_not_empty()

    def _refuse_not_empty(self) -> None:
        owner = holder(self.path)
        if owner is not None:  # a run is writing there right now: say whose
            raise RunLock(self.path, self.command).busy(owner)
        raise ConfigError(f"{str(self.path)!r} is not empty; {self.if_not_empty}")

    def create(self) -> Path:
        """The directory, created if needed and locked by this process (``RunDirectoryBusy`` when another holds
        it; a directory another writer filled since ``__init__`` is refused as not empty)."""
        if not self.main:
            return self.path
        if not self.path.exists():
            outer = self.path.absolute()
            while not outer.parent.exists():
                outer = outer.parent
            try:
                self.path.mkdir(parents=True)
                self.created = outer
            except FileExistsError:
                pass  # a run started beside this one made it first: the lock decides which of the two writes
            except OSError as e:  # os.access cannot see every reason (read-only mounts, quotas, root squash)
                raise ConfigError(f"cannot create run directory {str(self.path)!r} ({e.strerror}); choose another "
                                  f"--out") from None
        try:
            self.lock = RunLock(self.path, self.command, log=_log).acquire()
        except RunDirectoryBusy:
            self.created = None  # what is there now belongs to the other writer: never remove it
            raise
        if not self.resume and not is_empty_run_dir(self.path):  # another writer filled it since __init__
            self.release()
            self.created = None
            self._refuse_not_empty()
        return self.path

    def discard(self) -> None:
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            self.created = None
        self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def has_checkpoint(self) -> bool:
        from .checkpoint import list_checkpoints

        return bool(list_checkpoints(self.path / "checkpoints"))


def _write_run_file(path: Path, text: str, flag: str = "--out") -> None:
    """Write a file of the run whole or not at all (temp file + rename); a full disk or a read-only file system
    at this point is an input problem (exit code 2), and no empty or truncated file is left behind."""
    try:
        atomic_write_text(path, text)
    except OSError as e:
        raise ConfigError(f"cannot write {str(path)!r} ({e.strerror}); free space or choose another {flag}") from None


@contextlib.contextmanager
def _input_errors(domain: str):
    """Errors raised while a domain loads its inputs that are input problems become one line with exit code 2:
    file-system errors (a path that vanished, a permission), a file that is not UTF-8, a module the config names
    that does not import (missing, a syntax error, or raising in its top-level code: ``preflight.user_code_failure``),
    and a size that does not fit in memory. Domains raise ConfigError for everything else they can name; other
    exceptions (KeyError, AssertionError, ...) are programming errors and keep their traceback.
    ``GROVE_DEBUG=1`` re-raises with the traceback."""
    from .preflight import user_code_failure

    try:
        yield
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 — sorted below: input problems become one line, the rest re-raise
        if os.environ.get("GROVE_DEBUG"):
            raise
        if isinstance(e, OSError):
            why = " ".join(str(e).split())
        elif isinstance(e, UnicodeDecodeError):
            why = f"an input file is not UTF-8 text ({e.reason} at offset {e.start}); save it as UTF-8"
        elif isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] not in _OWN_PACKAGES:
            why = f"{e}; install it or fix the name in the config"
        elif (found := user_code_failure(e)) is not None:
            why = found
        elif (alloc := _allocation_failure(e)) is not None:
            why = (f"building it asks for more memory than this machine has ({alloc}); lower the sizes in the "
                   f"config")
        else:
            raise
        raise ConfigError(f"{domain}: {why}") from e


_OWN_PACKAGES = ("shared_rl", "visgen", "robotics", "bench")


def _quiet_loading() -> None:
    """Model-loading progress bars and import-time library chatter would bury the one-line error contract;
    training has its own bar."""

    for mod in ("diffusers.utils.logging", "transformers.utils.logging"):
        try:
            importlib.import_module(mod).disable_progress_bar()
        except Exception:  # noqa: BLE001 — a missing library simply has no bar to hide
            pass


def _load_config(args) -> tuple[dict, Path]:
    if args.config:
        config_path = Path(args.config)
    else:
        config_path = DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else FALLBACK_CONFIG
        _log(f"grove: no config given; running the default {config_path.relative_to(REPO_ROOT)}")
    return _read_config(config_path, args.overrides), config_path


def _read_config(config_path: Path, overrides: list[str]) -> dict:
    """The config file with its overrides applied; the bytes of both are checked before YAML reads them (UTF-8
    text, bounded size, nesting and alias expansion: ``preflight.check_config_file``, which ``load_yaml`` runs)."""
    from .preflight import check_override_text

    for override in overrides:
        check_override_text(override)
    return apply_overrides(load_yaml(config_path), overrides)


def batch_arithmetic(cfg) -> list[str]:
    """What one iteration and the whole run sample and step, in words (``--dry-run`` and the docs)."""
    r, o = cfg.rollout, cfg.optim
    structure = cfg.domain_config.rollout_structure(cfg)
    seqs = r.groups_per_iteration * r.group_size
    per_call = r.groups_per_call or r.groups_per_iteration
    calls = -(-r.groups_per_iteration // per_call)
    steps = o.inner_epochs * o.minibatches_per_epoch
    if structure == "flat":
        sampled = f"{r.groups_per_iteration} groups x {r.group_size} samples = {seqs} sequences"
        per_step = f"~{seqs / o.minibatches_per_epoch:.4g} sequences each"
    else:
        sampled = f"{r.groups_per_iteration} trees (the method's branching sets their size)"
        per_step = "a share of the trees' edges each"
    micro = (f"micro-batches of {o.micro_batch_size} sequences" if o.micro_batch_size
             else "one forward/backward per minibatch")
    every = f"every {cfg.eval.every} iterations and at the end" if cfg.eval.every else "at the end"
    ckpt = f"every {cfg.checkpoint.every} iterations and at the end" if cfg.checkpoint.every else "at the end"
    return [
        f"per iteration: {sampled}, in {calls} rollout call(s) of <= {per_call} groups",
        f"optimizer: {o.inner_epochs} epoch(s) x {o.minibatches_per_epoch} minibatch(es) = {steps} optimizer "
        f"step(s) per iteration, {per_step} ({micro})",
        f"whole run: {cfg.iterations} iterations = {cfg.iterations * steps} optimizer steps"
        + (f", {cfg.iterations * seqs:,} sequences" if structure == "flat" else ""),
        f"evaluation: {'before the first update, ' if cfg.eval.at_start else ''}{every}; checkpoints: {ckpt} "
        f"(keep the newest {cfg.checkpoint.keep_last})",
    ]


def _dry_run(cfg, config_path: Path, run_dir: Path, what: str) -> int:
    from .preflight import preflight, resolve_device

    with _input_errors(cfg.domain):
        preflight(cfg)
    print(f"# grove {what} --dry-run: {config_path} is valid; nothing was written. The resolved config:")
    print("\n".join(format_config(cfg)))
    print("# batch arithmetic:")
    print("\n".join(f"#   {line}" for line in batch_arithmetic(cfg)))
    print(f"#   device: {resolve_device(cfg.device)}; run directory: {run_dir}")
    print(f"#   memory: {memory_estimate_line(cfg)}")
    return 0


def memory_estimate_line(cfg) -> str:
    """``--dry-run``'s estimate of the persistent training state per process (``shared_rl.memory_estimate``, from
    the domain's ``parameter_groups``: parameter counts on the meta device), or why there is none."""
    from .memory_estimate import describe
    from .preflight import launched_processes

    groups = cfg.domain_config.parameter_groups(cfg)
    if not groups:
        return (f"no estimate (the {cfg.domain} domain counts no parameters before loading; its run logs a "
                f"'memory (...)' line once loaded)")
    return (f"estimate from parameter counts, {describe(groups, cfg.distributed.strategy, launched_processes())}; "
            f"activations, rollout buffers and caches not included")


def _dry_run_supervised(data: dict, domain: str, body: dict, config_path: Path, run_dir: Path) -> int:
    """``grove pretrain --dry-run``: the job's settings checked as its run checks them (unknown keys with a "did
    you mean", types, ranges), then printed resolved (defaults filled in); nothing is written."""
    import yaml

    from .config import check_supervised

    with _input_errors(domain):
        resolved = check_supervised(domain, body)
    if resolved is None:  # a third-party job that declares no settings class
        print(f"# grove pretrain --dry-run: {config_path} (kind: supervised); the {domain} job declares no settings "
              f"class, so only its domain was checked (it validates its settings when it starts); nothing was "
              f"written; run directory: {run_dir}")
        print(yaml.safe_dump(data, sort_keys=False).rstrip())
        return 0
    print(f"# grove pretrain --dry-run: {config_path} is valid (kind: supervised; every setting of the {domain} job "
          f"checked); nothing was written; run directory: {run_dir}. The resolved settings:")
    print(yaml.safe_dump({"kind": "supervised", "domain": domain, **to_dict(resolved)}, sort_keys=False).rstrip())
    return 0


def _allocation_failure(e: BaseException) -> str | None:
    """The one-line reason when ``e`` is a failed host-memory allocation (torch's CPU allocator raises a plain
    RuntimeError, Python a MemoryError), else None."""
    text = " ".join(str(e).split())
    if isinstance(e, MemoryError) or "can't allocate memory" in text or "DefaultCPUAllocator" in text:
        return text[:200] or type(e).__name__
    return None


def _fit(trainer, run: _RunDir) -> int:
    """Run the trainer; map how it stopped to the exit code (Ctrl-C: 130 after its checkpoint); release the run
    directory's lock however it ends."""
    try:
        trainer.fit(resume=trainer.restored_from is not None)
    except KeyboardInterrupt:  # a second Ctrl-C: abort without saving
        if run.created is not None and not run.has_checkpoint():
            run.discard()  # nothing resumable was made by this command: leave nothing behind
            _log(f"grove: interrupted before the first checkpoint; removed {run.path}")
        else:
            _log(f"grove: interrupted; the newest checkpoint is kept: resume with: grove train --resume {run.path}")
        return EXIT_INTERRUPTED
    except WorkerDied as e:  # the checkpoint from before this iteration is on disk: say how to continue
        raise WorkerDied(f"{e}; the newest checkpoint is kept: resume with: grove train --resume {run.path}") from None
    except OSError as e:
        if run.lock is not None and not run.lock.alive():  # deleted between the check and a write: the same stop
            raise RunDirectoryLost(f"the run directory {str(run.path)!r} was deleted, moved or replaced while the "
                                   f"run was writing it ({e.strerror}); the run stopped without recreating it") from e
        raise
    except (RuntimeError, MemoryError) as e:
        why = _allocation_failure(e)
        if why is None:
            raise
        raise ResourceError(f"out of host memory during the run ({why}); lower the sizes the config asks for "
                            f"(rollout.groups_per_iteration, rollout.group_size, the domain's sizes); the newest "
                            f"checkpoint is kept") from e
    finally:
        run.release()
    return EXIT_INTERRUPTED if trainer.stop_signal == "SIGINT" else 0


def cmd_train(args, force_supervised: bool = False) -> int:
    if args.resume:
        return cmd_resume(args)
    import yaml

    data, config_path = _load_config(args)
    kind = "supervised" if force_supervised else data.get("kind", "rl")
    if args.out is not None and not str(args.out).strip():
        raise ConfigError("--out is empty; give a directory, e.g. --out runs/my-run (or leave --out out for "
                          "runs/<config>-<time>)")
    run = _RunDir(Path(args.out or _default_run_dir(config_path)), resume=False)
    if kind == "supervised":
        from .registry import resolve_supervised

        domain = data.get("domain")
        if not isinstance(domain, str):
            raise ConfigError(f"{config_path}: a supervised config needs 'domain: NAME'")
        fn = resolve_supervised(domain)
        body = {k: v for k, v in data.items() if k not in ("kind", "domain")}
        if args.dry_run:
            return _dry_run_supervised(data, domain, body, config_path, run.path)
        try:
            run_dir = run.create()
            _write_run_file(run_dir / "config.yaml", yaml.safe_dump(data, sort_keys=False))
            result = fn(body, run_dir, _log)
        except ConfigError:
            run.discard()
            raise
        finally:
            run.release()
        _log(f"grove: done: {result}")
        return 0

    with _input_errors(str(data.get("domain", "config"))):
        cfg = _checked_train_config(data)
    if args.dry_run:
        return _dry_run(cfg, config_path, run.path, "train")
    from .trainer import Trainer

    _quiet_loading()
    try:
        with _input_errors(cfg.domain):
            trainer = Trainer(cfg, run.path, log=_log)  # builds the domain (loads models) before writing anything
        run_dir = run.create()
        if run.main:
            _write_run_file(run_dir / "config.yaml", yaml.safe_dump(dump_train_config(cfg), sort_keys=False))
    except ConfigError:
        run.discard()
        raise
    return _fit(trainer, run)


def _usable_checkpoint(run_dir: Path, flag: str) -> Path:
    """The newest checkpoint of ``run_dir`` that passes its checksums; a ConfigError saying why when none does."""
    from .checkpoint import newest_usable_checkpoint

    found, problems = newest_usable_checkpoint(run_dir / "checkpoints")
    if found is None:
        why = "; ".join(problems) if problems else "it has none yet (it stopped before its first checkpoint)"
        raise ConfigError(f"{flag} {str(run_dir)!r}: no usable checkpoint ({why}); nothing was changed. Start the "
                          f"run afresh with: grove train {run_dir / 'config.yaml'} --out NEW_DIR")
    return found


def _checked_train_config(data: dict):
    """``load_train_config(data)``, after the path checks that need no torch (``shared_rl.prechecks``: the same
    functions the domains' validation calls later), so a typo'd model or checkpoint path is answered in the time
    the CLI takes to start rather than after the typed configs' imports."""
    from .prechecks import precheck_paths

    precheck_paths(data)
    return load_train_config(data)


def _run_config(run_dir: Path, flag: str, overrides: list[str]):
    if not run_dir.is_dir():
        raise ConfigError(f"{flag} {str(run_dir)!r} is not a grove run directory (it does not exist)")
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{flag} {str(run_dir)!r}: no config.yaml there (not a grove run directory)")
    data = _read_config(run_dir / "config.yaml", overrides)
    if data.get("kind", "rl") == "supervised":
        raise ConfigError(f"{flag} {str(run_dir)!r} is a supervised run; {flag} works on RL runs (grove pretrain "
                          f"starts supervised jobs afresh)")
    with _input_errors(str(data.get("domain", "config"))):
        return _checked_train_config(data)


def _restore(trainer, checkpoints: Path, flag: str) -> None:
    """Load the newest checkpoint into ``trainer``; one that does not fit the config (an override changed the
    model), or lacks a part's state when training continues (``--resume``), is a ConfigError naming the
    checkpoint, before anything is written."""
    try:
        ok = trainer.resume(checkpoints, exact=flag == "--resume")
    except ConfigError:  # already one line (a checkpoint without some part's state)
        raise
    except (ValueError, KeyError, RuntimeError) as e:  # load_state_dict of a checkpoint: shapes or names differ
        raise ConfigError(f"{flag}: checkpoint in {checkpoints} does not fit this config ({' '.join(str(e).split())[:300]}); "
                          f"drop the overrides that change the model") from None
    if not ok:
        raise ConfigError(f"{flag}: no usable checkpoint left in {checkpoints}; nothing was changed")


def cmd_resume(args) -> int:
    """``grove train --resume RUN [key=value ...]``: refuse what would destroy or silently ignore anything (no
    usable checkpoint, a CONFIG or --out, nothing left to train), then continue from the newest checkpoint. The
    overrides are written into RUN/config.yaml (with a comment saying when) and into the next metrics record."""
    import yaml

    from .metrics import check_history
    from .rundir import final_complete

    run_path = Path(args.resume)
    if args.config:
        raise ConfigError(f"--resume continues {str(run_path)!r} with its own config.yaml; drop {args.config!r} "
                          f"(change settings with key=value overrides)")
    if args.out:
        raise ConfigError(f"--resume writes into {str(run_path)!r} itself; drop --out (to branch a run, copy its "
                          f"directory and resume the copy)")
    cfg = _run_config(run_path, "--resume", args.overrides)
    from .checkpoint import checkpoint_iteration  # torch: after the config's torch-free path checks

    run = _RunDir(run_path, resume=True, command="grove train --resume")
    if not args.dry_run:
        run.create()  # the lock, before the checks read the state another writer could be changing
    try:
        check_history(run_path / "metrics.jsonl")
        checkpoint = _usable_checkpoint(run_path, "--resume")
        done = checkpoint_iteration(checkpoint)
        export_only = done >= cfg.iterations
        if export_only and final_complete(run_path):
            raise ConfigError(f"--resume {str(run_path)!r}: its newest checkpoint is at iteration {done} of "
                              f"{cfg.iterations}, nothing is left to train; pass iterations=N with N > {done} to "
                              f"continue")
        if args.dry_run:
            return _dry_run(cfg, run_path / "config.yaml", run_path, "train --resume")
        _quiet_loading()
        from .trainer import Trainer

        with _input_errors(cfg.domain):
            trainer = Trainer(cfg, run_path, log=_log)
        _restore(trainer, run_path / "checkpoints", "--resume")
        if export_only:  # it finished training but was stopped while exporting: export again, train nothing
            trainer.log(f"{run_path}: trained to iteration {done} but its final/ export is missing or was cut "
                        f"short; exporting it again from {trainer.restored_from}")
            trainer._finish()
            return 0
        trainer.log(f"resumed from {trainer.restored_from} at iteration {trainer.start_iteration}")
        if args.overrides and run.main:
            old = (run_path / "config.yaml").read_text().splitlines()
            notes = [line for line in old if line.startswith("#")]
            notes.append(f"# resumed at iteration {done} ({time.strftime('%Y-%m-%d %H:%M:%S')}) with: "
                         f"{' '.join(args.overrides)}")
            text = "\n".join(notes) + "\n" + yaml.safe_dump(dump_train_config(cfg), sort_keys=False)
            _write_run_file(run_path / "config.yaml", text, flag="run directory")
            trainer.resume_note["resume/overrides"] = " ".join(args.overrides)
        return _fit(trainer, run)
    finally:
        run.release()


def cmd_eval(args) -> int:
    """``grove eval RUN [--out DIR]``: evaluate the newest checkpoint into DIR (results.json plus whatever the
    domain's evaluation draws, e.g. GIFs); the run directory is only read."""
    run_dir = Path(args.run_dir)
    cfg = _run_config(run_dir, "eval", args.overrides)
    from .trainer import Trainer

    checkpoint = _usable_checkpoint(run_dir, "eval")
    if args.out is not None:
        check_output_dir(args.out)  # the text as given: Path("") would silently be "."
    out = Path(args.out) if args.out is not None else Path("runs") / (
        f"eval-{run_dir.absolute().name}-{time.strftime('%Y%m%d-%H%M%S')}")
    target = _RunDir(out, resume=False, if_not_empty="choose another --out for the results", command="grove eval")
    inside = out.absolute().resolve()
    if inside == run_dir.absolute().resolve() or run_dir.absolute().resolve() in inside.parents:
        raise ConfigError(f"eval --out {str(out)!r} is inside the run {str(run_dir)!r}; grove eval never changes a "
                          f"run: choose a directory outside it")
    _quiet_loading()
    try:
        with _input_errors(cfg.domain):
            trainer = Trainer(cfg, out, log=_log)
        _restore(trainer, run_dir / "checkpoints", "eval")
        _log(f"grove eval: {checkpoint} (iteration {trainer.start_iteration})")
        out_dir = target.create()
    except ConfigError:
        target.discard()
        raise
    try:
        metrics = trainer.evaluate(trainer.start_iteration)
        result = {"run": str(run_dir), "checkpoint": str(checkpoint), "iteration": trainer.start_iteration,
                  "overrides": list(args.overrides), "metrics": metrics}
        _write_run_file(out_dir / "results.json", json.dumps(result, indent=1, default=float) + "\n")
        # the domain's pictures of this checkpoint (visgen: the captioned before/after grid, base vs checkpoint;
        # the LLM's samples), drawn as at the end of a run, and the page that shows them
        record = {"step": trainer.start_iteration, **metrics}
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the metrics JSON only
            trainer.domain.on_train_end(out_dir, [record])
        from .report import write_report

        report = write_report(out_dir, [record], f"grove eval: {run_dir.absolute().name} at iteration "
                              f"{trainer.start_iteration}", {"run": str(run_dir), "checkpoint": str(checkpoint),
                                                              "overrides": " ".join(args.overrides) or "none"})
    finally:
        target.release()
    print(json.dumps(metrics, indent=1))
    _log(f"grove: results in {out_dir / 'results.json'} (pictures: {report.name})")
    return 0


def cmd_bench(args) -> int:
    from .bench import markdown_table
    from .registry import resolve_benchmark

    fn = resolve_benchmark(args.name)
    if args.out is not None:
        check_output_dir(args.out)  # the text as given: Path("") would silently be "."
    out = Path(args.out) if args.out is not None else Path("runs") / f"bench-{args.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_output_dir(out)
    result = fn(out, args.quick)
    print(markdown_table(result["rows"]))
    _log(f"grove: results in {out / 'results.json'}")
    return 0


def _yaml_value(value) -> str:
    """``value`` as one line of YAML, the way it would be written in a config (``null``, ``[0.9, 0.999]``, ``''``)."""
    import yaml

    text = yaml.safe_dump(to_dict(value), default_flow_style=True, sort_keys=False, width=1 << 20).strip()
    return text[: -len("...")].strip() if text.endswith("\n...") else text


def format_config(cfg) -> list[str]:
    """The resolved ``TrainConfig`` as YAML lines, section by section (the domain's section under its name), each
    field as ``name: value   # help (default: X)``; a field without help text gets no comment. The output is a
    valid config: ``grove config show C > resolved.yaml`` trains the same run."""
    rows = []
    for path, value, default, help_ in describe(cfg):
        if path.startswith("domain_config."):
            path = cfg.domain + path[len("domain_config"):]
        *sections, name = path.split(".")
        rows.append((sections, f"{'  ' * len(sections)}{name}: {_yaml_value(value)}", default, help_))
    width = min(max(len(left) for _, left, _, _ in rows), 56)
    lines: list[str] = []
    open_sections: list[str] = []
    for sections, left, default, help_ in rows:
        same = 0
        while same < min(len(sections), len(open_sections)) and sections[same] == open_sections[same]:
            same += 1
        lines += [f"{'  ' * depth}{sections[depth]}:" for depth in range(same, len(sections))]
        open_sections = sections
        if help_:
            shown = "required" if default is dataclasses.MISSING else _yaml_value(default)
            left = f"{left:<{width}}   # {help_} (default: {shown})"
        lines.append(left)
    return lines


def cmd_config(args) -> int:
    if args.config_command != "show":
        raise ConfigError("config needs a sub-command: grove config show [CONFIG] [key=value ...]")
    if args.config and "=" in args.config and not Path(args.config).exists():  # only overrides were given
        args.overrides, args.config = [args.config] + list(args.overrides), None
    data, config_path = _load_config(args)  # no config: the default `grove train` runs, and says so
    if data.get("kind", "rl") == "supervised":
        raise ConfigError(f"{config_path}: config show resolves RL configs; this one is kind: supervised "
                          f"(its job validates it when run: grove pretrain {config_path})")
    with _input_errors(str(data.get("domain", "config"))):
        cfg = load_train_config(data)
    print(f"# {config_path} resolved: every setting `grove train` runs with, its help text and default")
    print("\n".join(format_config(cfg)))
    return 0


def cmd_group(name: str, argv: list[str]) -> int:
    """``grove NAME ...``: hand the rest of the command line to the command group's ``main(argv)``."""
    from .registry import resolve_command

    return int(resolve_command(name)(argv) or 0)


def _core_names() -> dict[str, list[str]]:
    """The built-in estimators by kind, policy losses and KL estimators, sorted (``registered_names``)."""
    here = Path(__file__).resolve().parent
    estimators = registered_names(here / "advantages.py", "register")
    names = {kind: sorted(n for n, kw in estimators.items() if kw.get("kind", "flat") == kind)
             for kind in ("flat", "tree", "step")}
    names["policy_loss"] = sorted(registered_names(here / "losses.py", "register_policy_loss"))
    names["kl_estimator"] = sorted(registered_names(here / "losses.py", "register_kl_estimator"))
    return names


def catalog() -> list[tuple[str, list[str]]]:
    """(what, names) for ``grove list``: the core's registries, then each domain's (found by name through
    ``shared_rl.registry.CATALOGS``, so this module imports no domain; a domain whose packages are missing says so).
    Imports no torch: the core's tensor registries are read from their source (``registered_names``), the domains'
    catalogs are text or read the same way (``visgen/catalog.py``, ``robotics/catalog.py``)."""
    import typing

    from . import registry
    from .config import LossConfig, SelectionConfig

    def literal(cls, name: str) -> list[str]:
        return [str(a) for a in typing.get_args(typing.get_type_hints(cls)[name])]

    core = _core_names()
    rows = [
        ("domains (domain:)", registry.domain_names()),
        ("supervised jobs (grove pretrain, kind: supervised)", registry.supervised_names()),
        ("benchmarks (grove bench NAME)", registry.benchmark_names()),
        ("command groups (grove NAME ...)", registry.command_names()),
        ("advantage estimators, flat (advantage.estimator)", core["flat"]),
        ("advantage estimators, tree rollouts (advantage.estimator)", core["tree"]),
        ("advantage estimators with a critic (advantage.estimator: {name: NAME, ...})", core["step"]),
        ("policy losses (loss.policy_loss)", core["policy_loss"]),
        ("KL estimators (loss.kl_estimator)", core["kl_estimator"]),
        ("loss aggregations (loss.aggregation)", literal(LossConfig, "aggregation")),
        ("group filters (selection.filter)", literal(SelectionConfig, "filter")),
        ("key samplers (selection.sampler)", literal(SelectionConfig, "sampler")),
    ]
    for name in registry.catalog_names():
        try:
            rows += [(f"{name}: {what}", list(names)) for what, names in registry.resolve_catalog(name)().items()]
        except (ConfigError, ImportError) as e:  # e.g. the robotics extra is not installed
            rows.append((name, [f"(unavailable: {e})"]))
    rl, supervised = recipes()
    rows.append(("recipes (grove train CONFIG; docs: README 'Recipes')", rl))
    rows.append(("supervised jobs' configs (grove pretrain CONFIG)", supervised))
    return rows


def recipes() -> tuple[list[str], list[str]]:
    """The configs under ``configs/`` (accelerate launch files aside), as (RL recipes, supervised jobs), each a
    path relative to the checkout; a file's top-level ``kind: supervised`` line sorts it (no YAML parse: fast)."""
    import re

    rl, supervised = [], []
    for path in sorted((REPO_ROOT / "configs").rglob("*.yaml")):
        if "accelerate" in path.parts:
            continue
        text = path.read_text(errors="replace")
        name = str(path.relative_to(REPO_ROOT))
        (supervised if re.search(r"^kind:\s*['\"]?supervised\b", text, re.M) else rl).append(name)
    return rl, supervised


def cmd_list(args) -> int:
    for what, names in catalog():
        print(f"{what}:\n  " + ", ".join(names))
    return 0


def _loaded_failures() -> tuple[type, ...]:
    """Failure classes of modules imported lazily (exit code 1): only when their module was imported, since an
    exception of a module never imported cannot have been raised."""
    rewards = sys.modules.get("shared_rl.rewards")
    return (rewards.RewardFailure,) if rewards is not None else ()


def version() -> str:
    try:
        from importlib.metadata import version as installed

        return installed("grove")
    except Exception:  # noqa: BLE001 — running from a checkout that is not installed
        from . import __version__

        return __version__


BUILTIN_COMMANDS = ("train", "pretrain", "eval", "bench", "config", "list")


def _command_groups() -> list[str]:
    from .registry import command_names

    return [n for n in command_names() if n not in BUILTIN_COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="grove", description="Group-relative RL post-training for image generators, robot "
                                                  "policies and LLMs.")
    p.add_argument("--version", action="store_true", help="print grove's version and exit")
    sub = p.add_subparsers(dest="command", parser_class=ArgumentParser)
    for name, help_ in (("train", "train with a YAML config (RL by default; supervised when kind: supervised)"),
                        ("pretrain", "supervised pretraining of an embedded model")):
        t = sub.add_parser(name, help=help_)
        t.add_argument("config", nargs="?", help="YAML config (default: the embedded shapes GRPO recipe)")
        t.add_argument("--out", help="run directory (default runs/<config>-<time>)")
        if name == "train":
            t.add_argument("--resume", help="continue the run in this directory from its newest valid checkpoint "
                                            "(overrides are recorded in its config.yaml)")
        t.add_argument("--dry-run", action="store_true",
                       help="validate everything, print the resolved config and batch arithmetic, write nothing")
        t.add_argument("overrides", nargs="*", help="dotted overrides such as optim.lr=1e-4")
    e = sub.add_parser("eval", help="evaluate the newest checkpoint of a run into its own directory")
    e.add_argument("run_dir")
    e.add_argument("--out", help="results directory (default runs/eval-<run>-<time>); the run is never changed")
    e.add_argument("overrides", nargs="*", help="dotted overrides of the run's config, e.g. eval.every=0")
    b = sub.add_parser("bench", help="run a benchmark; writes DIR/results.json, plots and a Markdown table")
    b.add_argument("name", help="benchmark name (grove list shows them)")
    b.add_argument("--out")
    b.add_argument("--quick", action="store_true", help="tiny settings that only check the plumbing")
    c = sub.add_parser("config", help="inspect configs: grove config show [CONFIG] [key=value ...]")
    csub = c.add_subparsers(dest="config_command", parser_class=ArgumentParser)
    show = csub.add_parser("show", help="print the resolved config section by section, with help texts and defaults")
    show.add_argument("config", nargs="?", help="YAML config (default: the one bare `grove train` runs)")
    show.add_argument("overrides", nargs="*", help="dotted overrides such as optim.lr=1e-4")
    sub.add_parser("list", help="what can be named in a config: rewards, estimators, losses, methods, benchmarks, "
                                "domains, recipes")
    for name in _command_groups():
        sub.add_parser(name, help=f"the {name} command group (grove {name} --help lists its tools)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if "torch.distributed" in sys.modules:  # launched by accelerate/torchrun: leave cleanly on every rank
        from .distributed import exit_distributed

        exit_distributed(code)
    return code


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import logging

    # import-time chatter of torchao (and diffusers' torchao shim) is not for the user's terminal
    for name in ("torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        if argv[:1] == ["--version"]:
            print(f"grove {version()}")
            return 0
        if argv and argv[0] not in BUILTIN_COMMANDS and argv[0] in _command_groups():
            return cmd_group(argv[0], argv[1:])
        parser = build_parser()
        if not argv:
            parser.print_help()
            return 0
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            # overrides after options land in unknown; anything not key=value is an error
            bad = [u for u in unknown if "=" not in u or u.startswith("-")]
            if bad:
                raise ConfigError(f"unrecognized arguments: {' '.join(bad)}")
            args.overrides = list(getattr(args, "overrides", []) or []) + unknown
        if args.version:
            print(f"grove {version()}")
            return 0
        if args.command == "train":
            if args.config and "=" in args.config and not Path(args.config).exists():
                args.overrides = [args.config] + list(args.overrides)
                args.config = None
            return cmd_train(args)
        if args.command == "pretrain":
            args.resume = None
            if not args.config:
                raise ConfigError("pretrain needs a config, e.g. grove pretrain configs/visgen/shapes_pretrain.yaml")
            return cmd_train(args, force_supervised=True)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "config":
            return cmd_config(args)
        if args.command == "list":
            return cmd_list(args)
        parser.print_help()
        return 2
    except ConfigError as e:
        _error_line(str(e))
        return 2
    except (ResourceError, NonFiniteError, RunDirectoryLost, WorkerDied, *_loaded_failures()) as e:
        _error_line(str(e))
        return 1
    except KeyboardInterrupt:
        print("grove: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
