"""Write a stratified sample of the embedded factcheck statements as a task JSONL.

The split is the demo's (``sdm_mlx.storage.datasets.factcheck_splits``: 15 % of each topic held out,
seed 0, plus the 245 shifted ``generated`` statements). From each part, ``--pool``,
``--heldout`` and ``--generated`` statements are drawn, balanced by label. Every row is
``{id, label, document, split}`` with ``split`` in ``pool | heldout_topics | generated``.

The rows of the three parts are shuffled together, so any prefix of the file (e.g. what a
resumable ``sdm-mlx embed`` finished before it was stopped) is itself a stratified sample.

    python tools/factcheck_sample.py --pool 600 --heldout 200 --generated 245 -o runs/qwen15/task.jsonl
    python tools/factcheck_sample.py --split-file runs/qwen15/verif_emb.jsonl   # -> verif_emb.<split>.jsonl

``--split-file`` writes the rows of a JSONL derived from the sample (e.g. the output
of ``sdm-mlx make-verification-data`` then ``sdm-mlx embed``, which keep the
``split`` field) into one file per split, next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from sdm_mlx.storage.datasets import factcheck_splits
from sdm_mlx.storage.files import atomic_write, make_dirs, write_jsonl


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


def sample_rows(n_pool: int, n_heldout: int, n_generated: int, seed: int = 0) -> list[dict]:
    """The sampled ``{id, label, document, split}`` rows in one seeded random order."""
    rng = np.random.default_rng(seed)
    rows = []
    for name, ds, n in zip(("pool", "heldout_topics", "generated"), factcheck_splits(), (n_pool, n_heldout, n_generated)):
        for i in balanced_pick(ds.y, n, rng):
            rows.append({"id": str(ds.ids[i]), "label": int(ds.y[i]), "document": ds.documents[i], "split": name})
    return [rows[i] for i in rng.permutation(len(rows))]


def split_file(path: str) -> dict:
    """Write ``<stem>.<split>.jsonl`` for every ``split`` value of ``path``'s rows; returns the row counts."""

    stem = path[:-6] if path.endswith(".jsonl") else path
    parts: dict = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if "split" not in row:
                    raise SystemExit(f"{path}: line {lineno}: no 'split' field (id {row.get('id')!r})")
                parts.setdefault(row["split"], []).append(line if line.endswith("\n") else line + "\n")
    for name, lines in parts.items():
        with atomic_write(f"{stem}.{name}.jsonl") as out:
            out.writelines(lines)
        print(f"{len(lines)} rows -> {os.path.basename(stem)}.{name}.jsonl", file=sys.stderr)
    return {k: len(v) for k, v in parts.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", type=int, default=600, help="statements from the training/calibration pool")
    ap.add_argument("--heldout", type=int, default=200, help="statements from the held-out 15 %% of each topic")
    ap.add_argument("--generated", type=int, default=245, help="statements from the shifted 'generated' set")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output")
    ap.add_argument("--split-file", help="instead: split this JSONL by its rows' 'split' field")
    args = ap.parse_args(argv)
    if args.split_file:
        split_file(args.split_file)
        return 0
    if not args.output:
        ap.error("give -o/--output (or --split-file)")
    write_sample(args.output, sample_rows(args.pool, args.heldout, args.generated, args.seed))
    return 0


def write_sample(path: str, rows: list[dict]) -> None:
    """Write the task rows (making the parent directories: runs/... on a fresh checkout) and say how many per split."""
    make_dirs(os.path.dirname(os.path.abspath(path)))
    write_jsonl(path, rows)
    counts = {s: sum(r["split"] == s for r in rows) for s in ("pool", "heldout_topics", "generated")}
    print(f"wrote {len(rows)} rows to {path}: {counts}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
