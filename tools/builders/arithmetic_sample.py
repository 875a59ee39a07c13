"""Write arithmetic statements with known truth as a task JSONL (a thin command-line shim).

The sampler lives in the package (:func:`sdm_mlx.pipeline.samplers.arithmetic_sample`), where the recipe verb
``sdm-mlx pipeline`` uses it (``preset: arithmetic``); this script keeps the older command line and split names.
A statement reads ``"47 plus 38 equals 85."``: true for half the rows, off by 1, 2 or 10 for the other half.

* ``pool``: two-digit operands (10-99; 2-12 for ``times``), for training and calibration;
* ``heldout_topics``: the same distribution, operand triples that never occur in the pool;
* ``generated``: the shift, three-digit operands (100-999; 13-99 by 2-9 for ``times``).

    python tools/builders/arithmetic_sample.py --pool 1200 --heldout 300 --generated 200 -o runs/arith/task.jsonl
    python tools/builders/arithmetic_sample.py --extend runs/arith/task.jsonl --pool 1200 -o runs/arith2/task.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

from sdm_mlx.pipeline.samplers import (ERRORS, OPERATIONS, draw, extend_pool, statement, triple,  # noqa: F401
                                       write_sample)
from sdm_mlx.pipeline.samplers import arithmetic_sample as sample_rows


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
        with open(args.extend, encoding="utf-8") as f:
            rows = [json.loads(x) for x in f if x.strip()]
        write_sample(args.output, extend_pool(rows, args.pool, args.seed))
        return 0
    write_sample(args.output, sample_rows(args.pool, args.heldout, args.generated, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
