"""The factcheck and arithmetic samplers (sdm_mlx.pipeline.samplers; tools/builders/arithmetic_sample.py is its
command-line shim): exact labels, balanced splits, held-out triples never in the pool, a seeded file, the pipeline's split names."""

import json
import re
import subprocess
import sys
from pathlib import Path

from sdm_mlx.pipeline import samplers as A

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tools" / "builders" / "arithmetic_sample.py"
STATEMENT = re.compile(r"^(-?\d+) (plus|minus|times) (-?\d+) equals (-?\d+)\.$")


def _parse(doc: str):
    a, op, b, c = STATEMENT.match(doc).groups()
    a, b, c = int(a), int(b), int(c)
    return a, op, b, c, {"plus": a + b, "minus": a - b, "times": a * b}[op]


def test_labels_are_the_truth_and_splits_are_balanced_and_disjoint():
    rows = A.arithmetic_sample(60, 20, 20, seed=3)
    assert [sum(r["split"] == s for r in rows) for s in ("pool", "heldout_topics", "generated")] == [60, 20, 20]
    triples = {}
    for r in rows:
        a, op, b, c, true = _parse(r["document"])
        assert r["label"] == int(c == true)
        if not r["label"]:
            assert c - true in A.ERRORS
        if op != "times":  # the shift: three-digit operands
            assert (a >= 100 and b >= 100) == (r["split"] == "generated")
        triples.setdefault(r["split"], set()).add((a, op, b))
    for split, n in (("pool", 60), ("heldout_topics", 20), ("generated", 20)):
        assert sum(r["label"] for r in rows if r["split"] == split) == n // 2
    assert not triples["pool"] & triples["heldout_topics"]


def test_the_cli_writes_the_same_file_for_the_same_seed(tmp_path):
    def run(path):
        subprocess.run([sys.executable, str(SAMPLE), "--pool", "8", "--heldout", "4",
                        "--generated", "4", "--seed", "1", "-o", str(path)], check=True, capture_output=True)
        return [json.loads(x) for x in path.read_text().splitlines()]

    first, second = run(tmp_path / "a" / "task.jsonl"), run(tmp_path / "b.jsonl")
    assert first == second and len(first) == 16
    assert len({r["id"] for r in first}) == 16


def test_extend_adds_unseen_pool_statements_and_keeps_the_sample(tmp_path):
    """--extend: the sample's rows unchanged and first, then --pool new balanced pool rows whose operand triples
    are in none of its splits (the held-out stays unseen), with new ids."""
    base = tmp_path / "task.jsonl"
    subprocess.run([sys.executable, str(SAMPLE), "--pool", "40", "--heldout", "20",
                    "--generated", "10", "-o", str(base)], check=True, capture_output=True)
    out = tmp_path / "more" / "task.jsonl"
    subprocess.run([sys.executable, str(SAMPLE), "--extend", str(base), "--pool",
                    "30", "-o", str(out)], check=True, capture_output=True)
    old = [json.loads(x) for x in base.read_text().splitlines()]
    new = [json.loads(x) for x in out.read_text().splitlines()]
    assert new[: len(old)] == old and len(new) == len(old) + 30
    added = new[len(old):]
    assert {r["split"] for r in added} == {"pool"} and sum(r["label"] for r in added) == 15
    seen = {_parse(r["document"])[:3] for r in old}
    assert not seen & {_parse(r["document"])[:3] for r in added}
    assert len({r["id"] for r in new}) == len(new)
    for r in added:
        a, op, b, c, true = _parse(r["document"])
        assert r["label"] == int(c == true)


def test_per_split_rows_use_the_pipeline_names_and_keep_the_sample():
    """arithmetic_rows / factcheck_rows: the same sample split into pool | heldout | shift (split fields renamed),
    each split in the sample's order, balanced by label."""
    flat = A.arithmetic_sample(12, 6, 4, seed=2)
    parts = A.arithmetic_rows(pool=12, heldout=6, shift=4, seed=2)
    assert {k: len(v) for k, v in parts.items()} == {"pool": 12, "heldout": 6, "shift": 4}
    assert [r["id"] for r in parts["heldout"]] == [r["id"] for r in flat if r["split"] == "heldout_topics"]
    assert all(r["split"] == s for s, rows in parts.items() for r in rows)
    fc = A.factcheck_rows(pool=10, heldout=6, shift=4, seed=0)
    assert {k: len(v) for k, v in fc.items()} == {"pool": 10, "heldout": 6, "shift": 4}
    assert all(sum(r["label"] for r in rows) == len(rows) // 2 for rows in fc.values())
    assert not {r["id"] for r in fc["pool"]} & {r["id"] for r in fc["heldout"]}
