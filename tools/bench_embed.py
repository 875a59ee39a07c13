"""Benchmark: LLM feature extraction (``sdm_mlx.llm.embed``) vs a plain mlx-lm forward pass.

    python tools/bench_embed.py [--model PATH] [--docs 64] [--batch-size 1 8] [--json out.json]
    python tools/bench_embed.py --size phi3-like-small     # a larger random model, same tokenizer
    python tools/bench_embed.py --model ~/.cache/sdm_mlx/test_llm/qwen2.5-coder-1.5b-instruct-float32 \
        --factcheck --docs 64 --batch-size 8 --cold          # the real model (tools/fetch_test_llm.py)

Without ``--model`` a random model is built locally with ``tools/tiny_models.py``
(``--size tiny``: hidden 64, 2 layers; ``small``: hidden 512, 4 layers, |V| 32064;
``medium``: hidden 1024, 8 layers, |V| 32064).  For each batch size it reports
documents/s and tokens/s of ``prompt_completion_features`` (tokenisation +
delimiter search + trunk forward + masked pooling) and the per-token cost
relative to ``model(x)`` — the plain mlx-lm forward pass producing logits — on
exactly the same (cut, right-padded) token batches; the host-side share
(tokenisation and delimiter search) is timed separately.  Prints a table, writes
JSON with ``--json`` and states which BLAS MLX used.  ``--factcheck`` uses the
embedded factcheck statements in the paper's verification encoding (the
model's chat template, ``{"correctness": true/false}`` completions) instead of
random words; ``--cold`` times one call of each pass after a single short
warm-up forward that pages the weights in (for real models, where one pass
takes minutes).  Peak RSS and MLX peak memory are
reported.
"""

from __future__ import annotations

import argparse
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


def timer(repeat: int, cold: bool):
    """``time(fn)``: one cold call (``cold``) or :func:`best_time`."""
    def once(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return once if cold else (lambda fn: best_time(fn, repeat))


def bench(model, tok, prompts, comps, batch_size: int, max_length: int, repeat: int, cold: bool = False) -> dict:
    timed = timer(repeat, cold)
    out = {}

    def features():
        out["feats"] = E.prompt_completion_features(model, tok, prompts, comps, batch_size=batch_size,
                                                    max_length=max_length)

    t_feat = timed(features)
    feats = out["feats"]
    n_kept = feats.n_kept
    tokens = int(n_kept.sum())

    # host-side share: tokenisation + delimiter search only
    def host():
        for p, c in zip(prompts, comps):
            ids = E.encode(tok, p + c)
            E.delimiter_token_index_in_text(tok, p + c, ids, (len(p), None))

    t_host = timed(host)

    # the same cut, padded batches through the full model (logits)
    order = np.argsort(-n_kept, kind="stable")
    seqs = [E.encode(tok, p + c) for p, c in zip(prompts, comps)]
    batches = []
    for b0 in range(0, len(seqs), batch_size):
        idx = order[b0 : b0 + batch_size]
        width = int(n_kept[idx].max())
        batches.append(mx.array(np.array([seqs[i][: n_kept[i]] + [0] * (width - n_kept[i]) for i in idx], np.int32)))
    padded = sum(int(b.size) for b in batches)

    def logits():
        for b in batches:
            mx.eval(model(b))

    def trunk_only():
        for b in batches:
            mx.eval(E.hidden_states(model, b))

    t_logits = timed(logits)
    t_trunk = timed(trunk_only)
    return {
        "batch_size": batch_size,
        "docs": len(prompts),
        "tokens": tokens,
        "padded_tokens": padded,
        "features_s": t_feat,
        "docs_per_s": len(prompts) / t_feat,
        "tokens_per_s": tokens / t_feat,
        "features_us_per_token": 1e6 * t_feat / tokens,
        "logits_forward_us_per_token": 1e6 * t_logits / tokens,
        "trunk_forward_us_per_token": 1e6 * t_trunk / tokens,
        "host_us_per_token": 1e6 * t_host / tokens,
        "features_over_logits": t_feat / t_logits,
        "logits_tokens_per_s": tokens / t_logits,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model dir / hub id (default: build a random one)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="random model size when --model is not given")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-length", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--factcheck", action="store_true",
                    help="factcheck statements in the verification encoding instead of random words")
    ap.add_argument("--cold", action="store_true", help="time one call of each pass after one short warm-up forward (large models)")
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
    if args.cold:  # page the (memory-mapped) weights in, so the first timed pass does not pay for it
        mx.eval(model(mx.array(tok.encode("warm up the weights")[:8])[None]))
    rows = [bench(model, tok, prompts, comps, b, args.max_length, args.repeat, args.cold) for b in args.batch_size]
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
        "timing": "one cold call" if args.cold else f"best of {args.repeat} after a warm-up",
        "peak_rss_gb": peak_rss_gb,
        "mlx_peak_memory_gb": mx.get_peak_memory() / 1e9,
        "load_average_at_end": load,
        "results": rows,
    }
    print(f"model: {label}  hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, |V| {cfg.vocab_size}, "
          f"features {2 * cfg.hidden_size}-dim")
    print(f"BLAS: {report['blas']}   device: {report['mlx_device']}   dtype: {report['dtype']}   "
          f"data: {report['data']}   timing: {report['timing']}")
    head = f"{'batch':>5} {'docs/s':>8} {'tok/s':>9} {'feat us/tok':>11} {'logits us/tok':>13} {'trunk us/tok':>12} {'host us/tok':>11} {'feat/logits':>11}"
    print(head)
    for r in rows:
        print(f"{r['batch_size']:>5} {r['docs_per_s']:>8.1f} {r['tokens_per_s']:>9.0f} {r['features_us_per_token']:>11.2f} "
              f"{r['logits_forward_us_per_token']:>13.2f} {r['trunk_forward_us_per_token']:>12.2f} "
              f"{r['host_us_per_token']:>11.2f} {r['features_over_logits']:>11.2f}")
    print(f"({args.docs} documents, {rows[0]['tokens']} kept tokens; padding overhead at the largest batch "
          f"{rows[-1]['padded_tokens'] / rows[-1]['tokens'] - 1:.1%})")
    print(f"peak RSS {peak_rss_gb:.2f} GB, MLX peak memory {report['mlx_peak_memory_gb']:.2f} GB, "
          f"load average at the end {' '.join(load)} (shared machine)")
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
