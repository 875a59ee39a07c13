"""Benchmark the constructed negatives' features two ways, on a pipeline run's own pool answers: force-decoded from
scratch (the forced stage's ``embed_forced``) against run after the prompt the answers stage kept
(``sdm_mlx/decoding/continuation.py``).

    python tools/bench/bench_forced.py RUN [--task sentiment] [--n 64] [--repeats 2] [--json out.json]

``RUN`` is an ``sdm-mlx pipeline`` run directory whose answers stage has decoded ``--n`` pool rows of ``--task``.
Each row's negative is its own answer inverted in its own layout (``forced_completions: flip``).  One process loads
the recipe's model, decodes the rows once with ``keep_prompt=True`` (what the answers stage does; not timed), then
alternates ``--repeats`` times:

* ``scratch``: :func:`~sdm_mlx.llm.embed.prompt_completion_features` of prompt + negative, the rows' shared prefix
  run once, ``embed_batch_size`` rows per pass (the forced stage);
* ``continuation``: :func:`~sdm_mlx.decoding.continuation.continuation_features` from the kept prompts (only the
  negatives' tokens run, all rows in one pass).

Recorded beside each measurement: load average, CPU user / system / idle / steal shares and RSS; in the report the
BLAS, the medians, their ratio and the largest difference between the two ways' features (relative to the largest
feature).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

import sdm_mlx  # noqa: E402,F401  (before mlx: OpenBLAS on Linux)
from bench_common import timed  # noqa: E402
from sdm_mlx.runtime.blas import describe_blas  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--task", default="sentiment")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import json

    from sdm_mlx.decoding import DecodeEngine, DecodeRequest, PrefixCache
    from sdm_mlx.decoding.continuation import continuation_features
    from sdm_mlx.errors import InputError
    from sdm_mlx.llm import embed as _embed
    from sdm_mlx.llm.answers import answer_in_layout
    from sdm_mlx.pipeline.answers import read_rows
    from sdm_mlx.pipeline.layout import Layout
    from sdm_mlx.pipeline.recipe import Recipe

    layout = Layout(args.run)
    with open(layout.recipe, encoding="utf-8") as f:
        recipe = Recipe.from_dict(json.load(f))
    task = recipe.task(args.task)
    comps = task.answer_completions()
    docs = {r["id"]: r["document"] for r in read_rows(layout.data(args.task, "pool"))}
    own = [r for r in read_rows(layout.answers(args.task, "pool")) if r["answer_label"] in (0, 1)][:args.n]
    if len(own) < args.n:
        raise InputError(f"only {len(own)} parsable pool answers of {args.task}; ask for fewer (--n)")
    model, tok = _embed.load_model(recipe.model)
    parts = tuple(recipe.record_features)
    prompts = [_embed.chat_text(tok, docs[r["id"]], system=recipe.system, prompt_template=task.template())
               for r in own]
    negs = [answer_in_layout(r["text"], comps, 1 - r["answer_label"]) for r in own]
    engine = DecodeEngine(model, tok, max_batch=recipe.generation_batch_size, prefix_cache=PrefixCache())
    decs = engine.run([DecodeRequest(_embed.encode(tok, p), recipe.max_tokens, features=True, feature_parts=parts,
                                     keep_prompt=True) for p in prompts])
    n_kept = _embed.prompt_completion_kept_lengths(tok, prompts, negs)
    conts = [_embed.encode(tok, p + c)[len(d.prompt_ids):] for p, c, d in zip(prompts, negs, decs)]
    seqs = [_embed.encode(tok, p + c) for p, c in zip(prompts, negs)]
    shared = seqs[0][: _embed.common_prefix_length(seqs)]
    modes = {
        "scratch": lambda: _embed.prompt_completion_features(model, tok, prompts, negs, batch_size=recipe.embed_batch_size,
                                                            shared_prefix=shared, parts=parts).embeddings,
        "continuation": lambda: continuation_features(model, [d.prompt_cache for d in decs], conts, n_kept, parts),
    }
    rows, feats = [], {}
    for rep in range(args.repeats):
        for mode, fn in modes.items():
            feats[mode], row = timed(mode, rep, fn, len(prompts))
            rows.append(row)
    med = {m: float(np.median([x["seconds"] for x in rows if x["mode"] == m])) for m in modes}
    diff = float(np.abs(feats["scratch"] - feats["continuation"]).max() / max(np.abs(feats["scratch"]).max(), 1e-30))
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "blas": describe_blas()},
              "model": recipe.model, "task": args.task, "rows": len(prompts), "feature_parts": list(parts),
              "tokens_scratch": int(sum(n_kept)), "tokens_continuation": int(sum(len(c) for c in conts)),
              "embed_batch_size": recipe.embed_batch_size, "measurements": rows, "median_s": med,
              "scratch_over_continuation": med["scratch"] / med["continuation"], "max_relative_difference": diff}
    print(f"\n{len(prompts)} negatives: scratch {med['scratch']:.1f} s, continuation {med['continuation']:.1f} s "
          f"({report['scratch_over_continuation']:.1f}x); largest difference {diff:.1e} of the largest feature")
    if args.json:
        from sdm_mlx.storage.files import write_json

        write_json(args.json, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
