"""The universal runs' committed results agree with each other (issue 42, §7), for the headline run
(``docs/results/universal_qwen15_cpu/``) and the first, 2,000-prompt one (``universal2k_qwen15_cpu/``): the primary
verifier artifact in ``verifier/`` loads and is the one ``table.json`` describes; ``verdicts.jsonl`` holds the fields
the issue names and the counts of the table; the calibration rows of ``primary_calibration.jsonl`` are that verifier's
calibration rows."""

import json
import os
from collections import Counter

import numpy as np
import pytest

RESULTS_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                            "results")
RUNS = ("universal_qwen15_cpu", "universal2k_qwen15_cpu")
FIELDS = {"task", "split", "id", "label", "answer", "correct", "verified", "p_lower", "reason", "stage"}


def _json(run, name):
    with open(os.path.join(RESULTS_ROOT, run, name), encoding="utf-8") as f:
        return json.load(f)


def _jsonl(run, name):
    with open(os.path.join(RESULTS_ROOT, run, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module", params=RUNS)
def run(request):
    return request.param


@pytest.fixture(scope="module")
def table(run):
    return _json(run, "table.json")


def test_the_committed_primary_verifier_is_the_one_the_table_describes(run, table):
    from sdm_mlx.estimator import SDMEstimator

    path = os.path.join(RESULTS_ROOT, run, "verifier")
    assert sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) < 25e6  # the issue's budget
    est = SDMEstimator.load(path)
    entry = table["verifiers"][table["primary"]]["index"]
    assert est.n_features_in_ == entry["width"] == 1536
    assert tuple(est.feature_parts_) == tuple(entry["features"]) == ("last",)
    assert est.alpha == entry["alpha"] == table["alpha"]
    assert len(est.support_ids_) == entry["support_size"] and len(est.calibration_ids_) == entry["calibration_size"]
    np.testing.assert_allclose(est.robust_min_valid_, entry["robust_min_valid_qbin"], rtol=1e-9)
    anatomy = _json(run, "primary_anatomy.json")
    assert anatomy["verifier"] == table["primary"]
    np.testing.assert_allclose(anatomy["calibration"]["robust_min_valid"], entry["robust_min_valid_qbin"], rtol=1e-9)
    assert [r["id"] for r in _jsonl(run, "primary_calibration.jsonl")] == list(est.calibration_ids_)


def test_verdicts_hold_the_issue_fields_and_the_table_counts(run, table):
    rows = _jsonl(run, "verdicts.jsonl")
    assert all(set(r) == FIELDS for r in rows)
    assert len({(r["stage"], r["task"], r["split"], r["id"]) for r in rows}) == len(rows)
    n = Counter((r["task"], r["split"]) for r in rows if r["stage"] == "base")
    verified = Counter((r["task"], r["split"]) for r in rows if r["stage"] == "base" and r["verified"])
    for task, splits in table["base"].items():
        for split, cell in splits.items():
            assert n[(task, split)] == cell["n"] and verified[(task, split)] == cell["verified"], (task, split)
    assert all(r["verified"] is False or r["reason"] is None for r in rows)
