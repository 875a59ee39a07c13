"""Write arithmetic statements with known truth as a task JSONL (the factcheck pipeline's second task).

A statement reads ``"47 plus 38 equals 85."``: an operation (plus, minus, times) with its result,
true for half the rows and off by 1, 2 or 10 for the other half. Truth is computed, so the labels
are exact and the task can be drawn at any size. Splits, with the factcheck sample's names so that
``tools/real_factcheck_pipeline.py`` runs it unchanged:

* ``pool``: two-digit operands (10-99; 2-12 for ``times``), for training and calibration;
* ``heldout_topics``: the same distribution, operand triples that never occur in the pool;
* ``generated``: the shift, three-digit operands (100-999; 13-99 by 2-9 for ``times``).

The rows are balanced by label within each split and shuffled together, so any prefix of the file
is itself a stratified sample (what a resumable answers run finished before it was stopped).

    python tools/arithmetic_sample.py --pool 1200 --heldout 300 --generated 200 -o runs/arith/task.jsonl
    python tools/arithmetic_sample.py --extend runs/arith/task.jsonl --pool 1200 -o runs/arith2/task.jsonl
"""

from __future__ import annotations

import argparse
import sys
import uuid

import numpy as np

from factcheck_sample import write_sample  # tools/ (this script's folder is on sys.path)

OPERATIONS = ("plus", "minus", "times")
#: how far a false statement's result is from the true one
ERRORS = (-10, -2, -1, 1, 2, 10)


def _operands(rng: np.random.Generator, op: str, shifted: bool) -> tuple[int, int]:
    if op == "times":
        return (int(rng.integers(13, 100)), int(rng.integers(2, 10))) if shifted else \
            (int(rng.integers(2, 13)), int(rng.integers(2, 13)))
    lo, hi = (100, 1000) if shifted else (10, 100)
    return int(rng.integers(lo, hi)), int(rng.integers(lo, hi))


def statement(a: int, op: str, b: int, truth: int, rng: np.random.Generator) -> str:
    """``"a op b equals c."`` with c the true result when ``truth`` is 1, otherwise off by one of :data:`ERRORS`."""
    c = a + b if op == "plus" else a - b if op == "minus" else a * b
    if not truth:
        c += int(rng.choice(ERRORS))
    return f"{a} {op} {b} equals {c}."


def draw(n: int, split: str, rng: np.random.Generator, seen: set, shifted: bool) -> list[dict]:
    """``n`` rows of one split, labels alternating (balanced), operand triples not in ``seen`` (updated)."""
    rows = []
    while len(rows) < n:
        op = OPERATIONS[int(rng.integers(len(OPERATIONS)))]
        a, b = _operands(rng, op, shifted)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        truth = len(rows) % 2
        rows.append({"id": str(uuid.UUID(bytes=rng.bytes(16))), "label": truth,
                     "document": statement(a, op, b, truth, rng), "split": split})
    return rows


def sample_rows(n_pool: int, n_heldout: int, n_generated: int, seed: int = 0) -> list[dict]:
    """The ``{id, label, document, split}`` rows of the three splits in one seeded random order."""
    rng = np.random.default_rng(seed)
    seen: set = set()
    rows = draw(n_pool, "pool", rng, seen, False) + draw(n_heldout, "heldout_topics", rng, seen, False) \
        + draw(n_generated, "generated", rng, seen, True)
    return [rows[i] for i in rng.permutation(len(rows))]


def triple(document: str) -> tuple[int, str, int]:
    """``(a, op, b)`` of a statement ``"a op b equals c."``."""
    a, op, b = document.split()[:3]
    return int(a), op, int(b)


def extend_pool(rows: list[dict], n_more: int, seed: int) -> list[dict]:
    """``rows`` followed by ``n_more`` new pool rows: operand triples in none of ``rows`` (so the held-out
    split stays unseen), drawn with their own seed; the earlier rows keep their ids and order (a resumable
    answers run only decodes the new ones)."""
    seen = {triple(r["document"]) for r in rows}
    more = draw(n_more, "pool", np.random.default_rng([seed, 1]), seen, False)
    return list(rows) + more


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", type=int, default=1200, help="two-digit statements for training and calibration")
    ap.add_argument("--heldout", type=int, default=300, help="two-digit statements never in the pool")
    ap.add_argument("--generated", type=int, default=200, help="three-digit statements (the shift)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extend", metavar="TASK_JSONL", default=None,
                    help="instead: this sample followed by --pool more pool statements unseen in it")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    if min(args.pool, args.heldout, args.generated) < 0:
        ap.error("--pool, --heldout and --generated must be >= 0")
    if args.extend:
        import json

        with open(args.extend, encoding="utf-8") as f:
            rows = [json.loads(x) for x in f if x.strip()]
        write_sample(args.output, extend_pool(rows, args.pool, args.seed))
        return 0
    write_sample(args.output, sample_rows(args.pool, args.heldout, args.generated, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
