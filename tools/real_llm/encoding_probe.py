"""Which pooled encoding of the real model's states tells its right answers from its wrong ones (issue 42, §3).

A logistic probe per encoding (standardised columns, L2, two strengths) is fitted on one answers file of
``sdm-mlx pipeline``'s answers stage (the model's own pool answers, every row recording max, mean and last) and
scores another (the held-out answers). Writes one row per scored answer with every probe's score
(``--rows``) and prints the per-encoding table: AUC, the right-rate of the most confident 10 / 30 / 50 % judged
right and the wrong-rate of the 10 % judged most likely wrong, with n.

    python tools/real_llm/encoding_probe.py runs/universal2k_qwen15_cpu/answers/sentiment_pool.jsonl \\
        runs/universal2k_qwen15_cpu/answers/sentiment_heldout.jsonl \\
        --rows docs/results/sentiment_qwen15_cpu/sentiment_encoding_probe.jsonl

Needs scikit-learn (``pip install -e '.[tools]'``). A probe is a ceiling-style diagnostic, not the verifier:
the SDM verifiers of the same encodings are the pipeline's ``verifiers`` stage.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from sdm_mlx.llm.pooling import FEATURE_PARTS as PARTS  # the order every recorded row holds
from sdm_mlx.pipeline.verifiers import slice_columns  # the verifiers stage's own column slicing
ENCODINGS = ("last", "mean,last", "max,mean,last", "max,last", "max", "mean")
STRENGTHS = (0.003, 0.03)


def load(path: str):
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    for r in rows:
        if tuple(r.get("feature_parts", ())) != PARTS:
            raise SystemExit(f"{path}: row {r.get('id')} records {r.get('feature_parts')}, not {list(PARTS)}")
    X = np.asarray([r["embedding"] for r in rows], dtype=np.float32)
    return rows, X, np.array([int(r["label"]) for r in rows])


def summary(y: np.ndarray, score: np.ndarray) -> dict:
    from sklearn.metrics import roc_auc_score

    order = np.argsort(-score, kind="stable")
    top = {f"right_top_{int(f * 100)}": round(float(y[order[: int(f * len(y))]].mean()), 3) for f in (0.1, 0.3, 0.5)}
    bottom = 1 - y[order[::-1][: len(y) // 10]].mean()
    return {"auc": round(float(roc_auc_score(y, score)), 3), **top, "wrong_bottom_10": round(float(bottom), 3)}


def main(argv=None) -> int:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fit", help="answers file the probes are fitted on (pool)")
    ap.add_argument("score", help="answers file the probes score (held out)")
    ap.add_argument("--rows", help="write one JSON row per scored answer with every probe's score")
    ap.add_argument("--json", help="write the table as JSON")
    a = ap.parse_args(argv)
    fit_rows, Xf, yf = load(a.fit)
    rows, Xs, ys = load(a.score)
    table, scores = [], {}
    for enc in ENCODINGS:
        cols = slice_columns(PARTS, tuple(enc.split(",")), Xf.shape[1], a.fit)
        for C in STRENGTHS:
            probe = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=3000)).fit(Xf[:, cols], yf)
            s = probe.predict_proba(Xs[:, cols])[:, 1]
            scores[f"{enc}|C={C}"] = s
            table.append({"encoding": enc, "dims": len(cols), "C": C, "n_fit": len(yf), "n_scored": len(ys),
                          "fit_right": round(float(yf.mean()), 3), "scored_right": round(float(ys.mean()), 3),
                          **summary(ys, s)})
    for t in table:
        print(f"{t['encoding']:14s} D={t['dims']:5d} C={t['C']:<6} AUC {t['auc']:.3f}  right top 10/30/50% "
              f"{t['right_top_10']:.3f}/{t['right_top_30']:.3f}/{t['right_top_50']:.3f}  wrong bottom 10% "
              f"{t['wrong_bottom_10']:.3f}  (n fit {t['n_fit']}, scored {t['n_scored']})")
    if a.rows:
        with open(a.rows, "w", encoding="utf-8") as f:
            for k, r in enumerate(rows):
                f.write(json.dumps({"id": r["id"], "label": int(r["label"]), "answer_label": int(r["answer_label"]),
                                    "task_label": int(r["task_label"]),
                                    "scores": {n: round(float(s[k]), 5) for n, s in scores.items()}}) + "\n")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"fit": a.fit, "scored": a.score, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
