"""Predictions on the embedded factcheck data match the stored cross-version fixture (behaviour unchanged).

The fixture was written by ``tests/helpers/behaviour_fixture.py`` before the typed-results / scikit-learn API change,
on another machine.  Discrete fields (prediction, admission, rejection reason, q, bins, n̂, exemplar ids) must
match exactly; floats to ``ATOL + RTOL·|stored|``, a tolerance set from the measured cross-machine spread
(documented in ``tests/helpers/behaviour_fixture.py``: ≤ 3.81e-4 relative, ≤ 9.0e-7 absolute over AVX-512 Intel and AMD,
with OpenBLAS and with MLX's bundled BLAS).  A decision may flip only on a row that lies within that tolerance
of its decision boundary.  Bit-for-bit properties of one machine are tested against same-run references
(``test_batch_invariance.py``, ``test_defaults.py``, ``index/test_sharded.py``).
"""

import copy
import json

import pytest

from behaviour_fixture import ATOL, FIXTURE, RTOL, canonical, compare_sets, fit_fixture_estimator, fixture_results


@pytest.fixture(scope="module")
def fitted():
    est = fit_fixture_estimator()
    return est, json.loads(canonical(fixture_results(est)))


def test_factcheck_estimates_match_the_stored_fixture_within_the_cross_machine_tolerance(fitted):
    est, fresh = fitted
    stored = json.loads(FIXTURE.read_text(encoding="utf-8"))
    problems = compare_sets(fresh, stored, est)
    assert not problems, f"{len(problems)} differences, first: {problems[:5]}"
    assert any(r["admitted"] for r in stored["heldout"]) and not all(r["admitted"] for r in stored["heldout"])


def test_the_comparison_catches_changed_floats_and_flips_away_from_a_boundary(fitted):
    est, fresh = fitted
    stored = json.loads(FIXTURE.read_text(encoding="utf-8"))
    assert not compare_sets(fresh, fresh, est)
    within = copy.deepcopy(fresh)
    row = within["heldout"][0]
    row["p_lower"] += 0.5 * (ATOL + RTOL * abs(row["p_lower"]))  # inside the tolerance
    assert not compare_sets(within, fresh, est)
    beyond = copy.deepcopy(fresh)
    beyond["heldout"][0]["p_lower"] += 1e-3 + 2 * RTOL * abs(beyond["heldout"][0]["p_lower"])
    assert any("p_lower" in p for p in compare_sets(beyond, fresh, est))
    # an admission flip on a row that is far from every decision boundary is a change of behaviour
    from behaviour_fixture import near_a_boundary

    far = next(i for i, r in enumerate(stored["heldout"]) if not near_a_boundary(r, est.calibration_))
    flipped = copy.deepcopy(fresh)
    flipped["heldout"][far]["admitted"] = not flipped["heldout"][far]["admitted"]
    assert any("admitted changed" in p for p in compare_sets(flipped, fresh, est))
    reordered = copy.deepcopy(fresh)
    reordered["generated"][3]["q"] += 1
    assert compare_sets(reordered, fresh, est)
