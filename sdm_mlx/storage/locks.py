"""The update lock of an artifact directory: an exclusive ``flock`` on its hidden sibling ``.<name>.sdm-lock``.

Re-entrant within a process (``update_model`` holds it while ``save`` takes it again); the lock file is removed
when the outermost holder releases it, so no lock file is left beside an output.  A process that waited for the
lock may then hold a file that was unlinked (or replaced by a new one): after ``flock`` it checks that the path
still names the file it locked, and otherwise opens the current one (:func:`_open_locked`).  ``wait=False`` raises
:class:`Busy` at once, naming the process that holds the lock (``sdm-mlx train`` holds its ``--output``'s lock
for the whole run so).  The writer protocol that uses it: :mod:`sdm_mlx.storage.artifact`.
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
from contextlib import contextmanager

from ..errors import ArtifactError, OutputError

_locks: dict = {}  # real path -> {"rlock", "fd", "depth"}: the locks this process holds
_locks_guard = threading.Lock()


def lock_path(path) -> str:
    """The lock file of the artifact directory ``path``: ``.<name>.sdm-lock`` beside it."""
    parent, base = os.path.split(os.path.realpath(os.fspath(path)))
    return os.path.join(parent, f".{base}.sdm-lock")


class Busy(OutputError):
    """The lock of an output is held by another process (``artifact_lock(..., wait=False)``); ``holder`` names it
    ("pid N: sdm-mlx VERB", or "" when unknown)."""

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder


def _open_locked(lock: str, shown: str, error, wait: bool) -> int:
    """The descriptor of ``lock`` (created if missing) under an exclusive ``flock``.

    Lock files are removed when released (:func:`artifact_lock`), so a lock taken on a file that was meanwhile
    unlinked (or replaced by a new one) is no lock at all: after ``flock`` the path must still name the locked
    file, else it is opened again.  ``wait=False``: raise :class:`Busy` instead of waiting for another process."""
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            raise error(f"cannot write {shown}: cannot create its lock file ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise Busy(f"{shown} is in use by another sdm-mlx process{f' ({holder})' if holder else ''}: it is "
                       "being written now; wait for that process to finish, or choose another output", holder) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the file was unlinked by the holder that released it: take the current one


def _lock_holder(fd: int) -> str:
    """``pid N: sdm-mlx VERB`` from a held lock file's contents, or ""."""
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _write_holder(fd: int) -> None:
    """Record this process in its lock file, for the message another process gets (best effort)."""
    verb = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: sdm-mlx {verb}".strip().encode(), 0)
    except OSError:
        pass


@contextmanager
def artifact_lock(path, error=ArtifactError, wait: bool = True):
    """Hold the exclusive update lock of the artifact directory ``path`` (re-entrant in one process:
    ``update_model`` holds it while ``save`` takes it again).

    The lock is an ``flock`` on the hidden sibling ``.<name>.sdm-lock``, which is removed again when the
    outermost holder releases it (a lock file is not left beside the output).  ``wait=False``: if another
    process holds it, raise :class:`Busy` (an :class:`~sdm_mlx.errors.OutputError` naming that process) at once
    (``sdm-mlx train`` holds its ``--output``'s lock for the whole run this way)."""
    real = os.path.realpath(os.fspath(path))
    with _locks_guard:
        entry = _locks.setdefault(real, {"rlock": threading.RLock(), "fd": None, "depth": 0})
    with entry["rlock"]:
        if entry["depth"] == 0:
            entry["fd"] = _open_locked(lock_path(real), os.fspath(path), error, wait)
            _write_holder(entry["fd"])
        entry["depth"] += 1
        try:
            yield
        finally:
            entry["depth"] -= 1
            if entry["depth"] == 0:
                try:
                    os.unlink(lock_path(real))  # still ours (checked when taken): waiters re-open a new one
                except OSError:
                    pass  # a directory the user may not write: the (empty) file stays, the lock is released
                os.close(entry["fd"])
                entry["fd"] = None
