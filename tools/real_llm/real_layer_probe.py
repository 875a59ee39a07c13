"""Does another layer's state separate right from wrong answers better than the final one? A linear probe per layer.

Reads the answer rows of ``tools/real_llm/real_answers.py`` (``answers.{pool,heldout_topics,generated}.jsonl``: each
row's ``id``, ``text``, ``n_kept`` and ``label`` = the model's answer is right) and the task file with the
statements, rebuilds each prompt + own answer, runs the model once over them (the shared prompt prefix once,
then the rows' own tokens in batches) and keeps, for every requested layer, the verifier feature of
DESIGN #21 pooled over the rows' own positions (``pooling="non-shared"``): ``concat(mean, state at n - 1)``.
``final`` is the final-norm state the verifier uses today. Then, per layer, a logistic regression on the pool
(per-dimension z-scored, C by an 80/20 split of the pool) reports on the held-out topics and on ``generated``:
accuracy, AUC, and the precision of its most confident tenth of each class. Alg. 3 admits only where *every*
class reaches alpha' above one threshold, so the "wrong" tenth's precision is the number to watch.

    python tools/real_llm/real_layer_probe.py --model ~/.cache/sdm_mlx/test_llm/qwen2.5-coder-1.5b-instruct-float32 \\
        --run runs/qwen15_factcheck_verified --layers 4 8 12 14 16 18 20 22 24 27 --json layers.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

SPLITS = ("pool", "heldout_topics", "generated")


def layer_features(model, seqs: list, layers: list, batch_size: int) -> dict:
    """``{layer: float32 [N, 2D]}`` (and ``"final"``): the own positions' mean and the last kept state."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    from sdm_mlx.llm.model import prefix_caches, run_shared_prefix, trunk
    from sdm_mlx.llm.pooling import common_prefix_length, pool_states

    P = min(common_prefix_length(seqs), min(len(s) for s in seqs) - 1)
    prefix = run_shared_prefix(model, seqs[0][:P])
    net = trunk(model)
    D = net.embed_tokens.weight.shape[1]
    out = {k: np.zeros((len(seqs), 2 * D), np.float32) for k in list(layers) + ["final"]}
    order = np.argsort([-len(s) for s in seqs], kind="stable")
    t0 = time.time()
    for b0 in range(0, len(seqs), batch_size):
        idx = order[b0 : b0 + batch_size]
        own = [seqs[i][P:] for i in idx]
        n = [len(o) for o in own]
        width = max(n)
        x = mx.array(np.array([o + [0] * (width - len(o)) for o in own], np.int32))
        cache = prefix_caches(prefix)
        h = net.embed_tokens(x)
        mask = create_attention_mask(h, cache[0])
        kept = {}
        for i, (layer, c) in enumerate(zip(net.layers, cache)):
            h = layer(h, mask, c)
            if i in layers:
                kept[i] = h
        kept["final"] = net.norm(h)
        pooled = {k: pool_states(s, n) for k, s in kept.items()}  # the package's one pooling, own positions
        mx.eval(pooled)
        for k, v in pooled.items():
            out[k][idx] = np.array(v, dtype=np.float32)
        print(f"{min(b0 + batch_size, len(seqs))}/{len(seqs)} rows, {time.time() - t0:.0f} s", file=sys.stderr,
              flush=True)
    return out


def top_precision(p: np.ndarray, y: np.ndarray, cls: int, frac: float = 0.1) -> float:
    """Share of class ``cls`` among the ``frac`` of rows the probe is most confident are ``cls``."""
    score = p if cls == 1 else 1 - p
    top = np.argsort(-score, kind="stable")[: max(1, int(round(frac * len(p))))]
    return float((y[top] == cls).mean())


def probe(X: np.ndarray, y: np.ndarray, split: np.ndarray) -> dict:
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    tr = split == "pool"
    Z = (X - X[tr].mean(0)) / (X[tr].std(0) + 1e-6)
    cut = int(tr.sum() * 0.8)
    Zt, yt = Z[tr], y[tr]
    best = max((LogisticRegression(C=C, max_iter=2000).fit(Zt[:cut], yt[:cut]).score(Zt[cut:], yt[cut:]), C)
               for C in (0.001, 0.01, 0.1))
    model = LogisticRegression(C=best[1], max_iter=2000).fit(Zt, yt)
    p = model.predict_proba(Z)[:, 1]
    res = {"C": best[1]}
    for name in ("heldout_topics", "generated"):
        m = split == name
        res[name] = {"n": int(m.sum()), "accuracy": float(model.score(Z[m], y[m])),
                     "auc": float(roc_auc_score(y[m], p[m])),
                     "top10_right_precision": top_precision(p[m], y[m], 1),
                     "top10_wrong_precision": top_precision(p[m], y[m], 0)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", required=True)
    ap.add_argument("--run", required=True, help="a tools/real_llm/real_answers.py output folder (answers.*.jsonl, "
                    "task.jsonl)")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12, 14, 16, 18, 20, 22, 24, 27],
                    help="0-based indices of the transformer blocks whose output is probed (besides the final norm)")
    ap.add_argument("--pool", type=int, default=None, help="use at most this many pool rows")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    from sdm_mlx.llm import embed as E
    from sdm_mlx.llm.model import load_model
    from sdm_mlx.llm.verification_data import PAPER_SYSTEM, PRESETS
    from sdm_mlx.runtime.allocator import keep_freed_buffers_after_load

    with open(f"{args.run}/task.jsonl", encoding="utf-8") as f:
        documents = {r["id"]: r["document"] for r in map(json.loads, f)}
    rows = []
    for split in SPLITS:
        with open(f"{args.run}/answers.{split}.jsonl", encoding="utf-8") as f:
            part = [json.loads(line) for line in f if line.strip()]
        rows += part[: args.pool] if split == "pool" else part
    keep_freed_buffers_after_load()
    model, tokenizer = load_model(args.model, head=False)
    template = PRESETS["factcheck"]["prompt_template"]
    seqs = [E.encode(tokenizer, E.chat_text(tokenizer, documents[r["id"]], system=PAPER_SYSTEM,
                                            prompt_template=template) + r["text"])[: r["n_kept"]] for r in rows]
    feats = layer_features(model, seqs, args.layers, args.batch_size)
    y = np.array([r["label"] for r in rows])
    split = np.array([r["split"] for r in rows])
    report = {"rows": {s: int((split == s).sum()) for s in SPLITS}, "layers": {}}
    for key, X in feats.items():
        parts = (("mean+state", slice(None)), ("state", slice(X.shape[1] // 2, None)))
        report["layers"][str(key)] = {part: probe(X[:, cols].astype(np.float64), y, split) for part, cols in parts}
        for part, r in report["layers"][str(key)].items():
            h, g = r["heldout_topics"], r["generated"]
            print(f"layer {str(key):>5} {part:10} held-out acc {h['accuracy']:.3f} auc {h['auc']:.3f} "
                  f"top-10% right {h['top10_right_precision']:.2f} wrong {h['top10_wrong_precision']:.2f} | "
                  f"generated acc {g['accuracy']:.3f} auc {g['auc']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
