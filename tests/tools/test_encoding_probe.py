"""tools/real_llm/encoding_probe.py ranks the encodings by how well a probe on them tells right answers from wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("sklearn")
import encoding_probe  # tools/real_llm is on pytest's pythonpath


def _answers(path, n, seed, D=6):
    """Rows as the answers stage writes them: max, mean and last of D dims each; only 'last' carries the label."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            y = int(rng.random() < 0.7)
            parts = rng.normal(size=(3, D))
            parts[2, 0] += 3.0 * (2 * y - 1)
            f.write(json.dumps({"id": f"r{i}", "label": y, "answer_label": y, "task_label": 1,
                                "feature_parts": ["max", "mean", "last"], "embedding": parts.ravel().tolist()}) + "\n")


def test_the_informative_part_ranks_first_and_every_scored_row_is_written(tmp_path):
    _answers(tmp_path / "pool.jsonl", 300, 0)
    _answers(tmp_path / "heldout.jsonl", 120, 1)
    rows, table = tmp_path / "rows.jsonl", tmp_path / "table.json"
    assert encoding_probe.main([str(tmp_path / "pool.jsonl"), str(tmp_path / "heldout.jsonl"), "--rows", str(rows),
                                "--json", str(table)]) == 0
    t = {(r["encoding"], r["C"]): r for r in json.loads(table.read_text())["table"]}
    assert t[("last", 0.03)]["auc"] > 0.9
    assert t[("max", 0.03)]["auc"] < 0.75 and t[("mean", 0.03)]["auc"] < 0.75
    assert t[("last", 0.03)]["dims"] == 6 and t[("max,mean,last", 0.03)]["dims"] == 18
    scored = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["id"] for r in scored] == [f"r{i}" for i in range(120)]
    assert set(scored[0]["scores"]) == {f"{e}|C={c}" for e in encoding_probe.ENCODINGS for c in encoding_probe.STRENGTHS}


def test_rows_recording_other_parts_are_refused(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"id": "x", "label": 1, "feature_parts": ["mean", "last"], "embedding": [0.0] * 4}) + "\n")
    with pytest.raises(SystemExit, match="records"):
        encoding_probe.main([str(p), str(p)])
