"""Predictions on the embedded factcheck data are bit-identical to the stored fixture (behaviour unchanged).

The fixture was written by ``tests/helpers/behaviour_fixture.py`` BEFORE the typed-results / scikit-learn API change
(then with ``predict`` + ``recalibrate``); every JSON value, float repr included, must still match.
"""

import json

from behaviour_fixture import FIXTURE, canonical, fixture_results


def test_factcheck_estimates_match_the_stored_fixture_bit_for_bit():
    stored = json.loads(FIXTURE.read_text(encoding="utf-8"))
    fresh = json.loads(canonical(fixture_results()))
    assert fresh.keys() == stored.keys()
    for name in stored:
        assert len(fresh[name]) == len(stored[name]), name
        for a, b in zip(fresh[name], stored[name]):
            assert a == b, f"{name}: row {b['id']} differs"
    assert any(r["admitted"] for r in stored["heldout"]) and not all(r["admitted"] for r in stored["heldout"])
