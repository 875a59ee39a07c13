"""Decode the model's own greedy answer to each task statement and keep its verifier features (a thin shim).

The work lives in :mod:`sdm_mlx.pipeline.answers` (the ``answers`` and ``forced`` stages of ``sdm-mlx pipeline``);
this script keeps the older command line for one file at a time.  Output rows: ``id, split, task_label,
answer_label (-1 = unparsable), form, label = 1 iff answer_label == task_label, text, n_kept, prompt_tokens,
generated_tokens, feature_parts, embedding``.  Resumable: rows already in ``--output`` are skipped, every batch is
appended and flushed.

    python tools/real_llm/real_answers.py --model "$MODEL" --input runs/real/task.jsonl --output runs/real/answers.jsonl
    python tools/real_llm/real_answers.py --forced --model "$MODEL" --input forced.jsonl --output forced_emb.jsonl
"""

from __future__ import annotations

import argparse
import sys

from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS
from sdm_mlx.pipeline.answers import (AnswerSettings, answer_form, decode_answers, done_ids,  # noqa: F401
                                      embed_forced, read_rows, shared_prefix_stats, write_prefix_stats)


def main(argv=None) -> int:
    from sdm_mlx.llm import embed as _embed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", required=True)
    ap.add_argument("--input", required=True, help="task JSONL: id, label, document[, split]")
    ap.add_argument("--output", required=True)
    ap.add_argument("--preset", default="factcheck", choices=sorted(PRESETS))
    ap.add_argument("--system", default=PAPER_SYSTEM)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None, help="decode at most this many rows of --input")
    ap.add_argument("--prefix-stats", help="instead: write the shared prompt prefix's length and state sum (.npz)")
    ap.add_argument("--forced", action="store_true",
                    help="instead: --input holds verification rows (id, prompt, completion); write their force-decoded "
                         "features (sdm-mlx embed's: the shared prompt prefix run once per batch)")
    ap.add_argument("--feature-parts", default="mean,last",
                    help="pooled parts of the features, concatenated in the order max, mean, last (DESIGN #21); "
                         "'max,mean,last' keeps all three, so either encoding can be sliced out later")
    args = ap.parse_args(argv)
    parts = _embed.check_feature_parts(args.feature_parts)
    rows = read_rows(args.input)[: args.limit]
    preset = PRESETS[args.preset]
    if args.forced:
        if not set(done_ids(args.output)) >= {r["id"] for r in rows}:
            model, tokenizer = _embed.load_model(args.model, head=False)
            embed_forced(model, tokenizer, rows, args.output, batch_size=args.batch_size, feature_parts=parts)
        return 0
    if args.prefix_stats:
        model, tokenizer = _embed.load_model(args.model)
        st = write_prefix_stats(args.prefix_stats, model, tokenizer, rows, system=args.system,
                                template=preset["prompt_template"])
        print(f"shared prefix: {st['P']} tokens ({st['prefix_text']!r}) -> {args.prefix_stats}", file=sys.stderr)
        return 0
    if not set(done_ids(args.output)) >= {r["id"] for r in rows}:
        model, tokenizer = _embed.load_model(args.model)
        decode_answers(model, tokenizer, rows, args.output,
                       AnswerSettings(args.system, preset["prompt_template"], preset["completions"],
                                      max_tokens=args.max_tokens, batch_size=args.batch_size, feature_parts=parts))
    else:
        print(f"{len(rows)} rows already in {args.output}; 0 to decode", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
