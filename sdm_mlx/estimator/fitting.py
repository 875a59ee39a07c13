"""What :meth:`SDMEstimator.fit <sdm_mlx.estimator.sdm_estimator.SDMEstimator.fit>` runs before it takes its fitted
state: the training and calibration rows pooled and validated once (DESIGN #9), the classes and α' they allow
(DESIGN #23, DESIGN #25), and the J rounds with their calibration and checkpoint (:mod:`.rounds`)."""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np

from .. import validation
from ..calibration import exact_one_minus
from ..calibration.nested import alpha_grid, decision_policy
from ..calibration import RescalerSettings, calibrate_round
from ..errors import InputError
from .rounds import RoundCalibrator, train_rounds


class PooledRows(NamedTuple):
    """The pooled training + calibration rows of a ``fit``, validated once."""

    X: np.ndarray  #: float32 [N, D]
    classes: np.ndarray  #: the sorted distinct labels (``classes_``)
    y: np.ndarray  #: the labels as class indices [N]
    ids: list  #: one id per row


def pooled_data(X, y, X_cal, y_cal, *, ids_train, ids_cal, num_classes) -> PooledRows:
    """(X, classes_, y as indices, ids) of train (+ calibration) rows, validated once."""
    X = validation.features(X, "training features")
    if y is None:
        raise InputError("SDMEstimator requires y to be passed, but the target y is None")
    ys = [np.asarray(y)]
    if ys[0].shape[:1] != (X.shape[0],):
        raise InputError(f"training labels: shape {ys[0].shape} for {X.shape[0]} rows (one label per row)")
    ids = list(ids_train) if ids_train is not None else [f"train-{i}" for i in range(X.shape[0])]
    if X_cal is not None:
        if y_cal is None:
            raise InputError("calibration features given without calibration labels (y_cal)")
        Xc = validation.features(X_cal, "calibration features", dim=X.shape[1])
        yc = np.asarray(y_cal)
        if yc.shape[:1] != (Xc.shape[0],):
            raise InputError(f"calibration labels: shape {yc.shape} for {Xc.shape[0]} rows (one label per row)")
        X = np.concatenate([X, Xc])
        ys.append(yc)
        ids += list(ids_cal) if ids_cal is not None else [f"cal-{i}" for i in range(Xc.shape[0])]
    if len(ids) != X.shape[0]:
        raise InputError(f"got {len(ids)} ids for {X.shape[0]} rows")
    ys = [validation.one_d(a, name) for a, name in zip(ys, ("training labels", "calibration labels"))]
    labels = np.concatenate(ys) if len(ys) > 1 else ys[0]
    classes, y_idx = validation.encode_labels(labels, "labels", num_classes)
    return PooledRows(X, classes, y_idx, ids)


def check_classes(est, y: np.ndarray, C: int) -> float:
    """Per-class row counts, class names and α' for C classes of ``est``'s parameters; returns the validated α'."""
    if C < 2:
        raise InputError("need at least two classes (a single-class problem cannot be calibrated); "
                         f"the labels hold {C} class")
    counts = np.bincount(y, minlength=C)
    thin = np.flatnonzero(counts < 4).tolist()
    if thin:
        raise InputError(
            f"class(es) {thin} have fewer than 4 rows in the pooled data (counts {counts.tolist()}); every "
            "class needs rows in both the training and the calibration half"
        )
    alpha = validation.alpha(est.alpha, C)
    levels = alpha_grid(est.alpha_grid, alpha, C)  # checked before training (DESIGN #25)
    decision_policy(levels, alpha, est.alpha_allow, est.alpha_review)
    min_cal = math.ceil(1 / exact_one_minus(alpha))  # smallest n with a quantile index ≥ 1 (exact)
    if (counts // 2 < min_cal).any():
        warnings.warn(
            f"calibration halves will hold fewer than 1/(1-α) = {min_cal} rows of some class "
            f"(class counts {counts.tolist()}): Alg. 3 then uses the class minimum as the α quantile and "
            "most predictions will be rejected",
            stacklevel=3,
        )
    if est.class_names is not None and len(est.class_names) != C:
        raise InputError(f"class_names has {len(est.class_names)} names for {C} classes")
    return alpha


def train_and_calibrate(est, rows: PooledRows, alpha: float, config, *, checkpoint, callback):
    """Alg. 1 rounds of ``est`` with per-round calibration; resumes from and writes ``checkpoint`` if given (and sets
    ``est.resumed_rounds_``).  Returns (the best round, its index, the rounds' summaries, their calibrations)."""
    X, classes, y, ids = rows
    C = len(classes)
    rescaler = RescalerSettings(max_epochs=est.rescaler_max_epochs, patience=est.rescaler_patience,
                                learning_rate=est.rescaler_learning_rate, engine=est.rescaler_engine)
    calibrator = RoundCalibrator(calibrate_round, y, alpha, est.seed, rescaler, callback=callback)
    progress, saver = None, None
    if checkpoint is not None:
        from .checkpoint import Checkpointer, check_checkpoint_path, fingerprint

        check_checkpoint_path(checkpoint)
        # the grid and the decision policy do not change training (DESIGN #25): not part of the fingerprint
        params = {k: v for k, v in est.get_params().items()
                  if k not in ("alpha_grid", "alpha_allow", "alpha_review")}
        fp = fingerprint({**params, "alpha": alpha}, X, y, ids, C)
        saver = Checkpointer(checkpoint, fp, calibrator.rounds, callback)
        progress = saver.resume(config.iterations)
    est.resumed_rounds_ = 0 if progress is None else progress.next_round
    best, best_j, summaries = train_rounds(X, y, C, config, callback, progress, calibrate=calibrator,
                                           save=None if saver is None else saver.save)
    rounds = calibrator.rounds
    for summary, cal in zip(summaries, rounds):
        summary["min_valid_qbin"] = float(cal.min_valid) if math.isfinite(cal.min_valid) else None
    return best, best_j, summaries, rounds
