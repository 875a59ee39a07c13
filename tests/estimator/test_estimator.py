import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from sdm_mlx.storage.artifact import ArtifactError
from sdm_mlx.cli import main
from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.errors import NotFittedError
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.evaluation.metrics import index_conditional_report

FAST = dict(iterations=2, epochs=4, exemplar_dim=32, learning_rate=1e-3, rescaler_max_epochs=60, verbose=False)


def gaussians(rng, n, shift=0.0, dim=8, sep=0.5):
    y = rng.integers(0, 2, n)
    mu = np.where(y[:, None] == 1, sep, -sep) * np.ones((n, dim))
    return (mu + rng.normal(size=(n, dim)) + shift).astype(np.float32), y


@pytest.fixture(scope="module")
def gaussian_model():
    rng = np.random.default_rng(0)
    X, y = gaussians(rng, 2000)
    est = SDMEstimator(alpha=0.9, iterations=3, epochs=8, exemplar_dim=32, learning_rate=1e-3,
                       rescaler_max_epochs=200, verbose=False).fit(X, y)
    return est, rng


def test_known_shift_index_conditional_and_ood(gaussian_model):
    est, rng = gaussian_model
    Xt, yt = gaussians(rng, 3000)
    p = est.estimate(Xt)
    report = index_conditional_report(yt, p.prediction, p.admitted, 2, 0.9)
    assert p.admitted.mean() > 0.1  # a useful fraction is admitted in-distribution
    for cond in report["class_conditional"] + report["prediction_conditional"]:
        if cond["n_admitted"] >= 30:
            assert cond["accuracy"] >= 0.9, cond
    assert report["index_conditional_calibrated"]
    # far-away points: rejected as out-of-distribution
    Xf, _ = gaussians(rng, 200, shift=30.0)
    pf = est.estimate(Xf)
    assert not pf.admitted.any()
    assert set(pf.rejection_reason) <= {"ood_distance", "ood_similarity"}
    assert (pf.d == 0).all()


def test_per_row_output_fields(gaussian_model):
    est, rng = gaussian_model
    X, _ = gaussians(rng, 5)
    p = est.estimate(X, ids=["a", "b", "c", "d", "e"], n_exemplars=3)
    rows = p.to_dicts()
    assert [r["id"] for r in rows] == ["a", "b", "c", "d", "e"]
    keys = {"id", "prediction", "admitted", "rejection_reason", "p_lower", "p_centroid", "p_upper", "q", "d0", "d",
            "logits", "sdm", "q_tilde", "hard_bin", "q_tilde_lower", "hard_bin_lower", "q_tilde_upper",
            "hard_bin_upper", "n_hat", "offset", "exemplars"}
    assert keys <= set(rows[0])
    assert len(rows[0]["exemplars"]) == 3
    ex = rows[0]["exemplars"]
    assert ex[0]["squared_distance"] <= ex[1]["squared_distance"] <= ex[2]["squared_distance"]
    assert ex[0]["squared_distance"] == pytest.approx(rows[0]["d0"], rel=1e-4, abs=1e-6)
    for r in rows:
        assert (r["rejection_reason"] is None) == r["admitted"]
        assert r["p_lower"] <= r["p_centroid"] + 1e-9
    json.dumps(rows)


def test_recalibrate_higher_alpha_admits_no_more(gaussian_model):
    est, rng = gaussian_model
    X, _ = gaussians(rng, 2000)
    base = est.estimate(X).admitted
    est.recalibrate(0.97)
    try:
        stricter = est.estimate(X).admitted
    finally:
        est.recalibrate(0.9)
    assert stricter.sum() <= base.sum()
    assert np.array_equal(est.estimate(X).admitted, base)


def test_factcheck_save_load_fresh_process_identical(tmp_path):
    pool, _, gen = factcheck_splits()
    est = SDMEstimator(**FAST).fit(pool.X, pool.y, ids_train=pool.ids)
    model_dir = tmp_path / "model"
    est.save(model_dir)
    expected = est.estimate(gen.X, ids=gen.ids).to_dicts()
    np.save(tmp_path / "x.npy", gen.X)
    code = (
        "import json, numpy as np, sys\n"
        "from sdm_mlx.estimator import SDMEstimator\n"
        f"est = SDMEstimator.load({str(model_dir)!r})\n"
        f"X = np.load({str(tmp_path / 'x.npy')!r})\n"
        "json.dump(est.estimate(X, ids=list(range(len(X)))).to_dicts(), sys.stdout)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    for a, b in zip(expected, got):
        b["id"] = a["id"]
        assert a == b


def test_bad_inputs_clear_errors(gaussian_model):
    est, rng = gaussian_model
    X, y = gaussians(rng, 50)
    with pytest.raises(ValueError, match="dimension 3"):
        est.estimate(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        est.estimate(np.full((2, 8), np.nan, np.float32))
    with pytest.raises(ValueError, match="must lie in"):
        SDMEstimator(**FAST).fit(X, np.full(50, 5), num_classes=2)
    with pytest.raises(ValueError, match="two classes"):
        SDMEstimator(**FAST).fit(X, np.zeros(50, int))
    with pytest.raises(ValueError, match="fewer than 4 rows"):
        SDMEstimator(**FAST).fit(X, np.r_[np.zeros(48, int), [1, 1]])
    with pytest.raises(ValueError, match="alpha"):
        SDMEstimator(alpha=0.4, **FAST).fit(X, y)
    with pytest.raises(ValueError, match="labels"):
        SDMEstimator(**FAST).fit(X, y[:10])
    with pytest.raises(NotFittedError, match="not fitted"):
        SDMEstimator().estimate(X)
    with pytest.raises(NotFittedError, match="not fitted"):
        SDMEstimator().predict(X)


def test_corrupt_and_tampered_artifacts(gaussian_model, tmp_path):
    est, _ = gaussian_model
    path = tmp_path / "m"
    est.save(path)
    SDMEstimator.load(path)
    # tampered weights
    w = path / "adaptor.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch for adaptor"):
        SDMEstimator.load(path)
    # tampered metadata
    est.save(path, overwrite=True)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["meta"]["k"] = 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="metadata"):
        SDMEstimator.load(path)
    # wrong version / missing file / not an artifact
    est.save(path, overwrite=True)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format version 99"):
        SDMEstimator.load(path)
    (path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ArtifactError, match="expected a JSON object"):
        SDMEstimator.load(path)
    with pytest.raises(ArtifactError, match="not an sdm_mlx artifact"):  # no longer recognisable: never replaced
        est.save(path, overwrite=True)
    shutil.rmtree(path)
    est.save(path)
    os.remove(path / "support.safetensors")
    with pytest.raises(ArtifactError, match="missing"):
        SDMEstimator.load(path)
    with pytest.raises(ArtifactError, match="no model artifact"):
        SDMEstimator.load(tmp_path / "nothing")


def test_atomic_save_keeps_previous_on_crash(gaussian_model, tmp_path, monkeypatch):
    est, rng = gaussian_model
    path = tmp_path / "m"
    est.save(path)
    X, _ = gaussians(rng, 20)
    before = SDMEstimator.load(path).estimate(X).p_lower
    import sdm_mlx.storage.artifact as artifact

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(artifact, "save_file", boom)
    with pytest.raises(ArtifactError, match="disk full"):
        est.save(path, overwrite=True)
    monkeypatch.undo()
    np.testing.assert_array_equal(SDMEstimator.load(path).estimate(X).p_lower, before)
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def test_cli_train_predict_recalibrate(tmp_path, capsys):
    rng = np.random.default_rng(5)
    X, y = gaussians(rng, 400)
    _write(tmp_path / "train.jsonl", [{"id": f"r{i}", "label": int(l), "embedding": x.tolist()} for i, (x, l) in enumerate(zip(X, y))])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("iterations: 2\nepochs: 3\nexemplar-dim: 16\nlearning_rate: 0.001\nrescaler-max-epochs: 30\nquiet: true\n")
    model = tmp_path / "model"
    assert main(["train", "--config", str(cfg), "--train", str(tmp_path / "train.jsonl"), "--output", str(model)]) == 0
    report = json.loads((model / "training_report.json").read_text())
    assert report["params"]["iterations"] == 2 and report["params"]["epochs"] == 3
    Xt, yt = gaussians(rng, 30)
    _write(tmp_path / "test.jsonl", [{"id": i, "embedding": x.tolist()} for i, x in enumerate(Xt)])
    out = tmp_path / "pred.jsonl"
    assert main(["predict", "--model", str(model), "--input", str(tmp_path / "test.jsonl"), "--output", str(out)]) == 0
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(30))
    assert main(["recalibrate", "--model", str(model), "--alpha", "0.97", "--output", str(tmp_path / "m97")]) == 0
    assert SDMEstimator.load(tmp_path / "m97").alpha == 0.97
    # errors: unknown YAML key, truncated JSONL, wrong width, missing field -> exit 2 and no partial output
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("epochz: 3\n")
    assert main(["train", "--config", str(bad_cfg), "--train", "x", "--output", "y"]) == 2
    assert "unknown key" in capsys.readouterr().err
    _write(tmp_path / "trunc.jsonl", ['{"id": 1, "embedding": [1, 2, 3, 4, 5, 6, 7, 8]}', '{"id": 2, "embedd'])
    out2 = tmp_path / "none.jsonl"
    assert main(["predict", "--model", str(model), "--input", str(tmp_path / "trunc.jsonl"), "--output", str(out2)]) == 2
    assert "malformed JSON" in capsys.readouterr().err and not out2.exists()
    _write(tmp_path / "wide.jsonl", [{"id": 1, "embedding": [1.0] * 9}])
    assert main(["predict", "--model", str(model), "--input", str(tmp_path / "wide.jsonl"), "--output", str(out2)]) == 2
    assert "dimension 9" in capsys.readouterr().err and not out2.exists()
    assert main(["predict", "--model", str(model)]) == 2
    assert "--input" in capsys.readouterr().err
