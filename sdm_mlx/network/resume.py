"""Resuming ``network-train`` (Alg. 4, ``alg:sdm-network-training``) after its last finished epoch.

After the verification layer is fitted, after every epoch's W_pos training and again after its calibration
count (improving or not), rank 0 writes ``<output>/resume/``, one artifact directory (kind
``sdm_network_resume``, replaced atomically by :func:`sdm_mlx.storage.artifact.save_artifact`, so a
``kill -9`` leaves the previous state or the new one) holding everything the next epoch reads:

* the settings fingerprint (:func:`settings_fingerprint`): every setting that shapes the result, the
  SHA-256 of every data file, the base model's files and the number of data-parallel ranks;
* the fixed split of Alg. 4 — the training, calibration and y = 1 training rows — and the
  SHA-256 of the saved verification layer (``<output>/verifier/`` is loaded instead of fitted again);
* the current W_pos (not only the kept one), the Adam state with its step count, the token
  shuffle generator's state, the best count, the selected epoch and the metrics so far; between an
  epoch's training and its count, the metrics also hold that epoch's row (:data:`TRAINED_EPOCH`), so a
  run stopped during the count (a decoding pass of the calibration split, hours of a real model on a
  CPU) resumes with the count, not with the epoch's training;
* in the middle of an epoch's W_pos training, every ``checkpoint_minutes`` (:data:`PARTIAL_EPOCH`): the
  mini-batches done, so a run stopped there runs only the rest of that epoch, in the same token order and with
  the epoch's q, d as they were computed before its first step.

Running the same command again continues from that state and ends with the result of an
uninterrupted run (the per-epoch q, d are generated from the restored W_pos; nothing else carries
over).  The state stays after the run finishes, so raising ``--epochs`` trains on from the last
epoch; deleting ``resume/`` frees its space (about three times W_pos) and only loses that.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import ArtifactError, OutputError
from ..runtime.callbacks import log
from ..storage.artifact import load_artifact, read_manifest, save_artifact
from ..storage.artifact_load import has_kind, manifest_digest, sha256_file
from ..storage.files import is_stream, strict, write_json
from .artifact import CONFIG_FILE, NetworkArtifactError, base_model_reference
from .artifact import FORMAT as NETWORK_FORMAT
from .artifact import FORMAT_VERSION as NETWORK_FORMAT_VERSION

KIND = "sdm_network_resume"
VERSION = 1
RESUME_DIR = "resume"
#: the metrics key of an epoch whose W_pos is trained and saved and whose calibration count is still to come
TRAINED_EPOCH = "trained_epoch"
#: the metrics key of an epoch saved in the middle of its W_pos training (``checkpoint_minutes``): the mini-batches
#: done, their loss sums and seconds, the shuffle generator's state before the epoch's draw, and the epoch's q, d
PARTIAL_EPOCH = "partial_epoch"
ROWS_FILE = "rows.json"
#: settings that do not change what the epochs compute (``epochs`` is compared on its own; a state is written
#: only after the admission check of ``require_admission`` passed; the host and MLX steps compute the same
#: update up to float rounding, and the state holds plain W_pos and Adam arrays either way; the batched
#: engine decodes and embeds a row the same whatever else is in its batch, tests/decoding; the base decodings
#: are the base head's own, checked against it: :mod:`.base_decodings`)
_NOT_COMPARED = ("output_dir", "epochs", "overwrite", "restart", "verbose", "distributed_timeout", "require_admission",
                 "train_step", "generation_batch_size", "embed_batch_size", "base_decodings", "checkpoint_minutes")
#: model files up to this size are compared by SHA-256, larger ones (the weights) by size
_HASHED_MODEL_FILE = 32 << 20


class ResumeMismatchError(OutputError):
    """``--output`` holds a network-train state written with other settings or inputs."""


@dataclass
class ResumeState:
    """What continuing a network-train run needs (see the module docstring)."""

    fingerprint: dict
    epochs_completed: int | None  #: None: the verifier is fitted, the initial count is not taken yet
    best: int = 0
    selected: int = 0
    metrics: dict = field(default_factory=dict)
    rng_state: dict | None = None
    rows: dict = field(default_factory=dict)  #: {"train", "calibration", "positive"}: lists of rows
    verifier_digest: str | None = None
    answer_stats: dict | None = None
    head: object = None  #: W_pos [|V|, D] (mx or NumPy); None before the initial count
    optimizer: dict | None = None  #: the Adam state, flattened ({"pos.weight.m": array, "step": ...})


# ---------------------------------------------------------------------------------------------
# the fingerprint
# ---------------------------------------------------------------------------------------------
def _file_digest(path) -> dict:
    """A data file's SHA-256 (a stream, e.g. ``-``, cannot be read twice: only its name)."""
    p = os.path.expanduser(str(path))
    if is_stream(p) or not os.path.isfile(p):
        return {"stream": str(path)}
    try:
        return {"sha256": sha256_file(p)}
    except OSError:  # reading it fails later with the reader's own error
        return {"unreadable": str(path)}


def model_fingerprint(model: str) -> dict:
    """The base model: a hub id as given; a local directory by its files (small ones by SHA-256, the
    weights by size — hashing gigabytes on every start would cost more than it protects)."""
    ref = base_model_reference(model)
    if not os.path.isdir(ref):
        return {"model": ref}
    files = {}
    for name in sorted(os.listdir(ref)):
        p = os.path.join(ref, name)
        if os.path.isfile(p):
            size = os.path.getsize(p)
            try:
                files[name] = sha256_file(p) if size <= _HASHED_MODEL_FILE else f"{size} bytes"
            except OSError:
                files[name] = "unreadable"
    return {"model": ref, "model_files": files}


def settings_fingerprint(config, ranks: int) -> dict:
    """Every setting and input that shapes a network-train result (see :data:`_NOT_COMPARED` for the rest)."""
    s = {k: v for k, v in strict(config).items() if k not in _NOT_COMPARED}
    for key in ("data", "verification_data"):
        if s.get(key) is not None:
            s[key] = _file_digest(s[key])
    if s.get("tasks"):
        s["tasks"] = [{**t, "data": _file_digest(t["data"])} if isinstance(t, dict) and t.get("data") else t
                      for t in s["tasks"]]
    if s.get("verifier"):
        s["verifier"] = {"manifest_sha256": manifest_digest(os.path.expanduser(s["verifier"]))}
    s.update(model_fingerprint(config.model))
    s["ranks"] = int(ranks)
    return s


def _shown(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 40 else text[:37] + "..."


def fingerprint_differences(saved: dict, current: dict) -> list[str]:
    """What differs between two fingerprints, in words (``learning_rate 0.01 -> 0.001``, ``--data's contents``)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if a == b or key in _NOT_COMPARED:  # a state written when it was still compared
            continue
        if key in ("data", "verification_data", "tasks"):
            out.append(f"the contents of --{key.replace('_', '-')}")
        elif key == "model_files":
            out.append("the base model's files")
        elif key == "ranks":
            out.append(f"the number of mlx.launch ranks {a} -> {b}")
        elif key == "verifier":
            out.append("the --verifier directory")
        else:
            out.append(f"{key} {_shown(a)} -> {_shown(b)}")
    return out


# ---------------------------------------------------------------------------------------------
# reading and writing the state
# ---------------------------------------------------------------------------------------------
def save_state(path, state: ResumeState) -> None:
    """Write ``state`` to ``path`` (atomically replacing the previous state)."""
    groups = {}
    if state.head is not None:
        groups["head"] = {"W_pos": state.head}
    if state.optimizer is not None:
        groups["optimizer"] = dict(state.optimizer)
    meta = {"fingerprint": state.fingerprint, "epochs_completed": state.epochs_completed, "best": state.best,
            "selected": state.selected, "metrics": state.metrics, "rng_state": state.rng_state,
            "verifier_digest": state.verifier_digest, "answer_stats": state.answer_stats}
    texts = {ROWS_FILE: json.dumps(strict(state.rows), ensure_ascii=False)}
    save_artifact(path, KIND, VERSION, groups, meta, overwrite=True, texts=texts)


def load_state(path) -> ResumeState | None:
    """The state at ``path``; None when there is none.  An unreadable one is an error naming the fix."""
    if not os.path.lexists(path):
        return None
    texts = {}
    try:
        groups, meta = load_artifact(path, KIND, VERSION, texts=texts)
        rows = json.loads(texts[ROWS_FILE])
        return ResumeState(
            fingerprint=meta["fingerprint"], epochs_completed=meta["epochs_completed"], best=int(meta["best"]),
            selected=int(meta["selected"]), metrics=meta["metrics"], rng_state=meta["rng_state"], rows=rows,
            verifier_digest=meta["verifier_digest"], answer_stats=meta.get("answer_stats"),
            head=groups.get("head", {}).get("W_pos"), optimizer=groups.get("optimizer"))
    except (ArtifactError, KeyError, TypeError, ValueError) as e:
        raise OutputError(f"the saved network-train state {path} is unreadable ({e}): pass --restart to start "
                          "over") from None


def is_state(path) -> bool:
    """True when ``path`` holds a network-train state (by its manifest kind)."""
    return has_kind(path, KIND, VERSION, "network-train state")


def discard_state(path) -> None:
    """Delete the state at ``path`` (only if it is one)."""
    if is_state(path):
        shutil.rmtree(path)


def find_state(config, fingerprint, path: str, verbose: bool = True) -> ResumeState | None:
    """The state to continue from, or None to start over (``fingerprint()`` gives the current run's).

    ``restart``: None.  Another fingerprint: :class:`ResumeMismatchError` (exit 2, naming ``--restart``), or
    with ``overwrite`` None (the log says why).  Fewer ``epochs`` than it finished: an error as well.
    """
    if config.restart or not is_state(path):
        return None
    state = load_state(path)
    shown = f"--output {config.output_dir}"
    diffs = fingerprint_differences(state.fingerprint, fingerprint())
    if diffs and config.overwrite:
        log(f"network-train: {shown} holds a run with different settings ({'; '.join(diffs)}); --overwrite: "
            "starting over", verbose)
        return None
    if diffs:
        raise ResumeMismatchError(f"{shown} holds a network-train run with different settings ({'; '.join(diffs)})"
                                  ": pass --restart to start over, or use another --output")
    done = state.epochs_completed or 0
    if done > config.epochs:
        raise ResumeMismatchError(f"{shown} holds a network-train run that already finished {done} epochs, more "
                                  f"than --epochs {config.epochs}: pass --epochs {done} or more to keep it, "
                                  "--restart to start over, or use another --output")
    return state


# ---------------------------------------------------------------------------------------------
# the training state: Adam and the shuffle generator
# ---------------------------------------------------------------------------------------------
def optimizer_arrays(optimizer) -> dict:
    """The Adam state flattened to ``{"step": ..., "learning_rate": ..., "pos.weight.m": ..., ...}``."""
    return dict(tree_flatten(optimizer.state))


def take_arrays(state: ResumeState) -> tuple:
    """``(W_pos, Adam state)`` of ``state``, removed from it: once they are in the heads and the optimizer, the
    run does not keep a second copy for its whole length (2.8 GB for Qwen2.5-1.5B's 151,936 x 1,536 head)."""
    head, optimizer = state.head, state.optimizer
    state.head = state.optimizer = None
    return head, optimizer


def restore_optimizer(optimizer, arrays: dict) -> None:
    """Put a saved Adam state (:func:`optimizer_arrays`) into ``optimizer``: before its step is compiled."""
    optimizer.state = tree_unflatten([(k, mx.array(np.asarray(v))) for k, v in arrays.items()])


def reopen_network(path: str, epochs_planned: int) -> None:
    """Mark the network at ``path`` as not finished (``epochs_planned`` epochs now), if it says finished."""
    path, config = read_manifest(path, CONFIG_FILE, NETWORK_FORMAT, NETWORK_FORMAT_VERSION, "SDM network",
                                 NetworkArtifactError)
    training = config.setdefault("training", {})
    if training.get("finished"):
        training.update(finished=False, epochs_planned=int(epochs_planned))
        write_json(os.path.join(path, CONFIG_FILE), config)


def pending_note(metrics: dict, done: int) -> str:
    """What of epoch ``done + 1`` a run resumed from ``metrics`` does not run again (for its log line)."""
    if (metrics.get(TRAINED_EPOCH) or {}).get("epoch") == done + 1:
        return f"; epoch {done + 1}'s W_pos was trained before the stop, so only its calibration count runs"
    part = metrics.get(PARTIAL_EPOCH) or {}
    if part.get("epoch") == done + 1:
        return (f"; epoch {done + 1} was saved after {part['done']} mini-batches of its W_pos training, so it goes "
                "on from there")
    return ""


def restore_rng(rng: np.random.Generator, state: dict | None) -> None:
    if state is not None:
        rng.bit_generator.state = state


# ---------------------------------------------------------------------------------------------
# the trainer's side
# ---------------------------------------------------------------------------------------------
class Resumption:
    """The network-train state of one run directory: found (or not) when the trainer starts, written by
    rank 0 after the verifier fit and after every finished epoch, restored into the trainer on a resume.

    ``state``: the state to continue from (None: start over).  Every rank reads it (one file system).
    """

    def __init__(self, config, ranks: int, writer: bool, out: str):
        self.config, self.writer = config, writer
        self.path, self.ranks, self._fingerprint = os.path.join(out, RESUME_DIR), ranks, None
        self.state = find_state(config, lambda: self.fingerprint, self.path, verbose=writer)
        self.rows, self.verifier_digest, self.answer_stats = {}, None, None

    @property
    def fingerprint(self) -> dict:
        """The current run's :func:`settings_fingerprint` (computed when first needed)."""
        if self._fingerprint is None:
            self._fingerprint = settings_fingerprint(self.config, self.ranks)
        return self._fingerprint

    @property
    def stage(self) -> int:
        """-2: no state; -1: verifier fitted, no initial count yet; k >= 0: epochs finished (ranks compare it)."""
        if self.state is None:
            return -2
        return -1 if self.state.epochs_completed is None else int(self.state.epochs_completed)

    def record_split(self, train_rows, cal_rows, pos_rows, verifier_path: str, answer_stats=None) -> None:
        """Alg. 4's fixed split and the saved verification layer, kept in every state written from now on."""
        self.rows = {"train": list(train_rows), "calibration": list(cal_rows), "positive": list(pos_rows)}
        self.verifier_digest = manifest_digest(verifier_path) if self.writer else None
        self.answer_stats = answer_stats

    def load_split(self, verifier_path: str):
        """(verifier, train rows, calibration rows, y = 1 training rows) of the saved state: the verification
        layer is loaded from ``verifier_path`` (checked against the state), not fitted again."""
        state = self.state
        if manifest_digest(verifier_path) != state.verifier_digest:
            raise ResumeMismatchError(f"{verifier_path} is not the verification layer the saved network-train "
                                      "state was written with: pass --restart to start over")
        from ..estimator import SDMEstimator

        est = SDMEstimator.load(verifier_path)
        self.rows, self.verifier_digest, self.answer_stats = state.rows, state.verifier_digest, state.answer_stats
        return est, state.rows["train"], state.rows["calibration"], state.rows["positive"]

    def save(self, heads, rng, optimizer, *, epochs_completed, best: int = 0, selected: int = 0,
             metrics: dict | None = None) -> None:
        """Rank 0 writes the state (``optimizer`` None: the verifier stage, before the initial count)."""
        if not self.writer:
            return
        trained = optimizer is not None
        save_state(self.path, ResumeState(
            fingerprint=self.fingerprint, epochs_completed=epochs_completed, best=best, selected=selected,
            metrics=metrics or {}, rng_state=rng.bit_generator.state, rows=self.rows,
            verifier_digest=self.verifier_digest, answer_stats=self.answer_stats,
            head=heads.pos.weight if trained else None, optimizer=optimizer_arrays(optimizer) if trained else None))

    def epoch_order(self, heads, rng, optimizer, *, epoch: int, saved: dict, partial: dict | None):
        """The :class:`~.step.EpochOrder` of epoch ``epoch``: from its start (``partial`` None; ``rng``'s state is
        kept as the epoch's order) or after the mini-batches of ``partial`` (:data:`PARTIAL_EPOCH`, the shuffle
        generator set back to the epoch's start).  Its checkpoints save the state with that epoch's progress,
        ``saved`` holding the run's ``metrics``, ``best``, ``selected`` and the epoch's ``qd`` (q, d, seconds)."""
        from .step import EpochOrder

        if partial is not None:
            restore_rng(rng, partial["rng_state"])
        start = rng.bit_generator.state
        qd = saved["qd"]

        def checkpoint(done: int, sums: tuple, seconds: float) -> None:
            mark = {"epoch": epoch, "done": int(done), "sums": list(sums), "seconds": float(seconds),
                    "rng_state": start, "q": np.asarray(qd["q"], np.float32).tolist(),
                    "d": np.asarray(qd["d"], np.float32).tolist(), "qd_seconds": float(qd["seconds"])}
            self.save(heads, rng, optimizer, epochs_completed=epoch - 1, best=saved["best"],
                      selected=saved["selected"], metrics={**saved["metrics"], PARTIAL_EPOCH: mark})
            log(f"network-train: epoch {epoch}: saved after {done} mini-batches (a stopped run goes on from here)",
                self.writer and self.config.verbose)

        every = float(self.config.checkpoint_minutes) * 60.0
        done = {} if partial is None else {"done": int(partial["done"]), "sums": tuple(partial["sums"]),
                                           "seconds": float(partial["seconds"])}
        return EpochOrder(rng, **done, checkpoint=checkpoint if every > 0 else None, every_seconds=every)

    def restore(self, heads, rng, optimizer, network_path: str) -> tuple[dict, int, int, int]:
        """Put W_pos, the Adam state and the shuffle generator of the saved epoch back; returns (metrics, best
        count, selected epoch, epochs finished).  Call before the training step is compiled.  A network that a
        finished run marked finished is marked unfinished again (training goes on: ``--epochs`` was raised)."""
        state = self.state
        if self.writer:
            reopen_network(network_path, self.config.epochs)
        head, adam = take_arrays(state)
        heads.pos.weight = mx.array(np.asarray(head, dtype=np.float32))
        del head
        restore_optimizer(optimizer, adam)
        restore_rng(rng, state.rng_state)
        metrics = dict(state.metrics, config=strict(self.config))
        metrics["resumed_after_epochs"] = list(metrics.get("resumed_after_epochs", [])) + [state.epochs_completed]
        return metrics, state.best, state.selected, int(state.epochs_completed)
