"""tools/real_llm/interim_verdicts.py: a run's trained verifier on a split's own answers, columns sliced to the
verifier's encoding, with per-row verdicts in verdicts.jsonl's fields."""

from __future__ import annotations

import json

import numpy as np
import pytest

import interim_verdicts  # tools/real_llm is on pytest's pythonpath
from sdm_mlx.estimator import SDMEstimator

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")


def _answers(n, seed, D=4):
    """Answer rows recording max, mean, last; only 'last' tells right (label 1) from wrong."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        y = int(i % 3 != 0)
        parts = rng.normal(size=(3, D))
        parts[2] += 4.0 * (2 * y - 1)
        rows.append({"id": f"h{i}", "task_label": i % 2, "answer_label": (i % 2) if y else 1 - i % 2, "label": y,
                     "feature_parts": ["max", "mean", "last"], "embedding": parts.ravel().tolist()})
    return rows


def test_the_verifier_sees_its_own_columns_and_the_rows_file_has_the_verdict_fields(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True), (run / "answers").mkdir(), (run / "verifiers").mkdir()
    held = _answers(90, 1)
    (run / "data" / "t_heldout.jsonl").write_text("".join(json.dumps({"id": r["id"], "label": r["task_label"]}) + "\n"
                                                          for r in held))
    (run / "answers" / "t_heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    pool = _answers(240, 0)
    X = np.array([r["embedding"][8:] for r in pool], dtype=np.float32)  # the 'last' columns
    est = SDMEstimator(alpha=0.9, iterations=1, epochs=5, exemplar_dim=8, batch_size=16, seed=0)
    est.fit(X, np.array([r["label"] for r in pool]), num_classes=2, feature_parts="last")
    est.save(run / "verifiers" / "universal-own-last")
    out = tmp_path / "rows.jsonl"
    assert interim_verdicts.main([str(run), "t", "heldout", "--verifier", "universal-own-last",
                                  "--rows", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["verifier"] == "universal-own-last" and summary["n"] == 90
    assert summary["verified"] > 0 and summary["min_index_conditional_accuracy"] == 1.0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in held]
    assert {"task", "split", "id", "label", "answer", "correct", "verified", "p_lower", "reason", "stage"} <= set(rows[0])
    assert sum(r["verified"] for r in rows) == summary["verified"]
    assert all(r["correct"] for r in rows if r["verified"])
