"""Benchmark: LLM features with the shared prompt prefix run once (``sdm_mlx.llm.embed``) vs the unshared old way.

    python tools/bench/bench_embed.py [--model PATH] [--docs 64] [--batch-size 1 8] [--rounds 2] [--json out.json]
    python tools/bench/bench_embed.py --size small           # a larger random model, same tokenizer
    python tools/bench/bench_embed.py --model ~/.cache/sdm_mlx/test_llm/qwen2.5-coder-1.5b-instruct-float32 \
        --factcheck --docs 32 --batch-size 8 --rounds 2   # the real model (tools/fetch_test_llm.py)

Without ``--model`` a random model is built locally with ``tools/builders/tiny_models.py``
(``--size tiny``: hidden 64, 2 layers; ``small``: hidden 512, 4 layers, |V| 32064;
``medium``: hidden 1024, 8 layers, |V| 32064).  For each batch size it times,
alternating old and new ``--rounds`` times in one process (ratios within one
run: the machine is shared), rows/s of

* new: ``prompt_completion_features`` — tokenisation, delimiter search, the
  token prefix every row shares prefilled once into a KV cache tiled over each
  batch, each row's own tokens, pooling;
* old: the 052b975 computation — every row's full kept token sequence through
  the trunk in right-padded batches, the same pooling;

and the largest relative difference between their features.  ``--factcheck``
uses the embedded factcheck statements in the paper's verification encoding
(the model's chat template, ``{"correctness": true/false}`` completions)
instead of random words.  Records the BLAS MLX used, the load average after
every round, peak RSS and MLX peak memory; prints a table, writes JSON with
``--json``.  Model load time is not included (the same for both ways).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from pathlib import Path

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sdm_mlx.llm import embed as E  # noqa: E402
from sdm_mlx.runtime.blas import describe_blas  # noqa: E402
from bench_common import SIZES, best_time, load_bench_model, write_report  # noqa: E402

WORDS = ("the film was warm funny dull wooden long moving sharp plot cast acting review minute year classic "
         "water boils sun orbits paris capital spiders insects").split()


def make_docs(n: int, seed: int = 0, min_words: int = 20, max_words: int = 120):
    rng = np.random.default_rng(seed)
    docs, comps = [], []
    for _ in range(n):
        docs.append(" ".join(rng.choice(WORDS, size=int(rng.integers(min_words, max_words + 1)))) + ".")
        comps.append('{"sentiment": "%s"}' % ("positive" if rng.random() < 0.5 else "negative"))
    return docs, comps


def factcheck_docs(tok, n: int, seed: int = 0):
    """``n`` factcheck statements (seeded sample) as (chat prompts, completions) of the verification encoding."""
    from sdm_mlx.storage.datasets import load_factcheck
    from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS, make_verification_rows

    ds = load_factcheck()
    idx = np.random.default_rng(seed).choice(len(ds.y), size=min(n, len(ds.y)), replace=False)
    rows = [{"id": ds.ids[i], "label": int(ds.y[i]), "document": ds.documents[i]} for i in idx]
    preset = PRESETS["factcheck"]
    ver = make_verification_rows(rows, preset["completions"], lambda d: E.chat_text(
        tok, d, system=PAPER_SYSTEM, prompt_template=preset["prompt_template"]), seed=seed)
    return [r["prompt"] for r in ver], [r["completion"] for r in ver]


def unshared_features(model, seqs: list, batch_size: int) -> np.ndarray:
    """The 052b975 computation: every (cut) row's full token sequence through the trunk, longest first, in
    right-padded batches, pooled with the same :func:`sdm_mlx.llm.embed.pool_states` (the "old way")."""
    lens = np.array([len(s) for s in seqs])
    order = np.argsort(-lens, kind="stable")
    out = np.empty((len(seqs), 0), dtype=np.float32)
    for b0 in range(0, len(seqs), batch_size):
        idx = order[b0 : b0 + batch_size]
        feats = E.pool_states(E.hidden_states(model, [seqs[i] for i in idx]), lens[idx])
        mx.eval(feats)
        if out.shape[1] == 0:
            out = np.empty((len(seqs), feats.shape[1]), dtype=np.float32)
        out[idx] = np.array(feats)
    return out


def bench(model, tok, prompts, comps, batch_size: int, max_length: int, rounds: int) -> dict:
    """Shared-prefix features (``prompt_completion_features``) against the unshared old way on the same
    rows, alternating ``rounds`` times (ratios within one run on a shared machine); host share timed apart."""
    got = {}

    def shared():
        got["feats"] = E.prompt_completion_features(model, tok, prompts, comps, batch_size=batch_size,
                                                    max_length=max_length)

    shared()  # warm-up: pages the weights in, fixes the kept lengths
    feats = got["feats"]
    seqs = [E.encode(tok, p + c)[: int(n)] for p, c, n in zip(prompts, comps, feats.n_kept)]

    def old():
        got["old"] = unshared_features(model, seqs, batch_size)

    t_old, t_new, loads = [], [], []
    for _ in range(rounds):
        for fn, acc in ((old, t_old), (shared, t_new)):
            t = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t)
        loads.append(os.getloadavg()[0])
    t = time.perf_counter()
    for p, c in zip(prompts, comps):  # host-side share: tokenisation + delimiter search
        E.delimiter_token_index_in_text(tok, p + c, E.encode(tok, p + c), (len(p), None))
    t_host = time.perf_counter() - t
    ref = got["old"]
    rel = float(np.abs(got["feats"].embeddings - ref).max() / np.abs(ref).max())
    tokens = int(feats.n_kept.sum())
    shared_len = E.common_prefix_length(seqs)
    own = tokens - len(seqs) * min(shared_len, int(feats.n_kept.min()) - 1)
    return {
        "batch_size": batch_size, "docs": len(prompts), "kept_tokens": tokens, "shared_prefix_tokens": shared_len,
        "own_tokens": own, "old_s": t_old, "new_s": t_new,
        "old_rows_per_s": len(prompts) / min(t_old), "new_rows_per_s": len(prompts) / min(t_new),
        "ratio_best": min(t_old) / min(t_new), "ratio_sum": sum(t_old) / sum(t_new),
        "host_s": t_host, "max_rel_difference": rel, "load_average_1min": loads,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model dir / hub id (default: build a random one)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="random model size when --model is not given")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-length", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2, help="alternating old/new timings per batch size")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--factcheck", action="store_true",
                    help="factcheck statements in the verification encoding instead of random words")
    args = ap.parse_args(argv)

    model, tok, label = load_bench_model(args.model, args.size)
    cfg = model.args
    if args.factcheck:
        prompts, comps = factcheck_docs(tok, args.docs)
    else:
        docs, comps = make_docs(args.docs)
        prompts = [E.chat_text(tok, d, system="You are a helpful AI assistant.",
                               prompt_template='Classify the sentiment. Respond using the following JSON: '
                                               '{"sentiment": str}. REVIEW: {document}') for d in docs]
    rows = [bench(model, tok, prompts, comps, b, args.max_length, args.rounds) for b in args.batch_size]
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    report = {
        "model": label,
        "hidden_size": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "feature_width": 2 * cfg.hidden_size,
        "blas": describe_blas(),
        "platform": platform.platform(),
        "mlx_device": str(mx.default_device()),
        "dtype": str(model.model.embed_tokens.weight.dtype),
        "data": "factcheck verification encoding" if args.factcheck else "random words",
        "timing": f"{args.rounds} alternating rounds (old, new) after a warm-up",
        "peak_rss_gb": peak_rss_gb,
        "mlx_peak_memory_gb": mx.get_peak_memory() / 1e9,
        "load_average_at_end": load,
        "results": rows,
    }
    print(f"model: {label}  hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, |V| {cfg.vocab_size}, "
          f"features {2 * cfg.hidden_size}-dim")
    print(f"BLAS: {report['blas']}   device: {report['mlx_device']}   dtype: {report['dtype']}   "
          f"data: {report['data']}   timing: {report['timing']}")
    print(f"{'batch':>5} {'old rows/s':>10} {'new rows/s':>10} {'ratio':>6} {'kept tok':>8} {'shared':>6} "
          f"{'own tok':>7} {'max rel diff':>12} {'load':>10}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['old_rows_per_s']:>10.3f} {r['new_rows_per_s']:>10.3f} {r['ratio_sum']:>6.2f} "
              f"{r['kept_tokens']:>8} {r['shared_prefix_tokens']:>6} {r['own_tokens']:>7} "
              f"{r['max_rel_difference']:>12.2e} {' '.join(f'{x:.1f}' for x in r['load_average_1min']):>10}")
    print(f"peak RSS {peak_rss_gb:.2f} GB, MLX peak memory {report['mlx_peak_memory_gb']:.2f} GB, "
          f"load average at the end {' '.join(load)} (shared machine)")
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
