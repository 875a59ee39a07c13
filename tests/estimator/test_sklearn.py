"""SDMEstimator as scikit-learn users expect it: scikit-learn's own estimator checks,
labels of any sortable type, predict / predict_proba / score / estimate, get/set_params, clone, quiet library.

scikit-learn is a test-only dependency (``pip install -e '.[test]'``).
"""

import dataclasses
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

sklearn = pytest.importorskip("sklearn")
from sklearn.base import clone, is_classifier  # noqa: E402
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from sdm_mlx.evaluation import baselines, metrics  # noqa: E402
from sdm_mlx import calibration  # noqa: E402
from sdm_mlx.storage.datasets import check_labels  # noqa: E402
from sdm_mlx.errors import InputError, NotFittedError, NothingAdmittedWarning  # noqa: E402
from sdm_mlx.estimator import SDMEstimator  # noqa: E402

#: small settings: one round, two epochs, M = 8 (the checks fit ~100 tiny models)
SMALL = dict(alpha=0.9, iterations=1, epochs=2, exemplar_dim=8, batch_size=10, learning_rate=1e-2,
             rescaler_max_epochs=5, n_exemplars=1)

#: the checks that cannot apply to SDM, and why
EXPECTED_FAILED_CHECKS = {
    "check_classifiers_train": (
        "predict is ŷ = argmax z' (the paper's prediction) while predict_proba is the SDM output, which is "
        "uniform (a tie) for rows beyond the support (d = 0): there argmax predict_proba ≠ predict; SDM rejects "
        "exactly those rows (rejection reason ood_distance / argmax_flip)"),
    "check_fit2d_1feature": (
        "the check fits 10 rows; SDM needs ≥ 4 rows per class (a training and a calibration half of ≥ 2 each) "
        "and says so"),
}


def _expected_failed(estimator):
    return EXPECTED_FAILED_CHECKS


@parametrize_with_checks([SDMEstimator(**SMALL)], expected_failed_checks=_expected_failed)
def test_sklearn_estimator_checks(estimator, check):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="calibration halves will hold fewer")
        check(estimator)


def blobs(n, seed=0, labels=("cat", "dog", "eel")):
    rng = np.random.default_rng(seed)
    k = rng.integers(0, len(labels), n)
    X = (rng.normal(size=(n, 6)) + 3.0 * np.eye(len(labels), 6)[k]).astype(np.float32)
    return X, np.asarray(labels, dtype=object)[k]


@pytest.fixture(scope="module")
def fitted():
    X, y = blobs(300)
    return SDMEstimator(**SMALL).fit(X, y), X, y


def test_string_labels_predict_score_proba_and_estimate(fitted, tmp_path):
    est, X, y = fitted
    assert is_classifier(est)
    assert list(est.classes_) == ["cat", "dog", "eel"] and est.n_features_in_ == 6
    pred = est.predict(X)
    assert isinstance(pred, np.ndarray) and set(pred) <= {"cat", "dog", "eel"}
    assert est.score(X, y) == pytest.approx(np.mean(pred == y)) and est.score(X, y) > 0.8
    proba = est.predict_proba(X)
    assert proba.shape == (300, 3)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-5)
    res = est.estimate(X[:20], ids=list(range(20)))
    np.testing.assert_array_equal(res.sdm, proba[:20])
    np.testing.assert_array_equal(est.classes_[res.prediction], pred[:20])  # JSON keeps class indices
    assert {"p_lower", "admitted", "rejection_reason", "exemplars"} <= set(res.to_dicts()[0])
    est.save(tmp_path / "m")
    back = SDMEstimator.load(tmp_path / "m")
    assert list(back.classes_) == ["cat", "dog", "eel"]
    np.testing.assert_array_equal(back.predict(X), pred)


def test_estimate_at_another_alpha_leaves_the_estimator_unchanged(fitted):
    est, X, _ = fitted
    params = est.get_params()
    before = est.estimate(X).to_dicts()
    cal = est.calibration_
    strict = est.estimate(X, alpha=0.97)
    assert est.get_params() == params and est.calibration_ is cal and est.alpha == 0.9
    assert est.estimate(X).to_dicts() == before
    assert strict.admitted.sum() <= np.asarray([r["admitted"] for r in before]).sum()
    with pytest.raises(InputError, match="alpha"):
        est.estimate(X, alpha=0.4)


def test_get_set_params_and_clone(fitted):
    est, _, _ = fitted
    params = est.get_params(deep=True)
    assert params["alpha"] == 0.9 and params["verbose"] is False and set(params) >= {"exemplar_dim", "class_names"}
    twin = clone(est)
    assert twin.get_params() == params and not twin.is_fitted
    assert twin.set_params(epochs=3, alpha=0.8) is twin and twin.epochs == 3 and est.epochs == 2
    with pytest.raises(InputError, match="invalid parameter 'epoch'"):
        twin.set_params(epoch=3)
    # no validation in __init__; fit validates
    bad = SDMEstimator(alpha="high", **{k: v for k, v in SMALL.items() if k != "alpha"})
    with pytest.raises(InputError, match="alpha must be a number"):
        bad.fit(*blobs(100))
    with pytest.raises(NotFittedError, match="not fitted"):
        SDMEstimator().predict_proba(np.zeros((2, 6)))


def test_library_is_quiet_and_the_cli_shows_progress(tmp_path, capfd):
    X, y = blobs(120, labels=(0, 1))
    SDMEstimator(**SMALL).fit(X, y)
    assert capfd.readouterr().err == ""
    rows = [{"id": i, "label": int(lab), "embedding": x.tolist()} for i, (x, lab) in enumerate(zip(X, y))]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [sys.executable, "-m", "sdm_mlx", "train", "--train", str(tmp_path / "train.jsonl"), "--iterations", "1",
            "--epochs", "2", "--exemplar-dim", "8", "--alpha", "0.9", "--rescaler-max-epochs", "5"]
    run = subprocess.run(args + ["--output", str(tmp_path / "m")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "round 1:" in run.stderr
    quiet = subprocess.run(args + ["--output", str(tmp_path / "q"), "--quiet"], capture_output=True, text=True)
    assert quiet.returncode == 0 and "round 1:" not in quiet.stderr


@pytest.mark.parametrize("labels, message", [
    (np.array([0, 1, 1.5]), "integer class labels"),
    (np.array([True, False, True]), "integer class labels"),
    (np.array([0, 1, 2]), "must lie in 0..1"),
    (np.array([0, -1, 1]), "must lie in 0..1"),
])
def test_one_label_rule_everywhere(labels, message):
    """Class-index labels are checked by one validator: the same input fails the same way everywhere."""
    n = labels.shape[0]
    calls = [
        lambda: check_labels(labels, 2, "labels"),
        lambda: calibration.output_ecdfs(np.full((n, 2), 0.5), labels, 2),
        lambda: metrics.index_conditional_report(labels, np.zeros(n, int), np.ones(n, bool), 2, 0.9),
        lambda: baselines.NoReject().fit(np.zeros((n, 2)), labels, 0.9),
        lambda: SDMEstimator(**SMALL).fit(np.zeros((n, 2)), labels, num_classes=2),
    ]
    for call in calls:
        with pytest.raises(InputError, match=message):
            call()


def test_fit_labels_any_sortable_type_but_not_continuous():
    X, y = blobs(120, labels=(0, 1))
    with pytest.raises(InputError, match="Unknown label type"):
        SDMEstimator(**SMALL).fit(X, y.astype(float) + 0.5)
    with pytest.raises(InputError, match="integer class labels"):
        SDMEstimator(**SMALL).fit(X, y.astype(bool))
    est = SDMEstimator(**SMALL).fit(X, np.where(y == 1, 7, -3))  # any integers: classes_ = sorted distinct
    assert est.classes_.tolist() == [-3, 7] and set(est.predict(X)) <= {-3, 7}
    assert dataclasses.is_dataclass(est.estimate(X[:2]).estimate)


def test_not_fitted_error_is_caught_as_scikit_learns():
    """With scikit-learn imported, predict before fit raises an error that both ``except`` clauses catch."""
    from sklearn.exceptions import NotFittedError as SklearnNotFittedError

    for call in (SDMEstimator().predict, SDMEstimator().predict_proba, SDMEstimator().predict_selective):
        with pytest.raises(SklearnNotFittedError, match="not fitted") as caught:
            call(np.zeros((2, 6)))
        assert isinstance(caught.value, (NotFittedError, ValueError, AttributeError))
        assert isinstance(caught.value, NotFittedError) and isinstance(caught.value, AttributeError)
    # without scikit-learn in the process, the same class without scikit-learn's base (a subprocess)
    code = ("import numpy as np, sys; from sdm_mlx import SDMEstimator; from sdm_mlx.errors import NotFittedError\n"
            "try: SDMEstimator().predict(np.zeros((1, 2)))\n"
            "except NotFittedError as e: print(type(e).__mro__[1].__name__, 'sklearn' in sys.modules, "
            "isinstance(e, ValueError) and isinstance(e, AttributeError))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["SDMError", "False", "True"], out.stderr


def test_selective_scorer_lets_grid_search_tune_alpha():
    """``score`` is accuracy and ignores rejection (equal for every alpha); the documented selective scorer
    (admitted fraction subject to accuracy ≥ min_accuracy) ranks the alphas and GridSearchCV picks one."""
    from sklearn.metrics import make_scorer
    from sklearn.model_selection import GridSearchCV, StratifiedKFold

    from sdm_mlx.storage.datasets import factcheck_splits
    from sdm_mlx.evaluation.selective import compared_nothing, selective_score, selective_scorer

    pool = factcheck_splits()[0]
    X, y = pool.X[:1600], np.asarray(["false", "true"], dtype=object)[pool.y[:1600]]
    grid = {"alpha": [0.6, 0.7, 0.8]}
    settings = dict(iterations=1, epochs=3, exemplar_dim=64, learning_rate=1e-3, rescaler_max_epochs=40)
    cv = StratifiedKFold(n_splits=2, shuffle=True, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small calibration halves: the estimator may warn
        scorer = make_scorer(selective_score, response_method=("predict_selective",), min_accuracy=0.7)
        search = GridSearchCV(SDMEstimator(**settings), grid, cv=cv, scoring=scorer).fit(X, y)
    best = search.best_estimator_
    # alpha changes what is admitted, never predict (ŷ = argmax z'): accuracy-based `score` cannot rank alphas
    assert len({int(best.estimate(X, alpha=a).admitted.sum()) for a in grid["alpha"]}) > 1
    scores = search.cv_results_["mean_test_score"]
    assert len(set(np.round(scores, 6))) > 1 and search.best_params_["alpha"] in grid["alpha"]
    assert scores.max() > 0  # some alpha admits rows at accuracy ≥ 0.7
    sel = best.predict_selective(X)
    admitted = np.array([v is not None for v in sel])
    assert 0 < admitted.sum() < len(X) and set(sel[admitted]) <= {"false", "true"}
    assert admitted.tolist() == best.estimate(X).admitted.tolist()
    if (sel[admitted] == y[admitted]).mean() >= 0.7:
        assert selective_score(y, sel, min_accuracy=0.7) == pytest.approx(admitted.mean())
    with pytest.warns(NothingAdmittedWarning, match="nothing was admitted among the 1600 rows"):
        assert selective_score(y, np.full(len(y), None, dtype=object)) == 0.0
    assert not compared_nothing(search)
    wrong = np.where(admitted, np.where(y == "true", "false", "true"), None)  # every admitted row wrong
    assert selective_score(y, wrong, min_accuracy=0.9) == pytest.approx(-0.9)
    assert selective_scorer(0.7)(best, X, y) == pytest.approx(selective_score(y, sel, min_accuracy=0.7))


def test_a_grid_search_whose_folds_admit_nothing_says_so():
    """Issue 41: GridSearchCV over alpha with selective_score, every fold admitting nothing, compared nothing and
    picked an arbitrary alpha silently (the docs' example hid the warnings with simplefilter("ignore"))."""
    import pathlib

    from sklearn.metrics import make_scorer
    from sklearn.model_selection import GridSearchCV

    from sdm_mlx.evaluation.selective import compared_nothing, selective_score
    from sdm_mlx.storage.datasets import factcheck_splits

    pool = factcheck_splits()[0]
    X, y = pool.X[:400], pool.y[:400]
    scorer = make_scorer(selective_score, response_method=("predict_selective",), min_accuracy=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        search = GridSearchCV(SDMEstimator(iterations=1, epochs=1, exemplar_dim=8, rescaler_max_epochs=2),
                              {"alpha": [0.9, 0.95]}, scoring=scorer, cv=2).fit(X, y)
    nothing = [w for w in caught if issubclass(w.category, NothingAdmittedWarning)]
    assert len(nothing) == 4, [str(w.message)[:80] for w in caught]  # 2 candidates x 2 folds, each said
    assert "compares nothing" in str(nothing[0].message) and "best_params_ arbitrarily" in str(nothing[0].message)
    assert compared_nothing(search)
    # the documented example keeps these warnings visible and checks the search
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "python-api.md").read_text(encoding="utf-8")
    example = doc[doc.index("GridSearchCV(SDMEstimator"):].split("```")[0]
    assert "simplefilter" not in example and "compared_nothing(search)" in example
