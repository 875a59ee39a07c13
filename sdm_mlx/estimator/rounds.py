"""The J rounds of Alg. 1 (``alg:sdm-estimator-training``): re-split, train, calibrate, keep the best, checkpoint.

Every round re-splits the pooled train+calibration rows in half (per class: DESIGN #9), trains a fresh
adaptor on one half (:func:`sdm_mlx.estimator.training.train_round`), calibrates it on the other
(:class:`RoundCalibrator`: Alg. 2 + Alg. 3), records what it learned (:func:`round_summary`), keeps the best
round so far (≥, later wins) and, when asked, saves the finished rounds (a checkpoint,
:mod:`sdm_mlx.estimator.checkpoint`).  These are the steps of :func:`train_rounds`'s loop; callbacks only
observe them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..errors import InputError
from ..runtime.callbacks import SILENT, Callback
from . import training
from .training import RoundResult, TrainConfig


def split_pool(y: np.ndarray, num_classes: int, rng: np.random.Generator, stratified: bool = True):
    """Shuffle the pooled rows and split them in half (per class when ``stratified``; DESIGN #9).

    Raises ValueError if either half lacks a class.
    """
    n = y.shape[0]
    if stratified:
        tr, ca = [], []
        for c in range(num_classes):
            idx = rng.permutation(np.flatnonzero(y == c))
            half = idx.size // 2
            tr.append(idx[:half])
            ca.append(idx[half:])
        train_idx, cal_idx = rng.permutation(np.concatenate(tr)), rng.permutation(np.concatenate(ca))
    else:
        perm = rng.permutation(n)
        train_idx, cal_idx = perm[: n // 2], perm[n // 2 :]
    for name, idx in (("training", train_idx), ("calibration", cal_idx)):
        counts = np.bincount(y[idx], minlength=num_classes)
        if (counts == 0).any():
            missing = np.flatnonzero(counts == 0).tolist()
            raise InputError(
                f"the {name} split has no rows of class(es) {missing}: each class needs at least 2 rows in the "
                "pooled data (one per split)"
            )
    return train_idx, cal_idx


@dataclass
class RoundsProgress:
    """Where :func:`train_rounds` stands after some rounds: enough to continue bit-identically."""

    next_round: int  #: rounds finished so far (the next round's index j)
    rng_state: dict  #: state of the re-split generator before round ``next_round``
    best: RoundResult | None
    best_j: int
    summaries: list


def round_summary(j: int, result: RoundResult) -> dict:
    """What one round learned: its selected epoch, per-epoch trajectories and the adaptor's movement."""
    chosen = result.history[result.best_epoch - 1]
    return {
        "round": j, "metric": result.metric, "best_epoch": result.best_epoch, "k": result.k,
        "epochs_run": result.epochs_run, "stopped_early": result.stopped_early,
        "cal_accuracy": chosen["cal_accuracy"],
        "projection_movement": result.movement.get("projection"),
        "classifier_movement": result.movement.get("classifier"),
        "loss": [h["loss"] for h in result.history],
        "balanced_median_q": [h["balanced_median_q"] for h in result.history],
        "cal_accuracy_per_epoch": [h["cal_accuracy"] for h in result.history],
    }


class RoundCalibrator:
    """Alg. 1's per-round calibration, a step of :func:`train_rounds`: after round j, Alg. 2 + Alg. 3 on the
    round's calibration split with ``calibrate`` (:func:`sdm_mlx.calibration.calibrate_round`, passed in so
    that training does not depend on the calibration math), W'' trained with ``rescaler`` (its seed: the
    round's, ``seed`` · 1000 + j); the results collect in ``rounds`` and each round's line goes to
    ``callback.message``."""

    def __init__(self, calibrate: Callable, y: np.ndarray, alpha: float, seed: int, rescaler, *,
                 callback: Callback = SILENT, rounds: list | None = None):
        self.calibrate = calibrate
        self.y, self.alpha, self.seed = y, alpha, seed
        self.rescaler, self.callback = rescaler, callback
        self.rounds = [] if rounds is None else rounds

    def __call__(self, j: int, result: RoundResult) -> None:
        cal = self.calibrate(
            result.calibration.sdm, result.calibration.q, self.y[result.cal_idx], result.calibration.y_hat,
            alpha=self.alpha, rescaler=replace(self.rescaler, seed=self.seed * 1000 + j),
        )
        self.rounds.append(cal)
        fit = cal.rescaler
        extra = f" (rescaler {fit.epochs_run} epochs, {fit.seconds:.1f}s)" if fit is not None else ""
        self.callback.message(f"round {j + 1}: min valid q~ {cal.min_valid:.3f}, psi "
                              f"{np.round(cal.psi, 3).tolist()}{extra}")


def train_rounds(
    X: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    config: TrainConfig,
    callback: Callback = SILENT,
    progress: RoundsProgress | None = None,
    *,
    calibrate: Callable[[int, RoundResult], None] | None = None,
    save: Callable[[RoundsProgress], None] | None = None,
) -> tuple[RoundResult, int, list]:
    """J rounds of Alg. 1 (``alg:sdm-estimator-training``) over stratified re-splits of the pooled data.

    Each round: re-split, :func:`~sdm_mlx.estimator.training.train_round`, ``calibrate(j, result)`` (the per-round calibration,
    :class:`RoundCalibrator`), the bookkeeping (summary, best round so far, generator state), then
    ``save(progress)`` (a checkpoint: :meth:`sdm_mlx.estimator.checkpoint.Checkpointer.save`).  ``callback``
    only observes: ``on_epoch_end`` during a round, ``on_round_end(j, result)`` after its calibration,
    ``on_rounds_state(progress)`` after its checkpoint.  Pass a saved ``progress`` to continue after its
    finished rounds: the result equals an uninterrupted run.  Returns (best round, its index j, per-round
    summaries).  Only the best round's arrays are kept in memory.
    """
    config.validate()
    rng = np.random.default_rng(config.seed)
    if progress is None:
        progress = RoundsProgress(0, rng.bit_generator.state, None, -1, [])
    else:
        rng.bit_generator.state = progress.rng_state
    for j in range(progress.next_round, config.iterations):
        train_idx, cal_idx = split_pool(y, num_classes, rng, config.stratified)
        result = training.train_round(  # looked up at call time (tests replace it to interrupt a fit)
            training.RoundSplit.of(X, y, train_idx, cal_idx), num_classes, config, seed=config.seed * 1000 + j,
            callback=callback, round_index=j,
        )
        if calibrate is not None:
            calibrate(j, result)
        callback.on_round_end(j, result)
        progress.summaries.append(round_summary(j, result))
        if progress.best is None or result.metric >= progress.best.metric:
            progress.best, progress.best_j = result, j
        progress.next_round, progress.rng_state = j + 1, rng.bit_generator.state
        if save is not None:
            save(progress)
        callback.on_rounds_state(progress)
    return progress.best, progress.best_j, progress.summaries
