"""Generator of the behaviour fixture: per-row JSON results of a small model on the embedded factcheck data.

``python tests/helpers/behaviour_fixture.py`` (re)writes ``tests/data/fixtures/factcheck_estimates.json``;
``tests/test_behaviour_fixture.py`` retrains with the same settings and compares bit for bit (exact float
``repr`` through JSON).  Regenerate ONLY for an intended change of behaviour.
"""

from __future__ import annotations

import json
from pathlib import Path

from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.estimator import SDMEstimator

FIXTURE = Path(__file__).parents[1] / "data" / "fixtures" / "factcheck_estimates.json"
SETTINGS = dict(iterations=2, epochs=3, exemplar_dim=64, learning_rate=1e-3, rescaler_max_epochs=40,
                n_exemplars=3, verbose=False)
ROWS = 120  #: rows kept per evaluation set (the fixture stays small)
RETHRESHOLD_ALPHA = 0.9


def fixture_results() -> dict:
    """{set name: per-row dicts} at the fitted α' and re-thresholded at α' = 0.9."""
    pool, heldout, generated = factcheck_splits()
    est = SDMEstimator(**SETTINGS).fit(pool.X, pool.y, ids_train=pool.ids)
    out = {}
    for name, ds in (("heldout", heldout), ("generated", generated)):
        out[name] = est.estimate(ds.X[:ROWS], ids=ds.ids[:ROWS]).to_dicts()
        out[f"{name}@{RETHRESHOLD_ALPHA}"] = est.estimate(ds.X[:ROWS], ids=ds.ids[:ROWS],
                                                          alpha=RETHRESHOLD_ALPHA).to_dicts()
    return out


def canonical(results: dict) -> str:
    return json.dumps(results, sort_keys=True, indent=None, allow_nan=False)


if __name__ == "__main__":
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(canonical(fixture_results()) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}")
