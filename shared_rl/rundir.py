"""One writer per run directory, files that are whole or absent, and a run that notices its directory vanish.

**The lock.** ``grove train``, ``grove train --resume`` and ``grove eval`` take ``RunLock`` on the directory they
write before they write anything else into it. It is an advisory ``fcntl.flock`` on ``DIR/.grove.lock``, whose
content is the owner record (host, pid, command, start time). A second writer finds the lock held and stops with
``RunDirectoryBusy`` (exit code 2), one line naming the owner. The kernel drops a flock when its process dies (also
by SIGKILL), so a lock file left behind by a killed run is *stale*: the next writer takes it over and says whose it
was. A writer that ends normally deletes the file again (a finished run holds no lock file). Only the main process
of a distributed run (rank 0) locks; the others never write the directory.

Why flock and not a lock file created with ``O_EXCL``: an ``O_EXCL`` file outlives a SIGKILL, and then either every
later run refuses (forever, until someone deletes it by hand) or it must guess from a pid whether the owner still
lives, which is wrong across hosts and after pid reuse. A flock is released by the kernel. Where the file system
has no flock (some FUSE or SMB mounts) the owner record alone decides: a live pid on this host owns the directory.

**Deleted directories.** ``check_run_dir`` is called before each write of a run (a metrics record, a checkpoint):
when the directory or its lock file is gone or replaced (``rm -rf RUN``, ``mv RUN ...`` while the run goes), it
raises ``RunDirectoryLost`` (exit code 1) instead of writing into a recreated, half-empty folder.

**Whole files.** ``atomic_write_text``/``atomic_path`` write a temporary file beside the target, fsync it and
rename it into place: a kill or a full disk leaves the old file or the new one, never a truncated one (a 0-byte
``config.yaml`` made a run neither resumable nor reusable). The end-of-run export goes the same way
(``begin_final``/``commit_final``): written into ``.tmp-final`` and renamed to ``final/`` as the run's last act, so
``final/`` exists exactly when the run finished, and ``grove train --resume`` exports a run again that was stopped
while exporting.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Iterator

from .errors import ConfigError, RunDirectoryBusy, RunDirectoryLost

LOCK_NAME = ".grove.lock"

# absolute run directory -> the lock this process holds on it
_HELD: dict[str, "RunLock"] = {}


def _key(path: Path) -> str:
    return os.path.abspath(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _read_owner(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        owner = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return owner if isinstance(owner, dict) else None


def describe_owner(owner: dict | None) -> str:
    if not owner:
        return "another grove process (its owner record is not written yet)"
    host = owner.get("host", "?")
    pid = owner.get("pid", "?")
    where = "this host" if host == socket.gethostname() else f"host {host}"
    return f"{owner.get('command', 'grove')} (pid {pid} on {where}, since {owner.get('started', '?')})"


def holder(run_dir: Path) -> dict | None:
    """The owner record of a live writer of ``run_dir``, or None when nobody holds its lock. Read-only: creates
    nothing (``grove train`` asks it before loading a model, to name the owner of a busy directory at once)."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_owner(fd) or {}
        except OSError:  # no flock on this file system: the owner record decides
            owner = _read_owner(fd)
            same_host = owner and owner.get("host") == socket.gethostname()
            return owner if same_host and isinstance(owner.get("pid"), int) and _pid_alive(owner["pid"]) else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunLock:
    """The exclusive lock of one run directory (see the module docstring). ``acquire`` raises ``RunDirectoryBusy``
    when another process holds it and ``ConfigError`` when the lock file cannot be written (a read-only or full
    file system); ``release`` (also on exit from ``with``) deletes the lock file."""

    def __init__(self, run_dir: Path, command: str, log=None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.command = command
        self.log = log
        self.fd: int | None = None
        self.stale: dict | None = None  # the owner record of a dead writer this lock took over

    def busy(self, owner: dict | None) -> RunDirectoryBusy:
        return RunDirectoryBusy(f"{str(self.run_dir)!r} is in use by {describe_owner(owner)}: one process writes a "
                                f"run directory at a time; wait for it to end or stop it, or choose another directory")

    def acquire(self) -> "RunLock":
        for _ in range(20):  # a writer that releases unlinks the file: lock the new one instead
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise ConfigError(f"cannot write the run directory {str(self.run_dir)!r} ({e.strerror}); "
                                  f"{_advice(e)}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise self.busy(owner) from None
            except OSError:  # no flock here (ENOLCK, EOPNOTSUPP...): a live owner on this host still counts
                owner = _read_owner(fd)
                if (owner and owner.get("host") == socket.gethostname() and owner.get("pid") != os.getpid()
                        and isinstance(owner.get("pid"), int) and _pid_alive(owner["pid"])):
                    os.close(fd)
                    raise self.busy(owner) from None
            try:
                same = os.stat(self.path)
                mine = os.fstat(fd)
            except FileNotFoundError:
                os.close(fd)
                continue
            if (same.st_dev, same.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
            previous = _read_owner(fd)
            record = {"host": socket.gethostname(), "pid": os.getpid(), "command": self.command,
                      "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
                os.fsync(fd)
            except OSError as e:
                self._unlink_and_close(fd)
                raise ConfigError(f"cannot write the run directory {str(self.run_dir)!r} ({e.strerror}); "
                                  f"{_advice(e)}") from None
            self.fd = fd
            if previous and previous.get("pid") != os.getpid():
                self.stale = previous
                if self.log:
                    self.log(f"grove: {self.run_dir}: took over the lock left by {describe_owner(previous)}, "
                             f"which is no longer running")
            _HELD[_key(self.run_dir)] = self
            return self
        raise self.busy(None)

    def _unlink_and_close(self, fd: int) -> None:
        try:
            st, mine = os.stat(self.path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(self.path)  # before closing: nobody can lock this file between the two
        except OSError:
            pass
        os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        if _HELD.get(_key(self.run_dir)) is self:
            del _HELD[_key(self.run_dir)]
        fd, self.fd = self.fd, None
        self._unlink_and_close(fd)

    def alive(self) -> bool:
        """The directory still holds this lock's file (not deleted, moved or replaced since ``acquire``)."""
        if self.fd is None:
            return False
        try:
            st, mine = os.stat(self.path), os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def __enter__(self) -> "RunLock":
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


def _advice(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "the disk is full: free space or choose another directory"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "it is read-only for this user: fix its permissions or choose another directory"
    return "choose another directory"


def check_run_dir(run_dir: Path | None) -> None:
    """Raise ``RunDirectoryLost`` when ``run_dir`` vanished (or, when this process locks it, was replaced) since
    the run started writing it. Called before every write of a run; never creates anything."""
    if run_dir is None:
        return
    lock = _HELD.get(_key(run_dir))
    gone = not lock.alive() if lock is not None else not Path(run_dir).is_dir()
    if gone:
        raise RunDirectoryLost(f"the run directory {str(run_dir)!r} was deleted, moved or replaced while the run "
                               f"was writing it; the run stopped without recreating it")


def holds_lock(run_dir: Path) -> bool:
    return _key(run_dir) in _HELD


def is_empty_run_dir(path: Path) -> bool:
    """Nothing in ``path`` but (possibly) a lock file."""
    return not any(p.name != LOCK_NAME for p in Path(path).iterdir())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed onto ``path`` (after an fsync) when the block ends
    without an exception, removed when it raises. A reader sees the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")  # the suffix kept: writers read it
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (``atomic_path``)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


FINAL_NAME = "final"


def final_complete(run_dir: Path) -> bool:
    """The run's end-of-run export is whole: ``final/`` exists (it is renamed into place as the last act of a run
    that finished, see ``export_final``)."""
    return (Path(run_dir) / FINAL_NAME).is_dir()


def begin_final(run_dir: Path, main: bool = True) -> Path:
    """Where the end-of-run export is written: ``RUN/.tmp-final`` (emptied first, on the main process). Every
    process that takes part in the export (all of them under FSDP2) writes there; ``commit_final`` then renames it
    to ``final/`` on the main process, after the run's other end-of-run writes. A kill at any moment leaves no
    ``final/``, and ``grove train --resume`` of such a run exports again."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".tmp-{FINAL_NAME}"
    if main:
        check_run_dir(run_dir)
        if tmp.exists():
            shutil.rmtree(tmp)
    return tmp


def commit_final(run_dir: Path) -> Path:
    """Rename the export written under ``begin_final``'s path to ``final/`` (made empty for a domain that exports
    nothing: its presence is what says the run finished), after an fsync of its files."""
    run_dir = Path(run_dir)
    tmp, final = run_dir / f".tmp-{FINAL_NAME}", run_dir / FINAL_NAME
    check_run_dir(run_dir)
    tmp.mkdir(exist_ok=True)
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    if final.exists():  # exported again (--resume of a finished run): the old export out of the way first
        trash = run_dir / f".trash-{FINAL_NAME}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(run_dir)
    return final
