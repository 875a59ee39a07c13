"""Versioned on-disk artifacts: a directory of safetensors + JSON, written atomically, checksummed.

Layout of an artifact directory::

    manifest.json          {"format", "format_version", "kind", "created", "files": {name: sha256}, "meta": {...}}
    <group>.safetensors    named float/int arrays (one file per group)

No pickle anywhere.  A save writes a hidden sibling temporary directory
(``.<name>.<pid>.*.sdm-tmp``), fsyncs it and swaps it into place, so a crash (even
``kill -9``) mid-save leaves the previous artifact intact (an interrupted swap is
repaired on the next load; temporaries of dead processes are removed by the next
save).  What may be replaced: a missing path, an empty directory, or — only with
``overwrite`` — an sdm_mlx artifact; never a file, a foreign directory, the working
directory or a directory holding an input.  Files are 0644 and directories 0755
whatever the umask.  Loading verifies the format, version and every file's SHA-256
and raises :class:`ArtifactError` with the reason otherwise.

Run directories (``demo``, ``network-train``) hold several outputs; they are marked
with ``.sdm_mlx_run.json`` (:func:`prepare_run_directory`) and written into again only
with ``overwrite``; nothing else in them is touched.
"""

from __future__ import annotations

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

from ..errors import ArtifactError, InputError, OutputError
from .files import (
    DIR_MODE, FILE_MODE, describe_os_error, dumps, fsync_dir, make_dirs, refuse_inputs_inside,
    remove_stale_temporaries, strict,
)

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
def atomic_directory(path, error=ArtifactError, overwrite: bool = False):
    """``with atomic_directory(path) as tmp:`` write into ``tmp``; on success it replaces ``path``.

    ``path`` may be missing, an empty directory, or (only with ``overwrite``) an sdm_mlx artifact;
    anything else (a file, a non-empty foreign directory, the working directory) is refused with
    ``error`` before anything is written.  A symlink is followed (the artifact lands at its target).
    The new directory (0755, files 0644) is fsynced and swapped in with two renames (the old one
    is moved aside to a hidden name first and deleted last; an interrupted swap is repaired by
    :func:`recover_interrupted_save`); an exception leaves ``path`` untouched and removes ``tmp``.
    """
    shown = os.fspath(path)
    real = os.path.realpath(shown)
    try:
        refuse_inputs_inside("output directory", shown, [])
    except OutputError as e:
        raise error(str(e)) from None
    recover_interrupted_save(real)
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
        _check_replaceable(real, shown, overwrite, error)  # again: it may have changed while we wrote
        _swap_in(tmp, real)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise error(f"cannot write {describe_os_error(e, shown)}") from None
        raise
    fsync_dir(parent)


def _swap_in(tmp: str, real: str) -> None:
    backup = _backup_path(real)
    if os.path.isdir(real) and artifact_kind(real) is not None:
        shutil.rmtree(backup, ignore_errors=True)
        os.rename(real, backup)
        os.rename(tmp, real)
        shutil.rmtree(backup, ignore_errors=True)
    else:  # missing or an empty directory (rename(2) replaces an empty directory atomically)
        os.rename(tmp, real)


def recover_interrupted_save(path) -> str:
    """Absolute ``path``; restores the previous directory if a save died between its two renames."""
    path = os.path.abspath(os.fspath(path))
    real = os.path.realpath(path)
    if not os.path.exists(real):
        for backup in (_backup_path(real), real + _LEGACY_BACKUP_SUFFIX):
            if os.path.isdir(backup) and artifact_kind(backup) is not None:
                os.rename(backup, real)
                break
    return path


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


def save_artifact(path, kind: str, version: int, groups: dict[str, dict], meta: dict,
                  overwrite: bool = False, *, texts: dict[str, str] | None = None) -> None:
    """Write ``groups`` ({group: {name: array}}) and JSON ``meta`` to the directory ``path`` atomically.

    ``meta`` must be strict JSON already (no NaN/Infinity: see :func:`sdm_mlx.storage.files.put_float`).
    ``texts`` ({file name: UTF-8 text}, e.g. an update log) are written beside the arrays and
    checksummed in the manifest's ``texts``.
    An existing artifact at ``path`` is replaced only with ``overwrite``; see :func:`atomic_directory`."""
    meta = strict(meta)
    with atomic_directory(path, overwrite=overwrite) as tmp:
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


def read_manifest(path, filename: str, fmt: str, version: int, what: str, error=ArtifactError) -> tuple[str, dict]:
    """(absolute path, parsed ``filename``) of an artifact directory whose JSON manifest has the given
    ``format`` and ``format_version``; ``error`` names the problem otherwise (missing, corrupt, wrong format
    or version).  Repairs a save interrupted between its two renames first."""
    path = recover_interrupted_save(path)
    if not os.path.isdir(path):
        raise error(f"no {what} at {path} (expected a directory with {filename})")
    mpath = os.path.join(path, filename)
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise error(f"{path} is not an sdm_mlx {what}: {filename} is missing") from None
    except json.JSONDecodeError as e:
        raise error(f"{mpath} is corrupt: {e}") from None
    if not isinstance(manifest, dict):
        raise error(f"{mpath} is corrupt: expected a JSON object")
    if manifest.get("format") != fmt:
        raise error(f"{mpath} is not an sdm_mlx {what} (format {manifest.get('format')!r}, expected {fmt!r})")
    if manifest.get("format_version") != version:
        raise error(f"{mpath} has format version {manifest.get('format_version')}; this sdm_mlx reads version {version}")
    return path, manifest


def load_artifact(path, kind: str, version: int, texts: dict | None = None) -> tuple[dict[str, dict], dict]:
    """Load and verify an artifact: returns ({group: {name: np.ndarray}}, meta).

    The checksummed text files (see :func:`save_artifact`) are verified too and, when a dict
    ``texts`` is given, put into it ({name: text})."""
    path, manifest = read_manifest(path, MANIFEST, FORMAT, version, "model artifact")
    mpath = os.path.join(path, MANIFEST)
    if manifest.get("kind") != kind:
        raise ArtifactError(f"{path} holds a {manifest.get('kind')!r} artifact, expected {kind!r}")
    meta = manifest.get("meta", {})
    if manifest.get("meta_sha256") != _meta_digest(meta):
        raise ArtifactError(f"{mpath}: checksum mismatch for the metadata (the manifest was modified)")
    groups = {}
    for name, digest in manifest.get("files", {}).items():
        fpath = os.path.join(path, name)
        if not os.path.exists(fpath):
            raise ArtifactError(f"{path}: file {name} is missing")
        if sha256_file(fpath) != digest:
            raise ArtifactError(f"{path}: checksum mismatch for {name} (the file is corrupt or was modified)")
        try:
            loaded = load_file(fpath)
        except (SafetensorError, OSError, ValueError) as e:
            raise ArtifactError(f"{path}: cannot read {name}: {e}") from None
        groups[name[: -len(".safetensors")]] = loaded
    for name, digest in (manifest.get("texts") or {}).items():
        fpath = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(fpath):
            raise ArtifactError(f"{path}: file {name} is missing")
        if sha256_file(fpath) != digest:
            raise ArtifactError(f"{path}: checksum mismatch for {name} (the file is corrupt or was modified)")
        if texts is not None:
            try:
                with open(fpath, encoding="utf-8") as f:
                    texts[name] = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ArtifactError(f"{path}: cannot read {name}: {e}") from None
    return groups, meta
