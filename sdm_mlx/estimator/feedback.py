"""Feedback without retraining: labelled rows appended to (and removed from) the support set.

``SDMEstimator.add_support(X, y, ids, source)`` computes each new row's exemplar
coordinates h' and prediction ŷ = argmax z' with the batch-invariant forward
(:class:`~sdm_mlx.core.adaptor.InvariantForward`, the one that gave the training
support its coordinates) and appends (h', label, ŷ, id) to the support set and
its index (exact: rows appended; hnswlib: ``add_items``, no rebuild).

What changes for later queries (the support set is what q and d0 are defined over):

* **q** (Similarity, ``equation:q``): the leading run of nearest support rows with
  label = prediction = ŷ now runs over the enlarged support.  A new row whose label
  equals its prediction extends runs of queries predicted that class; one whose
  label differs ("this admitted answer was wrong") is a bad neighbour that ends
  the run of every query whose nearest neighbours it joins, lowering their q.
  The cap k (largest per-class count of the training split) stays as calibrated.
* **d0** (squared L2 to the nearest support row) and therefore **d**, the quantile
  of d0 against the calibration eCDFs, which themselves do not change.
* the **nearest exemplars** returned with each prediction.

What does not change: the adaptor and z′ (no gradient step), the calibration
split and everything computed from it — the per-class eCDFs of d0 that define d,
the rescaler W″, the Alg. 3 ψ thresholds and min valid q̃, the per-round q̃ bins
and the Cauchy robust min valid q̃ and offsets.  The paper defines q and d over
the *training support* (the set a test row is compared with) and the calibration
statistics over the *calibration split* (rows held out from that support), which
feedback does not touch; so new labelled rows move test rows along the fixed
calibrated map (q, d) ↦ p̂_lower, they do not re-estimate the map.  The more the
support grows, the less the calibration rows' d0 (measured against the training
support) describe it: :func:`retrain_advice` recommends retraining past
:data:`RETRAIN_FRACTION` (see ``docs/feedback.md``).

Only rows added by feedback can be removed (``remove_support``): the training
support is what the calibration was measured against.
"""

from __future__ import annotations

import datetime as _dt
import json
import uuid

import numpy as np

from ..storage.datasets import id_key
from ..errors import ArtifactError, InputError

#: retraining is recommended once feedback rows exceed this fraction of the training support (overall or of a class)
RETRAIN_FRACTION = 0.10
#: the artifact file holding the append-only update log (JSONL, checksummed with the artifact)
LOG_FILE = "support_updates.jsonl"
LOG_FIELDS = ("op", "id", "label", "predicted_label", "time", "source")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


class FeedbackState:
    """Bookkeeping of feedback on one fitted support set: training-support size and the update log."""

    def __init__(self, support_ids: list, n_training: int, log: list | None = None):
        self.support_ids = support_ids  # the estimator's list this state describes (a refit replaces it)
        self.n_training = int(n_training)
        self.log = list(log or [])

    def added(self) -> int:
        return len(self.support_ids) - self.n_training


def label_indices_for(y, n_rows: int, classes, name: str) -> np.ndarray:
    """Class indices [n_rows] of labels given in the estimator's label space ``classes`` (``classes_``)."""
    from .. import validation

    classes = np.asarray(classes)
    arr = validation.one_d(y, name)
    if arr.shape[0] != n_rows:
        raise InputError(f"{name}: {arr.shape[0]} labels for {n_rows} rows")
    if classes.dtype.kind in "iu":
        arr = validation.label_indices(arr, name)
    elif arr.dtype.kind in "bf" or (arr.dtype.kind == "O" and any(isinstance(v, (bool, float)) for v in arr)):
        raise InputError(f"{name}: labels must be classes of this model ({classes.tolist()[:10]})")
    try:
        idx = np.clip(np.searchsorted(classes, arr), 0, len(classes) - 1)
        bad = classes[idx] != arr
    except TypeError:
        raise InputError(f"{name}: labels must be classes of this model ({classes.tolist()[:10]})") from None
    if np.any(bad):
        found = sorted({str(v) for v in arr[np.asarray(bad)].tolist()})[:5]
        if classes.dtype.kind in "iu" and np.array_equal(classes, np.arange(len(classes))):
            raise InputError(f"{name}: labels must be in 0..{len(classes) - 1}, found {found}")
        raise InputError(f"{name}: labels {found} are not classes of this model ({classes.tolist()[:10]})")
    return idx.astype(np.int64)


def new_ids(ids, n_rows: int, taken: set, name: str) -> list:
    """Ids for ``n_rows`` new support rows: given ones are checked (unique, JSON scalars, not ``taken``)."""
    if ids is None:
        return [f"feedback-{uuid.uuid4().hex[:16]}" for _ in range(n_rows)]
    ids = list(ids)
    if len(ids) != n_rows:
        raise InputError(f"{name}: {len(ids)} ids for {n_rows} rows")
    seen = set()
    for rid in ids:
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise InputError(f"{name}: ids must be strings or integers, got {rid!r}")
        key = id_key(rid)
        if key in seen:
            raise InputError(f"{name}: duplicate id {rid!r}")
        if key in taken:
            raise InputError(f"{name}: id {rid!r} is already a support or calibration row of this model")
        seen.add(key)
    return ids


def log_entries(op: str, ids: list, labels, predictions, source: str) -> list[dict]:
    t = now()
    return [{"op": op, "id": rid, "label": int(lab), "predicted_label": int(pred), "time": t, "source": source}
            for rid, lab, pred in zip(ids, labels, predictions)]


def dump_log(log: list[dict]) -> str:
    return "".join(json.dumps(e, ensure_ascii=False, sort_keys=True) + "\n" for e in log)


def parse_log(text: str, where: str) -> list[dict]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError as err:
            raise ArtifactError(f"{where}:{n}: not JSON ({err})") from None
        if not isinstance(e, dict) or any(k not in e for k in LOG_FIELDS):
            raise ArtifactError(f"{where}:{n}: an update log entry needs {', '.join(LOG_FIELDS)}")
        out.append(e)
    return out


def summary(est) -> dict:
    """Sizes, rows added since training (by source and class), last update and the retraining advice."""
    state = est.feedback_state_
    C = est.num_classes_
    n_train = state.n_training
    labels = np.asarray(est.support_labels_)
    added_labels = labels[n_train:]
    source_of: dict = {}  # id -> source of its latest add, for the rows present now
    for e in state.log:
        if e["op"] == "add":
            source_of[id_key(e["id"])] = e["source"]
        else:
            source_of.pop(id_key(e["id"]), None)
    by_source: dict = {}
    for rid in est.support_ids_[n_train:]:
        src = source_of.get(id_key(rid), "unknown")
        by_source[src] = by_source.get(src, 0) + 1
    added = int(len(est.support_ids_) - n_train)
    out = {
        "num_classes": C,
        "input_dim": int(est.input_dim_),
        "exemplar_dim": int(np.asarray(est.model_.projection.weight).shape[0]),  # M, the adaptor's exemplar width
        "support_coordinate_dim": int(est.support_vectors_.shape[1]),  # min(D, M): exact coordinates of width M
        "index_backend": est.index_backend,
        "alpha": est.alpha,
        "k": int(est.k_),
        "training_support_rows": n_train,
        "training_support_by_class": np.bincount(labels[:n_train], minlength=C).tolist(),
        "calibration_rows": len(est.calibration_ids_),
        "support_rows": int(len(est.support_ids_)),
        "added_rows": added,
        "added_by_class": np.bincount(added_labels, minlength=C).tolist(),
        "added_by_source": by_source,
        "added_mislabelled_by_model": int((added_labels != np.asarray(est.support_predictions_)[n_train:]).sum()),
        "updates_logged": len(state.log),
        "removed_rows": sum(1 for e in state.log if e["op"] == "remove"),
        "last_update": state.log[-1]["time"] if state.log else None,
    }
    out.update(retrain_advice(out))
    return out


def retrain_advice(s: dict) -> dict:
    """Recommend retraining when added rows exceed :data:`RETRAIN_FRACTION` of the training support,
    overall or within a class (see ``docs/feedback.md`` for why)."""
    n_train, fraction = s["training_support_rows"], s["added_rows"] / max(1, s["training_support_rows"])
    class_fracs = [a / max(1, t) for a, t in zip(s["added_by_class"], s["training_support_by_class"])]
    worst = int(np.argmax(class_fracs)) if class_fracs else 0
    retrain = fraction > RETRAIN_FRACTION or (class_fracs and class_fracs[worst] > RETRAIN_FRACTION)
    if retrain:
        why = (f"added rows are {fraction:.1%} of the {n_train} training support rows (class {worst}: "
               f"{class_fracs[worst]:.1%}), above {RETRAIN_FRACTION:.0%}: the calibration split's distances no longer "
               "describe the support set the d quantile and q are measured against; retrain (sdm-mlx train) with the "
               "added rows in the training data")
    else:
        why = (f"added rows are {fraction:.1%} of the training support (at most {max(class_fracs, default=0):.1%} of "
               f"a class), within {RETRAIN_FRACTION:.0%}: no retraining needed")
    return {"added_fraction": fraction, "retrain_recommended": bool(retrain), "recommendation": why}


class PersistError(RuntimeError):
    """A feedback label that could not be written to the verifier directory: a fault of the server's
    storage, not of the request (reported as a 5xx without the path; the detail goes to the server log)."""


def feedback_class(label, verified_label: int, num_classes: int) -> int:
    """The verifier's class for a feedback ``label``.

    ``true`` (the answer was right) is the verifier's verified class (``verified_label``, 1 for the
    verifiers ``sdm-mlx`` trains); ``false`` (the answer was wrong) is the other class of a binary
    verifier; an integer is taken as the class index itself (0..C−1).
    """
    if isinstance(label, bool):
        if label:
            return int(verified_label)
        if num_classes != 2:
            raise InputError(f"label false is ambiguous for a {num_classes}-class verifier: give the class index")
        return 1 - int(verified_label)
    if isinstance(label, int) and 0 <= label < num_classes:
        return int(label)
    shown = repr(label) if isinstance(label, (int, float, str, type(None))) else type(label).__name__
    raise InputError(f"label must be true (the answer was right), false (it was wrong) or a class index "
                     f"0..{num_classes - 1}, got {shown[:40]}")


class AlreadyLabelled(InputError):
    """Feedback for a verdict that already has its label (a verdict takes one label): HTTP 400 with this code."""

    api_code, api_param = "already_labelled", "verdict_id"


def _check_unlabelled(est, rid: str, verdict_id: str) -> None:
    if rid in est.support_ids_:
        raise AlreadyLabelled(f"verdict {verdict_id!r} is already labelled (support row {rid!r}); a verdict "
                              f"takes one label: to change it, remove that row first (sdm-mlx add-support "
                              f"--undo {rid}) and label a new verification")
