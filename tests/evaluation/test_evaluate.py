"""Evaluation (sdm_mlx.evaluation.evaluate), the `evaluate` CLI verb and `demo --quick`."""

from __future__ import annotations

import copy
import json
import os
import re
import pickle
import stat
from types import SimpleNamespace

import numpy as np
import pytest

from sdm_mlx import cli
from sdm_mlx.evaluation.baselines import run_baselines
from sdm_mlx.storage.datasets import Dataset, read_jsonl
from sdm_mlx.calibration.reasons import REASONS
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.evaluation.evaluate import (
    DEFAULT_BASELINES,
    SDM_ESTIMATORS,
    baseline_options,
    calibration_from_data,
    evaluate,
    format_evaluation,
    label_error_records,
    predict_datasets,
)
from sdm_mlx.storage.files import loads_strict, write_jsonl
from sdm_mlx.evaluation.metrics import REPORT_KEYS, index_conditional_report
from sdm_mlx.evaluation.plots import plots_available

C = 3
ALPHA = 0.6
SWEEP = [0.7, 0.9]


def _blobs(n, rng, shift=0.0, scale=1.0, dim=8):
    centers = np.eye(C, dim) * 4.0
    y = rng.integers(0, C, n)
    X = centers[y] + rng.normal(0.0, scale, (n, dim)) + shift
    return X.astype(np.float32), y.astype(np.int64)


@pytest.fixture(scope="module")
def setup():
    """A small fitted estimator (3 Gaussian blobs) and two labelled evaluation sets:
    in-distribution with 10 flipped labels, and a shifted/noisier one."""
    rng = np.random.default_rng(0)
    X, y = _blobs(1000, rng)
    ids = [f"p{i}" for i in range(len(y))]
    est = SDMEstimator(
        alpha=ALPHA, iterations=1, epochs=8, exemplar_dim=32, learning_rate=1e-2, batch_size=20,
        rescaler_max_epochs=30, rescaler_engine="numpy", verbose=False, seed=0, class_names=["a", "b", "c"],
    ).fit(X, y, ids_train=ids)
    Xt, yt = _blobs(200, rng)
    yt[:10] = (yt[:10] + 1) % C  # annotation errors
    Xs, ys = _blobs(150, rng, shift=1.5, scale=2.5)
    datasets = {
        "test": Dataset(ids=[f"t{i}" for i in range(200)], X=Xt, y=yt, documents=[f"doc {i}" for i in range(200)],
                        source="test"),
        "shifted": Dataset(ids=list(range(150)), X=Xs, y=ys, source="shifted"),
    }
    pool = Dataset(ids=ids, X=X, y=y, documents=[f"pool {i}" for i in range(len(y))])
    return SimpleNamespace(est=est, datasets=datasets, pool=pool)


@pytest.fixture(scope="module")
def report(setup):
    est = setup.est
    preds = predict_datasets(est, setup.datasets)
    rep = evaluate(est, setup.datasets, est.calibration_logits_, est.calibration_labels_, alphas=SWEEP,
                   predictions=preds)
    return SimpleNamespace(report=rep, predictions=preds)


# --------------------------------------------------------------------------- evaluate()


def test_report_structure_and_json(setup, report):
    rep = report.report
    text = json.dumps(rep, allow_nan=False)  # strict JSON: no NaN / inf anywhere
    assert json.loads(text) == rep
    for key in ("schema_version", "alpha", "alphas", "num_classes", "class_names", "primary_estimator",
                "estimators", "model", "baselines", "datasets", "warnings"):
        assert key in rep
    assert rep["alpha"] == ALPHA and rep["num_classes"] == C and rep["class_names"] == ["a", "b", "c"]
    assert rep["alphas"] == sorted(set(SWEEP + [ALPHA]))
    assert rep["estimators"] == list(DEFAULT_BASELINES) + list(SDM_ESTIMATORS)
    assert rep["primary_estimator"] == "sdm_p_lower"
    assert rep["baselines"]["skipped"] == {}
    assert rep["baselines"]["n_calibration"] == len(setup.est.calibration_ids_)
    assert set(rep["baselines"]["params"]) == set(DEFAULT_BASELINES)
    assert list(rep["datasets"]) == ["test", "shifted"]
    for name, ds in rep["datasets"].items():
        n = len(setup.datasets[name])
        assert ds["n"] == n and sum(ds["label_counts"]) == n and sum(ds["prediction_counts"]) == n
        assert list(ds["reports"]) == rep["estimators"]
        for r in ds["reports"].values():
            assert tuple(r) == REPORT_KEYS and r["alpha"] == ALPHA
        assert sorted(ds["calibrated"] + ds["violated"]) == sorted(rep["estimators"])
        assert set(ds["all_rejected"]) <= set(ds["calibrated"])
        for e, pts in ds["sweep"].items():
            assert [p["alpha"] for p in pts] == rep["alphas"]
            at = pts[rep["alphas"].index(ALPHA)]
            r = ds["reports"][e]
            assert at["n_admitted"] == r["marginal"]["n_admitted"]
            assert at["min_conditional_accuracy"] == r["min_conditional_accuracy"]
            assert at["index_conditional_calibrated"] == r["index_conditional_calibrated"]
        hb = ds["hard_bins"]
        n_adm = ds["reports"]["sdm_p_lower"]["marginal"]["n_admitted"]
        assert len(hb["bins"]) == len(hb["admitted"]) == len(hb["rejected"])
        assert sum(hb["admitted"]) == sum(hb["admitted_lower"]) == n_adm
        assert sum(hb["rejected"]) == sum(hb["rejected_lower"]) == n - n_adm
        assert sum(ds["rejection_reasons"].values()) == n - n_adm
        assert "" not in ds["rejection_reasons"]
        assert ds["reports"]["no_reject"]["marginal"]["n_admitted"] == n


def test_sdm_reports_match_predictions(setup, report):
    for name, ds in setup.datasets.items():
        pred = report.predictions[name]
        reps = report.report["datasets"][name]["reports"]
        for key, adm in (("sdm_p_lower", pred.admitted), ("sdm_p_centroid", pred.estimate.centroid.valid),
                         ("sdm_p_upper", pred.estimate.upper.valid)):
            assert reps[key] == index_conditional_report(ds.y, pred.prediction, adm, C, ALPHA)


def test_baseline_reports_match_run_baselines(setup, report):
    est = setup.est
    for name, ds in setup.datasets.items():
        z = report.predictions[name].logits
        expected = run_baselines(est.calibration_logits_, est.calibration_labels_, z, ds.y, ALPHA,
                                 names=list(DEFAULT_BASELINES), options=baseline_options())
        for b in DEFAULT_BASELINES:
            assert report.report["datasets"][name]["reports"][b] == json.loads(json.dumps(expected[b]))


def test_sweep_matches_rethresholded_estimates(setup, report, tmp_path):
    est = setup.est
    assert est.alpha == ALPHA
    ds = setup.datasets["test"]
    for a in SWEEP:
        pts = {e: p for e, pt in report.report["datasets"]["test"]["sweep"].items() for p in pt if p["alpha"] == a}
        pred = est.estimate(ds.X, ds.ids, n_exemplars=0, alpha=a)
        assert pts["sdm_p_lower"]["n_admitted"] == int(pred.admitted.sum())
        assert pts["sdm_p_centroid"]["n_admitted"] == int(pred.estimate.centroid.valid.sum())
        assert pts["sdm_p_upper"]["n_admitted"] == int(pred.estimate.upper.valid.sum())
    # the same as storing α' in a copy of the model with recalibrate
    est.save(tmp_path / "m")
    other = SDMEstimator.load(tmp_path / "m").recalibrate(SWEEP[0])
    assert other.estimate(ds.X).to_dicts() == est.estimate(ds.X, alpha=SWEEP[0]).to_dicts()
    assert est.alpha == ALPHA


def _snapshot(value) -> bytes:
    """Bytes of a fitted attribute; an MLX module by its parameter values (its pickle also carries
    internals that are not the model)."""
    if hasattr(value, "parameters") and callable(value.parameters):
        from mlx.utils import tree_flatten

        return pickle.dumps([(k, np.array(v)) for k, v in tree_flatten(value.parameters())])
    return pickle.dumps(value)


def test_evaluate_never_modifies_the_estimator(setup):
    est, ds = setup.est, setup.datasets["test"]
    params = copy.deepcopy(est.get_params())
    state = {k: copy.deepcopy(v) for k, v in vars(est).items() if k.endswith("_") and not k.startswith("_")}
    rows = est.estimate(ds.X, ds.ids).to_dicts()
    evaluate(est, {"test": ds}, est.calibration_logits_, est.calibration_labels_, alphas=[0.7, 0.8, 0.9, 0.97])
    assert est.get_params() == params
    for k, v in state.items():
        assert _snapshot(getattr(est, k)) == _snapshot(v), k
    assert est.estimate(ds.X, ds.ids).to_dicts() == rows


def test_evaluate_without_calibration_logits(setup):
    rep = evaluate(setup.est, {"test": setup.datasets["test"]}, alphas=[0.8])
    assert rep["estimators"] == ["no_reject", "softmax"] + list(SDM_ESTIMATORS)
    assert set(rep["baselines"]["skipped"]) == {"temperature", "aps", "raps"}
    assert "skipped baselines" in format_evaluation(rep)
    assert setup.est.alpha == ALPHA


def test_evaluate_rejects_bad_inputs(setup):
    est, ds = setup.est, setup.datasets["test"]
    unlabelled = Dataset(ids=ds.ids, X=ds.X, y=None)
    with pytest.raises(ValueError, match="no labels"):
        evaluate(est, {"u": unlabelled})
    bad = Dataset(ids=ds.ids, X=ds.X, y=np.full(len(ds), C))
    with pytest.raises(ValueError, match="must lie in"):
        evaluate(est, {"b": bad})
    with pytest.raises(ValueError):
        evaluate(est, {"test": ds}, alphas=[0.3])
    with pytest.raises(ValueError, match="no evaluation sets"):
        evaluate(est, {})


def test_format_evaluation_has_one_table_per_set(report):
    text = format_evaluation(report.report)
    assert text.count("== test: 200 rows") == 1 and text.count("== shifted: 150 rows") == 1
    for e in report.report["estimators"]:
        assert text.count(f"\n{e} ") == 2
    assert "index-conditional calibration at alpha'=0.6 holds for" in text
    assert "classes: 0=a, 1=b, 2=c" in text


def test_label_error_records_sorted_and_complete(setup, report):
    rows = label_error_records(setup.datasets, report.predictions, ["a", "b", "c"])
    expected = set()
    for name, ds in setup.datasets.items():
        pred = report.predictions[name]
        for i in np.flatnonzero(pred.admitted & (pred.prediction != ds.y)):
            expected.add((name, ds.ids[i]))
    assert {(r["dataset"], r["id"]) for r in rows} == expected
    p = [r["p_lower"] for r in rows]
    assert p == sorted(p, reverse=True)
    for r in rows:
        assert r["label"] != r["prediction"]
        assert {"id", "document", "label", "prediction", "p_lower", "p_centroid", "p_upper", "n_hat"} <= set(r)
        assert r["prediction_name"] == "abc"[r["prediction"]]


def test_label_error_records_order_on_handmade_predictions():
    ds = Dataset(ids=["a", "b", "c", "d"], X=np.zeros((4, 2), np.float32), y=np.array([0, 1, 1, 0]),
                 documents=["A", "B", "C", "D"])
    pred = SimpleNamespace(
        admitted=np.array([True, True, False, True]), prediction=np.array([1, 0, 0, 0]),
        p_lower=np.array([0.96, 0.99, 0.999, 0.97]), p_centroid=np.array([0.97, 0.995, 1.0, 0.98]),
        p_upper=np.array([0.98, 0.999, 1.0, 0.99]), n_hat=np.array([[5, 7], [9, 3], [1, 1], [4, 4]]),
        hard_bin=np.array([3, 4, 5, 3]),
    )
    rows = label_error_records({"x": ds}, {"x": pred})
    assert [r["id"] for r in rows] == ["b", "a"]  # c is rejected, d is correct
    assert rows[0]["n_hat"] == 9 and rows[1]["n_hat"] == 7  # n̂ of the predicted class
    assert rows[0]["document"] == "B" and "admitted" not in rows[0]


def test_calibration_logits_saved_loaded_and_recomputable(setup, tmp_path):
    est = setup.est
    assert est.calibration_logits_.shape == (len(est.calibration_ids_), C)
    assert np.array_equal(est.calibration_labels_, setup.pool.subset(
        [setup.pool.ids.index(i) for i in est.calibration_ids_]).y)
    est.save(tmp_path / "m")
    loaded = SDMEstimator.load(tmp_path / "m")
    np.testing.assert_array_equal(loaded.calibration_logits_, est.calibration_logits_)
    np.testing.assert_array_equal(loaded.calibration_labels_, est.calibration_labels_)
    z, y = calibration_from_data(loaded, setup.pool)
    np.testing.assert_allclose(z, est.calibration_logits_, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y, est.calibration_labels_)
    with pytest.raises(ValueError, match="calibration ids are not in the file"):
        calibration_from_data(loaded, setup.datasets["test"])


# --------------------------------------------------------------------------- CLI


def _write(path, ds: Dataset, with_labels=True):
    rows = []
    for i, x in enumerate(ds.X):
        row = {"id": ds.ids[i], "embedding": [float(v) for v in x]}
        if with_labels:
            row["label"] = int(ds.y[i])
        if ds.documents[i] is not None:
            row["document"] = ds.documents[i]
        rows.append(row)
    write_jsonl(path, rows)
    return str(path)


@pytest.fixture(scope="module")
def cli_files(setup, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    setup.est.save(d / "model")
    old = SDMEstimator.load(d / "model")
    old.calibration_logits_ = old.calibration_labels_ = None  # as an artifact written before they were stored
    old.save(d / "model_old")
    return SimpleNamespace(
        dir=d, model=str(d / "model"), model_old=str(d / "model_old"),
        test=_write(d / "test.jsonl", setup.datasets["test"]),
        shifted=_write(d / "shifted.jsonl", setup.datasets["shifted"]),
        pool=_write(d / "pool.jsonl", setup.pool),
    )


def test_cli_evaluate_end_to_end(cli_files, capsys, monkeypatch):
    import sdm_mlx.evaluation.plots as plots_mod

    monkeypatch.setattr(plots_mod, "plots_available", lambda: False)  # as without matplotlib
    d = cli_files.dir
    rc = cli.main(["evaluate", "--model", cli_files.model, "--input", cli_files.test, "--input", cli_files.shifted,
                   "--report", str(d / "out" / "report.json"), "--label-errors", str(d / "out" / "errors.jsonl"),
                   "--plots", str(d / "plots"), "--alphas", "0.7", "0.9", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "== test: 200 rows" in out and "== shifted: 150 rows" in out
    for e in list(DEFAULT_BASELINES) + list(SDM_ESTIMATORS):
        assert out.count(f"\n{e} ") == 2
    assert "matplotlib" in err and "no plots" in err
    assert not (d / "plots").exists() or not any((d / "plots").iterdir())
    rep = json.loads((d / "out" / "report.json").read_text())
    assert list(rep["datasets"]) == ["test", "shifted"]
    assert rep["alphas"] == [0.6, 0.7, 0.9]
    assert rep["inputs"] == {"test": cli_files.test, "shifted": cli_files.shifted}
    assert rep["model_path"] == cli_files.model
    rows = [json.loads(line) for line in (d / "out" / "errors.jsonl").read_text().splitlines()]
    assert len(rows) == sum(ds["label_errors"] for ds in rep["datasets"].values())
    assert [r["p_lower"] for r in rows] == sorted((r["p_lower"] for r in rows), reverse=True)
    for r in rows:
        assert {"id", "dataset", "document", "label", "prediction", "p_lower", "p_centroid", "p_upper",
                "n_hat"} <= set(r)


@pytest.mark.skipif(not plots_available(), reason="matplotlib not installed")
def test_cli_evaluate_writes_plots(cli_files, capsys):
    pdir = cli_files.dir / "plots_real"
    rc = cli.main(["evaluate", "--model", cli_files.model, "--input", cli_files.test, "--plots", str(pdir),
                   "--alphas", "0.7", "--quiet"])
    assert rc == 0
    names = sorted(os.listdir(pdir))
    assert names == ["test_admitted_vs_accuracy.png", "test_hard_bins.png"]
    for n in names:
        assert (pdir / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_evaluate_old_model_with_and_without_calibration_data(cli_files, capsys):
    d = cli_files.dir
    rc = cli.main(["evaluate", "--model", cli_files.model_old, "--input", cli_files.test, "--alphas", "0.7",
                   "--report", str(d / "old.json")])
    out, err = capsys.readouterr()
    assert rc == 0 and "--calibration-data" in err and "skipped baselines" in out
    assert set(json.loads((d / "old.json").read_text())["baselines"]["skipped"]) == {"temperature", "aps", "raps"}
    rc = cli.main(["evaluate", "--model", cli_files.model_old, "--input", cli_files.test, "--alphas", "0.7",
                   "--calibration-data", cli_files.pool, "--report", str(d / "old2.json"), "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rep2 = json.loads((d / "old2.json").read_text())
    rep_new = json.loads(json.dumps(evaluate(SDMEstimator.load(cli_files.model),
                                             {"test": read_jsonl(cli_files.test)},
                                             *_stored(cli_files.model), alphas=[0.7])))
    assert rep2["baselines"]["skipped"] == {}
    assert rep2["datasets"]["test"]["reports"] == rep_new["datasets"]["test"]["reports"]


def _stored(model):
    est = SDMEstimator.load(model)
    return est.calibration_logits_, est.calibration_labels_


def test_cli_evaluate_errors(cli_files, tmp_path, capsys):
    assert cli.main(["evaluate", "--input", cli_files.test]) == 2
    assert "--model" in capsys.readouterr().err
    unl = tmp_path / "unlabelled.jsonl"
    unl.write_text(json.dumps({"id": 1, "embedding": [0.0] * 8}) + "\n")
    assert cli.main(["evaluate", "--model", cli_files.model, "--input", str(unl), "--quiet"]) == 2
    assert "label" in capsys.readouterr().err
    wide = tmp_path / "wide.jsonl"
    wide.write_text(json.dumps({"id": 1, "label": 0, "embedding": [0.0] * 5}) + "\n")
    assert cli.main(["evaluate", "--model", cli_files.model, "--input", str(wide), "--quiet"]) == 2
    assert "dimension" in capsys.readouterr().err


def test_demo_quick_end_to_end(tmp_path, capsys):
    out_dir = tmp_path / "demo"
    rc = cli.main(["demo", "--quick", "--output", str(out_dir), "--quiet", "--no-plots"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "== heldout_topics: 912 rows" in out and "== generated: 245 rows" in out
    for e in list(DEFAULT_BASELINES) + list(SDM_ESTIMATORS):
        assert out.count(f"\n{e} ") == 2
    assert "sdm-mlx evaluate --model" in out
    # the settings used, and why they differ from `sdm-mlx train`'s; the rejection reasons under each table
    assert "settings: J=2 rounds of up to 4 epochs, M=256" in out and "a smoke run" in out
    for name, block in zip(("heldout_topics", "generated"), out.split("\n== ")[1:]):
        reasons = loads_strict((out_dir / "report.json").read_text())["datasets"][name]["rejection_reasons"]
        assert f"rejected by sdm_p_lower: {sum(reasons.values())} of " in block
        for reason, count in reasons.items():
            line = rf"^ +{count}  {reason}: {re.escape(REASONS[reason].plain_line)}$"  # the one text of each reason
            assert re.search(line, block, re.M), (reason, count, block)
    rep = loads_strict((out_dir / "report.json").read_text())  # strict JSON: no NaN / Infinity
    loads_strict((out_dir / "model" / "manifest.json").read_text())
    assert list(rep["datasets"]) == ["heldout_topics", "generated"]
    assert rep["demo"]["settings"]["mode"] == "quick"
    assert rep["class_names"] == ["false", "true"]
    assert (out_dir / "label_errors.jsonl").exists()
    assert (out_dir / "model" / "manifest.json").exists()
    for name, n in (("pool", 5173), ("heldout_topics", 912), ("generated", 245)):
        assert len(read_jsonl(out_dir / "data" / f"{name}.jsonl")) == n
    est = SDMEstimator.load(out_dir / "model")
    assert len(est.rounds_) == 2 and est.calibration_logits_ is not None
    assert est.feature_field_ == "attributes"
    assert stat.S_IMODE(os.stat(out_dir / "model" / "manifest.json").st_mode) == 0o644
