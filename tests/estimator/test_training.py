import numpy as np
import pytest
from mlx.utils import tree_flatten

from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.runtime.callbacks import Callback
from sdm_mlx.estimator.rounds import split_pool, train_rounds
from sdm_mlx.estimator.training import TrainConfig, balanced_median, flip_rule


@pytest.fixture(scope="module")
def pool():
    pool, _, _ = factcheck_splits(seed=0)
    return pool


def _weights(model):
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_alg1_improves_balanced_median_q_and_is_reproducible(pool):
    cfg = TrainConfig(epochs=6, iterations=1, exemplar_dim=128, seed=3, learning_rate=1e-4)
    best, j, _ = train_rounds(pool.X, pool.y, 2, cfg)
    first = best.history[0]["balanced_median_q"]
    assert best.metric > first, (best.metric, first)
    assert best.history[best.best_epoch - 1]["balanced_median_q"] == best.metric
    again, _, _ = train_rounds(pool.X, pool.y, 2, cfg)
    w1, w2 = _weights(best.model), _weights(again.model)
    assert w1.keys() == w2.keys()
    for k in w1:
        np.testing.assert_array_equal(w1[k], w2[k])
    # per-row state is consistent with the model
    assert best.calibration.q.shape == (len(best.cal_idx),)
    assert ((best.calibration.d >= 0) & (best.calibration.d <= 1)).all()
    np.testing.assert_allclose(best.calibration.sdm.sum(1), 1.0, rtol=1e-5)


def test_rounds_use_stratified_disjoint_splits(pool):
    cfg = TrainConfig(epochs=1, iterations=2, exemplar_dim=16)
    seen = []

    class Seen(Callback):
        def on_round_end(self, j, result):
            seen.append(result)

    train_rounds(pool.X[:400], pool.y[:400], 2, cfg, Seen())
    for r in seen:
        assert not set(r.train_idx) & set(r.cal_idx)
        assert len(r.train_idx) + len(r.cal_idx) == 400
    assert not np.array_equal(np.sort(seen[0].train_idx), np.sort(seen[1].train_idx))


def test_split_pool_errors_on_missing_class():
    with pytest.raises(ValueError, match="class"):
        split_pool(np.array([0, 0, 0, 1]), 2, np.random.default_rng(0))


def test_balanced_median_and_flip_rule():
    assert balanced_median(np.array([1, 3, 10, 10, 10]), np.array([0, 0, 1, 1, 1]), 3) == pytest.approx((2 + 10 + 0) / 3)
    s = np.array([[0.5, 0.5], [0.2, 0.8], [0.9, 0.1]])
    np.testing.assert_array_equal(flip_rule(s, np.array([0, 1, 1])), [True, False, True])


def test_config_validation():
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(epochs=0).validate()
    with pytest.raises(ValueError, match="index_backend"):
        TrainConfig(index_backend="faiss").validate()
