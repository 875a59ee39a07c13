"""One row, one answer: a row's prediction does not depend on the batch it arrives in.

Every field of :class:`Predictions` is compared bit for bit (``==`` on the JSON rows and
``np.array_equal`` on the arrays) for rows scored alone, in the whole batch and in shuffled
batches; calibration and support rows re-scored after ``fit`` reproduce the fitted values
exactly; exact duplicates of support rows are exact ties (d0 = 0, q by the (distance, index)
rule of DESIGN #4, checked against a float64 NumPy brute force).
"""

import dataclasses
import json
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from sdm_mlx import calibration as cal
from sdm_mlx.calibration.threshold import _quantile_index
from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.index import ExactIndex, HnswIndex, good_neighbours_by_class, similarity_from_neighbours

ARRAY_FIELDS = ("logits", "q", "d0", "d", "sdm", "exemplar_index", "exemplar_distance")


def estimate_arrays(pred) -> dict:
    """Every array of the typed estimate, by path (``lower.q_tilde``), taken from the dataclass fields."""
    est = pred.estimate
    out = {f.name: getattr(est, f.name) for f in dataclasses.fields(est) if not dataclasses.is_dataclass(getattr(est, f.name))}
    for name, variant in est.variants().items():
        out.update({f"{name}.{f.name}": getattr(variant, f.name) for f in dataclasses.fields(variant)})
    return out


@pytest.fixture(scope="module")
def factcheck_model():
    """A small model on the embedded factcheck data (D = 32 < M = 64: the QR-coordinate path)."""
    pool, heldout, _ = factcheck_splits()
    est = SDMEstimator(iterations=2, epochs=3, exemplar_dim=64, learning_rate=1e-3, rescaler_max_epochs=40,
                       verbose=False).fit(pool.X, pool.y, ids_train=pool.ids)
    return est, pool, heldout


@pytest.fixture(scope="module")
def wide_model():
    """A small model on random wide features (D = 1000 ≥ M = 64: coordinates are h' itself)."""
    rng = np.random.default_rng(5)
    n, dim = 700, 1000
    y = rng.integers(0, 3, n)
    centres = rng.normal(size=(3, dim)) * 0.15
    X = (centres[y] + rng.normal(size=(n, dim)) * rng.uniform(0.5, 3.0, size=(n, 1))).astype(np.float32)
    X[:, 7] *= 40.0  # an outlier feature, as in LLM hidden states
    est = SDMEstimator(alpha=0.9, iterations=1, epochs=2, exemplar_dim=64, learning_rate=1e-3,
                       rescaler_max_epochs=30, verbose=False).fit(X, y)
    Xq = (centres[rng.integers(0, 3, 150)] + rng.normal(size=(150, dim))).astype(np.float32)
    return est, np.concatenate([Xq, X[:50]])


_DICTS: dict = {}  # id -> (the whole-batch predictions, their to_dicts), computed once


def assert_same_predictions(a, b, rows_a=slice(None)):
    """Predictions ``b`` equal predictions ``a`` restricted to ``rows_a``, bit for bit, every field."""
    for name in ARRAY_FIELDS:
        va, vb = np.asarray(getattr(a, name))[rows_a], np.asarray(getattr(b, name))
        assert va.dtype == vb.dtype, name
        assert np.array_equal(va, vb), f"field {name} differs"
    ea, eb = estimate_arrays(a), estimate_arrays(b)
    for name in ea:
        va, vb = np.asarray(ea[name])[rows_a], np.asarray(eb[name])
        assert va.dtype == vb.dtype, name
        # NaN is "none" in float fields (e.g. alpha_region_lower of a row admitted at no level): equal to itself here
        assert np.array_equal(va, vb, equal_nan=va.dtype.kind == "f"), f"estimate field {name} differs"
    if id(a) not in _DICTS:  # kept with ``a`` itself: a freed object's id may be reused by the next test's
        _DICTS[id(a)] = (a, a.to_dicts())
    sub = [_DICTS[id(a)][1][i] for i in np.arange(len(a))[rows_a]]
    got = b.to_dicts()
    for ra, rb in zip(sub, got):
        rb["id"] = ra["id"]
        assert ra == rb


def check_alone_batch_shuffled(est, X, alone_rows, seed=0):
    whole = est.estimate(X)
    for i in alone_rows:
        assert_same_predictions(whole, est.estimate(X[i : i + 1]), slice(i, i + 1))
    rng = np.random.default_rng(seed)
    for _ in range(2):
        perm = rng.permutation(X.shape[0])
        assert_same_predictions(whole, est.estimate(X[perm]), perm)
    # ragged batches of every size from 1 to 9
    start, size = 0, 1
    while start < X.shape[0]:
        stop = min(start + size, X.shape[0])
        assert_same_predictions(whole, est.estimate(X[start:stop]), slice(start, stop))
        start, size = stop, size % 9 + 1
    return whole


def test_factcheck_predictions_alone_batch_shuffled(factcheck_model):
    est, pool, heldout = factcheck_model
    X = np.concatenate([heldout.X, pool.X[:100]])  # the first pool rows are support or calibration rows
    alone = np.random.default_rng(1).choice(X.shape[0], 40, replace=False)
    whole = check_alone_batch_shuffled(est, X, alone)
    assert np.array_equal(whole.d0, whole.exemplar_distance[:, 0])


def test_wide_features_predictions_alone_batch_shuffled(wide_model):
    est, X = wide_model
    assert est.support_vectors_.shape[1] == 64
    whole = check_alone_batch_shuffled(est, X, range(0, X.shape[0], 9), seed=3)
    assert np.array_equal(whole.d0, whole.exemplar_distance[:, 0])


def _rows_by_id(pool, ids):
    where = {i: n for n, i in enumerate(pool.ids)}
    return pool.X[[where[i] for i in ids]]


def test_calibration_rows_rescored_reproduce_the_fit(factcheck_model):
    est, pool, _ = factcheck_model
    Xc = _rows_by_id(pool, est.calibration_ids_)
    batch = est.estimate(Xc)
    assert np.array_equal(batch.logits, est.calibration_logits_)
    fitted = est.rounds_[est.best_round_]
    assert np.array_equal(batch.q_tilde, fitted.q_tilde)
    # the calibration distance eCDFs are the sorted fitted d0 of rows with q > 0, per true class
    for c, ecdf in enumerate(est.calibration_distance_ecdfs_):
        keep = (batch.q > 0) & (est.calibration_labels_ == c)
        assert np.array_equal(np.sort(batch.d0[keep]), ecdf)
    rng = np.random.default_rng(2)
    for i in rng.choice(Xc.shape[0], 60, replace=False):
        assert_same_predictions(batch, est.estimate(Xc[i : i + 1]), slice(i, i + 1))


def _brute_q(queries, support, y_hat, good, k):
    d = ((queries[:, None, :].astype(np.float64) - support[None].astype(np.float64)) ** 2).sum(-1)
    idx = np.argsort(d, axis=1, kind="stable")  # stable: exact ties by ascending support index
    return similarity_from_neighbours(idx[:, : min(k, len(support))], y_hat, good), d.min(axis=1)


def test_support_duplicates_are_exact_ties(factcheck_model):
    est, pool, _ = factcheck_model
    Xs = _rows_by_id(pool, est.support_ids_)
    z, coords = est._forward(Xs)
    assert np.array_equal(coords, est.support_vectors_)  # fit-time support = predict-time coordinates
    sample = np.random.default_rng(4).choice(Xs.shape[0], 300, replace=False)
    pred = est.estimate(Xs[sample])
    assert np.all(pred.d0 == 0.0)
    assert np.all(pred.exemplar_distance[:, 0] == 0.0)
    good = good_neighbours_by_class(est.support_labels_, est.support_predictions_, est.num_classes_)
    q_ref, _ = _brute_q(coords[sample], est.support_vectors_, pred.prediction, good, est.k_)
    assert np.array_equal(pred.q, q_ref)
    for j, i in enumerate(sample[:25]):
        one = est.estimate(Xs[i : i + 1])
        assert one.d0[0] == 0.0 and one.q[0] == pred.q[j]


def test_saved_model_same_answers_with_another_blas(factcheck_model, tmp_path):
    """Load in a fresh process on MLX's bundled BLAS, one thread: every field of every row unchanged."""
    est, pool, heldout = factcheck_model
    X = np.concatenate([heldout.X[:200], _rows_by_id(pool, est.support_ids_[:100])])
    est.save(tmp_path / "model")
    np.save(tmp_path / "x.npy", X)
    code = (
        "import json, sys, numpy as np\n"
        "from sdm_mlx.estimator import SDMEstimator\n"
        f"est = SDMEstimator.load({str(tmp_path / 'model')!r})\n"
        f"X = np.load({str(tmp_path / 'x.npy')!r})\n"
        "rows = [est.estimate(X[i : i + 1], ids=[i]).to_dicts()[0] for i in range(0, len(X), 7)]\n"
        "json.dump([est.estimate(X).to_dicts(), rows], sys.stdout)\n"
    )
    env = dict(os.environ, SDM_MLX_NO_BLAS_PRELOAD="1", OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    whole, alone = json.loads(out.stdout)
    expected = json.loads(json.dumps(est.estimate(X).to_dicts()))
    assert whole == expected
    assert alone == expected[::7]
    assert all(r["d0"] == 0.0 for r in whole[200:])


# ------------------------------------------------------------------ the support index on its own


@pytest.fixture
def tie_heavy():
    """Support with exact duplicate rows (mixed labels) and near-tied distances; queries include duplicates."""
    rng = np.random.default_rng(11)
    base = rng.normal(size=(120, 24)).astype(np.float32)
    support = np.concatenate([base, base[:30], base[:30] + np.float32(1e-7), base[5:8], base[5:8]])
    labels = rng.integers(0, 3, support.shape[0])
    preds = np.where(rng.random(support.shape[0]) < 0.3, (labels + 1) % 3, labels)
    queries = np.concatenate([support[::4], rng.normal(size=(40, 24)).astype(np.float32) * 0.3 + base[0]])
    return support, queries, labels, preds


@pytest.mark.parametrize("k", [3, 40, 1000])
def test_exact_index_one_query_one_answer(tie_heavy, k):
    support, queries, labels, preds = tie_heavy
    good = good_neighbours_by_class(labels, preds, 3)
    y_hat = np.arange(queries.shape[0]) % 3
    index = ExactIndex(support)
    q, d0, top_d, top_i = index.similarity_and_neighbours(queries, y_hat, good, k, 6)
    q_ref, d0_ref = _brute_q(queries, support, y_hat, good, k)
    assert np.array_equal(q, q_ref)
    assert np.array_equal(d0, d0_ref.astype(np.float32))
    assert np.array_equal(d0, top_d[:, 0])
    for i in range(queries.shape[0]):
        one = index.similarity_and_neighbours(queries[i : i + 1], y_hat[i : i + 1], good, k, 6)
        for got, want in zip(one, (q, d0, top_d, top_i)):
            assert np.array_equal(got[0], want[i])
    sd, si = index.search(queries, 6)
    assert np.array_equal(sd, top_d) and np.array_equal(si, top_i)


def test_exact_index_many_duplicates_keep_the_index_order():
    # 40 identical support rows: the top-n are the lowest indices, whatever the float32 screening picks
    rng = np.random.default_rng(3)
    row = rng.normal(size=(1, 16)).astype(np.float32)
    support = np.concatenate([rng.normal(size=(50, 16)).astype(np.float32) + 5, np.repeat(row, 40, 0)])
    d, i = ExactIndex(support).search(np.repeat(row, 3, 0), 12)
    assert np.array_equal(i, np.tile(np.arange(50, 62), (3, 1)))
    assert np.all(d == 0.0)


def test_exact_index_float32_noise_cannot_change_the_answer():
    # far from the centring row, float32 distances of 60 near-duplicates are mostly rounding noise:
    # the screening band must still hand every float64 top-n (and the first bad neighbour) to the re-rank
    rng = np.random.default_rng(6)
    p = rng.normal(size=16) * 300
    cloud = (p + rng.normal(size=(60, 16)) * 1e-3).astype(np.float32)
    support = np.concatenate([np.full((1, 16), -3000, np.float32), cloud, rng.normal(size=(30, 16)).astype(np.float32)])
    labels = np.zeros(len(support), dtype=np.int64)
    preds = np.where(rng.random(len(support)) < 0.2, 1, 0)
    good = good_neighbours_by_class(labels, preds, 2)
    queries = (p + rng.normal(size=(20, 16)) * 1e-3).astype(np.float32)
    y_hat = np.zeros(20, dtype=np.int64)
    index = ExactIndex(support)
    q, d0, top_d, top_i = index.similarity_and_neighbours(queries, y_hat, good, 50, 12)
    d = ((queries[:, None, :].astype(np.float64) - support[None].astype(np.float64)) ** 2).sum(-1)
    order = np.argsort(d, axis=1, kind="stable")
    assert np.array_equal(top_i, order[:, :12])
    assert np.array_equal(top_d, np.take_along_axis(d, order[:, :12], 1).astype(np.float32))
    assert np.array_equal(q, _brute_q(queries, support, y_hat, good, 50)[0])
    assert np.array_equal(d0, top_d[:, 0])


def test_hnsw_rows_are_batch_invariant(tie_heavy):
    support, queries, labels, preds = tie_heavy
    good = good_neighbours_by_class(labels, preds, 3)
    y_hat = np.arange(queries.shape[0]) % 3
    index = HnswIndex(support)
    whole = index.similarity_and_neighbours(queries, y_hat, good, 20, 5)
    assert np.array_equal(whole[1], whole[2][:, 0])
    for i in range(0, queries.shape[0], 5):
        one = index.similarity_and_neighbours(queries[i : i + 1], y_hat[i : i + 1], good, 20, 5)
        for got, want in zip(one, whole):
            assert np.array_equal(got[0], want[i])


# ------------------------------------------------------------------ Alg. 3 quantile index


def test_quantile_index_exact_rational():
    assert int(_quantile_index(np.array([100]), 0.71)[0]) == 29
    ns = np.arange(1, 301)
    for hundredths in range(51, 100):
        alpha = round(hundredths / 100, 2)
        want = np.minimum((100 - hundredths) * ns // 100, ns - 1)
        assert np.array_equal(_quantile_index(ns, alpha), want), alpha
        frac = 1 - Fraction(str(alpha))
        assert np.array_equal(want, np.minimum(frac.numerator * ns // frac.denominator, ns - 1))


def test_alg3_alpha_071_n100_uses_rank_29():
    # 29 of 100 values below α' = 0.71: ψ = sorted[29] = 0.9 passes; rank 28 would give 0.5 and fail
    o = np.array([0.5] * 29 + [0.9] * 71 + [0.99] * 100)
    y = np.array([0] * 100 + [1] * 100)
    q = np.full(200, 1.5)
    mv, psi = cal.min_valid_qbin(o, q, y, np.ones(200, bool), 2, 0.71)
    assert mv == 1.5
    np.testing.assert_array_equal(psi, [0.9, 0.99])


# ------------------------------------------------------------------ the error-free row product


def test_exact_row_product_is_row_local_and_accurate(monkeypatch):
    from sdm_mlx.core import exact_product
    from sdm_mlx.core.exact_product import ExactRowProduct

    rng = np.random.default_rng(8)
    W = rng.uniform(-0.03, 0.03, size=(64, 1000)).astype(np.float32)
    b = rng.normal(size=64).astype(np.float32)
    X = rng.normal(size=(37, 1000)).astype(np.float32)
    X[:, 3] *= 300.0  # an outlier feature
    X[5] = 0.0
    f = ExactRowProduct(W, b)
    whole = f(X)
    ref = X.astype(np.float64) @ W.astype(np.float64).T + b
    f32_gemm = X @ W.T + b  # float32 BLAS: the accuracy the forward had before
    assert np.abs(whole - ref).max() <= 0.5 * np.abs(f32_gemm - ref).max()
    assert np.array_equal(whole[5], b.astype(np.float64))
    monkeypatch.setattr(exact_product, "CHUNK_ROWS", 4)
    assert np.array_equal(f(X[::-1]), whole[::-1])
    for i in range(X.shape[0]):
        assert np.array_equal(f(X[i : i + 1])[0], whole[i])
