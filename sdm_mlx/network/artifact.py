"""SDM-network artifacts: the positive head, its JSON config and the verification layer.

Layout of a network directory::

    network_config.json         format, version, base model path/id, |V|, D, tied,
                                head file + SHA-256, verifier subdirectory, training
                                epoch / calibration count, generation settings
    positive_head.safetensors   {"W_pos": float32 [|V|, D]}
    verifier/                   the verification layer (SDMEstimator.save)

Saving writes a sibling temporary directory, fsyncs it and swaps it into place
(the previous directory is renamed aside first and removed last), so a crash
never leaves a half-written network.  Loading attaches ``W_pos`` to a freshly
``mlx_lm.load``-ed base model (or to a model you pass) and checks the shapes,
the head checksum and the format version, with errors that say what is wrong.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import warnings
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..storage.artifact import atomic_directory, read_manifest, sha256_file
from ..errors import ArtifactError, InputError
from ..storage.files import dumps, write_json
from ..llm.model import model_dims
from .heads import HeadShapeError, SDMHeads

FORMAT = "sdm_mlx_network"
FORMAT_VERSION = 1
CONFIG_FILE = "network_config.json"
HEAD_FILE = "positive_head.safetensors"
HEAD_KEY = "W_pos"
VERIFIER_DIR = "verifier"


class NetworkArtifactError(ArtifactError):
    """A missing, corrupt or incompatible SDM-network artifact."""


def base_model_reference(path_or_id: str) -> str:
    """An existing local directory as an absolute path; anything else (a hub id) unchanged."""
    expanded = os.path.expanduser(str(path_or_id))
    return os.path.abspath(expanded) if os.path.exists(expanded) else str(path_or_id)


def base_model_entry(path_or_id: str, artifact_dir: str) -> dict:
    """How a network config stores its base model: a hub id as given; a local directory relative to the
    artifact directory (so a run directory moved together with its model still works), plus the absolute
    path at save time as a fallback."""
    expanded = os.path.expanduser(str(path_or_id))
    if not os.path.exists(expanded):
        return {"base_model": str(path_or_id), "base_model_kind": "hub"}
    absolute = os.path.realpath(expanded)
    return {"base_model": os.path.relpath(absolute, os.path.realpath(artifact_dir)), "base_model_kind": "local",
            "base_model_absolute": absolute}


def resolve_base_model(config: dict, artifact_dir: str) -> str:
    """The base model to load for a stored config (see :func:`base_model_entry`; older configs hold an
    absolute path or a hub id)."""
    stored = str(config["base_model"])
    if config.get("base_model_kind") != "local":
        return stored
    candidates = [stored if os.path.isabs(stored) else os.path.normpath(os.path.join(artifact_dir, stored))]
    if config.get("base_model_absolute"):
        candidates.append(str(config["base_model_absolute"]))
    for c in candidates:
        if os.path.exists(c):
            return c
    raise NetworkArtifactError(
        f"{artifact_dir}: the base model {stored!r} (relative to the network directory) is missing; looked at "
        f"{', '.join(candidates)} (move the model together with the run directory, or pass the model explicitly)"
    )


def save_network(path, heads: SDMHeads, base_model: str, verifier, settings: dict | None = None,
                 training: dict | None = None, *, overwrite: bool = False) -> str:
    """Write the network directory ``path`` atomically; returns its absolute path.

    ``verifier``: a fitted ``SDMEstimator`` (saved with its ``save``) or the path
    of an already saved one (copied).  ``settings``: generation/prompt settings
    stored for reuse (delimiter, system, prompt template, completions, ...);
    ``training``: epoch, calibration count, etc.  An existing network at ``path`` is replaced only with
    ``overwrite``; anything else there is refused (see :func:`sdm_mlx.storage.artifact.atomic_directory`).
    """
    shown = path
    path = os.path.abspath(os.fspath(path))
    with atomic_directory(shown, NetworkArtifactError, overwrite=overwrite) as tmp:
        head_path = os.path.join(tmp, HEAD_FILE)
        mx.save_safetensors(head_path, {HEAD_KEY: heads.pos.weight.astype(mx.float32)}, metadata={"format": "mlx"})
        vdir = os.path.join(tmp, VERIFIER_DIR)
        if isinstance(verifier, (str, os.PathLike)):
            shutil.copytree(os.fspath(verifier), vdir)
        else:
            verifier.save(vdir)
        config = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **base_model_entry(base_model, os.path.realpath(path)),
            "vocab_size": int(heads.vocab_size),
            "hidden_size": int(heads.hidden_size),
            "tied_embeddings": bool(heads.tied),
            "head_file": HEAD_FILE,
            "head_key": HEAD_KEY,
            "head_dtype": "float32",
            "head_sha256": sha256_file(head_path),
            "verifier": VERIFIER_DIR,
            "settings": settings or {},
            "training": training or {},
        }
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(dumps(config, indent=1) + "\n")
    return path


def mark_network_finished(path, epochs_completed: int) -> None:
    """Record in ``network_config.json`` that training finished (the head is the final selection).

    Only the small JSON file is rewritten (atomically, by :func:`sdm_mlx.storage.files.write_json`); the head and the
    verifier are untouched.
    """
    path = os.path.abspath(os.fspath(path))
    config = read_network_config(path)
    config.setdefault("training", {}).update(finished=True, epochs_completed=int(epochs_completed))
    write_json(os.path.join(path, CONFIG_FILE), config)


def training_status(config: dict) -> str | None:
    """A warning text when the network comes from an unfinished (interrupted) training, else None."""
    t = config.get("training", {})
    if t.get("finished", True):
        return None
    held = "the untrained base head" if int(t.get("epoch", 0)) == 0 else f"the head of epoch {t.get('epoch')}"
    return (f"this network's training did not finish ({t.get('epochs_completed', '?')} of "
            f"{t.get('epochs_planned', '?')} epochs completed): it holds {held}")


def read_network_config(path) -> dict:
    """The validated ``network_config.json`` of a network directory; ``base_model`` is resolved to the
    model to load (the stored value is kept as ``base_model_stored``)."""
    path, config = read_manifest(path, CONFIG_FILE, FORMAT, FORMAT_VERSION, "SDM network", NetworkArtifactError)
    cpath = os.path.join(path, CONFIG_FILE)
    for key in ("base_model", "vocab_size", "hidden_size", "head_file", "verifier"):
        if key not in config:
            raise NetworkArtifactError(f"{cpath} lacks the key {key!r}")
    config["base_model_stored"] = config["base_model"]
    config["base_model"] = resolve_base_model(config, os.path.realpath(path))
    return config


def load_head_weight(path, config: dict | None = None) -> np.ndarray:
    """W_pos of a network directory as float32 NumPy ``[|V|, D]`` (checksum and stored shape verified)."""
    path = os.path.abspath(os.fspath(path))
    config = config or read_network_config(path)
    hpath = os.path.join(path, config["head_file"])
    if not os.path.exists(hpath):
        raise NetworkArtifactError(f"{path}: head file {config['head_file']} is missing")
    if config.get("head_sha256") and sha256_file(hpath) != config["head_sha256"]:
        raise NetworkArtifactError(f"{path}: checksum mismatch for {config['head_file']} (corrupt or modified)")
    try:
        arrays = mx.load(hpath)
    except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file
        raise NetworkArtifactError(f"{path}: cannot read {config['head_file']}: {e}") from None
    key = config.get("head_key", HEAD_KEY)
    if key not in arrays:
        raise NetworkArtifactError(f"{path}: {config['head_file']} has no array {key!r} (found {sorted(arrays)})")
    w = np.array(arrays[key].astype(mx.float32))
    expected = (int(config["vocab_size"]), int(config["hidden_size"]))
    if w.shape != expected:
        raise NetworkArtifactError(f"{path}: W_pos has shape {w.shape}, the config says {expected}")
    return w


@dataclass
class SDMNetwork:
    """A loaded SDM network: frozen base model + positive head, tokenizer, verification layer, settings."""

    heads: SDMHeads
    tokenizer: object
    verifier: object | None
    config: dict = field(default_factory=dict)
    path: str | None = None

    @property
    def model(self):
        return self.heads.model

    @property
    def settings(self) -> dict:
        return self.config.get("settings", {})

    def generate(self, prompts, **kwargs):
        """Greedy joint decoding (:func:`sdm_mlx.network.generation.greedy_generate`) with the stored settings as
        defaults; ``kwargs``: the fields of :class:`~sdm_mlx.network.generation.DecodeSettings` and
        ``greedy_generate``'s keywords."""
        from dataclasses import fields

        from .generation import DecodeSettings, greedy_generate

        s = self.settings
        knobs = {key: s[key] for key in ("delimiter", "max_new_tokens", "max_length") if key in s}
        knobs.update({f.name: kwargs.pop(f.name) for f in fields(DecodeSettings) if f.name in kwargs})
        return greedy_generate(self.heads, self.tokenizer, prompts, DecodeSettings(**knobs), **kwargs)


def load_network(path, model=None, tokenizer=None, load_verifier: bool = True) -> SDMNetwork:
    """Load a network directory: W_pos attached to ``model`` (default: ``mlx_lm.load`` of the stored base model).

    Raises :class:`NetworkArtifactError` for a bad directory and
    :class:`~sdm_mlx.network.heads.HeadShapeError` when the head does not fit the
    base model (different vocabulary or hidden size).
    """
    path = os.path.abspath(os.fspath(path))
    config = read_network_config(path)
    status = training_status(config)
    if status is not None:
        warnings.warn(f"{path}: {status}", RuntimeWarning, stacklevel=2)
    w = load_head_weight(path, config)
    if model is None:
        from ..llm.embed import load_model

        model, loaded_tok = load_model(config["base_model"])
        tokenizer = tokenizer or loaded_tok
    if tokenizer is None:
        raise InputError("pass the tokenizer together with the model")
    vocab, hidden = model_dims(model)
    if (vocab, hidden) != w.shape:
        raise HeadShapeError(
            f"{path}: the positive head is [{w.shape[0]}, {w.shape[1]}] (vocabulary x hidden) but the base model "
            f"{config['base_model']!r} has an LM head of [{vocab}, {hidden}]: wrong base model for this network"
        )
    heads = SDMHeads(model, mx.array(w), reference_head=config.get("settings", {}).get("reference_head", "model"))
    verifier = None
    if load_verifier:
        from ..estimator import SDMEstimator

        vdir = os.path.join(path, config["verifier"])
        if not os.path.isdir(vdir):
            raise NetworkArtifactError(f"{path}: verification layer directory {config['verifier']!r} is missing")
        verifier = SDMEstimator.load(vdir)
    return SDMNetwork(heads=heads, tokenizer=tokenizer, verifier=verifier, config=config, path=path)
