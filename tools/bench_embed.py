"""Benchmark: LLM feature extraction (``sdm_mlx.embed``) vs a plain mlx-lm forward pass.

    python tools/bench_embed.py [--model PATH] [--docs 64] [--batch-size 1 8] [--json out.json]
    python tools/bench_embed.py --size phi3-like-small     # a larger random model, same tokenizer

Without ``--model`` a random model is built locally with ``tests/tiny_models.py``
(``--size tiny``: hidden 64, 2 layers; ``small``: hidden 512, 4 layers, |V| 32064;
``medium``: hidden 1024, 8 layers, |V| 32064).  For each batch size it reports
documents/s and tokens/s of ``prompt_completion_features`` (tokenisation +
delimiter search + trunk forward + masked pooling) and the per-token cost
relative to ``model(x)`` — the plain mlx-lm forward pass producing logits — on
exactly the same (cut, right-padded) token batches; the host-side share
(tokenisation and delimiter search) is timed separately.  Prints a table, writes
JSON with ``--json`` and states which BLAS MLX used.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sdm_mlx import embed as E  # noqa: E402
from sdm_mlx.blas import describe_blas  # noqa: E402
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


def bench(model, tok, prompts, comps, batch_size: int, max_length: int, repeat: int) -> dict:
    def features():
        return E.prompt_completion_features(model, tok, prompts, comps, batch_size=batch_size, max_length=max_length)

    feats = features()
    t_feat = best_time(features, repeat)
    n_kept = feats.n_kept
    tokens = int(n_kept.sum())

    # host-side share: tokenisation + delimiter search only
    def host():
        for p, c in zip(prompts, comps):
            ids = E.encode(tok, p + c)
            E.delimiter_token_index_in_text(tok, p + c, ids, (len(p), None))

    t_host = best_time(host, repeat)

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

    t_logits = best_time(logits, repeat)
    t_trunk = best_time(trunk_only, repeat)
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
    args = ap.parse_args(argv)

    model, tok, label = load_bench_model(args.model, args.size)
    cfg = model.args
    docs, comps = make_docs(args.docs)
    prompts = [E.chat_text(tok, d, system="You are a helpful AI assistant.",
                           prompt_template='Classify the sentiment. Respond using the following JSON: '
                                           '{"sentiment": str}. REVIEW: {document}') for d in docs]
    rows = [bench(model, tok, prompts, comps, b, args.max_length, args.repeat) for b in args.batch_size]
    report = {
        "model": label,
        "hidden_size": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "feature_width": 2 * cfg.hidden_size,
        "blas": describe_blas(),
        "platform": platform.platform(),
        "mlx_device": str(mx.default_device()),
        "results": rows,
    }
    print(f"model: {label}  hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, |V| {cfg.vocab_size}, "
          f"features {2 * cfg.hidden_size}-dim")
    print(f"BLAS: {report['blas']}   device: {report['mlx_device']}")
    head = f"{'batch':>5} {'docs/s':>8} {'tok/s':>9} {'feat us/tok':>11} {'logits us/tok':>13} {'trunk us/tok':>12} {'host us/tok':>11} {'feat/logits':>11}"
    print(head)
    for r in rows:
        print(f"{r['batch_size']:>5} {r['docs_per_s']:>8.1f} {r['tokens_per_s']:>9.0f} {r['features_us_per_token']:>11.2f} "
              f"{r['logits_forward_us_per_token']:>13.2f} {r['trunk_forward_us_per_token']:>12.2f} "
              f"{r['host_us_per_token']:>11.2f} {r['features_over_logits']:>11.2f}")
    print(f"({args.docs} documents, {rows[0]['tokens']} kept tokens; padding overhead at the largest batch "
          f"{rows[-1]['padded_tokens'] / rows[-1]['tokens'] - 1:.1%})")
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
