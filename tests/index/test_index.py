import numpy as np
import pytest

from sdm_mlx.index import (
    ExactIndex,
    HnswIndex,
    default_k,
    good_neighbours_by_class,
    make_index,
    similarity_from_neighbours,
)


def brute(queries, support, exclude=None):
    d = ((queries[:, None, :].astype(np.float64) - support[None].astype(np.float64)) ** 2).sum(-1)
    if exclude is not None:
        d[np.arange(len(queries)), exclude] = np.inf
    idx = np.argsort(d, axis=1, kind="stable")  # stable => ties by ascending index
    return np.take_along_axis(d, idx, 1), idx


def ref_q(queries, support, y_hat, good, k, exclude=None):
    _, idx = brute(queries, support, exclude)
    k_eff = min(k, len(support)) - (1 if exclude is not None else 0)
    return similarity_from_neighbours(idx[:, :k_eff], y_hat, good)


@pytest.fixture
def random_data():
    rng = np.random.default_rng(1)
    support = rng.normal(size=(300, 16)).astype(np.float32)
    queries = rng.normal(size=(40, 16)).astype(np.float32)
    labels = rng.integers(0, 3, 300)
    preds = labels.copy()

    flip = rng.random(300) < 0.25
    preds[flip] = (preds[flip] + 1) % 3
    return support, queries, labels, preds, rng


def test_search_matches_float64_reference(random_data):
    support, queries, *_ = random_data
    d, i = ExactIndex(support).search(queries, 7)
    rd, ri = brute(queries, support)
    np.testing.assert_array_equal(i, ri[:, :7])
    np.testing.assert_allclose(d, rd[:, :7], rtol=1e-5, atol=1e-5)


def test_similarity_matches_reference(random_data):
    support, queries, labels, preds, rng = random_data
    good = good_neighbours_by_class(labels, preds, 3)
    y_hat = rng.integers(0, 3, len(queries))
    index = ExactIndex(support)
    for k in (1, 5, 50, 1000):
        q, d0 = index.similarity(queries, y_hat, good, k)
        np.testing.assert_array_equal(q, ref_q(queries, support, y_hat, good, k))
    rd, _ = brute(queries, support)
    np.testing.assert_allclose(d0, rd[:, 0], rtol=1e-5, atol=1e-5)


def test_self_exclusion_before_k_cap(random_data):
    support, _, labels, preds, _ = random_data
    good = good_neighbours_by_class(labels, preds, 3)
    index = ExactIndex(support)
    ex = np.arange(len(support))
    q, d0 = index.similarity(support, preds, good, 10, exclude=ex)
    np.testing.assert_array_equal(q, ref_q(support, support, preds, good, 10, exclude=ex))
    assert q.max() <= 9  # k includes the identity slot
    assert (d0 > 0).all()
    d, i = index.search(support[:5], 3, exclude=ex[:5])
    assert not (i == ex[:5, None]).any()


def test_exact_ties_lowest_index_first_across_tiles():
    base = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]], dtype=np.float32)
    support = np.tile(base, (50, 1))  # many exact ties at distance 1 from the origin
    query = np.zeros((1, 2), dtype=np.float32)
    index = ExactIndex(support, block_bytes=4 * len(support))  # one query row per block
    d, i = index.search(query, 12)
    np.testing.assert_array_equal(i[0], np.arange(12))
    np.testing.assert_allclose(d[0], 1.0)
    # q over ties: labels good only for even indices -> q counts 0..? in index order
    labels = np.zeros(len(support), dtype=int)
    preds = np.zeros(len(support), dtype=int)
    preds[5] = 1  # first bad neighbour in tie order is index 5
    good = good_neighbours_by_class(labels, preds, 2)
    q, _ = index.similarity(query, np.array([0]), good, 100)
    assert q[0] == 5


def test_identical_vectors_and_self_exclusion():
    support = np.ones((6, 4), dtype=np.float32)
    labels = np.array([0, 0, 0, 1, 1, 1])
    good = good_neighbours_by_class(labels, labels, 2)
    q, d0 = ExactIndex(support).similarity(support, labels, good, 6, exclude=np.arange(6))
    # row 0: neighbours 1,2 (good), then 3 (bad)  -> q = 2; rows 3..5: index 0 first (bad) -> 0
    np.testing.assert_array_equal(q, [2, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(d0, 0.0)


def test_large_offset_vectors():
    rng = np.random.default_rng(3)
    support = (1e4 + rng.normal(size=(200, 8))).astype(np.float32)
    queries = (1e4 + rng.normal(size=(20, 8))).astype(np.float32)
    d, i = ExactIndex(support).search(queries, 5)
    rd, ri = brute(queries, support)
    np.testing.assert_array_equal(i, ri[:, :5])
    np.testing.assert_allclose(d, rd[:, :5], rtol=1e-3)
    labels = rng.integers(0, 2, 200)
    good = good_neighbours_by_class(labels, labels, 2)
    y_hat = rng.integers(0, 2, 20)
    q, _ = ExactIndex(support).similarity(queries, y_hat, good, 50)
    np.testing.assert_array_equal(q, ref_q(queries, support, y_hat, good, 50))


def test_similarity_from_neighbours_hand_case():
    good = np.array([[True, True, False, True], [False, False, True, False]])
    idx = np.array([[0, 1, 2, 3], [2, 0, 1, 3], [3, 0, -1, -1]])
    q = similarity_from_neighbours(idx, np.array([0, 1, 0]), good)
    np.testing.assert_array_equal(q, [2, 1, 2])


def test_hnsw_agrees_with_exact_on_separated_data():
    rng = np.random.default_rng(0)
    centers = np.array([[0.0] * 8, [20.0] * 8], dtype=np.float32)
    labels = np.repeat([0, 1], 100)
    support = (centers[labels] + rng.normal(size=(200, 8))).astype(np.float32)
    queries = (centers[[0, 1] * 10] + rng.normal(size=(20, 8))).astype(np.float32)
    good = good_neighbours_by_class(labels, labels, 2)
    y_hat = np.array([0, 1] * 10)
    qe, de = ExactIndex(support).similarity(queries, y_hat, good, 100)
    qh, dh = HnswIndex(support, ef=200).similarity(queries, y_hat, good, 100)
    np.testing.assert_array_equal(qe, qh)
    np.testing.assert_allclose(de, dh, rtol=1e-4)
    _, ie = ExactIndex(support).search(queries, 5)
    _, ih = make_index(support, "hnsw", ef=200).search(queries, 5)
    np.testing.assert_array_equal(ie, ih)


def test_bad_inputs():
    with pytest.raises(ValueError, match="NaN"):
        ExactIndex(np.array([[np.nan, 1.0]], dtype=np.float32))
    with pytest.raises(ValueError, match="empty"):
        ExactIndex(np.zeros((0, 3), dtype=np.float32))
    index = ExactIndex(np.zeros((3, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="dimension"):
        index.search(np.zeros((1, 3), dtype=np.float32), 1)
    with pytest.raises(ValueError, match="unknown index backend"):
        make_index(np.zeros((3, 2)), "faiss")
    assert default_k(np.array([0, 0, 1, 1, 1]), 2) == 3


def _duplicated_support():
    """Few distinct points, each repeated 400 times over with mixed labels / predictions: exact ties everywhere.
    Returns the generator too (the callers draw their queries from it, after these draws)."""
    rng = np.random.default_rng(7)
    distinct = rng.normal(size=(15, 6)).astype(np.float32)
    support = distinct[rng.integers(0, 15, 400)]
    labels = rng.integers(0, 3, 400)
    preds = np.where(rng.random(400) < 0.7, labels, rng.integers(0, 3, 400))
    return rng, distinct, support, labels, preds, good_neighbours_by_class(labels, preds, 3)


@pytest.mark.parametrize("exclude", [False, True])
def test_similarity_with_many_duplicates_matches_reference(exclude):
    # few distinct points, each repeated with mixed labels/predictions: exact good/bad ties everywhere
    rng, distinct, support, labels, preds, good = _duplicated_support()
    index = ExactIndex(support, block_bytes=4 * 400 * 37)  # several query blocks
    if exclude:
        queries, y_hat, ex = support, preds, np.arange(400)
    else:
        queries, y_hat, ex = distinct[rng.integers(0, 15, 60)], rng.integers(0, 3, 60), None
    for k in (3, 40, 400):
        q, d0 = index.similarity(queries, y_hat, good, k, exclude=ex)
        np.testing.assert_array_equal(q, ref_q(queries, support, y_hat, good, k, exclude=ex))
    rd, _ = brute(queries, support, ex)
    np.testing.assert_allclose(d0, rd[:, 0], atol=1e-5)


@pytest.mark.parametrize("backend", ["exact", "hnsw"])
@pytest.mark.parametrize("self_excluded", [False, True])
def test_similarity_and_neighbours_equals_separate_calls(random_data, backend, self_excluded):
    support, queries, labels, preds, rng = random_data
    good = good_neighbours_by_class(labels, preds, 3)
    index = make_index(support, backend, **({"ef": 300} if backend == "hnsw" else {}))
    if self_excluded:
        queries, y_hat, ex = support[:50], preds[:50], np.arange(50)
    else:
        y_hat, ex = rng.integers(0, 3, len(queries)), None
    q, d0, top_d, top_i = index.similarity_and_neighbours(queries, y_hat, good, 40, 6, exclude=ex)
    q2, d02 = index.similarity(queries, y_hat, good, 40, exclude=ex)
    sd, si = index.search(queries, 6, exclude=ex)
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_allclose(d0, d02, rtol=1e-5)
    np.testing.assert_array_equal(top_i, si)
    np.testing.assert_allclose(top_d, sd, rtol=1e-5)
    np.testing.assert_allclose(top_d[:, 0], d0, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("self_excluded", [False, True])
def test_host_matmul_in_products_of_a_few_rows_gives_the_same_answers(random_data, monkeypatch, self_excluded):
    """A block's float32 distances from one NumPy product, from several products of a few rows
    (:data:`~sdm_mlx.index.screening.HOST_MATMUL_PRODUCTS`) or from MLX: the same q, d0 and neighbours."""
    from sdm_mlx.index import screening

    support, queries, labels, preds, _ = random_data
    queries = np.concatenate([queries, support[:20]])  # exact duplicates of support rows
    good = good_neighbours_by_class(labels, preds, 3)
    y_hat = np.random.default_rng(2).integers(0, 3, queries.shape[0])
    exclude = np.where(np.arange(queries.shape[0]) >= 40, np.arange(queries.shape[0]) - 40, -1) if self_excluded else None
    per_row = support.shape[0] * support.shape[1]
    answers = []
    for adds, products in ((1 << 40, 2), (3 * per_row, 30), (3 * per_row + 5, 30), (per_row, 1), (0, 2)):
        monkeypatch.setattr(screening, "HOST_MATMUL_MULTIPLY_ADDS", adds)
        monkeypatch.setattr(screening, "HOST_MATMUL_PRODUCTS", products)
        answers.append(ExactIndex(support).similarity_and_neighbours(queries, y_hat, good, 60, 7, exclude))
    for other in answers[1:]:
        for a, b in zip(answers[0], other):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    np.testing.assert_array_equal(answers[0][0], ref_q(queries, support, y_hat, good, 60, exclude))


@pytest.mark.parametrize("self_excluded", [False, True])
@pytest.mark.parametrize("blocks", [1, 3])
def test_dense_index_matches_the_reference_on_random_data(random_data, self_excluded, blocks):
    """The float32 index of the training epochs (index.dense): the exact q and d0 where float32 orders the
    neighbours as float64 does (random data: no near-ties), in one query block or several."""
    support, queries, labels, preds, rng = random_data
    good = good_neighbours_by_class(labels, preds, 3)
    index = make_index(support, "dense", block_bytes=4 * 300 * (300 // blocks + 1))
    if self_excluded:
        queries, y_hat, ex = support, preds, np.arange(len(support))
    else:
        y_hat, ex = rng.integers(0, 3, len(queries)), None
    for k in (1, 5, 50, 1000):
        q, d0 = index.similarity(queries, y_hat, good, k, exclude=ex)
        np.testing.assert_array_equal(q, ref_q(queries, support, y_hat, good, k, exclude=ex))
    rd, _ = brute(queries, support, ex)
    np.testing.assert_allclose(d0, rd[:, 0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("exclude", [False, True])
def test_dense_index_orders_exact_ties_by_support_index(exclude):
    """Duplicated support rows with mixed labels: exact float32 ties, ordered by support index as the exact
    index orders them (equal float32 distances of equal vectors)."""
    rng, distinct, support, labels, preds, good = _duplicated_support()
    if exclude:
        queries, y_hat, ex = support, preds, np.arange(400)
    else:
        queries, y_hat, ex = distinct[rng.integers(0, 15, 60)], rng.integers(0, 3, 60), None
    dense, exact = make_index(support, "dense"), ExactIndex(support)
    for k in (3, 40, 400):
        q, _ = dense.similarity(queries, y_hat, good, k, exclude=ex)
        np.testing.assert_array_equal(q, exact.similarity(queries, y_hat, good, k, exclude=ex)[0])


@pytest.mark.parametrize("exclude", [False, True])
def test_many_near_tied_rows_resolved_together_match_the_reference(exclude, monkeypatch):
    # concentrated clusters far from the centring row: the float32 bands are wide, most rows go to the float64
    # resolution of near-ties (in one vectorised call per block) and to the re-ranking of the screened columns
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(3, 256)) * 0.05 + 4.0
    cluster = rng.integers(0, 3, 500)
    support = (centres[cluster] + rng.normal(size=(500, 256)) * 0.02).astype(np.float32)
    support[0] = 0.0  # the centring row, far from the rest
    labels = cluster
    preds = np.where(rng.random(500) < 0.8, labels, rng.integers(0, 3, 500))
    good = good_neighbours_by_class(labels, preds, 3)
    calls = []
    original = ExactIndex._resolve_near_ties
    monkeypatch.setattr(ExactIndex, "_resolve_near_ties",
                        lambda self, query, *a, **kw: calls.append(len(query)) or original(self, query, *a, **kw))
    index = ExactIndex(support, block_bytes=4 * 500 * 64)  # several query blocks
    if exclude:
        queries, y_hat, ex = support, preds, np.arange(500)
    else:
        queries = (centres[rng.integers(0, 3, 120)] + rng.normal(size=(120, 256)) * 0.02).astype(np.float32)
        y_hat, ex = rng.integers(0, 3, 120), None
    for k in (5, 60, 500):
        q, d0, top_d, top_i = index.similarity_and_neighbours(queries, y_hat, good, k, 7, exclude=ex)
        np.testing.assert_array_equal(q, ref_q(queries, support, y_hat, good, k, exclude=ex))
        rd, ri = brute(queries, support, ex)
        np.testing.assert_array_equal(top_i, ri[:, :7])
        np.testing.assert_array_equal(top_d, rd[:, :7].astype(np.float32))
        np.testing.assert_array_equal(d0, rd[:, 0].astype(np.float32))
    assert sum(calls) > 0.3 * len(queries) * 3 and max(calls) > 1  # many rows, several per call
