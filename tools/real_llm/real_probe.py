"""Which features and which framing carry the verifier's signal: SDM adaptor vs a linear probe's ceiling.

Reads verification rows with LLM features and a ``split`` field (``pool`` = training +
calibration, ``heldout_topics``, ``generated``), e.g. the own-answer rows of
``tools/real_llm/real_answers.py`` or force-decoded rows from ``sdm-mlx make-verification-data`` +
``sdm-mlx embed``. For every feature variant

* pooling ``all`` (the paper: mean over every kept position ⊕ the delimiter-predicting state),
  ``non-shared`` (mean over the positions after the prompt prefix every row shares ⊕ the same
  state; needs ``--prefix-stats`` from ``tools/real_llm/real_answers.py --prefix-stats``) and ``state``
  (the delimiter-predicting state alone),

it reports on each split

* a linear probe's accuracy (scikit-learn ``LogisticRegression`` on per-dimension z-scored
  features, C chosen by 5-fold cross-validation on the pool only: the ceiling of a linear
  map on these features), and
* the SDM estimator's (``normalize`` scalar and per-dimension): no-reject accuracy, and at α'
  the admitted fraction, the admitted rows' accuracy and the verified-generation view (rows
  predicted label 1 and admitted: how many, and how many of them have label 1).

With ``--task-label`` the rows' ``task_label`` (statement truth) and ``answer_label`` are
probed too: for force-decoded pairs label = XOR(truth, answer).

    python tools/real_llm/real_probe.py --rows runs/real/answers.jsonl --prefix-stats runs/real/prefix.npz \\
        --json runs/real/probe_own.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

SPLITS = ("pool", "heldout_topics", "generated")


def load(path: str, limit: int | None = None):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    rows = rows[:limit]
    X = np.array([r["embedding"] for r in rows], dtype=np.float32)
    return rows, X


def non_shared(X: np.ndarray, n_kept: np.ndarray, P: int, state_sum: np.ndarray) -> np.ndarray:
    """Replace the mean half by the mean over positions P..n-1 (the shared prefix's states removed)."""
    D = X.shape[1] // 2
    n = n_kept.astype(np.float64)[:, None]
    mean = (X[:, :D].astype(np.float64) * n - state_sum[None, :]) / (n - P)
    return np.concatenate([mean.astype(np.float32), X[:, D:]], axis=1)


def add_positions(rows, model_path: str) -> None:
    """``n_kept`` (positions pooled before the completion's delimiter) and ``answer_label`` of force-decoded rows."""
    from sdm_mlx.llm import embed as E
    from sdm_mlx.network.generation import parse_task_prediction
    from sdm_mlx.llm.verification_data import PRESETS

    tok = E.load_tokenizer(model_path)
    for r in rows:
        if "n_kept" not in r:
            text = r["prompt"] + r["completion"]
            r["n_kept"] = E.delimiter_token_index_in_text(tok, text, E.encode(tok, text), (len(r["prompt"]), None),
                                                          E.DEFAULT_DELIMITER)
        if "answer_label" not in r:
            r["answer_label"] = parse_task_prediction(r["completion"], PRESETS["factcheck"]["completions"])


def variants(rows, X, prefix) -> dict:
    D = X.shape[1] // 2
    out = {"all": X, "state": X[:, D:]}
    if prefix is not None:
        n_kept = np.array([r.get("n_kept", -1) for r in rows])
        if np.all(n_kept > int(prefix["P"])):
            out["non-shared"] = non_shared(X, n_kept, int(prefix["P"]), prefix["state_sum"])
    return out


def probe(Xp, yp, tests: dict) -> dict:
    """Logistic-regression ceiling: C by 5-fold CV on the pool, accuracy on each test split."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_score
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(Xp)
    Z = scaler.transform(Xp)
    best = max((float(np.mean(cross_val_score(LogisticRegression(C=c, max_iter=2000), Z, yp, cv=5))), c)
               for c in (1e-3, 1e-2, 1e-1, 1.0))
    clf = LogisticRegression(C=best[1], max_iter=2000).fit(Z, yp)
    res = {"C": best[1], "cv_accuracy": round(best[0], 4), "train_accuracy": round(float(clf.score(Z, yp)), 4)}
    for name, (Xt, yt) in tests.items():
        res[name] = round(float(clf.score(scaler.transform(Xt), yt)), 4) if len(yt) else None
    return res


def sdm(Xp, yp, tests: dict, normalize: str, args) -> dict:
    from sdm_mlx import SDMEstimator

    t0 = time.time()
    est = SDMEstimator(normalize=normalize, alpha=args.alpha, iterations=args.iterations, seed=0)
    est.fit(Xp, yp)
    res = {"seconds": round(time.time() - t0, 1), "train_accuracy": round(float(np.mean(est.predict(Xp) == yp)), 4)}
    for name, (Xt, yt) in tests.items():
        if not len(yt):
            continue
        p = est.estimate(Xt)
        pred, adm = np.asarray(p.prediction), np.asarray(p.admitted)
        verified = adm & (pred == 1)
        res[name] = {
            "n": int(len(yt)), "no_reject_accuracy": round(float(np.mean(pred == yt)), 4),
            "admitted": int(adm.sum()), "admitted_accuracy": round(float(np.mean(pred[adm] == yt[adm])), 4)
            if adm.any() else None,
            "verified": int(verified.sum()), "verified_label1_share": round(float(np.mean(yt[verified] == 1)), 4)
            if verified.any() else None,
        }
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", required=True)
    ap.add_argument("--prefix-stats", default=None)
    ap.add_argument("--json", required=True)
    ap.add_argument("--alpha", type=float, default=0.95)
    ap.add_argument("--iterations", type=int, default=3, help="J of the SDM estimators (quick comparison)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--no-sdm", action="store_true", help="probes only")
    ap.add_argument("--task-label", action="store_true", help="also probe task_label and answer_label")
    ap.add_argument("--tokenizer", default=None, help="model directory: positions of force-decoded rows")
    args = ap.parse_args(argv)
    rows, X = load(args.rows, args.limit)
    if args.tokenizer:
        add_positions(rows, args.tokenizer)
    prefix = dict(np.load(args.prefix_stats)) if args.prefix_stats else None
    split = np.array([r["split"] for r in rows])
    y = np.array([int(r["label"]) for r in rows])
    report = {"rows": args.rows, "counts": {s: int((split == s).sum()) for s in SPLITS},
              "label1_share": {s: round(float(y[split == s].mean()), 4) for s in SPLITS if (split == s).any()}}
    targets = {"label": y}
    if args.task_label:
        targets["task_label"] = np.array([int(r["task_label"]) for r in rows])
        targets["answer_label"] = np.array([int(r["answer_label"]) for r in rows])
    for vname, V in variants(rows, X, prefix).items():
        for tname, t in targets.items():
            tests = {s: (V[split == s], t[split == s]) for s in SPLITS[1:]}
            key = f"probe/{vname}/{tname}"
            report[key] = probe(V[split == "pool"], t[split == "pool"], tests)
            print(key, report[key], file=sys.stderr, flush=True)
        if args.no_sdm or vname == "state":
            continue
        for norm in ("scalar", "per-dimension"):
            tests = {s: (V[split == s], y[split == s]) for s in SPLITS[1:]}
            key = f"sdm/{vname}/{norm}"
            report[key] = sdm(V[split == "pool"], y[split == "pool"], tests, norm, args)
            print(key, report[key], file=sys.stderr, flush=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
