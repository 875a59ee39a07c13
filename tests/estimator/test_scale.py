"""Issue 14 §3 on one machine: the latency paths give the old answers bit for bit, prediction of many
rows runs in bounded memory, and the scale / latency / reexpress benchmark tools run.

* host (NumPy) screening vs MLX screening of the exact index, and NumPy vs MLX exact products:
  identical q, d0, neighbours and logits on random tie-heavy data, alone and batched;
* chunked ``estimate`` / ``iter_estimate`` == one call, bit for bit; the working memory of
  streamed prediction does not grow with the number of rows (tracemalloc and MLX peaks);
* ``sdm-mlx predict`` streams rows with a progress bar, same rows as the API;
* ``tools/bench/bench_latency.py``, ``bench_scale.py``, ``bench_reexpress.py``: ``--help`` and ``--smoke``.
"""

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from sdm_mlx.estimator import chunking as chunked
from sdm_mlx.core import exact_product
from sdm_mlx.index import screening as screening_mod
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.core.exact_product import ExactRowProduct
from sdm_mlx.index import ExactIndex, good_neighbours_by_class

ROOT = Path(__file__).resolve().parents[2]
ARRAY_FIELDS = ("logits", "q", "d0", "d", "sdm", "exemplar_index", "exemplar_distance", "admitted", "p_lower",
                "rejection_reason", "n_hat")


@pytest.fixture(scope="module")
def tie_heavy():
    """Support with exact duplicates and near-ties (the hard screening cases), 3 classes, and queries."""
    rng = np.random.default_rng(3)
    base = rng.normal(size=(300, 24)).astype(np.float32)
    support = np.concatenate([base, base[:60], base[:30] + np.float32(1e-7)])
    labels = rng.integers(0, 3, support.shape[0])
    preds = np.where(rng.random(support.shape[0]) < 0.8, labels, rng.integers(0, 3, support.shape[0]))
    queries = np.concatenate([rng.normal(size=(90, 24)).astype(np.float32), support[:40]])
    return support, good_neighbours_by_class(labels, preds, 3), queries, rng.integers(0, 3, queries.shape[0])


def _index_answers(index, queries, y_hat, good, exclude=None):
    q, d0, top_d, top_i = index.similarity_and_neighbours(queries, y_hat, good, 200, 7, exclude)
    s_d, s_i = index.search(queries, 9, exclude)
    return q, d0, top_d, top_i, s_d, s_i


@pytest.mark.parametrize("matmul_on_host", [True, False])
def test_host_screening_equals_mlx_screening(tie_heavy, monkeypatch, matmul_on_host):
    """q, d0 and neighbours: NumPy screening == MLX screening, bit for bit, batched and one row at a time."""
    support, good, queries, y_hat = tie_heavy
    exclude = np.where(np.arange(queries.shape[0]) >= 90, np.arange(queries.shape[0]) - 90, -1)
    index = ExactIndex(support, block_bytes=4 * support.shape[0] * 16)  # 16-row blocks: many blocks
    monkeypatch.setattr(screening_mod, "HOST_MATMUL_MULTIPLY_ADDS", 1 << 40 if matmul_on_host else 0)
    monkeypatch.setattr(ExactIndex, "_on_host", lambda self, rows: False)
    mlx_batch = _index_answers(index, queries, y_hat, good, exclude)
    monkeypatch.setattr(ExactIndex, "_on_host", lambda self, rows: True)
    host_batch = _index_answers(index, queries, y_hat, good, exclude)
    host_rows = [_index_answers(index, queries[i : i + 1], y_hat[i : i + 1], good, exclude[i : i + 1])
                 for i in range(0, queries.shape[0], 13)]
    for a, b in zip(mlx_batch, host_batch):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    for j, i in enumerate(range(0, queries.shape[0], 13)):
        for a, b in zip(mlx_batch, host_rows[j]):
            assert np.array_equal(a[i : i + 1], b)
    assert (mlx_batch[1][90:] == 0).sum() >= 30  # the duplicates were found (self excluded, a twin is left)


def test_host_exact_product_equals_mlx(monkeypatch):
    """The error-free product gives the same float64 bits from NumPy (small) and MLX (large) GEMMs."""
    rng = np.random.default_rng(1)
    w, b, x = rng.normal(size=(40, 300)), rng.normal(size=40), rng.normal(size=(50, 300)) * rng.uniform(0.1, 50, (50, 1))
    x[:, 3] *= 1e4  # an outlier feature
    prod = ExactRowProduct(w, b)
    monkeypatch.setattr(exact_product, "HOST_MULTIPLY_ADDS", 0)
    on_mlx = prod(x)
    monkeypatch.setattr(exact_product, "HOST_MULTIPLY_ADDS", 1 << 40)
    assert np.array_equal(on_mlx, prod(x))
    assert all(np.array_equal(on_mlx[i : i + 1], prod(x[i : i + 1])) for i in range(0, 50, 7))


@pytest.fixture(scope="module")
def small_model():
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(2, 16)) * 0.6
    y = rng.integers(0, 2, 1000)
    X = (centres[y] + rng.normal(size=(1000, 16))).astype(np.float32)
    est = SDMEstimator(alpha=0.8, iterations=1, epochs=4, exemplar_dim=32, learning_rate=3e-3,
                       rescaler_max_epochs=20).fit(X, y)
    return est, centres


def _queries(centres, n, seed=0):
    rng = np.random.default_rng(seed)
    return (centres[rng.integers(0, 2, n)] + rng.normal(size=(n, centres.shape[1]))).astype(np.float32)


def test_chunked_estimate_is_one_call_bit_for_bit(small_model, monkeypatch):
    est, centres = small_model
    X = _queries(centres, 700)
    whole = est.estimate(X, ids=[f"r{i}" for i in range(700)])
    monkeypatch.setattr("sdm_mlx.estimator.sdm_estimator.PREDICT_CHUNK_ROWS", 64)
    chunked_pred = est.estimate(X, ids=[f"r{i}" for i in range(700)], progress=False)
    assert chunked_pred.ids == whole.ids and 0 < whole.admitted.sum() < len(whole), whole.admitted.sum()
    for name in ARRAY_FIELDS:
        a, b = getattr(whole, name), getattr(chunked_pred, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert chunked_pred.to_dicts() == whole.to_dicts()
    parts = list(est.iter_estimate(X, chunk_rows=100, alpha=0.85))
    assert [len(p) for p in parts] == [100] * 7 and parts[3].ids == list(range(300, 400))
    assert np.array_equal(np.concatenate([p.admitted for p in parts]), est.estimate(X, alpha=0.85).admitted)


def test_iter_estimate_errors_name_the_rows(small_model):
    est, centres = small_model
    X = _queries(centres, 300)
    X[250, 2] = np.nan
    with pytest.raises(Exception, match=r"rows 200\.\.299: .*NaN"):
        list(est.iter_estimate(X, chunk_rows=100))
    with pytest.raises(Exception, match="got 2 ids for 300 rows"):
        est.iter_estimate(X, ids=["a", "b"])


def _streamed_peaks(est, X, chunk_rows):
    """(tracemalloc peak, MLX peak) in bytes of streaming predictions of X, each chunk dropped."""
    mx.reset_peak_memory()
    tracemalloc.start()
    for pred in est.iter_estimate(X, chunk_rows=chunk_rows):
        assert len(pred) <= chunk_rows
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, mx.get_peak_memory()


def test_streamed_prediction_memory_does_not_grow_with_rows(small_model, monkeypatch):
    """The working memory of chunked prediction (tiny distance-block budget) is the same at 20k and 80k rows."""
    est, centres = small_model
    monkeypatch.setattr(est, "_index", ExactIndex(est.support_vectors_, block_bytes=4 * est.index_.size * 64))
    small, large = _queries(centres, 20_000, 1), _queries(centres, 80_000, 2)
    _streamed_peaks(est, small[:3000], 2000)  # warm-up (first-call allocations)
    p_small, mx_small = _streamed_peaks(est, small, 2000)
    p_large, mx_large = _streamed_peaks(est, large, 2000)
    print("streamed peaks", p_small, p_large, mx_small, mx_large)
    assert p_large < 1.25 * p_small + 256 * 1024, (p_small, p_large)
    assert mx_large < 1.25 * mx_small + 256 * 1024, (mx_small, mx_large)
    # the bound: far below what holding 80k rows of results would take
    assert p_large < 80_000 * 100


def test_cli_predict_streams_with_progress(small_model, tmp_path, monkeypatch):
    est, centres = small_model
    est.save(tmp_path / "model")
    X = _queries(centres, 150, 4)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "embedding": x.tolist()}) + "\n" for i, x in enumerate(X)))
    run = subprocess.run([sys.executable, "-m", "sdm_mlx", "predict", "--model", str(tmp_path / "model"),
                          "--input", str(inp), "--output", str(tmp_path / "out.jsonl"), "--chunk-rows", "40"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "predict: 150rows" in run.stderr  # tqdm bar on stderr: rows and rows/s (the input is read once)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    expected = SDMEstimator.load(tmp_path / "model").estimate(X, ids=[f"q{i}" for i in range(150)]).to_dicts()
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(150)]
    assert [r["q"] for r in rows] == [r["q"] for r in expected]
    assert [r["admitted"] for r in rows] == [r["admitted"] for r in expected]
    quiet = subprocess.run([sys.executable, "-m", "sdm_mlx", "predict", "--model", str(tmp_path / "model"),
                            "--input", str(inp), "--output", str(tmp_path / "out2.jsonl"), "--quiet"],
                           capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "predict [" not in quiet.stderr
    assert (tmp_path / "out2.jsonl").read_text() == (tmp_path / "out.jsonl").read_text()


@pytest.mark.parametrize("tool", ["bench_latency.py", "bench_scale.py", "bench_reexpress.py"])
def test_bench_tools_help_and_smoke(tool, tmp_path):
    path = ROOT / "tools" / "bench" / tool
    help_run = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0 and "--smoke" in help_run.stdout
    out = tmp_path / "report.json"
    smoke = subprocess.run([sys.executable, str(path), "--smoke", "--json", str(out)], capture_output=True,
                           text=True, timeout=180, cwd=tmp_path)
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["results"]


def test_cli_predict_streamed_input_errors_name_the_line(small_model, tmp_path):
    """Checks that span chunks: a duplicate id names the line it was first seen on; output is not replaced."""
    est, centres = small_model
    est.save(tmp_path / "model")
    X = _queries(centres, 100, 5)
    lines = [json.dumps({"id": f"q{i}", "embedding": x.tolist(), "label": int(i % 2)}) for i, x in enumerate(X)]
    lines[90] = json.dumps({"id": "q3", "embedding": X[90].tolist(), "label": 0})
    inp = tmp_path / "dup.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    run = subprocess.run([sys.executable, "-m", "sdm_mlx", "predict", "--model", str(tmp_path / "model"),
                          "--input", str(inp), "--output", str(out), "--chunk-rows", "30"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert f"{inp}:91: duplicate id 'q3' (first seen on line 4)" in run.stderr
    assert out.read_text() == "previous\n"
    lines[90] = json.dumps({"id": "q90", "embedding": X[90].tolist(), "label": 0})
    inp.write_text("\n".join(lines) + "\n")
    summary = tmp_path / "summary.json"
    ok = subprocess.run([sys.executable, "-m", "sdm_mlx", "predict", "--model", str(tmp_path / "model"),
                         "--input", str(inp), "--output", str(out), "--chunk-rows", "30", "--summary", str(summary)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    pred = est.estimate(X, ids=[f"q{i}" for i in range(100)])
    got = json.loads(summary.read_text())
    assert got["rows"] == 100 and got["admitted"] == int(pred.admitted.sum())
    assert got["accuracy"] == float((pred.prediction == np.arange(100) % 2).mean())
