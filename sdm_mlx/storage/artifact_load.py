"""Reading artifact directories (:mod:`sdm_mlx.storage.artifact` writes them): manifests, one pinned version, every file checked.

:func:`load_artifact` reads every file relative to one open directory (:class:`PinnedDirectory`), so a load never
mixes the manifest of one version with the files of another while a writer publishes a new one (by an atomic
exchange of directories, :func:`sdm_mlx.storage.artifact.atomic_directory`); a version deleted under the reader is read
again from the new one (:func:`read_consistently`).  A reader never renames anything: a missing directory is not
revived from a backup (the user may have moved it on purpose).
"""

from __future__ import annotations

import hashlib
import json
import os

from safetensors import SafetensorError
from safetensors.numpy import load_file

from ..errors import ArtifactError
from .files import describe_os_error

FORMAT = "sdm_mlx"
MANIFEST = "manifest.json"
#: (manifest file, format) of every kind of artifact directory sdm_mlx writes
ARTIFACT_MANIFESTS = ((MANIFEST, FORMAT), ("network_config.json", "sdm_mlx_network"))
_LEGACY_BACKUP_SUFFIX = ".previous"
#: times a reader starts again when the version it was reading was replaced under it
READ_ATTEMPTS = 20


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _meta_digest(meta: dict) -> str:
    # allow_nan: artifacts written before strict JSON hold Infinity in their metadata
    return hashlib.sha256(json.dumps(meta, sort_keys=True, allow_nan=True).encode()).hexdigest()


def manifest_digest(path) -> str | None:
    """SHA-256 of the artifact directory's manifest (identifies one saved version), or None."""
    try:
        return sha256_file(os.path.join(path, MANIFEST))
    except OSError:
        return None


def _valid_manifest(path: str) -> bool:
    """True when ``path`` holds a manifest whose metadata checksum holds (a version some writer published)."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        return manifest.get("meta_sha256") == _meta_digest(manifest.get("meta", {}))
    except (OSError, ValueError, AttributeError, TypeError):
        return False


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


def has_kind(path, kind: str, version: int, what: str) -> bool:
    """True when ``path`` holds a readable sdm_mlx artifact of ``kind`` (its manifest says so), e.g. a training
    checkpoint or a network-train state; anything else (missing, foreign, unreadable) is False."""
    try:
        _, manifest = read_manifest(path, MANIFEST, "sdm_mlx", version, what)
    except (ArtifactError, OSError):
        return False
    return manifest.get("kind") == kind


def _backup_path(real: str) -> str:
    parent, base = os.path.split(real)
    return os.path.join(parent, f".{base}.sdm-previous")


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


def read_manifest(path, filename: str, fmt: str, version: int, what: str, error=ArtifactError) -> tuple[str, dict]:
    """(absolute path, parsed ``filename``) of an artifact directory whose JSON manifest has the given
    ``format`` and ``format_version``; ``error`` names the problem otherwise (missing, corrupt, wrong format
    or version).  Repairs a save interrupted between its two renames first."""
    given = os.fspath(path)
    path = recover_interrupted_save(path)
    if not os.path.isdir(path):
        raise error(f"no {what} at {path} (expected a directory with {filename}){interrupted_save_hint(path)}"
                    + _hint(given, what))
    mpath = os.path.join(path, filename)
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise error(f"{path} is not an sdm_mlx {what}: {filename} is missing" + _hint(given, what)) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{mpath} is corrupt: {e}") from None
    except OSError as e:
        raise error(f"cannot read {describe_os_error(e, mpath)}") from None
    return path, check_manifest(manifest, mpath, fmt, version, what, error)


#: the model kind (sdm_mlx.storage.path_hints) a reader of ``what`` wants
_WANTED = {"model artifact": "estimator", "SDM network": "network"}


def _hint(path: str, what: str) -> str:
    """``"; <what the path is and what was probably meant>"`` for a model path of the wrong kind, or ``""``."""
    from .path_hints import wrong_kind_hint

    wanted = _WANTED.get(what)
    hint = wrong_kind_hint(path, wanted) if wanted else ""
    return f"; {hint}" if hint else ""


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


def load_artifact(path, kind: str, version: int, texts: dict | None = None,
                  info: dict | None = None) -> tuple[dict[str, dict], dict]:
    """Load and verify an artifact: returns ({group: {name: np.ndarray}}, meta).

    Every file is read from one version of the directory (:class:`PinnedDirectory`; a
    version replaced by a writer while being read is read again from the new one) and checked against
    the manifest read from that same version.  The checksummed text files (see :func:`save_artifact`)
    are verified too and, when a dict ``texts`` is given, put into it ({name: text}).  ``info``
    (a dict) receives ``manifest_digest``, the identity of the version read."""
    shown = os.fspath(path)
    path, _ = read_manifest(path, MANIFEST, FORMAT, version, "model artifact")  # clear errors first
    got_texts, got_info = {}, {}
    try:
        groups, meta = read_consistently(path, lambda pinned: _read_version(pinned, kind, version,
                                                                               got_texts, got_info))
    except OSError as e:
        raise ArtifactError(f"cannot read {describe_os_error(e, shown)}") from None
    if texts is not None:
        texts.update(got_texts)
    if info is not None:
        info.update(got_info)
    return groups, meta


def _read_version(pinned, kind: str, version: int, texts: dict, info: dict) -> tuple[dict, dict]:
    """(groups, meta) of the pinned version; its text files into ``texts``, its manifest digest into ``info``."""
    path, mpath = pinned.path, os.path.join(pinned.path, MANIFEST)
    try:
        with pinned.open(MANIFEST) as f:
            raw = f.read()
        manifest = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path} is not an sdm_mlx model artifact: {MANIFEST} is missing") from None
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{mpath} is corrupt: {e}") from None
    check_manifest(manifest, mpath, FORMAT, version, "model artifact")
    info["manifest_digest"] = hashlib.sha256(raw).hexdigest()
    if manifest.get("kind") != kind:
        raise ArtifactError(f"{path} holds a {manifest.get('kind')!r} artifact, expected {kind!r}")
    meta = manifest.get("meta", {})
    if manifest.get("meta_sha256") != _meta_digest(meta):
        raise ArtifactError(f"{mpath}: checksum mismatch for the metadata (the manifest was modified)")
    groups = {}
    for name, digest in (manifest.get("files") or {}).items():
        groups[name[: -len(".safetensors")]] = _read_member(pinned, name, digest, as_text=False)
    for name, digest in (manifest.get("texts") or {}).items():
        texts[name] = _read_member(pinned, name, digest, as_text=True)
    return groups, meta


def _read_member(pinned, name: str, digest: str, as_text: bool):
    """A checksummed file of the pinned version: its arrays (safetensors) or its text."""
    path = pinned.path
    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
        raise ArtifactError(f"{path}: invalid file name {name!r} in the manifest")
    try:
        f = pinned.open(name)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: file {name} is missing") from None
    with f:
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        if h.hexdigest() != digest:
            raise ArtifactError(f"{path}: checksum mismatch for {name} (the file is corrupt or was modified)")
        try:
            if as_text:
                f.seek(0)
                return f.read().decode("utf-8")
            return _load_safetensors(f)
        except (SafetensorError, OSError, ValueError) as e:
            raise ArtifactError(f"{path}: cannot read {name}: {e}") from None


def _load_safetensors(f) -> dict:
    """The arrays of an open safetensors file (memory-mapped through its descriptor where possible)."""
    fd_path = f"/dev/fd/{f.fileno()}"
    if os.path.exists(fd_path):
        return load_file(fd_path)
    from safetensors.numpy import load

    f.seek(0)
    return load(f.read())
