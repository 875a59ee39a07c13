"""Versioned on-disk artifacts: a directory of safetensors + JSON, written atomically, checksummed.

Layout of an artifact directory::

    manifest.json          {"format", "format_version", "kind", "created", "files": {name: sha256}, "meta": {...}}
    <group>.safetensors    named float/int arrays (one file per group)

No pickle anywhere.  What may be replaced: a missing path, an empty directory, or — only with
``overwrite`` — an sdm_mlx artifact whose owner may write its directory; never a file, a foreign
directory, a write-protected directory (``chmod u-w``: the lock is the user's, and swapping the
directory aside would bypass it), the working directory or a directory holding an input.  Files
are 0644 and directories 0755 whatever the umask.

The writer protocol, the same for every mutation of an artifact (``SDMEstimator.save``,
``sdm-mlx add-support`` / ``--undo``, ``recalibrate``, ``train --overwrite``, ``network-train``,
the servers' persisted feedback):

1. the complete new version is written into a hidden sibling temporary directory
   (``.<name>.<pid>.*.sdm-tmp``) and fsynced;
2. under :func:`artifact_lock` (an exclusive ``flock`` on the hidden sibling ``.<name>.sdm-lock``,
   re-entrant within a process, removed again on release) the target is checked again — an update
   (:func:`sdm_mlx.estimator.updates.update_model`) holds the lock from before it re-reads the version on
   disk, so it applies its change to the current version; a plain save over the version it was
   loaded from is refused if another writer replaced that version meanwhile (``expected_digest``);
3. the new version is published by one atomic :func:`exchange` of the two directory entries
   (``renameat2`` + ``RENAME_EXCHANGE`` on Linux, ``renamex_np`` + ``RENAME_SWAP`` on macOS): the
   path always names a complete version, old or new, never nothing;
4. the previous version (now at the temporary name) is deleted.

A crash (even ``kill -9``) at any point leaves the previous or the new version; temporaries of dead
processes are removed by the next save.  Readers (:mod:`sdm_mlx.storage.artifact_load`) read every file of
one version, verify the format, version and every file's SHA-256, and raise :class:`ArtifactError`
with the reason otherwise.

Run directories (``demo``, ``network-train``) hold several outputs; they are marked
with ``.sdm_mlx_run.json`` (:func:`prepare_run_directory`) and written into again only
with ``overwrite``; nothing else in them is touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime as _dt
import errno
import json
import os
import shutil
import stat
import sys
import tempfile
from contextlib import contextmanager

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

from ..errors import ArtifactError, InputError, OutputError
from .artifact_load import (  # noqa: F401  (re-exported: the reading side of what this module writes)
    ARTIFACT_MANIFESTS, FORMAT, MANIFEST, _backup_path, _meta_digest, _valid_manifest, artifact_kind,
    check_manifest, interrupted_save_hint, load_artifact, manifest_digest, read_manifest,
    recover_interrupted_save, sha256_file,
)
from .locks import Busy, artifact_lock, lock_path  # noqa: F401  (re-exported: the writer protocol's lock)
from .files import (
    DIR_MODE, FILE_MODE, describe_os_error, dumps, fsync_dir, make_dirs, refuse_inputs_inside,
    remove_stale_temporaries, strict,
)

#: marker file of a run directory (demo, network-train) that sdm_mlx created
RUN_MARKER = ".sdm_mlx_run.json"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # Linux renameat2 flag
_RENAME_SWAP = 2      # macOS renamex_np flag


def _to_storable(a) -> np.ndarray:
    a = np.asarray(a)
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # (np.ascontiguousarray would turn 0-d scalars into 1-d)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    if a.dtype.kind not in "iuf":
        raise TypeError(f"cannot store an array of dtype {a.dtype} in safetensors")
    return a


def pack_ragged(prefix: str, arrays: list[np.ndarray]) -> dict:
    """Store a list of 1-D arrays of different lengths under ``prefix/0``, ``prefix/1``, …"""
    return {f"{prefix}/{i}": np.asarray(a) for i, a in enumerate(arrays)}


def unpack_ragged(prefix: str, group: dict, count: int) -> list[np.ndarray]:
    """Inverse of :func:`pack_ragged`."""
    try:
        return [group[f"{prefix}/{i}"] for i in range(count)]
    except KeyError as e:
        raise ArtifactError(f"artifact is missing array {e.args[0]!r}") from None


# --------------------------------------------------------------------------------------------
# the writer protocol: write-protection, atomic exchange (its lock: storage/locks.py)
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# directory ownership: what may be replaced
# --------------------------------------------------------------------------------------------
def _check_replaceable(path: str, shown: str, overwrite: bool, error) -> None:
    """Refuse to replace anything but a missing path, an empty directory or (with ``overwrite``) an artifact."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise error(f"{shown} exists and is not a directory; refusing to replace it")
    if not os.path.isdir(path):
        return
    if artifact_kind(path) is not None:
        if not overwrite:
            raise error(f"{shown} already holds an sdm_mlx artifact; pass --overwrite (Python: overwrite=True) "
                        "to replace it")
        if owner_cannot_write(path):
            raise error(f"cannot write {shown}: the directory is write-protected (its permissions do not allow "
                        f"writing); refusing to replace it — make it writable (chmod u+w {shown}) to update it")
        return
    try:
        entries = os.listdir(path)
    except OSError as e:
        raise error(f"cannot write {describe_os_error(e, shown)}") from None
    if entries:
        raise error(f"{shown} is a non-empty directory that is not an sdm_mlx artifact; refusing to replace it "
                    "(choose a new or empty directory)")


def check_artifact_output(path, overwrite: bool, inputs=(), flag: str = "--output", error=ArtifactError) -> None:
    """Before any work: refuse an artifact output that :func:`atomic_directory` would refuse, or that
    holds one of the ``inputs`` ([(flag, path), ...])."""
    try:
        refuse_inputs_inside(flag, path, inputs)
    except OutputError as e:
        raise error(str(e)) from None
    real = os.path.realpath(os.fspath(path))
    _check_replaceable(real, os.fspath(path), overwrite, error)


def set_modes(root: str) -> None:
    """0755 for ``root`` and its directories, 0644 for its files (independent of the umask)."""
    os.chmod(root, DIR_MODE)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), DIR_MODE)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), FILE_MODE)


def _fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


@contextmanager
def atomic_directory(path, error=ArtifactError, overwrite: bool = False, expected_digest: str | None = None):
    """``with atomic_directory(path) as tmp:`` write into ``tmp``; on success it replaces ``path``.

    ``path`` may be missing, an empty directory, or (only with ``overwrite``) an sdm_mlx artifact whose
    directory its owner may write; anything else (a file, a non-empty foreign directory, a write-protected
    directory, the working directory) is refused with ``error`` before anything is written.  A symlink is
    followed (the artifact lands at its target).  The new directory (0755, files 0644) is fsynced and
    published under :func:`artifact_lock` by one atomic :func:`exchange` of directory entries (see the
    module docstring); the previous version is deleted after.  ``expected_digest``: the manifest
    digest of the version the data were loaded from — refused if another writer replaced it meanwhile
    (no lost update).  An exception leaves ``path`` untouched and removes ``tmp``.
    """
    shown = os.fspath(path)
    real = os.path.realpath(shown)
    try:
        refuse_inputs_inside("output directory", shown, [])
    except OutputError as e:
        raise error(str(e)) from None
    _check_replaceable(real, shown, overwrite, error)
    parent, base = os.path.split(real)
    try:
        make_dirs(parent)
        remove_stale_temporaries(real)
        tmp = tempfile.mkdtemp(prefix=f".{base}.{os.getpid()}.", suffix=".sdm-tmp", dir=parent)
    except OSError as e:
        raise error(f"cannot write {describe_os_error(e, shown)}") from None
    try:
        yield tmp
        set_modes(tmp)
        _fsync_tree(tmp)
        replacing = os.path.isdir(real) and artifact_kind(real) is not None
        with artifact_lock(real, error) if replacing else contextlib.nullcontext():
            _check_replaceable(real, shown, overwrite, error)  # again, under the lock: it may have changed
            _check_unchanged(real, shown, expected_digest, error)
            _swap_in(tmp, real)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise error(f"cannot write {describe_os_error(e, shown)}") from None
        if isinstance(e, SafetensorError):
            raise error(f"cannot write {shown}: {e}") from None
        raise
    fsync_dir(parent)


def _check_unchanged(real: str, shown: str, expected_digest: str | None, error) -> None:
    if expected_digest is None or not os.path.isdir(real):
        return
    if manifest_digest(real) != expected_digest and _valid_manifest(real):  # (a corrupt one may be replaced)
        raise error(f"{shown} was changed by another writer since this model was loaded (e.g. rows added by "
                    "add-support or a server's feedback); refusing to overwrite those changes — load it again, "
                    "apply the change and save (or use sdm_mlx.estimator.updates.update_model, which does so under the lock)")


def _swap_in(tmp: str, real: str) -> None:
    """Publish ``tmp`` at ``real`` (under the lock): one atomic exchange, then the old version is deleted."""
    if os.path.isdir(real) and artifact_kind(real) is not None:
        if exchange(tmp, real):
            shutil.rmtree(tmp, ignore_errors=True)  # the previous version, now at the temporary name
            return
        backup = _backup_path(real)  # no exchange on this file system: two renames, under the lock
        shutil.rmtree(backup, ignore_errors=True)
        os.rename(real, backup)
        os.rename(tmp, real)
        shutil.rmtree(backup, ignore_errors=True)
    else:  # missing or an empty directory (rename(2) replaces an empty directory atomically)
        os.rename(tmp, real)


def prepare_run_directory(path, kind: str, overwrite: bool, inputs=(), flag: str = "--output",
                          check_only: bool = False) -> str:
    """Make ``path`` a run directory of ``kind`` (``"demo"``, ``"network-train"``); returns its real path.

    Allowed: a missing or empty directory (created 0755 and marked with ``.sdm_mlx_run.json``), or a
    directory marked as a run of the same kind when ``overwrite`` is set (its outputs are then replaced
    one by one, atomically; nothing else in it is touched).  Refused: the working directory or a parent
    of it, a directory holding an input, a foreign non-empty directory, an unmarked artifact, a file.
    ``check_only``: only the checks (before anything is read), nothing is created.
    """
    from .files import write_json

    shown = os.fspath(path)
    real = os.path.realpath(shown)
    refuse_inputs_inside(flag, shown, inputs)
    if os.path.lexists(real) and not os.path.isdir(real):
        raise OutputError(f"{flag} {shown} exists and is not a directory")
    marker = os.path.join(real, RUN_MARKER)
    if os.path.isdir(real) and os.listdir(real):
        if not os.path.isfile(marker):
            raise OutputError(f"{flag} {shown} is a non-empty directory that sdm_mlx did not create; refusing to "
                              "write into it (choose a new or empty directory)")
        try:
            with open(marker, encoding="utf-8") as f:
                found = json.load(f).get("kind")
        except (OSError, ValueError, AttributeError):
            found = None
        if found != kind:
            raise OutputError(f"{flag} {shown} holds a {found!r} run, not a {kind!r} run; choose another directory")
        if not overwrite:
            raise OutputError(f"{flag} {shown} holds an earlier {kind} run; pass --overwrite to replace its outputs "
                              "(or choose a new directory)")
    if check_only:
        return real
    try:
        make_dirs(real)
    except OSError as e:
        raise OutputError(f"cannot create {flag} {describe_os_error(e, shown)}") from None
    write_json(marker, {"format": "sdm_mlx_run", "kind": kind,
                        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})
    return real


def save_artifact(path, kind: str, version: int, groups: dict[str, dict], meta: dict, *,
                  overwrite: bool = False, texts: dict[str, str] | None = None,
                  expected_digest: str | None = None) -> str:
    """Write ``groups`` ({group: {name: array}}) and JSON ``meta`` to the directory ``path`` atomically.

    ``meta`` must be strict JSON already (no NaN/Infinity: see :func:`sdm_mlx.storage.files.put_float`).
    ``texts`` ({file name: UTF-8 text}, e.g. an update log) are written beside the arrays and
    checksummed in the manifest's ``texts``.
    An existing artifact at ``path`` is replaced only with ``overwrite``; see :func:`atomic_directory`
    (``expected_digest``: refuse if the directory is no longer that version).  Returns the manifest
    digest of the version written."""
    meta = strict(meta)
    with atomic_directory(path, overwrite=overwrite, expected_digest=expected_digest) as tmp:
        files = {}
        for group, arrays in groups.items():
            name = f"{group}.safetensors"
            fpath = os.path.join(tmp, name)
            save_file({k: _to_storable(v) for k, v in arrays.items()}, fpath)
            files[name] = sha256_file(fpath)
        text_files = {}
        for name, text in (texts or {}).items():
            if os.path.basename(name) != name or name.endswith(".safetensors") or name == MANIFEST:
                raise InputError(f"invalid artifact text file name {name!r}")
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
            text_files[name] = sha256_file(os.path.join(tmp, name))
        manifest = {
            "format": FORMAT,
            "kind": kind,
            "format_version": version,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            "meta": meta,
            "meta_sha256": _meta_digest(meta),
        }
        if text_files:
            manifest["texts"] = text_files
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            f.write(dumps(manifest, indent=1) + "\n")
        written = sha256_file(os.path.join(tmp, MANIFEST))
    return written


