"""``sdm-mlx api-features``: the paper's 7-dim attribute vector from black-box LLM answers with top-1 logprobs.

The input format is documented in :mod:`sdm_mlx.llm.api_features` (example:
``tests/data/api_answers_example.jsonl``).
"""

from __future__ import annotations

import sys

from ..errors import CLIError, InputError

HELP = ("7-dim features (mean top-1 token probability per JSON value ⊕ confidence-weighted answer one-hot) "
        "from LLM API answers")


#: Options without a usable default (``--help`` marks them; the CLI checks them before ``run``).
REQUIRED = ("input", "output")


def add_arguments(p) -> None:
    p.add_argument("--input",
                   help="JSONL: id, label, response (generated JSON), logprobs (per-token top-1), [refusal]; "
                        "'-' = stdin")
    p.add_argument("--output", help="output JSONL (input rows + the vector; '-' = stdout); written atomically, "
                                    "must not be the --input")
    p.add_argument("--field", default="attributes",
                   help="output field of the vector "
                        "(sdm-mlx train --features auto reads 'attributes' and/or 'embedding')")
    p.add_argument("--letters", default="ABCD", help="the answer letters, in label order")
    p.add_argument("--on-bad-letter", choices=["error", "zero"], default="error",
                   help="answer_letter not among --letters: fail, or leave the one-hot part at zero")


def run(args) -> int:
    letters = str(args.letters).strip().upper()
    if len(letters) < 2 or len(set(letters)) != len(letters) or not letters.isalpha():
        raise CLIError("--letters must be at least two distinct letters, e.g. ABCD")
    from ..llm.api_features import APIFeatureError, feature_row
    from ..storage.datasets import read_objects as read_jsonl
    from ..storage.files import refuse_same_files, write_jsonl

    refuse_same_files([("--output", args.output)], [("--input", args.input)])

    rows = read_jsonl(args.input)
    out = []
    for lineno, row in rows:
        try:
            out.append(feature_row(row, args.field, letters, args.on_bad_letter))
        except APIFeatureError as e:
            raise InputError(f"{args.input}: line {lineno} (id {row.get('id')!r}): {e}") from None
    write_jsonl(args.output, out)
    n_ref = sum(1 for _, r in rows if r.get("refusal"))
    print(f"sdm-mlx api-features: wrote {len(out)} rows with {3 + len(letters)}-dim '{args.field}' to "
          f"{args.output} ({n_ref} refusal(s) as zero vectors)", file=sys.stderr, flush=True)
    return 0
