"""Reading artifact directories written by :mod:`sdm_mlx.artifact`: one version, every file checked.

Every file is read relative to one open directory (:class:`~sdm_mlx.writer.PinnedDirectory`), so a
load never mixes the manifest of one version with the files of another while a writer publishes a
new one; a version deleted under the reader is read again from the new one.
"""

from __future__ import annotations

import hashlib
import json
import os

from safetensors import SafetensorError
from safetensors.numpy import load_file

from .artifact import FORMAT, MANIFEST, _meta_digest, check_manifest, read_manifest
from .errors import ArtifactError
from .io import describe_os_error
from .writer import read_consistently


def load_artifact(path, kind: str, version: int, texts: dict | None = None,
                  info: dict | None = None) -> tuple[dict[str, dict], dict]:
    """Load and verify an artifact: returns ({group: {name: np.ndarray}}, meta).

    Every file is read from one version of the directory (:class:`~sdm_mlx.writer.PinnedDirectory`; a
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
