"""Write a stratified sample of the embedded factcheck statements as a task JSONL (a thin command-line shim).

The sampler lives in the package (:func:`sdm_mlx.pipeline.samplers.factcheck_sample`), where the recipe verb
``sdm-mlx pipeline`` uses it; this script keeps the older command line and split names
(``pool | heldout_topics | generated``).  The split is the demo's (15 % of each topic held out, seed 0, plus
the 245 shifted ``generated`` statements); from each part ``--pool``, ``--heldout`` and ``--generated``
statements are drawn, balanced by label, and shuffled together (any prefix of the file is stratified).

    python tools/builders/factcheck_sample.py --pool 600 --heldout 200 --generated 245 -o runs/qwen15/task.jsonl
    python tools/builders/factcheck_sample.py --split-file runs/qwen15/verif_emb.jsonl   # -> verif_emb.<split>.jsonl

``--split-file`` writes the rows of a JSONL derived from the sample (which keeps the ``split`` field) into one
file per split, next to it.
"""

from __future__ import annotations

import argparse
import sys

from sdm_mlx.pipeline.samplers import balanced_pick, split_file, write_sample  # noqa: F401  (the old names)
from sdm_mlx.pipeline.samplers import factcheck_sample as sample_rows


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


if __name__ == "__main__":
    sys.exit(main())
