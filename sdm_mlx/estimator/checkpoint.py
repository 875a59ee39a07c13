"""Resumable training: the finished rounds of Alg. 1 + calibration, saved after every round.

A checkpoint is an artifact directory (kind ``sdm_train_checkpoint``, written atomically by
:func:`sdm_mlx.storage.artifact.save_artifact`) holding, after round j of J:

* the fingerprint of the run: SHA-256 over the estimator settings that shape training and
  calibration and over the pooled data (features, labels, ids, C);
* the round bookkeeping of :class:`sdm_mlx.estimator.rounds.RoundsProgress` (rounds done, the re-split
  generator state, the per-round summaries, the best round so far with its model, support and
  calibration state);
* every finished round's :class:`sdm_mlx.calibration.RoundCalibration` (W'', Alg. 3 inputs, ...).

Continuing from it is bit-identical to an uninterrupted run with the same seed, because every
round draws from its own seed and the re-split generator state is restored exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..core.adaptor import ExemplarAdaptor
from ..storage.artifact import ArtifactError, load_artifact, pack_ragged, read_manifest, save_artifact, unpack_ragged
from ..storage.artifact_load import has_kind
from ..calibration import RoundCalibration
from ..runtime.callbacks import Callback
from ..calibration.rescaler import RescalerFit
from .rounds import RoundsProgress
from .training import RoundResult, SplitState
from ..errors import InputError

KIND = "sdm_train_checkpoint"
VERSION = 1
_STATE_FIELDS = ("z", "h", "y_hat", "q", "d0", "d", "sdm")
#: Estimator settings that do not change what training and calibration compute.
_IGNORED = ("verbose", "n_exemplars", "class_names")


def fingerprint(params: dict, X: np.ndarray, y: np.ndarray, ids: list, num_classes: int) -> str:
    """SHA-256 of the settings that shape training/calibration and of the pooled data."""
    h = hashlib.sha256()
    kept = {k: v for k, v in sorted(params.items()) if k not in _IGNORED}
    h.update(json.dumps(kept, sort_keys=True, default=str).encode())
    h.update(json.dumps([int(num_classes), list(X.shape)]).encode())
    h.update(np.ascontiguousarray(X, dtype=np.float32).tobytes())
    h.update(np.ascontiguousarray(y, dtype=np.int64).tobytes())
    h.update(json.dumps([str(i) for i in ids]).encode())
    return h.hexdigest()


def is_checkpoint(path) -> bool:
    """True when ``path`` holds an sdm_mlx training checkpoint (by its manifest kind)."""
    return has_kind(path, KIND, VERSION, "training checkpoint")


def check_checkpoint_path(path) -> None:
    """Refuse a checkpoint path that exists and is not ours (it would be replaced)."""
    if os.path.lexists(path) and not is_checkpoint(path):
        raise InputError(f"{path} exists and is not an sdm_mlx training checkpoint; move it away or choose "
                         "another --output")


def _result_groups(best: RoundResult) -> dict:
    groups = {
        "best_model": {k: np.array(v) for k, v in tree_flatten(best.model.parameters())},
        "best_index": {"train_idx": best.train_idx, "cal_idx": best.cal_idx},
        "best_ecdfs": {**pack_ragged("train", best.train_distance_ecdfs),
                       **pack_ragged("calibration", best.calibration_distance_ecdfs)},
    }
    for split in ("train", "calibration"):
        state = getattr(best, split)
        groups[f"best_{split}"] = {name: getattr(state, name) for name in _STATE_FIELDS}
    if best.basis is not None:
        groups["best_basis"] = {"basis": best.basis}
    return groups


def save_checkpoint(path, fp: str, progress: RoundsProgress, rounds: list[RoundCalibration]) -> None:
    """Write the checkpoint after a finished round (atomically replaces the previous one)."""
    best = progress.best
    groups = _result_groups(best)
    round_meta = []
    for j, r in enumerate(rounds):
        arrays, meta = r.to_arrays()
        groups[f"round_{j}"] = arrays
        round_meta.append(meta)
    meta = {
        "fingerprint": fp, "next_round": progress.next_round, "rng_state": progress.rng_state,
        "best_j": progress.best_j, "summaries": progress.summaries, "rounds": round_meta,
        "best": {"metric": best.metric, "best_epoch": best.best_epoch, "k": best.k, "history": best.history,
                 "movement": best.movement, "epochs_run": best.epochs_run, "stopped_early": best.stopped_early,
                 "num_classes": int(best.train.z.shape[1])},
    }
    save_artifact(path, KIND, VERSION, groups, meta, overwrite=True)


def _restore_round(arrays: dict, meta: dict) -> RoundCalibration:
    r = RoundCalibration.from_arrays(arrays, meta)
    fit = meta.get("rescaler")
    if fit is not None:
        r.rescaler = RescalerFit(W=r.W, epoch_losses=np.asarray(fit["epoch_losses"], dtype=np.float64),
                                 best_epoch=fit["best_epoch"], best_loss=fit["best_loss"],
                                 epochs_run=fit["epochs_run"], stopped_early=fit["stopped_early"],
                                 seconds=fit["seconds"])
    return r


def _restore_best(groups: dict, meta: dict) -> RoundResult:
    params = groups["best_model"]
    m, d = params["projection.weight"].shape
    C = int(meta["num_classes"])
    model = ExemplarAdaptor(d, m, C)
    model.load_weights([(k, mx.array(v)) for k, v in params.items()])
    states = {s: SplitState(**{n: groups[f"best_{s}"][n] for n in _STATE_FIELDS}) for s in ("train", "calibration")}
    return RoundResult(
        model=model, metric=meta["metric"], best_epoch=meta["best_epoch"], k=meta["k"],
        train_idx=groups["best_index"]["train_idx"].astype(np.int64),
        cal_idx=groups["best_index"]["cal_idx"].astype(np.int64),
        train=states["train"], calibration=states["calibration"],
        train_distance_ecdfs=unpack_ragged("train", groups["best_ecdfs"], C),
        calibration_distance_ecdfs=unpack_ragged("calibration", groups["best_ecdfs"], C),
        history=meta["history"], movement=meta["movement"], epochs_run=meta["epochs_run"],
        stopped_early=meta["stopped_early"],
        basis=groups["best_basis"]["basis"] if "best_basis" in groups else None,
    )


def load_checkpoint(path, fp: str) -> tuple[tuple[RoundsProgress, list] | None, str]:
    """((progress, rounds), "") to resume, or (None, why not) — the reason is "" when there is no checkpoint."""
    if not os.path.lexists(path):
        return None, ""
    try:
        groups, meta = load_artifact(path, KIND, VERSION)
    except ArtifactError as e:
        return None, f"the checkpoint is unreadable ({e})"
    if meta.get("fingerprint") != fp:
        return None, "it was written with different arguments or data"
    try:
        rounds = [_restore_round(groups[f"round_{j}"], rm) for j, rm in enumerate(meta["rounds"])]
        progress = RoundsProgress(next_round=int(meta["next_round"]), rng_state=meta["rng_state"],
                                  best=_restore_best(groups, meta["best"]), best_j=int(meta["best_j"]),
                                  summaries=meta["summaries"])
    except (KeyError, ValueError, TypeError) as e:
        return None, f"the checkpoint is incomplete ({e!r})"
    if len(rounds) != progress.next_round:
        return None, "the checkpoint is inconsistent (round count)"
    return (progress, rounds), ""


class Checkpointer:
    """The checkpoint step of :func:`~sdm_mlx.estimator.rounds.train_rounds` (:meth:`save` after each round:
    the finished rounds and their calibrations in ``rounds``), and the state to resume from:
    ``Checkpointer(path, fp, rounds, callback).resume()`` → the saved :class:`RoundsProgress` (its
    calibrations are appended to ``rounds``) or None to start over (``callback.message`` says why)."""

    def __init__(self, path, fp: str, rounds: list, callback: Callback):
        self.path, self.fp, self.rounds, self.callback = path, fp, rounds, callback

    def resume(self, iterations: int) -> RoundsProgress | None:
        loaded, why = load_checkpoint(self.path, self.fp)
        if loaded is not None:
            progress, rounds = loaded
            self.rounds.extend(rounds)
            self.callback.message(f"resuming from {self.path}: {progress.next_round} of {iterations} rounds "
                                  "already done")
            return progress
        if why:
            self.callback.message(f"not resuming from {self.path}: {why}; starting over")
        return None

    def save(self, progress: RoundsProgress) -> None:
        save_checkpoint(self.path, self.fp, progress, self.rounds)


def remove_checkpoint(path) -> None:
    """Delete a checkpoint directory after a successful run (only if it is one)."""
    if is_checkpoint(path):
        shutil.rmtree(path)


def checkpoint_rounds(path) -> int | None:
    """How many finished rounds the checkpoint at ``path`` holds (None: there is none)."""
    if not is_checkpoint(path):
        return None
    _, manifest = read_manifest(path, "manifest.json", "sdm_mlx", VERSION, "training checkpoint")
    return int(manifest.get("meta", {}).get("next_round", 0))
