"""The verifiers of a recipe: which ones, on which rows, trained how, and their verdicts on own answers.

**Row sets** (issue 42 §2; the rows' task is never a feature, ids are ``<task>/<id>``):

* ``own`` (b): the model's own answers to the pool prompts, label 1 = the parsed answer is right, features of
  that decoding;
* ``forced`` (a): the paper's force-decoded rows of the pool prompts, half of them constructed negatives (the
  other label's answer shown), label 1 = the shown answer is right (ids ``<task>/<id>/forced``);
* ``own+forced`` (c): the own answers plus the constructed negatives (label 0) among the forced rows of the same
  prompts.

With ``forced_completions: flip`` the forced rows are each own pool answer with its answer inverted in the
model's own layout (:func:`sdm_mlx.llm.answers.answer_in_layout`; label 1 when the inverted answer is right,
i.e. the model was wrong): (a) shows each prompt once, with its right or its wrong answer (half each, seeded as
``make-verification-data`` assigns negatives), taking the own row or the inverted one; (c) is every own answer
plus every inverted one, so both labels are balanced by construction.

A **universal** verifier trains on the union of every task's rows; **per-task** verifiers (``per_task``) on one
task's.  Each encoding in the recipe's ``features`` (``mean,last``, ``max,mean,last``) slices its columns out of the
recorded features, so every encoding comes from one decoding.  Test time is always the model's own answers of the
held-out and shift splits: :func:`evaluate_verifier` gives each a verdict as ``sdm-mlx generate`` would (verified =
a parsed task answer, admitted by p̂_lower, verification prediction 1 = "the answer is right").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..llm.pooling import UNRECORDED_FEATURE_PARTS, part_columns
from .layout import Layout
from .recipe import TEST_SPLITS, Recipe, verifier_name

#: reason of a verdict whose answer parses to no task label (as sdm-mlx generate's)
PARSE_FAILURE = "parse_failure"
PREDICTED_UNVERIFIED = "predicted_unverified"


@dataclass(frozen=True)
class VerifierPlan:
    name: str
    scope: str  #: "universal" or a task name
    tasks: tuple
    row_set: str
    parts: tuple
    test_tasks: tuple = ()  #: the tasks whose held-out / shift answers it judges (universal: every task)

    def uses_forced(self) -> bool:
        return self.row_set in ("forced", "own+forced")

    def uses_own(self) -> bool:
        return self.row_set in ("own", "own+forced")


def plans(recipe: Recipe) -> list[VerifierPlan]:
    """Every verifier the recipe asks for, in the order the verifiers stage trains them: the universal primary (its
    row set on the first encoding), the per-task ones of the same row set and encoding (the comparison of one
    verifier for every task with one per task), then the other universal ones and the other per-task ones; a
    stopped stage has the comparisons that matter most."""
    v = recipe.verifier
    names = tuple(t.name for t in recipe.tasks if t.sizes["pool"] > 0)
    every = tuple(t.name for t in recipe.tasks)
    sets = (v.primary,) + tuple(s for s in v.row_sets if s != v.primary)
    universal = [VerifierPlan(verifier_name("universal", s, f), "universal", names, s, f, every)
                 for s in sets for f in v.features]
    per_task = []
    if v.per_task != "none" and len(names) > 1:
        pairs = [(v.primary, v.features[0])] if v.per_task == "primary" else [(s, f) for s in sets for f in v.features]
        per_task = [VerifierPlan(verifier_name(t, s, f), t, (t,), s, f, (t,)) for s, f in pairs for t in names]
    first = len(names) if per_task else 0  # the per-task verifiers of the primary pair
    return universal[:1] + per_task[:first] + universal[1:] + per_task[first:]


def needs_forced(recipe: Recipe) -> bool:
    return any(s in ("forced", "own+forced") for s in recipe.verifier.row_sets)


def answer_splits(recipe: Recipe, task) -> list[str]:
    """The splits whose own answers the recipe needs: the test splits always, the pool for the own-answer row sets
    and for constructed negatives in the model's own answer form."""
    need_pool = any(s in ("own", "own+forced") for s in recipe.verifier.row_sets) or (
        needs_forced(recipe) and recipe.verifier.forced_completions in ("model", "flip"))
    return [s for s in task.splits() if s in TEST_SPLITS or (s == "pool" and need_pool)]


# -- reading rows -----------------------------------------------------------------------------------------------

def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def slice_columns(recorded, wanted, width: int, where: str) -> np.ndarray:
    """Column indices of the parts ``wanted`` in the rows' features that concatenate ``recorded``
    (:func:`sdm_mlx.llm.pooling.part_columns`, with the pipeline's fix)."""
    return part_columns(recorded, wanted, width, where, "delete the rows and decode them again with "
                        "record_features holding every part you ask for")


class RowStore:
    """Rows with features, read once per file and kept (features as float32 arrays, in the data file's order)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self._cache: dict = {}

    def _load(self, path: str, order: list, what: str, fix: str):
        if path in self._cache:
            return self._cache[path]
        if not os.path.exists(path):
            raise InputError(f"{what}: {path} does not exist; {fix}")
        by_id, parts, wanted = {}, None, set(order)
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                if r["id"] in by_id or r["id"] not in wanted:
                    continue
                emb = np.asarray(r.pop("embedding"), dtype=np.float32)
                row_parts = tuple(r.get("feature_parts") or UNRECORDED_FEATURE_PARTS)
                parts = parts or row_parts
                if row_parts != parts:
                    raise InputError(f"{path}: rows with different feature_parts ({parts} and {row_parts})")
                by_id[r["id"]] = (r, emb)
        missing = [i for i in order if i not in by_id]
        if missing:
            raise InputError(f"{what}: {path} lacks {len(missing)} of {len(order)} rows (e.g. id {missing[0]!r}); "
                             f"{fix}")
        meta = [by_id[i][0] for i in order]
        X = np.stack([by_id[i][1] for i in order]) if order else np.zeros((0, 0), np.float32)
        self._cache[path] = (meta, X, parts or UNRECORDED_FEATURE_PARTS)
        return self._cache[path]

    def data(self, task: str, split: str) -> list[dict]:
        key = ("data", task, split)
        if key not in self._cache:
            path = self.layout.data(task, split)
            if not os.path.exists(path):
                raise InputError(f"{path} does not exist: run the data stage first")
            self._cache[key] = read_jsonl(path)
        return self._cache[key]

    def own(self, task: str, split: str):
        """``(meta rows, features [N, W], recorded parts)`` of the own answers of ``task``'s ``split``."""
        order = [r["id"] for r in self.data(task, split)]
        return self._load(self.layout.answers(task, split), order, f"own answers of {task}/{split}",
                          "run the answers stage first (it resumes where it stopped)")

    def forced(self, task: str):
        """``(meta rows, features, recorded parts)`` of the force-decoded pool rows of ``task``."""
        order = [r["id"] for r in self.data(task, "pool")]
        return self._load(self.layout.forced(task), order, f"forced rows of {task}",
                          "run the forced stage first (it resumes where it stopped)")


def _flip_rows(plan: VerifierPlan, store: RowStore, task: str, seed: int):
    """``(ids, X, y, rows)`` of ``task`` for ``forced_completions: flip`` (see the module docstring)."""
    from ..llm.verification_data import assign_negatives

    own, Xo, po = store.own(task, "pool")
    flip, Xf, pf = store.forced(task)
    co = slice_columns(po, plan.parts, Xo.shape[1], f"own answers of {task}/pool")
    cf = slice_columns(pf, plan.parts, Xf.shape[1], f"forced rows of {task}")
    if plan.row_set == "own+forced":
        pick = [("own", i) for i in range(len(own))] + [("forced", i) for i in range(len(flip))]
    else:  # (a): one row per prompt, shown its right answer or (constructed negative) its wrong one
        shown_wrong = assign_negatives([int(m["task_label"]) for m in own], seed=seed)
        pick = [("own" if int(own[i]["label"]) != int(shown_wrong[i]) else "forced", i) for i in range(len(own))]
    ids = [f"{task}/{(own if k == 'own' else flip)[i]['id']}" + ("/forced" if k == "forced" else "") for k, i in pick]
    X = np.stack([(Xo[i, co] if k == "own" else Xf[i, cf]) for k, i in pick]) if pick else np.zeros((0, 0), np.float32)
    y = [int((own if k == "own" else flip)[i]["label"]) for k, i in pick]
    rows = [{**(own if k == "own" else flip)[i], "task": task, "kind": k} for k, i in pick]
    return ids, X, y, rows


def training_rows(plan: VerifierPlan, store: RowStore, forced_completions: str = "model", seed: int = 0):
    """``(ids, X, y, rows)`` of a plan's row set: ids ``<task>/<id>`` (own) and ``<task>/<id>/forced`` (forced),
    ``rows`` the metadata of each (``task``, ``kind`` own | forced, and the source row's fields)."""
    ids, Xs, ys, rows = [], [], [], []
    for task in plan.tasks:
        if plan.uses_forced() and forced_completions == "flip":
            i, X, y, r = _flip_rows(plan, store, task, seed)
            ids += i
            ys += y
            rows += r
            if len(i):
                Xs.append(X)
            continue
        if plan.uses_own():
            meta, X, parts = store.own(task, "pool")
            ids += [f"{task}/{m['id']}" for m in meta]
            ys += [int(m["label"]) for m in meta]
            rows += [{**m, "task": task, "kind": "own"} for m in meta]
            if len(meta):
                Xs.append(X[:, slice_columns(parts, plan.parts, X.shape[1], f"own answers of {task}/pool")])
        if plan.uses_forced():
            meta, X, parts = store.forced(task)
            keep = np.array([i for i, m in enumerate(meta) if plan.row_set == "forced" or int(m["label"]) == 0],
                            dtype=np.int64)
            if keep.size:
                cols = slice_columns(parts, plan.parts, X.shape[1], f"forced rows of {task}")
                Xs.append(X[keep][:, cols])
                ids += [f"{task}/{meta[i]['id']}/forced" for i in keep]
                ys += [int(meta[i]["label"]) for i in keep]
                rows += [{**meta[i], "task": task, "kind": "forced"} for i in keep]
    X = np.concatenate(Xs) if Xs else np.zeros((0, 0), np.float32)
    return ids, X, np.asarray(ys, dtype=np.int64), rows


def fingerprint(plan: VerifierPlan, recipe: Recipe, store: RowStore) -> dict:
    """What a trained verifier depends on: its rows (counts per task) and the training settings."""
    return {"row_set": plan.row_set, "features": list(plan.parts), "tasks": list(plan.tasks),
            "rows": {t: len(store.data(t, "pool")) for t in plan.tasks}, "train": recipe.verifier.train,
            "forced_completions": recipe.verifier.forced_completions if plan.uses_forced() else None}


def _float(x):
    x = float(x)
    return x if np.isfinite(x) else None


def train_verifier(plan: VerifierPlan, recipe: Recipe, store: RowStore, path: str, log) -> dict:
    """Fit and save one verifier (resuming its rounds from ``path + ".partial"``); returns its index entry.  A
    row set with a single label (e.g. a model that is always right) cannot train one: the entry says why."""
    import time

    from ..estimator import SDMEstimator
    from ..estimator.checkpoint import remove_checkpoint

    ids, X, y, _ = training_rows(plan, store, recipe.verifier.forced_completions, recipe.seed)
    counts = {str(c): int((y == c).sum()) for c in (0, 1)}
    entry = {"name": plan.name, "scope": plan.scope, "tasks": list(plan.tasks), "row_set": plan.row_set,
             "features": list(plan.parts), "rows": len(ids), "labels": counts,
             "width": int(X.shape[1]) if X.size else 0}
    if min(counts.values()) < 2:
        entry["skipped"] = (f"the rows hold {counts['0']} wrong and {counts['1']} right answers: both verification "
                            "classes are needed")
        log(f"{plan.name}: skipped: {entry['skipped']}")
        return entry
    log(f"{plan.name}: training on {len(ids)} rows ({counts['1']} right, {counts['0']} wrong), "
        f"{X.shape[1]} features ({','.join(plan.parts)})")
    est = SDMEstimator(**recipe.verifier.train, verbose=True, class_names=["wrong", "correct"])
    checkpoint = path.rstrip(os.sep) + ".partial"
    t0 = time.perf_counter()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "admits nothing": recorded in the entry instead
        est.fit(X, y, ids_train=ids, num_classes=2, checkpoint=checkpoint, feature_parts=plan.parts)
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    est.save(path, overwrite=True)
    remove_checkpoint(checkpoint)
    adm = est.admission_ or {}
    entry.update(support_size=len(est.support_ids_), calibration_size=len(est.calibration_ids_),
                 alpha=est.alpha, can_admit=bool(adm.get("can_admit")),
                 min_valid_qbin=_float(est.calibration_.min_valid), robust_min_valid_qbin=_float(est.robust_min_valid_),
                 admission=json.loads(json.dumps(adm, default=_float)))
    log(f"{plan.name}: {'admits rows' if entry['can_admit'] else 'ADMITS NOTHING'} "
        f"(robust min valid q~ {entry['robust_min_valid_qbin']}; {entry['seconds']} s)")
    return entry


def verdict(row_meta: dict, pred: dict) -> dict:
    """The verdict of one own answer, as ``sdm-mlx generate`` gives it: verified = a parsed task answer that
    p̂_lower admits with verification prediction 1 ("the answer is right")."""
    answer = int(row_meta["answer_label"])
    if answer < 0:
        reason = PARSE_FAILURE
    elif not pred["admitted"]:
        reason = pred["rejection_reason"] or "rejected"
    elif int(pred["prediction"]) != 1:
        reason = PREDICTED_UNVERIFIED
    else:
        reason = None
    return {"answer": answer if answer >= 0 else None, "correct": answer == int(row_meta["task_label"]),
            "verified": reason is None, "p_lower": _float(pred["p_lower"]) if pred["p_lower"] is not None else None,
            "reason": reason, "prediction": int(pred["prediction"]), "admitted": bool(pred["admitted"])}


def fit_probe(X: np.ndarray, y: np.ndarray, l2: float = 1.0, max_iter: int = 300):
    """A linear probe of the same rows (the ceiling an SDM verifier is compared with): L2-regularised logistic
    regression on per-dimension standardised features (L-BFGS); returns ``score(X) -> P(label 1)``."""
    from scipy.optimize import minimize
    from scipy.special import expit

    mu = X.mean(axis=0, dtype=np.float64)
    sd = X.std(axis=0, dtype=np.float64)
    sd[sd < 1e-12] = 1.0
    Z = ((X - mu) / sd).astype(np.float64)
    t = y.astype(np.float64)
    n = len(t)

    def loss(wb):
        w, b = wb[:-1], wb[-1]
        z = Z @ w + b
        value = np.sum(np.logaddexp(0.0, z) - t * z) / n + 0.5 * l2 * (w @ w) / n
        g = (expit(z) - t) / n
        return value, np.concatenate([Z.T @ g + l2 * w / n, [g.sum()]])

    wb = minimize(loss, np.zeros(Z.shape[1] + 1), jac=True, method="L-BFGS-B",
                  options={"maxiter": max_iter}).x
    return lambda A: expit(((A - mu) / sd) @ wb[:-1] + wb[-1])


def auc(scores, labels) -> float | None:
    """Area under the ROC curve of ``scores`` for ``labels`` (1 positive; ties count half); None with one class."""
    from scipy.stats import rankdata

    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    n1, n0 = int(labels.sum()), int((~labels).sum())
    if not n1 or not n0:
        return None
    ranks = rankdata(scores)
    return float((ranks[labels].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def evaluate_verifier(plan: VerifierPlan, recipe: Recipe, store: RowStore, path: str) -> list[dict]:
    """The verdict on every held-out and shift own answer of the plan's tasks (rows: task, split, id, label,
    answer, correct, verified, p_lower, reason, prediction, admitted, and ``probe``: a linear probe's P(right)
    trained on the verifier's rows, the ceiling the table compares with)."""
    from ..estimator import SDMEstimator

    est = SDMEstimator.load(path)
    _, Xtr, ytr, _ = training_rows(plan, store, recipe.verifier.forced_completions, recipe.seed)
    probe = fit_probe(Xtr, ytr)
    out = []
    for task in plan.test_tasks:
        for split in TEST_SPLITS:
            if not recipe.task(task).sizes.get(split):
                continue
            meta, X, parts = store.own(task, split)
            if not meta:
                continue
            cols = slice_columns(parts, plan.parts, X.shape[1], f"own answers of {task}/{split}")
            preds = est.estimate(X[:, cols], ids=[f"{task}/{m['id']}" for m in meta], n_exemplars=0).to_dicts()
            probe_p = probe(X[:, cols].astype(np.float64))
            for m, p, q in zip(meta, preds, probe_p):
                out.append({"task": task, "split": split, "id": m["id"], "label": int(m["task_label"]),
                            **verdict(m, p), "probe": round(float(q), 6)})
    return out
