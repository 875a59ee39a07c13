"""The rejection reasons in words (sdm_mlx/calibration/reasons.py): one text per reason, read by the verdict page, the
evaluation report (the demo's reason list) and the MCP tool; each names the condition of ``estimate`` that failed for
that row, with the row's own figures, and says what would change the verdict (issue 41, section 2).

A small estimator on the embedded factcheck data gives real rejections: the shifted ``generated`` statements are
mostly ``ood_similarity``.  For every rejected row the defining condition is recomputed from the estimate's arrays,
so a reason whose text described another condition (the old "low q" wording of ``ood_similarity``) fails here."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

from sdm_mlx.calibration import REJECTION_REASONS
from sdm_mlx.calibration.reasons import REASONS, plain, reason_text, reason_words
from sdm_mlx.estimator import SDMEstimator
from sdm_mlx.storage.datasets import factcheck_splits


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """(estimator, its saved directory, the held-out + shifted rows, their estimate)."""
    pool, heldout, generated = factcheck_splits()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        est = SDMEstimator(iterations=1, epochs=4, exemplar_dim=64, rescaler_max_epochs=30, seed=0,
                           verbose=False).fit(pool.X, pool.y, ids_train=pool.ids)
    d = tmp_path_factory.mktemp("reasons")
    est.save(d / "model")
    generated.to_jsonl(d / "generated.jsonl")
    X = np.concatenate([heldout.X, generated.X])
    return est, d, X, est.estimate(X)


def thresholds(est) -> dict:
    cal = est.calibration_
    return {"min_valid": cal.min_valid, "robust_min_valid": cal.robust_min_valid, "psi": list(cal.psi),
            "alpha": est.alpha}


def test_every_reason_has_its_condition_and_what_would_change_it():
    assert set(REJECTION_REASONS) | {"parse_failure", "predicted_unverified", None} == set(REASONS)
    for reason, words in REASONS.items():
        assert words.condition and words.meaning and words.change, reason
        text = reason_text(reason)
        assert text.endswith(f"What would change the verdict: {words.change}."), text
    # the condition of ood_similarity is the soft bin, not a low q (issue 41: q = 178 was shown as "low q")
    assert REASONS["ood_similarity"].condition.startswith("floor(q̃_lower) ≤ 0")
    assert not re.search(r"low (similarity )?q\b|too few nearby", " ".join(map(str, REASONS.values())))
    assert reason_words("no_such_reason").condition == "no_such_reason"  # never a KeyError
    assert plain("q̃ ≥ ψ, α'") == "q~ >= psi, alpha'"


def _defining_condition(reason, i, est, pred) -> bool:
    """The condition ``reason`` names, recomputed from the estimate's arrays for row ``i``."""
    e, cal = pred.estimate, est.calibration_
    y, q, d = int(pred.prediction[i]), float(pred.q[i]), float(pred.d[i])
    raw_lower = 0.0 if e.sdm_flip[i] else float(e.lower.v[i, y]) * math.log(2.0 + q)
    if reason == "ood_distance":
        return d == 0.0
    if reason == "ood_similarity":
        return math.floor(raw_lower) <= 0
    if reason == "below_model_min_qbin":
        return raw_lower >= 1 and float(pred.q_tilde_lower[i]) < cal.min_valid
    if reason == "below_robust_min_qbin":
        return raw_lower >= 1 and float(pred.q_tilde_lower[i]) < cal.robust_min_valid
    if reason == "below_threshold_psi":
        o = e.lower.o[i].copy()
        o[y] = pred.p_lower[i]
        return set(np.flatnonzero(o >= np.asarray(cal.psi)).tolist()) != {y}
    if reason == "argmax_flip":
        for out in (pred.sdm[i], e.centroid.o[i], e.lower.o[i]):
            if not (np.argmax(out) == y and np.sum(out == out.max()) == 1):
                return True
        return False
    return reason in ("no_valid_threshold", "no_robust_threshold")


def test_each_rejected_row_meets_the_condition_its_text_names(fitted):
    est, _, _, pred = fitted
    rows = pred.to_dicts()
    seen = set()
    for i, row in enumerate(rows):
        reason = row["rejection_reason"]
        if reason is None:
            continue
        seen.add(reason)
        assert _defining_condition(reason, i, est, pred), (reason, row["q"], row["d"])
        text = reason_text(reason, row, thresholds(est))
        assert text.startswith(REASONS[reason].condition + ":"), text
        if reason == "ood_similarity":  # the row's own q and the v it would need
            q = row["q"]
            assert f"q = {q}" in text
            if q >= 1:
                need = 1.0 / math.log(2.0 + q)
                assert f"v_lower ≥ {need:.3g}" in text and float(pred.estimate.lower.v[i, row["prediction"]]) < need
        if reason == "below_threshold_psi":
            assert f"p̂_lower = {row['p_lower']:.3g}" in text
    assert "ood_similarity" in seen, seen  # the shifted rows give real rejections of this kind


def test_the_page_the_report_and_the_mcp_tool_show_the_same_text(fitted):
    from sdm_mlx.evaluation.report import rejection_reason_lines
    from sdm_mlx.evaluation.verdict_html import context_of, esc, render_page
    from sdm_mlx.serve.mcp import thresholds_of, why

    est, _, _, pred = fitted
    row = next(r for r in pred.to_dicts() if r["rejection_reason"] == "ood_similarity")
    expected = reason_text("ood_similarity", row, thresholds(est))
    assert esc(expected) in render_page(row, context_of(est))
    verification = {k: row[k] for k in ("admitted", "p_lower", "prediction", "rejection_reason")}
    assert why({**verification, "verified": False}, row, thresholds_of(est)) == expected
    lines = rejection_reason_lines({"n": 10, "rejection_reasons": {"ood_similarity": 7, "below_threshold_psi": 2}})
    assert lines[1] == "  7  ood_similarity: " + REASONS["ood_similarity"].plain_line
    assert lines[2] == "  2  below_threshold_psi: " + REASONS["below_threshold_psi"].plain_line


def test_cli_evaluate_lists_each_reason_with_its_condition(fitted):
    _, d, _, _ = fitted
    r = subprocess.run([sys.executable, "-m", "sdm_mlx", "evaluate", "--model", "model", "--input", "generated.jsonl",
                        "--report", "report.json", "--quiet"], cwd=d, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    reasons = json.loads((d / "report.json").read_text())["datasets"]["generated"]["rejection_reasons"]
    assert reasons.get("ood_similarity")
    for reason, count in reasons.items():
        assert f"  {count}  {reason}: {REASONS[reason].plain_line}\n" in r.stdout, (reason, r.stdout[-2000:])
    assert "low q" not in r.stdout and "what would change it:" in r.stdout
