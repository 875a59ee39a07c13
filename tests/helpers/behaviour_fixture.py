"""Generator and comparator of the behaviour fixture: per-row JSON results of a small model on the embedded
factcheck data.

``python tests/helpers/behaviour_fixture.py`` (re)writes ``tests/data/fixtures/factcheck_estimates.json``;
``tests/estimator/test_behaviour_fixture.py`` retrains with the same settings and compares with :func:`compare_sets`.
Regenerate ONLY for an intended change of behaviour.

The fixture was written on another machine, so floats are compared to a tolerance, never bit for bit:
float32 BLAS kernels (OpenBLAS per CPU family, MLX's bundled reference BLAS, Accelerate) round differently,
and 3 epochs of training carry that into every float of every row.  Measured spread against the stored file:

* this Intel Xeon (AVX-512), OpenBLAS preloaded:          max 3.81e-4 relative (``offset``, a value of ~1.7e-3
  that moved 6.4e-7), max 9.0e-7 absolute (``p_lower``); every one of 480 rows differs somewhere;
* the same machine with ``SDM_MLX_NO_BLAS_PRELOAD=1``:   max 9.3e-6 relative (``logits``), 3.0e-7 absolute;
* an AMD EPYC (AVX-512, OpenBLAS 0.3.21):                max 3.8e-4 relative (``p_lower``, offset, ``d0``).

No discrete field (prediction, admission, rejection reason, q, bins, n̂, exemplar ids) changed in any of them.
Floats must satisfy ``|fresh − stored| ≤ ATOL + RTOL·|stored|`` (RTOL ≈ 5× the largest relative spread,
ATOL ≈ 10× the largest absolute one); a change of behaviour moves these values by far more.

A decision can legitimately flip between machines when the float that decides it lies within that tolerance
of its threshold.  A row whose discrete fields differ is therefore accepted only if the stored row is within
tolerance of one of its decision boundaries (:func:`near_a_boundary`: a logit tie, p_lower at ψ, q~ at a
bin edge or a min valid q~, tied exemplar distances), and at most :data:`MAX_FLIPPED_ROWS` rows per set may
flip.  n̂ may move by one where q~ sits within tolerance of a calibration q~ (:func:`n_hat_problems`).
Not covered: an SDM output within tolerance of a calibration eCDF point moves v by one step (1/~1300 here) and
q~ by ln(2+q)/~1300; that is inside RTOL for q~ ≳ 2 but would be reported for a smaller q~.  Properties that hold bit for bit on ONE
machine (batch invariance, resume identity, distributed == single process) are tested against a reference
computed in the same run, never against this file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.estimator import SDMEstimator

FIXTURE = Path(__file__).parents[1] / "data" / "fixtures" / "factcheck_estimates.json"
SETTINGS = dict(iterations=2, epochs=3, exemplar_dim=64, learning_rate=1e-3, rescaler_max_epochs=40,
                n_exemplars=3, verbose=False)
ROWS = 120  #: rows kept per evaluation set (the fixture stays small)
RETHRESHOLD_ALPHA = 0.9

RTOL = 2e-3  #: relative float tolerance (measured cross-machine spread ≤ 3.81e-4, see the module docstring)
ATOL = 1e-5  #: absolute float tolerance (measured cross-machine spread ≤ 9.0e-7)
MAX_FLIPPED_ROWS = 3  #: rows per set whose decision may flip (each one near a boundary); 0 were seen
#: fields compared exactly; a difference is a "flip", allowed only near a decision boundary
DISCRETE_KEYS = ("prediction", "admitted", "rejection_reason", "q", "hard_bin", "hard_bin_lower", "hard_bin_upper")


def fit_fixture_estimator(every: int = 1, **extra) -> SDMEstimator:
    """The fixture's estimator fitted on the pool (``every``: keep every n-th pool row, a smaller same-run
    reference for tests that need no stored file; ``extra``: more estimator settings)."""
    pool, _, _ = factcheck_splits()
    pool = pool.subset(range(0, len(pool), every))
    return SDMEstimator(**SETTINGS, **extra).fit(pool.X, pool.y, ids_train=pool.ids)


def fixture_results(est: SDMEstimator | None = None) -> dict:
    """{set name: per-row dicts} at the fitted α' and re-thresholded at α' = 0.9."""
    est = fit_fixture_estimator() if est is None else est
    _, heldout, generated = factcheck_splits()
    out = {}
    for name, ds in (("heldout", heldout), ("generated", generated)):
        out[name] = est.estimate(ds.X[:ROWS], ids=ds.ids[:ROWS]).to_dicts()
        out[f"{name}@{RETHRESHOLD_ALPHA}"] = est.estimate(ds.X[:ROWS], ids=ds.ids[:ROWS],
                                                          alpha=RETHRESHOLD_ALPHA).to_dicts()
    return out


def canonical(results: dict) -> str:
    return json.dumps(results, sort_keys=True, indent=None, allow_nan=False)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= ATOL + RTOL * abs(b)


def _near(x: float, points) -> bool:
    points = np.asarray(points, dtype=np.float64).ravel()
    return points.size > 0 and bool(np.min(np.abs(points - x)) <= ATOL + RTOL * abs(x))


def near_a_boundary(row: dict, cal) -> list[str]:
    """The decision boundaries the (stored) row lies within tolerance of, for the calibration ``cal``: a logit
    tie (ŷ), p_lower at ψ_ŷ (admission), q~ at a bin edge or at a min valid q~ (OOD, bins, admission), tied
    exemplar distances (their order)."""
    near = []
    z = sorted(row["logits"], reverse=True)
    if len(z) > 1 and close(z[1], z[0]):
        near.append("logit tie (prediction)")
    if _near(row["p_lower"], [cal.psi[row["prediction"]]]):
        near.append("p_lower at psi")
    for key in ("q_tilde", "q_tilde_lower", "q_tilde_upper"):
        qt = row[key]
        if qt > 0 and _near(qt, [np.round(qt), cal.min_valid, cal.robust_min_valid]):
            near.append(f"{key} at a bin edge or min valid q~")
    dists = [e["squared_distance"] for e in row["exemplars"]]
    if any(close(a, b) for a, b in zip(dists[1:], dists)):
        near.append("exemplar distance tie")
    return near


def n_hat_problems(fresh: dict, stored: dict, cal) -> list[str]:
    """n̂_c counts calibration q~ below the row's q~: it may move by one where q~ is within tolerance of a
    calibration value (the arrays are dense, ~1300 values per class here), and nowhere else."""
    out = []
    for c, (a, b) in enumerate(zip(fresh["n_hat"], stored["n_hat"])):
        if a != b and not (abs(a - b) == 1 and _near(stored["q_tilde"], cal.sample_size_arrays[c])):
            out.append(f"n_hat[{c}] {a} vs stored {b}")
    return out


def _float_mismatches(fresh, stored, path: str) -> list[str]:
    """Paths where floats differ beyond tolerance or non-floats differ, recursively."""
    if isinstance(stored, dict):
        return [m for k in stored for m in _float_mismatches(fresh.get(k), stored[k], f"{path}.{k}")]
    if isinstance(stored, list):
        if not isinstance(fresh, list) or len(fresh) != len(stored):
            return [f"{path}: {fresh!r} != {stored!r}"]
        return [m for i, (a, b) in enumerate(zip(fresh, stored)) for m in _float_mismatches(a, b, f"{path}[{i}]")]
    if isinstance(stored, float) and isinstance(fresh, (float, int)) and not isinstance(fresh, bool):
        return [] if close(float(fresh), stored) else [f"{path}: {fresh!r} vs stored {stored!r}"]
    return [] if fresh == stored else [f"{path}: {fresh!r} != {stored!r}"]


def compare_rows(fresh: dict, stored: dict, cal) -> tuple[list[str], bool]:
    """(problems, flipped) for one row: discrete fields exactly, floats to tolerance; a row whose decisions
    flipped is a problem unless it lies near a decision boundary (then its floats are not compared)."""
    if fresh["id"] != stored["id"]:
        return [f"id {fresh['id']!r} != stored {stored['id']!r}"], False
    flips = [k for k in DISCRETE_KEYS if fresh[k] != stored[k]]
    ex_ids = [[(e["id"], e["label"], e["predicted_label"]) for e in r["exemplars"]] for r in (fresh, stored)]
    if ex_ids[0] != ex_ids[1]:
        flips.append("exemplars")
    if flips:
        near = near_a_boundary(stored, cal)
        decision_boundary = any(n != "exemplar distance tie" for n in near)
        if decision_boundary or (flips == ["exemplars"] and near):
            return [], True
        return [f"{k} changed ({fresh[k]!r} vs stored {stored[k]!r}) and the row is near no decision "
                f"boundary" for k in flips], True
    floats = _float_mismatches({k: v for k, v in fresh.items() if k != "n_hat"},
                               {k: v for k, v in stored.items() if k != "n_hat"}, "")
    return floats + n_hat_problems(fresh, stored, cal), False


def compare_sets(fresh: dict, stored: dict, est: SDMEstimator) -> list[str]:
    """Every problem of a fresh fixture against the stored one (empty: they agree)."""
    problems = [] if fresh.keys() == stored.keys() else [f"sets {sorted(fresh)} != {sorted(stored)}"]
    for name in stored:
        cal = est.calibration_at(RETHRESHOLD_ALPHA) if name.endswith(f"@{RETHRESHOLD_ALPHA}") else est.calibration_
        if len(fresh.get(name, [])) != len(stored[name]):
            problems.append(f"{name}: {len(fresh.get(name, []))} rows, stored {len(stored[name])}")
            continue
        flipped = 0
        for a, b in zip(fresh[name], stored[name]):
            row_problems, row_flipped = compare_rows(a, b, cal)
            flipped += row_flipped
            problems += [f"{name} row {b['id']}: {p}" for p in row_problems]
        if flipped > MAX_FLIPPED_ROWS:
            problems.append(f"{name}: {flipped} rows flipped a decision (at most {MAX_FLIPPED_ROWS} may, near a "
                            f"boundary)")
    return problems


if __name__ == "__main__":
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(canonical(fixture_results()) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}")
