"""Versioned on-disk artifacts: a directory of safetensors + JSON, written atomically, checksummed.

Layout of an artifact directory::

    manifest.json          {"format", "format_version", "kind", "created", "files": {name: sha256}, "meta": {...}}
    <group>.safetensors    named float/int arrays (one file per group)

No pickle anywhere.  A save writes a hidden sibling temporary directory
(``.<name>.<pid>.*.sdm-tmp``), fsyncs it and publishes it by one atomic exchange under
the artifact's lock (:mod:`sdm_mlx.writer`), so a crash (even ``kill -9``) mid-save leaves
the previous artifact intact and a reader sees one complete version, old or new
(temporaries of dead processes are removed by the next save).  What may be replaced: a missing path, an empty directory, or — only with
``overwrite`` — an sdm_mlx artifact; never a file, a foreign directory, the working
directory or a directory holding an input.  Files are 0644 and directories 0755
whatever the umask.  Loading verifies the format, version and every file's SHA-256
and raises :class:`ArtifactError` with the reason otherwise.

Run directories (``demo``, ``network-train``) hold several outputs; they are marked
with ``.sdm_mlx_run.json`` (:func:`prepare_run_directory`) and written into again only
with ``overwrite``; nothing else in them is touched.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from .errors import ArtifactError, InputError, OutputError
from .io import (
    DIR_MODE, FILE_MODE, describe_os_error, dumps, fsync_dir, make_dirs, refuse_inputs_inside,
    remove_stale_temporaries, strict,
)
from .writer import artifact_lock, exchange, owner_cannot_write

FORMAT = "sdm_mlx"
MANIFEST = "manifest.json"
#: (manifest file, format) of every kind of artifact directory sdm_mlx writes
ARTIFACT_MANIFESTS = ((MANIFEST, FORMAT), ("network_config.json", "sdm_mlx_network"))
#: marker file of a run directory (demo, network-train) that sdm_mlx created
RUN_MARKER = ".sdm_mlx_run.json"
_LEGACY_BACKUP_SUFFIX = ".previous"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _meta_digest(meta: dict) -> str:
    # allow_nan: artifacts written before strict JSON hold Infinity in their metadata
    return hashlib.sha256(json.dumps(meta, sort_keys=True, allow_nan=True).encode()).hexdigest()


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
# directory ownership: what may be replaced
# --------------------------------------------------------------------------------------------
def artifact_kind(path) -> str | None:
    """The format of the sdm_mlx artifact in directory ``path`` (``"sdm_mlx"``, ``"sdm_mlx_network"``) or None."""
    for name, fmt in ARTIFACT_MANIFESTS:
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("format") == fmt:
            return fmt
    return None


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


def _backup_path(real: str) -> str:
    parent, base = os.path.split(real)
    return os.path.join(parent, f".{base}.sdm-previous")


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
    published under :func:`~sdm_mlx.writer.artifact_lock` by one atomic exchange of directory entries
    (:mod:`sdm_mlx.writer`); the previous version is deleted after.  ``expected_digest``: the manifest
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


def manifest_digest(path) -> str | None:
    """SHA-256 of the artifact directory's manifest (identifies one saved version), or None."""
    try:
        return sha256_file(os.path.join(path, MANIFEST))
    except OSError:
        return None


def _check_unchanged(real: str, shown: str, expected_digest: str | None, error) -> None:
    if expected_digest is None or not os.path.isdir(real):
        return
    if manifest_digest(real) != expected_digest:
        raise error(f"{shown} was changed by another writer since this model was loaded (e.g. rows added by "
                    "add-support or a server's feedback); refusing to overwrite those changes — load it again, "
                    "apply the change and save (or use sdm_mlx.feedback.update_model, which does so under the lock)")


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


def recover_interrupted_save(path) -> str:
    """Absolute ``path``.  Nothing is renamed by a reader: a missing directory is never revived from a
    backup (the user may have moved it on purpose); see :func:`interrupted_save_hint`."""
    return os.path.abspath(os.fspath(path))


def interrupted_save_hint(path: str) -> str:
    """A sentence naming the previous version left by a save interrupted between two renames (file systems
    without an atomic exchange, or an older sdm_mlx), or ``""``."""
    real = os.path.realpath(path)
    for backup in (_backup_path(real), real + _LEGACY_BACKUP_SUFFIX):
        if os.path.isdir(backup) and artifact_kind(backup) is not None:
            return (f" (an interrupted update left the previous version at {backup}; rename it back to "
                    f"{path} to use it)")
    return ""


def prepare_run_directory(path, kind: str, overwrite: bool, inputs=(), flag: str = "--output",
                          check_only: bool = False) -> str:
    """Make ``path`` a run directory of ``kind`` (``"demo"``, ``"network-train"``); returns its real path.

    Allowed: a missing or empty directory (created 0755 and marked with ``.sdm_mlx_run.json``), or a
    directory marked as a run of the same kind when ``overwrite`` is set (its outputs are then replaced
    one by one, atomically; nothing else in it is touched).  Refused: the working directory or a parent
    of it, a directory holding an input, a foreign non-empty directory, an unmarked artifact, a file.
    ``check_only``: only the checks (before anything is read), nothing is created.
    """
    from .io import write_json

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

    ``meta`` must be strict JSON already (no NaN/Infinity: see :func:`sdm_mlx.io.put_float`).
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


def read_manifest(path, filename: str, fmt: str, version: int, what: str, error=ArtifactError) -> tuple[str, dict]:
    """(absolute path, parsed ``filename``) of an artifact directory whose JSON manifest has the given
    ``format`` and ``format_version``; ``error`` names the problem otherwise (missing, corrupt, wrong format
    or version).  Repairs a save interrupted between its two renames first."""
    path = recover_interrupted_save(path)
    if not os.path.isdir(path):
        raise error(f"no {what} at {path} (expected a directory with {filename}){interrupted_save_hint(path)}")
    mpath = os.path.join(path, filename)
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise error(f"{path} is not an sdm_mlx {what}: {filename} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{mpath} is corrupt: {e}") from None
    except OSError as e:
        raise error(f"cannot read {describe_os_error(e, mpath)}") from None
    return path, check_manifest(manifest, mpath, fmt, version, what, error)


def check_manifest(manifest, mpath: str, fmt: str, version: int, what: str, error=ArtifactError) -> dict:
    """``manifest`` if it is a JSON object of ``format`` ``fmt`` and ``format_version`` ``version``."""
    if not isinstance(manifest, dict):
        raise error(f"{mpath} is corrupt: expected a JSON object")
    if manifest.get("format") != fmt:
        raise error(f"{mpath} is not an sdm_mlx {what} (format {manifest.get('format')!r}, expected {fmt!r})")
    found = manifest.get("format_version")
    if isinstance(found, bool) or not isinstance(found, int):
        raise error(f"{mpath}: format_version must be the integer {version}, found {json.dumps(found)[:40]} "
                    f"(a {type(found).__name__}); the manifest was edited or written by another tool")
    if found != version:
        raise error(f"{mpath} has format version {found}; this sdm_mlx reads version {version}")
    return manifest


from .artifact_load import load_artifact  # noqa: E402  (re-exported; it reads what this module writes)
