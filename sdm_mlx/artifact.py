"""Versioned on-disk artifacts: a directory of safetensors + JSON, written atomically, checksummed.

Layout of an artifact directory::

    manifest.json          {"format", "format_version", "kind", "created", "files": {name: sha256}, "meta": {...}}
    <group>.safetensors    named float/int arrays (one file per group)

No pickle anywhere.  A save writes a sibling temporary directory, fsyncs it and
swaps it into place, so a crash mid-save leaves the previous artifact intact
(an interrupted swap is repaired on the next load).  Loading verifies the
format, version and every file's SHA-256 and raises :class:`ArtifactError`
with the reason otherwise.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
from contextlib import contextmanager

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

FORMAT = "sdm_mlx"
MANIFEST = "manifest.json"
_BACKUP_SUFFIX = ".previous"


class ArtifactError(ValueError):
    """A missing, corrupt, tampered or incompatible artifact."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _meta_digest(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True, allow_nan=True).encode()).hexdigest()


def _fsync_dir(path: str) -> None:
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


@contextmanager
def atomic_directory(path, error=ArtifactError):
    """``with atomic_directory(path) as tmp:`` write into ``tmp``; on success it replaces ``path``.

    The new directory is fsynced and swapped in with two renames (the old one is moved aside
    first and deleted last); an exception leaves ``path`` untouched and removes ``tmp``.
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(path) and not os.path.isdir(path):
        raise error(f"{path} exists and is not a directory")
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    backup = path + _BACKUP_SUFFIX
    if os.path.exists(path):
        shutil.rmtree(backup, ignore_errors=True)
        os.rename(path, backup)
    os.rename(tmp, path)
    _fsync_dir(parent)
    shutil.rmtree(backup, ignore_errors=True)


def recover_interrupted_save(path) -> str:
    """Absolute ``path``; restores the previous directory if a save died between its two renames."""
    path = os.path.abspath(os.fspath(path))
    backup = path + _BACKUP_SUFFIX
    if not os.path.exists(path) and os.path.isdir(backup):
        os.rename(backup, path)
    return path


def save_artifact(path, kind: str, version: int, groups: dict[str, dict], meta: dict) -> None:
    """Write ``groups`` ({group: {name: array}}) and JSON ``meta`` to the directory ``path`` atomically."""
    with atomic_directory(path) as tmp:
        files = {}
        for group, arrays in groups.items():
            name = f"{group}.safetensors"
            fpath = os.path.join(tmp, name)
            save_file({k: _to_storable(v) for k, v in arrays.items()}, fpath)
            files[name] = sha256_file(fpath)
        manifest = {
            "format": FORMAT,
            "kind": kind,
            "format_version": version,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            "meta": meta,
            "meta_sha256": _meta_digest(meta),
        }
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())


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


def load_artifact(path, kind: str, version: int) -> tuple[dict[str, dict], dict]:
    """Load and verify an artifact: returns ({group: {name: np.ndarray}}, meta)."""
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
    return groups, meta
