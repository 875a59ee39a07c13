"""Input normalisation of the estimator (DESIGN #2): scalar (default), per-dimension, none."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sdm_mlx import SDMEstimator
from sdm_mlx.core.adaptor import fit_normalization, normalize_mode, per_dimension_normalization, scalar_normalization
from sdm_mlx.storage.artifact import ArtifactError
from sdm_mlx.errors import InputError

FAST = dict(alpha=0.9, iterations=2, epochs=6, exemplar_dim=16, learning_rate=1e-3, batch_size=16, seed=0)


def llm_like(n: int = 120, seed: int = 0):
    """Rows whose signal lies in small dimensions while two huge, near-constant dimensions dominate the
    scale (the "massive activations" of LLM hidden states, docs/performance.md)."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    X = rng.normal(0.0, 0.05, (n, 12)).astype(np.float32)
    X[:, :6] += (y[:, None] * 2 - 1) * 0.1  # the signal: ±0.1 on six dimensions
    X[:, 6] += 400.0 + rng.normal(0, 30.0, n)  # huge offsets with large, signal-free spread
    X[:, 7] -= 250.0 + rng.normal(0, 20.0, n)
    return X.astype(np.float32), y


def test_statistics_are_the_training_rows_with_ddof_1():
    X = np.array([[1.0, 5.0, 2.0], [3.0, 5.0, 4.0], [8.0, 5.0, 0.0]])
    mean, std = per_dimension_normalization(X)
    np.testing.assert_allclose(mean, X.mean(axis=0))
    np.testing.assert_allclose(std, [X[:, 0].std(ddof=1), 1.0, X[:, 2].std(ddof=1)])  # constant dim: std 1
    m, s = scalar_normalization(X)
    assert m == pytest.approx(X.mean()) and s == pytest.approx(X.std(ddof=1))
    assert fit_normalization(X, "none") is None
    assert normalize_mode(True) == "scalar" and normalize_mode(False) == "none"
    with pytest.raises(InputError, match="normalize must be one of scalar, per-dimension, none"):
        normalize_mode("zscore")
    with pytest.raises(InputError, match="at least two training rows"):
        per_dimension_normalization(X[:1])


def test_default_is_scalar_and_unchanged():
    """The default stays the paper's scalar normalisation: same model as normalize="scalar" and as the old
    normalize=True spelling, bit for bit in the same run."""
    X, y = llm_like()
    assert SDMEstimator().normalize == "scalar"
    fits = [SDMEstimator(**FAST, **kw).fit(X, y) for kw in ({}, {"normalize": "scalar"}, {"normalize": True})]
    outs = [f.estimate(X) for f in fits]
    for o in outs[1:]:
        np.testing.assert_array_equal(o.p_lower, outs[0].p_lower)
        np.testing.assert_array_equal(o.logits, outs[0].logits)
    assert np.asarray(fits[0].model_.input_mean).shape == ()


def test_invalid_mode_is_refused_at_fit():
    X, y = llm_like(40)
    with pytest.raises(InputError, match="normalize must be one of"):
        SDMEstimator(**FAST, normalize="z").fit(X, y)


def test_per_dimension_learns_where_scalar_cannot_and_round_trips(tmp_path):
    X, y = llm_like(160)
    Xt, yt = llm_like(200, seed=1)
    per_dim = SDMEstimator(**FAST, normalize="per-dimension").fit(X, y)
    scalar = SDMEstimator(**FAST).fit(X, y)
    acc_pd = float(np.mean(per_dim.predict(Xt) == yt))
    acc_sc = float(np.mean(scalar.predict(Xt) == yt))
    assert acc_pd >= 0.9 and acc_pd > acc_sc + 0.2, (acc_pd, acc_sc)
    mean = np.asarray(per_dim.model_.input_mean)
    assert mean.shape == (12,)
    # fitted on a round's training half: close to, not equal to, the full pool's statistics
    assert abs(float(mean[6]) - float(X[:, 6].mean())) < 10.0
    per_dim.save(tmp_path / "m")
    loaded = SDMEstimator.load(tmp_path / "m")
    assert loaded.normalize == "per-dimension"
    np.testing.assert_array_equal(np.asarray(loaded.model_.input_std), np.asarray(per_dim.model_.input_std))
    np.testing.assert_array_equal(loaded.estimate(Xt).p_lower, per_dim.estimate(Xt).p_lower)


def test_none_keeps_raw_inputs_and_the_artifact_is_checked(tmp_path):
    X, y = llm_like(60)
    est = SDMEstimator(**FAST, normalize="none").fit(X, y)
    assert float(np.asarray(est.model_.input_mean)) == 0.0 and float(np.asarray(est.model_.input_std)) == 1.0
    est.save(tmp_path / "m")
    assert SDMEstimator.load(tmp_path / "m").normalize == "none"
    from sdm_mlx.estimator.persistence import _check_normalization

    est.normalize = "per-dimension"  # the stored scalar statistics do not fit this mode
    with pytest.raises(ArtifactError, match="needs input statistics of shape"):
        _check_normalization(est.normalize, {"input_mean": np.zeros(()), "input_std": np.ones(())}, 12)
    est.normalize = "none"
    with pytest.raises(ArtifactError, match="normalize 'none' but"):
        _check_normalization(est.normalize, {"input_mean": np.array(3.0), "input_std": np.array(1.0)}, 12)
    with pytest.raises(ArtifactError, match="not finite"):
        _check_normalization(est.normalize, {"input_mean": np.array(0.0), "input_std": np.array(0.0)}, 12)


def _write_rows(path, X, y, extra=None):
    with open(path, "w") as f:
        for i, (x, lab) in enumerate(zip(X, y)):
            f.write(json.dumps({"id": i, "label": int(lab), "embedding": [float(v) for v in x], **(extra or {})}) + "\n")


def _train(tmp_path, name, rows, *flags):
    args = [sys.executable, "-m", "sdm_mlx", "train", "--train", str(rows), "--output", str(tmp_path / name),
            "--iterations", "1", "--epochs", "2", "--exemplar-dim", "8", *flags]
    return subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})


def _stored_mode(path):
    return SDMEstimator.load(path).normalize, np.asarray(SDMEstimator.load(path).model_.input_mean).shape


def test_cli_normalize_option_and_llm_default(tmp_path):
    X, y = llm_like(40)
    plain, llm = tmp_path / "plain.jsonl", tmp_path / "llm.jsonl"
    _write_rows(plain, X, y)
    _write_rows(llm, X, y, {"embedding_source": "llm-hidden-states"})  # as sdm-mlx embed writes them
    r = _train(tmp_path, "a", plain)
    assert r.returncode == 0, r.stderr
    assert _stored_mode(tmp_path / "a") == ("scalar", ())
    r = _train(tmp_path, "b", llm)
    assert r.returncode == 0, r.stderr
    assert "normalize: per-dimension" in r.stderr
    assert _stored_mode(tmp_path / "b") == ("per-dimension", (12,))
    r = _train(tmp_path, "c", llm, "--normalize", "scalar")  # an explicit choice wins over the LLM default
    assert r.returncode == 0 and "normalize: per-dimension" not in r.stderr
    assert _stored_mode(tmp_path / "c") == ("scalar", ())
    r = _train(tmp_path, "d", plain, "--normalize", "per-dimension")
    assert r.returncode == 0 and _stored_mode(tmp_path / "d") == ("per-dimension", (12,))
    r = _train(tmp_path, "e", plain, "--no-normalize")
    assert r.returncode == 0 and _stored_mode(tmp_path / "e") == ("none", ())
    cfg = tmp_path / "c.yaml"
    cfg.write_text("normalize: per-dimension\n")
    r = _train(tmp_path, "f", plain, "-c", str(cfg))
    assert r.returncode == 0 and _stored_mode(tmp_path / "f") == ("per-dimension", (12,))
    r = _train(tmp_path, "g", plain, "--normalize", "zscore")
    assert r.returncode == 2 and "invalid choice: 'zscore'" in r.stderr
