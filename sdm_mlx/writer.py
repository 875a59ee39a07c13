"""The writer protocol of artifact directories: one lock, one atomic exchange, readers pinned to one version.

Every mutation of an artifact directory — ``SDMEstimator.save``, ``sdm-mlx add-support`` / ``--undo``,
``recalibrate``, ``train --overwrite``, ``network-train``, the server's and the MCP server's persisted
feedback — follows the same steps:

1. take :func:`artifact_lock` (an exclusive ``flock`` on the hidden sibling ``.<name>.sdm-lock``,
   re-entrant within a process);
2. re-read what is on disk (an update applies its change to the current version, never to a copy
   loaded earlier; a plain save checks that the directory is still the version it was loaded from);
3. write the complete new version into a hidden sibling temporary directory and fsync it;
4. publish it with one atomic :func:`exchange` of the two directory entries (``renameat2`` with
   ``RENAME_EXCHANGE`` on Linux, ``renamex_np`` with ``RENAME_SWAP`` on macOS): the model path
   always names a complete version, old or new, and there is no moment where it is missing;
5. delete the previous version (now at the temporary name).

A reader (:class:`PinnedDirectory`) opens the directory once and every file relative to that open
directory, so all the files it reads belong to the same version; if a writer deleted that version
while it was being read, the reader starts again on the new one (:func:`read_consistently`).

A directory whose owner cannot write it (``chmod u-w`` / ``a-w``) is never replaced: the lock is the
user's, and swapping the directory aside would bypass it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
import sys
import threading
from contextlib import contextmanager

from .errors import ArtifactError

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # Linux renameat2 flag
_RENAME_SWAP = 2      # macOS renamex_np flag
#: times a reader starts again when the version it was reading was replaced under it
READ_ATTEMPTS = 20

_locks: dict = {}
_locks_guard = threading.Lock()


def lock_path(path) -> str:
    """The lock file of the artifact directory ``path``: ``.<name>.sdm-lock`` beside it."""
    parent, base = os.path.split(os.path.realpath(os.fspath(path)))
    return os.path.join(parent, f".{base}.sdm-lock")


@contextmanager
def artifact_lock(path, error=ArtifactError):
    """Hold the exclusive update lock of the artifact directory ``path`` (re-entrant in one process:
    ``update_model`` holds it while ``save`` takes it again)."""
    real = os.path.realpath(os.fspath(path))
    with _locks_guard:
        entry = _locks.setdefault(real, {"rlock": threading.RLock(), "fd": None, "depth": 0})
    with entry["rlock"]:
        if entry["depth"] == 0:
            try:
                fd = os.open(lock_path(real), os.O_CREAT | os.O_RDWR, 0o644)
            except OSError as e:
                raise error(f"cannot write {os.fspath(path)}: cannot create its lock file "
                            f"({e.strerror or e})") from None
            fcntl.flock(fd, fcntl.LOCK_EX)
            entry["fd"] = fd
        entry["depth"] += 1
        try:
            yield
        finally:
            entry["depth"] -= 1
            if entry["depth"] == 0:
                os.close(entry["fd"])
                entry["fd"] = None


def owner_cannot_write(path: str) -> bool:
    """True when the directory ``path`` is write-protected: its owner's write bit is off (``chmod u-w``),
    or this process lacks write permission.  (Checked by mode bits too, so that root respects it.)"""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return not (st.st_mode & stat.S_IWUSR) or not os.access(path, os.W_OK)


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def exchange(a: str, b: str) -> bool:
    """Atomically exchange the directory entries ``a`` and ``b`` (both must exist); False when the
    platform or file system cannot (the caller then falls back to two renames under the lock)."""
    if _LIBC is None:
        return False
    if sys.platform.startswith("linux") and hasattr(_LIBC, "renameat2"):
        fn = _LIBC.renameat2
        rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    elif sys.platform == "darwin" and hasattr(_LIBC, "renamex_np"):
        rc = _LIBC.renamex_np(os.fsencode(a), os.fsencode(b), _RENAME_SWAP)
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


class VersionReplaced(Exception):
    """The directory version being read was replaced (and deleted) by a writer: read again."""


class PinnedDirectory:
    """One version of a directory: opened once, every file opened relative to it.

    ``open(name)`` returns a binary file of this version; a file missing because a writer deleted
    this version meanwhile raises :class:`VersionReplaced` (a file missing from a version that is still
    current raises ``FileNotFoundError``: the artifact is incomplete).
    """

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        self._id = _identity(os.fstat(self.fd))

    def replaced(self) -> bool:
        """True when ``path`` no longer names the opened version."""
        try:
            return _identity(os.stat(self.path)) != self._id
        except OSError:
            return True

    def open(self, name: str):
        try:
            return open(name, "rb", opener=lambda n, flags: os.open(n, flags, dir_fd=self.fd))
        except FileNotFoundError:
            if self.replaced():
                raise VersionReplaced(name) from None
            raise

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _identity(st) -> tuple:
    return st.st_dev, st.st_ino


def read_consistently(path: str, read):
    """``read(PinnedDirectory)`` on one version of ``path``; started again on the new version when a writer
    replaced the one being read (``read`` raises :class:`VersionReplaced`, or any error while the
    version it read is no longer current)."""
    for attempt in range(READ_ATTEMPTS):
        with PinnedDirectory(path) as pinned:
            try:
                return read(pinned)
            except VersionReplaced:
                continue
            except (ArtifactError, OSError, ValueError):
                if attempt + 1 < READ_ATTEMPTS and pinned.replaced():
                    continue
                raise
    raise ArtifactError(f"{path} was replaced {READ_ATTEMPTS} times while it was being read; try again")
