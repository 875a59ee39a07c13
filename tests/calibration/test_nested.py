"""Nested calibration (DESIGN #25): every grid level from the same rounds, α regions anchored at α', decisions.

The invariants checked on the embedded factcheck data and on adversarial rows (far off the support,
shuffled features, random admission matrices):

* the reported ladder is nested: admitted at α ⟹ admitted at every smaller grid α;
* it agrees with the model: ``admitted`` ⟺ ``alpha_region_lower`` ≥ α';
* a row's region is a level where the paper's per-level rule admits it;
* ``decision`` follows the policy; changing the grid needs no retraining and survives save / load.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from sdm_mlx.calibration import DEFAULT_ALPHA_GRID, anchored_region, nested_admissions
from sdm_mlx.calibration.nested import DecisionPolicy, alpha_grid, decisions, level_admissions
from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.errors import InputError
from sdm_mlx.estimator import SDMEstimator


def _check_ladder(est, pred, paper=None):
    """The invariants of the module docstring for one Predictions object."""
    e, nested = pred.estimate, est.nested_
    grid, alpha = np.asarray(nested.grid), est.alpha
    ladder = nested_admissions(e.alpha_region_lower, grid)
    assert not np.any(ladder[:, 1:] < ladder[:, :-1]), "admitted at a level but not at a smaller one"
    centroid = nested_admissions(e.alpha_region_centroid, grid)
    assert not np.any(centroid[:, 1:] < centroid[:, :-1])
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(e.admitted, e.alpha_region_lower >= alpha)
    if paper is None:
        _, paper, _ = level_admissions(nested, pred.logits, pred.q, pred.d, pred.sdm)
    has = ~np.isnan(e.alpha_region_lower)
    cols = np.searchsorted(-grid, -e.alpha_region_lower[has])
    assert np.all(paper[np.flatnonzero(has), cols]), "a region level where the paper's rule rejects the row"
    np.testing.assert_array_equal(ladder[:, list(grid).index(alpha)], e.admitted)
    expected = decisions(e.alpha_region_lower, nested.policy)
    np.testing.assert_array_equal(e.decision, expected)
    np.testing.assert_array_equal(e.decision == "allow", e.admitted)  # default policy: allow = α'
    return paper


@pytest.fixture(scope="module")
def fitted():
    train, _, test = factcheck_splits()
    est = SDMEstimator(iterations=2, epochs=5, seed=0, rescaler_max_epochs=50, rescaler_learning_rate=1e-3).fit(train.X, train.y, ids_train=train.ids)
    return est, train, test


def test_factcheck_ladder_is_nested_and_agrees_with_admission(fitted):
    est, _, test = fitted
    assert est.nested_.grid == DEFAULT_ALPHA_GRID and est.alpha in est.nested_.grid
    pred = est.estimate(test.X, test.ids)
    paper = _check_ladder(est, pred)
    assert pred.estimate.admitted.any() and (pred.estimate.decision == "review").any()
    rows = pred.to_dicts()
    assert {"alpha_region_lower", "alpha_region_centroid", "decision"} <= set(rows[0])
    assert all(r["alpha_region_lower"] is None or r["alpha_region_lower"] in est.nested_.grid for r in rows)
    # the paper's per-level rule itself: count (not assert) the rows it leaves non-nested, for the record
    assert paper.shape == (len(test.ids), len(est.nested_.grid))


def test_shared_row_work_gives_each_level_the_full_estimator(fitted):
    from sdm_mlx.calibration import estimate

    est, _, test = fitted
    pred = est.estimate(test.X)
    main, lower, centroid = level_admissions(est.nested_, pred.logits, pred.q, pred.d, pred.sdm)
    for j, cal in enumerate(est.nested_.levels):
        full = estimate(cal, pred.logits, pred.q, pred.d, pred.sdm)
        np.testing.assert_array_equal(lower[:, j], full.admitted)
        np.testing.assert_array_equal(centroid[:, j], full.centroid.valid)
    np.testing.assert_array_equal(main.lower.p, estimate(est.calibration_, pred.logits, pred.q, pred.d, pred.sdm).lower.p)


def test_alpha_derived_state_has_one_owner_and_each_level_is_computed_once(fitted, monkeypatch):
    """nested_ is the one store; calibration_, robust_min_valid_ and offsets_ are read-only views of its level
    at α'; a recalibration runs Alg. 3 once per round and level (none at the level the rounds were fitted at)
    and the Cauchy aggregation once per level."""
    from sdm_mlx.calibration import rounds as rounds_module

    est, _, _ = fitted
    assert est.calibration_ is est.nested_.levels[est.nested_.anchor]
    assert est.robust_min_valid_ == est.calibration_.robust_min_valid and est.offsets_ is est.calibration_.offsets
    for name in ("calibration_", "robust_min_valid_", "offsets_"):
        with pytest.raises(AttributeError):
            setattr(est, name, None)
        assert name not in vars(est)
    alg3, cauchy = [], []
    real_alg3, real_cauchy = rounds_module._min_valid_qbin, rounds_module._cauchy
    monkeypatch.setattr(rounds_module, "_min_valid_qbin", lambda *a: alg3.append(a[-1]) or real_alg3(*a))
    monkeypatch.setattr(rounds_module, "_cauchy", lambda at, j, a: cauchy.append(a) or real_cauchy(at, j, a))
    before = est.calibration_
    est.recalibrate()
    levels = [a for a in est.nested_.grid if a != est.rounds_[0].alpha]
    assert sorted(alg3) == sorted(levels * len(est.rounds_)) and sorted(cauchy) == sorted(est.nested_.grid)
    np.testing.assert_array_equal(est.calibration_.psi, before.psi)
    assert est.calibration_.min_valid == before.min_valid


@pytest.mark.parametrize("levels_at_once", [1, 2, 3, 1000])
def test_levels_stacked_in_groups_equal_one_level_at_a_time(fitted, monkeypatch, levels_at_once):
    from sdm_mlx.calibration import conditional

    est, _, test = fitted
    pred = est.estimate(test.X[:37])
    rows = conditional._rows(est.nested_.levels[0], pred.logits, pred.q, pred.d, pred.sdm)
    monkeypatch.setattr(conditional, "STACKED_ROWS", 37 * levels_at_once)
    lower, centroid = conditional.levels_validity(est.nested_.levels, rows)
    for j, cal in enumerate(est.nested_.levels):
        one = conditional.level_validity(cal, rows)
        np.testing.assert_array_equal(lower[:, j], one[0])
        np.testing.assert_array_equal(centroid[:, j], one[1])


def test_adversarial_rows_keep_the_invariants(fitted):
    est, train, test = fitted
    rng = np.random.default_rng(1)
    far = test.X * 25 + rng.normal(0, 50, test.X.shape).astype(np.float32)  # far off the support
    shuffled = test.X[:, rng.permutation(test.X.shape[1])]  # in range, structure destroyed
    near_ties = np.repeat(train.X[:5], 20, axis=0) + rng.normal(0, 1e-3, (100, train.X.shape[1])).astype(np.float32)
    for X in (far, shuffled, near_ties):
        _check_ladder(est, est.estimate(X))


def test_anchored_region_on_adversarial_admissions():
    grid = (0.99, 0.97, 0.95, 0.9, 0.85)
    A = np.array([
        [1, 0, 1, 0, 1],  # admitted at α' = 0.95 but not at 0.97 or 0.9: region 0.95
        [1, 1, 1, 1, 1],  # everywhere: 0.99
        [1, 1, 0, 1, 0],  # rejected at α': the highest level below α' that admits it (0.9)
        [0, 0, 0, 0, 0],  # nowhere
        [0, 0, 0, 0, 1],  # only the lowest level
        [0, 1, 1, 0, 0],  # a run from α' up to 0.97
    ], dtype=bool)
    region = anchored_region(A, grid, anchor=2)
    np.testing.assert_array_equal(region, [0.95, 0.99, 0.9, np.nan, 0.85, 0.97])
    rng = np.random.default_rng(0)
    for anchor in range(len(grid)):
        A = rng.random((2000, len(grid))) < 0.5
        region = anchored_region(A, grid, anchor)
        ladder = nested_admissions(region, grid)
        assert not np.any(ladder[:, 1:] < ladder[:, :-1])
        np.testing.assert_array_equal(ladder[:, anchor], A[:, anchor])
        has = ~np.isnan(region)
        assert np.all(A[np.flatnonzero(has), np.searchsorted(-np.asarray(grid), -region[has])])


def test_policy_and_grid_validation():
    assert alpha_grid([0.9, 0.97, 0.9], 0.95, 2) == (0.97, 0.95, 0.9)
    with pytest.raises(InputError, match="alpha_grid: alpha must satisfy"):
        alpha_grid([0.9, 0.4], 0.95, 2)
    with pytest.raises(InputError, match="alpha_grid must be a list"):
        alpha_grid("0.9", 0.95, 2)
    with pytest.raises(InputError, match="review <= allow"):
        DecisionPolicy(allow=0.9, review=0.95)
    np.testing.assert_array_equal(decisions(np.array([0.97, 0.9, 0.8, np.nan]), DecisionPolicy(0.95, 0.85)),
                                  ["allow", "review", "reject", "reject"])
    with pytest.raises(InputError, match="alpha_grid"):
        SDMEstimator(alpha_grid=[0.3]).fit(np.random.default_rng(0).normal(size=(40, 3)), np.arange(40) % 2)


def test_finer_grid_without_retraining_and_persistence(fitted, tmp_path):
    est, _, test = fitted
    before = est.estimate(test.X, test.ids)
    weights = np.array(est.model_.projection.weight)
    fine = [round(0.97 - 0.0025 * i, 4) for i in range(41)]  # 0.97 .. 0.87 in steps of 0.0025
    est.recalibrate(alpha_grid=fine, alpha_review=0.9)
    try:
        after = est.estimate(test.X, test.ids)
        np.testing.assert_array_equal(np.array(est.model_.projection.weight), weights)
        np.testing.assert_array_equal(after.admitted, before.admitted)  # α' unchanged: the same admissions
        np.testing.assert_array_equal(after.p_lower, before.p_lower)
        assert set(np.unique(after.estimate.alpha_region_lower[~np.isnan(after.estimate.alpha_region_lower)])) \
            <= set(fine) | {est.alpha}
        _check_ladder(est, after)
        est.save(tmp_path / "m")
        loaded = SDMEstimator.load(tmp_path / "m")
        assert loaded.alpha_grid == fine and loaded.nested_.policy.review == 0.9
        again = loaded.estimate(test.X, test.ids)
        np.testing.assert_array_equal(again.estimate.alpha_region_lower, after.estimate.alpha_region_lower)
        np.testing.assert_array_equal(again.estimate.decision, after.estimate.decision)
    finally:
        est.recalibrate(alpha_grid=list(DEFAULT_ALPHA_GRID), alpha_review=None)
        est.alpha_review = None
        est.recalibrate()


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "sdm_mlx", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd)


def _dump(ds, path, n=None):
    with open(path, "w") as f:
        for i in range(len(ds.y) if n is None else n):
            f.write(json.dumps({"id": ds.ids[i], "label": int(ds.y[i]), "attributes": ds.X[i].tolist(),
                                "document": ds.documents[i]}) + "\n")


def test_cli_grid_through_train_recalibrate_predict_evaluate(tmp_path):
    train, _, test = factcheck_splits()
    _dump(train, tmp_path / "train.jsonl")
    _dump(test, tmp_path / "test.jsonl", 120)
    res = _cli("train", "--train", "train.jsonl", "--output", "m", "--iterations", 2, "--epochs", 5, "--quiet", "--rescaler-max-epochs", 50, "--rescaler-learning-rate", 1e-3,
               "--alpha-grid", 0.97, 0.9, 0.85, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = _cli("predict", "--model", "m", "--input", "test.jsonl", "--output", "p.jsonl", "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in open(tmp_path / "p.jsonl")]
    assert {r["alpha_region_lower"] for r in rows} <= {0.97, 0.95, 0.9, 0.85, None}
    assert all((r["alpha_region_lower"] or 0) >= 0.95 for r in rows if r["admitted"])
    assert all(r["decision"] == ("allow" if r["admitted"] else r["decision"]) for r in rows)
    res = _cli("recalibrate", "--model", "m", "--alpha-grid", 0.96, 0.93, 0.91, "--output", "m2", cwd=tmp_path)
    assert res.returncode == 0 and "alpha grid (4 levels): 0.96 0.95 0.93 0.91" in res.stdout, res.stderr
    res = _cli("evaluate", "--model", "m2", "--input", "test.jsonl", "--report", "r.json", "--quiet",
               "--baselines", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "admission at every alpha level" in res.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    ladder = report["datasets"]["test"]["ladder"]
    assert [p["alpha"] for p in ladder] == report["grid"] == [0.96, 0.95, 0.93, 0.91]
    counts = [p["n_admitted"] for p in ladder]
    assert counts == sorted(counts) and sum(report["datasets"]["test"]["decisions"].values()) == 120
    res = _cli("recalibrate", "--model", "m", "--alpha-grid", 1.5, "--output", "m3", cwd=tmp_path)
    assert res.returncode == 2 and "alpha_grid" in res.stderr
    res = _cli("recalibrate", "--model", "m", "--output", "m3", cwd=tmp_path)
    assert res.returncode == 2 and "nothing to change" in res.stderr
    # a policy set once can be returned to its defaults ('default'), the grid too
    res = _cli("recalibrate", "--model", "m2", "--alpha-allow", 0.96, "--alpha-review", 0.93, "--output", "m4",
               cwd=tmp_path)
    assert res.returncode == 0 and "allow >= 0.96, review >= 0.93" in res.stdout, res.stderr
    res = _cli("recalibrate", "--model", "m4", "--alpha-allow", "default", "--alpha-review", "default",
               "--alpha-grid", "default", "--output", "m5", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    grid = " ".join(f"{a:g}" for a in DEFAULT_ALPHA_GRID)
    assert f"({len(DEFAULT_ALPHA_GRID)} levels): {grid}; allow >= 0.95, review >= 0.8" in res.stdout, res.stdout
    reset = SDMEstimator.load(tmp_path / "m5")
    assert reset.alpha_allow is None and reset.alpha_review is None and reset.alpha_grid is None
    res = _cli("recalibrate", "--model", "m4", "--alpha-allow", "high", "--output", "m6", cwd=tmp_path)
    assert res.returncode == 2 and "'default'" in res.stderr and not (tmp_path / "m6").exists()
    res = _cli("recalibrate", "--model", "m4", "--alpha-grid", 0.9, "default", "--output", "m6", cwd=tmp_path)
    assert res.returncode == 2 and "single word 'default'" in res.stderr
