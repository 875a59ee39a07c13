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


def test_host_step_follows_the_compiled_mlx_step():
    """The host step (closed-form gradient with rank-C products, Adam in row blocks) and the compiled MLX step
    (autodiff through h', mlx.optimizers.Adam) follow one trajectory up to float32 rounding."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from sdm_mlx.core.adaptor import ExemplarAdaptor
    from sdm_mlx.estimator.adaptor_step import HostAdaptorStep, normalized
    from sdm_mlx.estimator.training import _make_step

    rng = np.random.default_rng(0)
    D, M, C, N = 96, 64, 3, 400  # D ≥ M, several row blocks of W_g
    X = (rng.normal(size=(N, D)) * 2 + 0.5).astype(np.float32)
    y, q = rng.integers(0, C, N), rng.integers(0, 30, N).astype(np.float32)
    d = rng.uniform(0, 1, N).astype(np.float32)

    def model():
        m = ExemplarAdaptor(D, M, C, seed=3)
        m.set_normalization(0.5, 2.0)
        return m

    reference = model()
    w0 = np.array(reference.projection.weight)
    opt = optim.Adam(learning_rate=1e-3, betas=[0.9, 0.999], eps=1e-8, bias_correction=True)
    step = _make_step(reference, opt)
    host = HostAdaptorStep(model(), learning_rate=1e-3, block_bytes=4 * D * 10)
    assert host.block_rows == 10
    x_norm = normalized(reference, X)
    X_mx, y_mx, q_mx, d_mx = mx.array(X), mx.array(y.astype(np.int32)), mx.array(q), mx.array(d)
    for _ in range(30):
        b = rng.choice(N, 50, replace=False)
        b_mx = mx.array(b)
        loss = step(X_mx[b_mx], y_mx[b_mx], q_mx[b_mx], d_mx[b_mx])
        mx.eval(loss, reference.parameters(), opt.state)
        assert host(x_norm[b], y[b], q[b], d[b]) == pytest.approx(loss.item(), rel=1e-5)
    params = host.params()
    moved = np.linalg.norm(np.array(reference.projection.weight) - w0)
    assert np.linalg.norm(params["projection.weight"] - np.array(reference.projection.weight)) < 1e-4 * moved
    for name, value in (("projection.bias", reference.projection.bias), ("classifier.weight", reference.classifier.weight),
                        ("classifier.bias", reference.classifier.bias)):
        np.testing.assert_allclose(params[name], np.array(value), atol=1e-6)
    np.testing.assert_allclose(host.logits(x_norm), np.array(reference(X_mx)[0]), rtol=1e-5, atol=1e-5)
