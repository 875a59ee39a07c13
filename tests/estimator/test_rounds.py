"""The rounds loop of Alg. 1 (sdm_mlx/estimator/rounds.py): the per-round calibration and the checkpoint are
steps of the loop, in a fixed order, and callbacks only observe them; a round's kept epoch is frozen."""

import dataclasses

import numpy as np
import pytest

from sdm_mlx.estimator.rounds import RoundsProgress, train_rounds
from sdm_mlx.estimator.training import RoundResult, TrainConfig
from sdm_mlx.runtime.callbacks import Callback


def _data(n=120, d=6):
    rng = np.random.default_rng(0)
    y = np.arange(n) % 2
    return (rng.normal(size=(n, d)) + 3.0 * y[:, None]).astype(np.float32), y


class Observer(Callback):
    def __init__(self, order):
        self.order = order

    def on_epoch_end(self, j, epoch, metrics):
        self.order.append(("epoch", j, epoch))

    def on_round_end(self, j, result):
        self.order.append(("observed round", j))

    def on_rounds_state(self, state):
        self.order.append(("observed state", state.next_round))


def test_calibration_and_checkpoint_are_steps_of_the_loop_and_callbacks_observe():
    X, y = _data()
    cfg = TrainConfig(epochs=2, iterations=2, exemplar_dim=8, patience=None)
    order, saved = [], []

    def calibrate(j, result):
        assert isinstance(result, RoundResult)
        order.append(("calibrate", j))

    def save(progress):
        assert isinstance(progress, RoundsProgress) and len(progress.summaries) == progress.next_round
        saved.append(progress.next_round)
        order.append(("save", progress.next_round))

    best, best_j, summaries = train_rounds(X, y, 2, cfg, Observer(order), calibrate=calibrate, save=save)
    assert order == [
        ("epoch", 0, 1), ("epoch", 0, 2), ("calibrate", 0), ("observed round", 0), ("save", 1), ("observed state", 1),
        ("epoch", 1, 1), ("epoch", 1, 2), ("calibrate", 1), ("observed round", 1), ("save", 2), ("observed state", 2),
    ]
    assert saved == [1, 2] and len(summaries) == 2 and best is not None and best_j in (0, 1)


def test_without_steps_the_rounds_run_the_same_and_the_result_is_frozen():
    X, y = _data()
    cfg = TrainConfig(epochs=2, iterations=2, exemplar_dim=8, patience=None)
    plain = train_rounds(X, y, 2, cfg)
    stepped = train_rounds(X, y, 2, cfg, calibrate=lambda j, r: None, save=lambda p: None)
    assert plain[1:] == stepped[1:]
    np.testing.assert_array_equal(plain[0].calibration.sdm, stepped[0].calibration.sdm)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain[0].metric = 0.0
