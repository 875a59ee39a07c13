"""The predict and evaluate data paths: features are validated once, at the boundary, and chunked once.

``sdm-mlx predict`` reads the JSONL in chunks of ``--chunk-rows``; the reader validates each row, and each chunk
is scored as it was read (no second validation pass, no second split).  The public ``SDMEstimator.estimate``
validates what it is given, chunk by chunk above ``PREDICT_CHUNK_ROWS``, each row once.
"""

import json

import numpy as np
import pytest
from cli_lab import rows, write_rows

import sdm_mlx.storage.datasets as datasets_module
import sdm_mlx.validation as validation_module
from sdm_mlx import cli
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.estimator.chunking import concat_predictions

N_ROWS = 50


@pytest.fixture
def counted(monkeypatch):
    """Rows passed through each feature validator, and the batch sizes the estimator scored."""
    seen = {"reader_rows": 0, "validator_rows": 0, "scored_batches": []}
    parse_rows, features = datasets_module.parse_rows, validation_module.features
    scored = SDMEstimator._estimate_checked

    def counting_parse_rows(batch, *args, **kwargs):
        ds = parse_rows(batch, *args, **kwargs)
        seen["reader_rows"] += len(ds)
        return ds

    def counting_features(X, *args, **kwargs):
        out = features(X, *args, **kwargs)
        seen["validator_rows"] += out.shape[0]
        return out

    def counting_scored(self, X, *args, **kwargs):
        seen["scored_batches"].append(len(X))
        return scored(self, X, *args, **kwargs)

    monkeypatch.setattr(datasets_module, "parse_rows", counting_parse_rows)
    monkeypatch.setattr(validation_module, "features", counting_features)
    monkeypatch.setattr(SDMEstimator, "_estimate_checked", counting_scored)
    return seen


def _predict(lab, tmp_path, name: str, *extra) -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    rc = cli.main(["predict", "--model", str(lab / "model"), "--input", str(tmp_path / "in.jsonl"),
                   "--output", str(out), "--quiet", *extra])
    assert rc == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_predict_validates_each_row_once_and_scores_the_read_chunks(lab, tmp_path, counted):
    write_rows(tmp_path / "in.jsonl", rows(N_ROWS, seed=3, both=False))
    chunked = _predict(lab, tmp_path, "chunked", "--chunk-rows", "16")
    assert counted["reader_rows"] == N_ROWS  # the reader validated every row ...
    assert counted["validator_rows"] == 0  # ... and nothing validated the features again
    assert counted["scored_batches"] == [16, 16, 16, 2]  # the reader's chunks, not split again

    whole = _predict(lab, tmp_path, "whole")  # one chunk (the default --chunk-rows is 8192)
    assert counted["scored_batches"][4:] == [N_ROWS]
    assert chunked == whole
    assert [r["id"] for r in whole] == list(range(N_ROWS))


def test_predict_over_more_rows_than_a_chunk_equals_the_api(lab, tmp_path):
    data = rows(N_ROWS, seed=4, both=False)
    write_rows(tmp_path / "in.jsonl", data)
    got = _predict(lab, tmp_path, "chunked", "--chunk-rows", "7", "--n-exemplars", "2")
    est = SDMEstimator.load(lab / "model")
    X = np.asarray([r["embedding"] for r in data], dtype=np.float32)
    expected = est.estimate(X, ids=[r["id"] for r in data], n_exemplars=2).to_dicts()
    for row, r in zip(expected, data):
        row["label"] = r["label"]
    assert got == json.loads(json.dumps(expected))


def test_evaluate_validates_each_row_once(lab, tmp_path, counted):
    path = write_rows(tmp_path / "eval.jsonl", rows(N_ROWS, seed=5, both=False))
    rc = cli.main(["evaluate", "--model", str(lab / "model"), "--input", path, "--report",
                   str(tmp_path / "report.json"), "--quiet"])
    assert rc == 0
    assert counted["reader_rows"] == N_ROWS
    assert counted["validator_rows"] == 0
    assert counted["scored_batches"] == [N_ROWS]


def test_the_public_estimate_validates_each_row_once(lab, counted):
    est = SDMEstimator.load(lab / "model")
    X = np.asarray([r["embedding"] for r in rows(N_ROWS, seed=6, both=False)], dtype=np.float64)
    whole = est.estimate(X)
    assert counted["validator_rows"] == N_ROWS and counted["scored_batches"] == [N_ROWS]
    chunked = concat_predictions(list(est.iter_estimate(X, chunk_rows=20)))
    assert counted["validator_rows"] == 2 * N_ROWS and counted["scored_batches"][1:] == [20, 20, 10]
    assert chunked.to_dicts() == whole.to_dicts()
    X[37, 2] = np.nan
    with pytest.raises(ValueError, match=r"rows 20\.\.39: features: features contain NaN or Inf \(rows \[17\]\)"):
        list(est.iter_estimate(X, chunk_rows=20))
    with pytest.raises(ValueError, match=r"features: features contain NaN or Inf \(rows \[37\]\)"):
        est.estimate(X)


def test_predict_reads_its_input_once_with_the_progress_bar_on(lab, tmp_path, monkeypatch):
    import builtins

    path = tmp_path / "in.jsonl"
    write_rows(path, rows(N_ROWS, seed=3, both=False))
    opened, real_open = [], builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file) == str(path):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    out = tmp_path / "out.jsonl"
    assert cli.main(["predict", "--model", str(lab / "model"), "--input", str(path), "--output", str(out)]) == 0
    assert len(opened) == 1  # no second pass to count the rows for the bar
    assert len(out.read_text().splitlines()) == N_ROWS


def test_scoring_does_not_recheck_the_arrays_the_estimator_made(lab, monkeypatch):
    """The features are checked once at the boundary; the index and the calibration math take the estimator's
    own arrays (h', ŷ, q, d, the SDM output) unchecked."""
    from sdm_mlx.calibration import conditional
    from sdm_mlx.index import exact

    calls = []
    for module, name in ((exact, "_as_float32_matrix"), (exact, "check_predictions"), (conditional, "_matrix"),
                         (conditional, "_vector")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    est = SDMEstimator.load(lab / "model")
    X = np.asarray([r["embedding"] for r in rows(N_ROWS, seed=3, both=False)], dtype=np.float32)
    est.estimate(X)  # the first call validates each level's record once (built by the package at load)
    calls.clear()
    est.estimate(X)
    assert calls == []
