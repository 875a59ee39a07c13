"""Benchmark: verified generation (``sdm_mlx.verified``) vs plain mlx-lm greedy generation of the same tokens.

    python tools/bench/bench_generate.py [--size tiny|small|medium] [--prompts 8] [--tokens 64] [--support 1000]
                                   [--json out.json]
    python tools/bench/bench_generate.py --model DIR [--verifier DIR] [--factcheck] ...   # a real model
    python tools/bench/bench_generate.py --batched --old-src DIR ...   # batched engine vs older code, see below

``--batched``: ``generate --input``'s verified generation over many prompts and Alg. 4's per-epoch
decoding, the batched engine against an older ``sdm_mlx`` tree (``--old-src``), in one run:
:mod:`bench_generate_batched` (its docstring lists what is measured).

With ``--verifier`` a saved ``SDMEstimator`` (e.g. trained with ``sdm-mlx train`` on
``sdm-mlx embed`` features of this model) replaces the synthetic one; with
``--factcheck`` the prompts are factcheck statements in the paper's verification
prompt (``sdm_mlx.llm.verification_data.PRESETS["factcheck"]``) instead of random
movie-review words.

Without ``--model`` a random model is built locally with ``tools/builders/tiny_models.py``
(``tiny``: hidden 64, 2 layers, |V| ≈ 360; ``small``: hidden 512, 4 layers,
|V| 32064; ``medium``: hidden 1024, 8 layers, |V| 32064).  The verification
layer is an ``SDMEstimator`` fitted (tiny settings) on ``--support`` synthetic
rows of the model's feature width — only its size matters for the timing.
Decoding runs a fixed number of tokens (``--tokens``, delimiter stop off; an
EOS ends a row early and the token counts follow) for each prompt and reports:

* ``mlx_lm``      — ``mlx_lm.stream_generate`` (greedy) tokens/s;
* ``plain``       — our plain decoder (mlx-lm's ``generate_step``) without verification;
* ``joint``       — joint neg+pos decoding with a positive head (W_pos = float32 copy of
                    the LM head) via ``network.generation.greedy_generate``, without verification;
* ``plain+verify`` / ``joint+verify`` — decoding + verification of the answer, end to end, as
  ``VerifiedGenerator`` does a first attempt: the verifier input is pooled from the decoding's
  own states (``DecodeRequest(features=True)``), then the estimate;
* per-answer verification latency: the separate feature pass (prompt + answer through the
  trunk once more: what a re-asked attempt, ``/v1/verify`` and the code before decode-time
  features pay), adaptor + support search (q, d0, exemplars), the whole estimate, the
  verification as timed in the verified paths, medians;
* overhead of each path relative to ``mlx_lm`` on the same tokens.

Prints a table, writes JSON with ``--json`` and states which BLAS MLX used.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import sdm_mlx  # noqa: F401  (before mlx: loads OpenBLAS on Linux)
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    from sdm_mlx.llm import embed as E  # noqa: E402
    from sdm_mlx.runtime.blas import describe_blas  # noqa: E402
except ImportError:  # an older sdm_mlx tree in --batched's workers: its flat layout (sdm_mlx/<name>.py)
    import importlib

    E = importlib.import_module("sdm_mlx.{}".format("embed"))
    describe_blas = importlib.import_module("sdm_mlx.{}".format("blas")).describe_blas
from bench_common import SIZES, load_bench_model, write_report  # noqa: E402

SYSTEM = "You are a helpful AI assistant."
TEMPLATE = ("Classify the sentiment of the following movie review. "
            'Respond using the following JSON: {"sentiment": str}. REVIEW: {document}')
WORDS = "the film was warm funny dull wooden long moving sharp plot cast acting review minute year classic".split()


def make_verifier(width: int, n: int, seed: int = 0):
    from sdm_mlx.estimator import SDMEstimator

    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    X = rng.normal(size=(n, width)).astype(np.float32) + 0.5 * y[:, None].astype(np.float32)
    est = SDMEstimator(alpha=0.9, iterations=1, epochs=1, exemplar_dim=1000, batch_size=50, learning_rate=1e-3,
                       rescaler_max_epochs=5, verbose=False, seed=seed)
    return est.fit(X, y)


def make_prompts(tok, n: int, factcheck: bool) -> list[str]:
    """``n`` chat prompts: random review words in the sentiment prompt, or factcheck statements (seed 0)."""
    rng = np.random.default_rng(0)
    if not factcheck:
        return [E.chat_text(tok, " ".join(rng.choice(WORDS, size=int(rng.integers(10, 40)))) + ".", system=SYSTEM,
                            prompt_template=TEMPLATE) for _ in range(n)]
    try:
        from sdm_mlx.storage.datasets import load_factcheck
        from sdm_mlx.llm.verification_data import PRESETS
    except ImportError:  # an older tree's flat layout (see the imports above)
        import importlib

        load_factcheck = importlib.import_module("sdm_mlx.{}".format("data")).load_factcheck
        PRESETS = importlib.import_module("sdm_mlx.{}".format("verification_data")).PRESETS

    docs = load_factcheck("generated").documents
    template = PRESETS["factcheck"]["prompt_template"]
    return [E.chat_text(tok, docs[i], system=SYSTEM, prompt_template=template)
            for i in rng.choice(len(docs), size=n, replace=False)]


def _median(v):
    return float(np.median(v)) if v else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model dir / hub id (default: build a random one)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt (delimiter stop off)")
    ap.add_argument("--support", type=int, default=1000,
                    help="rows of synthetic verifier data (train + calibration; half become the support set)")
    ap.add_argument("--verifier", default=None, help="saved SDMEstimator directory (default: a synthetic one)")
    ap.add_argument("--factcheck", action="store_true", help="factcheck statements in the paper's prompt")
    ap.add_argument("--n-exemplars", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    b = ap.add_argument_group("--batched: the batched engine vs older code")
    b.add_argument("--batched", action="store_true")
    b.add_argument("--old-src", default=None, help="directory holding the older sdm_mlx package")
    b.add_argument("--batch", type=int, default=16, help="rows decoded at once")
    b.add_argument("--old-batch", type=int, default=None,
                   help="rows decoded at once by the older code (default: --batch; e.g. its own default, 8)")
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--workloads", default="generate,alg4")
    b.add_argument("--slot", default=None, help="command prefix of every worker (e.g. /work/wt/realslot)")
    args = ap.parse_args(argv)
    if args.batched:
        return batched(args)

    import mlx_lm

    from sdm_mlx.network.heads import SDMHeads
    from sdm_mlx.decoding.batching import DecodeEngine, DecodeRequest
    from sdm_mlx.verified import AnswerVerifier

    def one_prompt(heads=None):  # one prompt at a time through the batched engine (plain, or joint with heads)
        engine = DecodeEngine(model, tok, heads=heads, max_batch=1, prefix_cache=False)
        return lambda pid, tokens: engine.run([DecodeRequest(list(pid), int(tokens), stop_at_delimiter=False,
                                                             features=True)])[0]

    model, tok, label = load_bench_model(args.model, args.size)
    cfg = model.args
    n_real = len(tok.get_vocab())
    if cfg.vocab_size > n_real and getattr(model, "lm_head", None) is not None and not args.model:
        # padded vocabulary of a random model: copy real rows into the padding rows so that greedy argmax
        # (first index on ties) only ever picks ids the tokenizer can decode; the compute is unchanged
        w = model.lm_head.weight
        model.lm_head.weight = w[mx.array(np.arange(cfg.vocab_size) % n_real)]
        mx.eval(model.lm_head.weight)
    t0 = time.perf_counter()
    if args.verifier:
        from sdm_mlx.estimator import SDMEstimator

        est = SDMEstimator.load(args.verifier)
    else:
        est = make_verifier(2 * cfg.hidden_size, args.support)
    fit_s = time.perf_counter() - t0
    verifier = AnswerVerifier(model, tok, est, n_exemplars=args.n_exemplars)
    heads = SDMHeads(model)
    # features=True: the decoders pool the verifier input from their own states, as VerifiedGenerator does
    decoders = {"plain": one_prompt(), "joint": one_prompt(heads)}
    prompts = make_prompts(tok, args.prompts, args.factcheck)
    ids = [E.encode(tok, p) for p in prompts]

    # warm-up (compilation, caches)
    list(mlx_lm.stream_generate(model, tok, prompts[0], max_tokens=4))
    for d in decoders.values():
        out = d(ids[0], 4)
        verifier(ids[0], out.token_ids, out.text)

    totals = {k: [0, 0.0] for k in ("mlx_lm", "plain", "joint", "plain+verify", "joint+verify")}
    feat, search, estimate, verify = [], [], [], []
    for p, pid in zip(prompts, ids):
        t = time.perf_counter()
        n_ref = sum(1 for r in mlx_lm.stream_generate(model, tok, p, max_tokens=args.tokens)
                    if r.finish_reason != "stop")
        totals["mlx_lm"][0] += n_ref
        totals["mlx_lm"][1] += time.perf_counter() - t
        for name, dec in decoders.items():
            out = dec(pid, args.tokens)
            totals[name][0] += len(out.token_ids)
            totals[name][1] += out.seconds
            v = verifier(pid, out.token_ids, out.text, features=(out.features, out.feature_info))
            totals[name + "+verify"][0] += len(out.token_ids)
            totals[name + "+verify"][1] += out.seconds + v.seconds
            verify.append(v.seconds)
            # breakdown of one verification
            t1 = time.perf_counter()
            X, _ = verifier.features(pid, out.token_ids)
            t2 = time.perf_counter()
            z, h = est._forward(X)  # the breakdown times the private steps of estimate()
            est.index_.similarity(h, z.argmax(axis=1), est._good(), est.k_)
            est.index_.search(h, args.n_exemplars)
            t3 = time.perf_counter()
            est.estimate(X, n_exemplars=args.n_exemplars)
            t4 = time.perf_counter()
            feat.append(t2 - t1)
            search.append(t3 - t2)
            estimate.append(t4 - t3)
    ref_rate = totals["mlx_lm"][0] / totals["mlx_lm"][1]
    rows = []
    for name, (n, s) in totals.items():
        rate = n / s if s > 0 else float("nan")
        rows.append({"path": name, "tokens": n, "seconds": s, "tokens_per_s": rate,
                     "overhead_vs_mlx_lm": ref_rate / rate - 1.0})
    lat = {"feature_pass_s": _median(feat), "adaptor_and_support_search_s": _median(search),
           "estimate_s": _median(estimate), "verification_total_s": _median(verify),
           "verification_total_p90_s": float(np.percentile(verify, 90))}
    report = {
        "model": label, "hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size, "feature_width": 2 * cfg.hidden_size, "support_rows": int(len(est.support_ids_)),
        "verifier": args.verifier or "synthetic", "verifier_fit_or_load_s": fit_s, "prompts": args.prompts, "tokens_per_prompt": args.tokens,
        "mean_prompt_tokens": float(np.mean([len(i) for i in ids])),
        "blas": describe_blas(), "platform": platform.platform(), "mlx_device": str(mx.default_device()),
        "results": rows, "verification_latency": lat,
    }
    print(f"model: {label}  hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, |V| {cfg.vocab_size}; "
          f"verifier: {2 * cfg.hidden_size}-dim features, {report['support_rows']} support rows")
    print(f"BLAS: {report['blas']}   device: {report['mlx_device']}   {args.prompts} prompts "
          f"(~{report['mean_prompt_tokens']:.0f} tokens) x {args.tokens} generated tokens")
    print(f"{'path':>14} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'overhead vs mlx-lm':>19}")
    for r in rows:
        print(f"{r['path']:>14} {r['tokens']:>7} {r['seconds']:>8.3f} {r['tokens_per_s']:>8.1f} "
              f"{r['overhead_vs_mlx_lm']:>18.1%}")
    print("verification latency per answer (median): "
          f"feature pass {1e3 * lat['feature_pass_s']:.2f} ms, adaptor + support search "
          f"{1e3 * lat['adaptor_and_support_search_s']:.2f} ms, whole estimate {1e3 * lat['estimate_s']:.2f} ms, "
          f"total {1e3 * lat['verification_total_s']:.2f} ms (p90 {1e3 * lat['verification_total_p90_s']:.2f} ms)")
    if args.json:
        write_report(args.json, report)
    return 0


def batched(args) -> int:
    """``--batched``: old vs new on a saved model (``--model``, else a random phi3 of ``--size`` saved here)."""
    import tempfile

    import bench_generate_batched as bb

    if not args.old_src:
        raise SystemExit("--batched needs --old-src DIR (an older sdm_mlx tree)")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tiny_models import make_tiny_model

            overrides = {k: v for k, v in (SIZES[args.size] or {}).items() if k != "vocab_size"} or None
            model = make_tiny_model(tmp, "phi3", overrides=overrides)
        report = bb.compare(args, model)
    report.update(blas=describe_blas(), platform=platform.platform(), size=None if args.model else args.size)
    bb.print_table(report)
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
