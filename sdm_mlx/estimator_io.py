"""Persistence of :class:`~sdm_mlx.estimator.SDMEstimator`: its versioned safetensors + JSON artifact.

:func:`save_estimator` and :func:`load_estimator` are what ``SDMEstimator.save`` and
``SDMEstimator.load`` delegate to.  The artifact (``sdm_mlx.artifact``) holds the adaptor's
weights, the support set (exemplar vectors h', labels, predictions, basis), the calibration and
training distance eCDFs (``equation:d``), every round's calibration (Alg. 1–3), the feedback log
and the JSON metadata; writes are atomic and only rank 0 writes under a sharded ``mlx.launch``.
"""

from __future__ import annotations

import json
import os

import numpy as np
from mlx.utils import tree_flatten

from .adaptor import ExemplarAdaptor, exemplar_basis
from .artifact import ArtifactError, load_artifact, pack_ragged, save_artifact, unpack_ragged
from .calibration import RoundCalibration
from .feedback import LOG_FILE as FEEDBACK_LOG
from .feedback import FeedbackState, dump_log, parse_log
from .io import put_float

#: why a stored robust min valid q~ is null (+inf): every prediction is rejected
ROBUST_INF_REASON = ("no robust threshold: the Cauchy robust min valid q~ is +inf (rounds without a valid "
                     "threshold reach the median, or a non-finite MAD), so every prediction is rejected")

#: the support rows' document texts ({id key: text}), kept for showing exemplars (sdm_mlx.verdict_html)
DOCUMENTS_FILE = "support_documents.json"

ARTIFACT_KIND = "sdm_estimator"
ARTIFACT_VERSION = 1


def save_estimator(est, path, overwrite: bool = False) -> None:
    """Write fitted ``est`` as an artifact directory at ``path`` (see ``SDMEstimator.save``)."""
    est._check_fitted()
    if getattr(est._index, "group", None) is not None and est._index.group.rank() != 0:
        return  # sharded under mlx.launch: rank 0 alone writes the artifact (docs/distributed.md)
    rounds = [r.to_arrays() for r in est.rounds_]  # (arrays, meta) per round
    groups = _artifact_groups(est, [arrays for arrays, _ in rounds])
    meta = _artifact_meta(est, [round_meta for _, round_meta in rounds])
    state = est.feedback_state_
    texts = {}
    if state.log:
        meta["n_training_support"] = state.n_training
        texts[FEEDBACK_LOG] = dump_log(state.log)
    documents = getattr(est, "support_documents_", None)
    if documents:
        texts[DOCUMENTS_FILE] = json.dumps(documents, ensure_ascii=False, sort_keys=True)
    put_float(meta, "robust_min_valid", est.robust_min_valid_, ROBUST_INF_REASON)
    kept = _kept_training_report(path, meta) if overwrite else None
    # saving back over the version it was loaded from: refused if another writer replaced it meanwhile
    origin = getattr(est, "_artifact_origin", None)
    real = os.path.realpath(os.fspath(path))
    expected = origin[1] if overwrite and origin is not None and origin[0] == real else None
    digest = save_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION, groups, meta,
                           overwrite=overwrite, texts=texts, expected_digest=expected)
    est._artifact_origin = (real, digest)
    if kept is not None:  # beside the artifact, not in its manifest (``sdm-mlx train`` rewrites it)
        from .io import atomic_write

        with atomic_write(os.path.join(os.fspath(path), TRAINING_REPORT)) as f:
            f.write(kept)


TRAINING_REPORT = "training_report.json"  #: written by ``sdm-mlx train`` next to the artifact


def _kept_training_report(path, meta: dict) -> str | None:
    """The ``training_report.json`` text of the artifact being replaced when it describes the same training (the
    same history and round summaries: e.g. a save after ``add_support``), so ``save(path, overwrite=True)`` keeps
    it; else None (a report of another training would mislead)."""
    import json

    folder = os.fspath(path)
    try:
        with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as f:
            old = json.load(f).get("meta", {})
        with open(os.path.join(folder, TRAINING_REPORT), encoding="utf-8") as f:
            report = f.read()
    except (OSError, ValueError, AttributeError):
        return None
    same = all(json.dumps(old.get(k), sort_keys=True) == json.dumps(meta.get(k), sort_keys=True)
               for k in ("history", "round_summaries", "best_round"))
    return report if same else None


def _artifact_groups(est, round_arrays: list) -> dict:
    """The artifact's array groups: adaptor weights, support set, distance eCDFs, calibration, rounds."""
    groups = {
        "adaptor": {k: np.array(v) for k, v in tree_flatten(est.model_.parameters())},
        "support": {
            "vectors": est.support_vectors_,
            "labels": est.support_labels_,
            "predictions": est.support_predictions_,
            **({} if est.exemplar_basis_ is None else {"basis": est.exemplar_basis_}),
        },
        "distance_ecdfs": {
            **pack_ragged("calibration", est.calibration_distance_ecdfs_),
            **pack_ragged("training", est.training_distance_ecdfs_),
        },
    }
    if getattr(est, "calibration_logits_", None) is not None:
        groups["calibration"] = {"logits": est.calibration_logits_, "labels": est.calibration_labels_}
    for j, arrays in enumerate(round_arrays):
        groups[f"round_{j}"] = arrays
    return groups


def _artifact_meta(est, round_meta: list) -> dict:
    """The artifact's JSON metadata (parameters, sizes, rounds, ids, classes)."""
    return {
        "params": est.get_params(),
        "num_classes": est.num_classes_,
        "input_dim": int(est.input_dim_),
        "k": int(est.k_),
        "best_round": int(est.best_round_),
        "rounds": round_meta,
        "round_summaries": est.round_summaries_,
        "history": est.history_,
        "support_ids": est.support_ids_,
        "calibration_ids": est.calibration_ids_,
        "feature_field": getattr(est, "feature_field_", None),
        "classes": est.classes_.tolist(),
    }


def load_estimator(cls, path, shard_index: bool | None = None):
    """An instance of ``cls`` loaded from the artifact at ``path`` (see ``SDMEstimator.load``)."""
    texts, info = {}, {}
    groups, meta = load_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION, texts=texts, info=info)
    try:
        est = cls(**meta["params"])
        m, d = _restore(est, groups, meta)
    except (KeyError, ValueError, TypeError, IndexError) as e:
        if isinstance(e, ArtifactError):
            raise
        raise ArtifactError(f"{path}: artifact content is incomplete or inconsistent ({e!r})") from None
    n_train = _check_loaded(est, path, meta, m, d)
    log = parse_log(texts.get(FEEDBACK_LOG, ""), os.path.join(os.fspath(path), FEEDBACK_LOG))
    est._feedback = FeedbackState(est.support_ids_, n_train, log)
    est.support_documents_ = _documents(texts.get(DOCUMENTS_FILE), path)
    est._artifact_origin = (os.path.realpath(os.fspath(path)), info.get("manifest_digest"))
    if shard_index is not None:
        est.shard_index = bool(shard_index)
    est._prepare_predict()
    est._apply_alpha(est.alpha)
    return est


def _restore(est, groups: dict, meta: dict) -> tuple[int, int]:
    """Set ``est``'s fitted attributes from the artifact; (M, D) of the adaptor's projection."""
    import mlx.core as mx

    C = int(meta["num_classes"])
    adaptor = groups["adaptor"]
    m, d = adaptor["projection.weight"].shape
    model = ExemplarAdaptor(d, m, C)
    model.load_weights([(k, mx.array(v)) for k, v in adaptor.items()])
    est.model_ = model
    est.num_classes_ = C
    est.input_dim_ = int(meta["input_dim"])
    est.k_ = int(meta["k"])
    est.best_round_ = int(meta["best_round"])
    est.round_summaries_ = meta["round_summaries"]
    est.history_ = meta["history"]
    est.support_vectors_ = groups["support"]["vectors"]
    # the stored basis reproduces the stored support coordinates bit for bit (absent in older artifacts)
    stored_basis = groups["support"].get("basis")
    est.exemplar_basis_ = stored_basis.astype(np.float32) if stored_basis is not None else exemplar_basis(model)
    est.support_labels_ = groups["support"]["labels"].astype(np.int64)
    est.support_predictions_ = groups["support"]["predictions"].astype(np.int64)
    est.support_ids_ = meta["support_ids"]
    est.feature_field_ = meta.get("feature_field")  # absent before it was stored: "auto"
    est.calibration_ids_ = meta["calibration_ids"]
    cal = groups.get("calibration")  # absent in artifacts written before it was stored
    est.calibration_logits_ = None if cal is None else cal["logits"].astype(np.float32)
    est.calibration_labels_ = None if cal is None else cal["labels"].astype(np.int64)
    est.calibration_distance_ecdfs_ = unpack_ragged("calibration", groups["distance_ecdfs"], C)
    est.training_distance_ecdfs_ = unpack_ragged("training", groups["distance_ecdfs"], C)
    est.rounds_ = [RoundCalibration.from_arrays(groups[f"round_{j}"], rm) for j, rm in enumerate(meta["rounds"])]
    est.classes_ = np.asarray(meta["classes"]) if "classes" in meta else np.arange(C)  # absent: indices
    est.n_features_in_ = est.input_dim_
    return m, d


def _check_loaded(est, path, meta: dict, m: int, d: int) -> int:
    """Cross-check the loaded support set; the number of training support rows (before feedback)."""
    if len(est.support_ids_) != est.support_vectors_.shape[0]:
        raise ArtifactError(f"{path}: support ids and vectors disagree in length")
    if est.support_vectors_.shape[1] != min(m, d):
        raise ArtifactError(
            f"{path}: support vectors have width {est.support_vectors_.shape[1]}, expected min(M, D) = {min(m, d)}"
        )
    n_train = meta.get("n_training_support", len(est.support_ids_))
    if not isinstance(n_train, int) or not 1 <= n_train <= len(est.support_ids_):
        raise ArtifactError(
            f"{path}: n_training_support {n_train!r} does not fit {len(est.support_ids_)} support rows")
    return n_train


def _documents(text, path) -> dict:
    """The stored {id key: document} (empty when the model keeps none)."""
    if not text:
        return {}
    try:
        docs = json.loads(text)
    except ValueError:
        docs = None
    if not isinstance(docs, dict) or not all(isinstance(v, str) for v in docs.values()):
        raise ArtifactError(f"{path}: {DOCUMENTS_FILE} is not a mapping of ids to document texts")
    return docs
