"""The task rows of Factcheck and Arithmetic (moved here from ``tools/builders/factcheck_sample.py`` and
``tools/builders/arithmetic_sample.py``, which remain as thin command-line shims).

Every sampler returns task rows ``{id, label, document, split}``.  The pipeline's own split names are
``pool`` (training and calibration of the verifier), ``heldout`` (the in-distribution test) and ``shift`` (the
distribution shift); the older scripts' names ``heldout_topics`` and ``generated`` are the same parts
(:data:`SPLIT_NAMES` maps them).

* :func:`factcheck_rows`: the demo's factcheck split (:func:`sdm_mlx.storage.datasets.factcheck_splits`: 15 % of
  each topic held out, seed 0, plus the 245 shifted ``generated`` statements); from each part ``n`` statements,
  balanced by label.
* :func:`arithmetic_rows`: computed statements ``"47 plus 38 equals 85."``, true for half the rows and off by 1, 2
  or 10 for the other half; two-digit operands in the pool and held-out split (held-out operand triples never in
  the pool), three-digit ones as the shift.

The rows of the three parts are shuffled together, so any prefix of the whole sample is itself a stratified
sample (what a resumable answers run finished before it was stopped).
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import numpy as np

from ..errors import InputError

#: the older scripts' split names -> the pipeline's
SPLIT_NAMES = {"pool": "pool", "heldout_topics": "heldout", "generated": "shift"}
#: the older scripts' split names, in order
LEGACY_SPLITS = ("pool", "heldout_topics", "generated")


def balanced_pick(y: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``n`` rows (all when ``n`` >= len), half from each label as far as possible."""
    if n >= y.size:
        return np.arange(y.size)
    by_class = [rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)]
    take = [min(n // len(by_class), idx.size) for idx in by_class]
    short = n - sum(take)
    for k, idx in enumerate(by_class):  # give the remainder to classes with rows left
        extra = min(short, idx.size - take[k])
        take[k] += extra
        short -= extra
    return np.sort(np.concatenate([idx[:t] for idx, t in zip(by_class, take)]))


def factcheck_sample(n_pool: int, n_heldout: int, n_generated: int, seed: int = 0) -> list[dict]:
    """The sampled ``{id, label, document, split}`` rows (splits ``pool | heldout_topics | generated``) in one
    seeded random order (``tools/builders/factcheck_sample.py``'s file)."""
    from ..storage.datasets import factcheck_splits

    rng = np.random.default_rng(seed)
    rows = []
    for name, ds, n in zip(LEGACY_SPLITS, factcheck_splits(), (n_pool, n_heldout, n_generated)):
        for i in balanced_pick(ds.y, n, rng):
            rows.append({"id": str(ds.ids[i]), "label": int(ds.y[i]), "document": ds.documents[i], "split": name})
    return [rows[i] for i in rng.permutation(len(rows))]


# -- arithmetic -------------------------------------------------------------------------------------------------

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


def arithmetic_sample(n_pool: int, n_heldout: int, n_generated: int, seed: int = 0) -> list[dict]:
    """The ``{id, label, document, split}`` rows of the three splits (``pool | heldout_topics | generated``) in one
    seeded random order (``tools/builders/arithmetic_sample.py``'s file)."""
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


# -- per split, with the pipeline's names --------------------------------------------------------------------------

def by_split(rows: list[dict]) -> dict[str, list[dict]]:
    """``{pool | heldout | shift: rows}`` of a sample written with the older split names (the rows' ``split``
    field renamed too), each in the sample's order."""
    out: dict = {s: [] for s in SPLIT_NAMES.values()}
    for r in rows:
        split = SPLIT_NAMES.get(r["split"], r["split"])
        out.setdefault(split, []).append({**r, "split": split})
    return out


def factcheck_rows(*, pool: int, heldout: int, shift: int, seed: int = 0) -> dict[str, list[dict]]:
    """The factcheck sample per pipeline split (:func:`factcheck_sample`)."""
    return by_split(factcheck_sample(pool, heldout, shift, seed))


def arithmetic_rows(*, pool: int, heldout: int, shift: int, seed: int = 0) -> dict[str, list[dict]]:
    """The arithmetic sample per pipeline split (:func:`arithmetic_sample`)."""
    if min(pool, heldout, shift) < 0:
        raise InputError("arithmetic: pool, heldout and shift must be >= 0")
    return by_split(arithmetic_sample(pool, heldout, shift, seed))


# -- files -----------------------------------------------------------------------------------------------------------

def write_sample(path: str, rows: list[dict], splits=LEGACY_SPLITS) -> None:
    """Write the task rows (making the parent directories) and say how many per split on stderr."""
    from ..storage.files import make_dirs, write_jsonl

    make_dirs(os.path.dirname(os.path.abspath(path)))
    write_jsonl(path, rows)
    counts = {s: sum(r["split"] == s for r in rows) for s in splits}
    print(f"wrote {len(rows)} rows to {path}: {counts}", file=sys.stderr)


def split_file(path: str) -> dict:
    """Write ``<stem>.<split>.jsonl`` for every ``split`` value of ``path``'s rows; returns the row counts."""
    from ..storage.files import atomic_write

    stem = path[:-6] if path.endswith(".jsonl") else path
    parts: dict = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if "split" not in row:
                    raise InputError(f"{path}: line {lineno}: no 'split' field (id {row.get('id')!r})")
                parts.setdefault(row["split"], []).append(line if line.endswith("\n") else line + "\n")
    for name, lines in parts.items():
        with atomic_write(f"{stem}.{name}.jsonl") as out:
            out.writelines(lines)
        print(f"{len(lines)} rows -> {os.path.basename(stem)}.{name}.jsonl", file=sys.stderr)
    return {k: len(v) for k, v in parts.items()}
