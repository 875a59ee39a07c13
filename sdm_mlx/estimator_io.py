"""Persistence of :class:`~sdm_mlx.estimator.SDMEstimator`: its versioned safetensors + JSON artifact.

:func:`save_estimator` and :func:`load_estimator` are what ``SDMEstimator.save`` and
``SDMEstimator.load`` delegate to.  The artifact (``sdm_mlx.artifact``) holds the adaptor's
weights, the support set (exemplar vectors h', labels, predictions, basis), the calibration and
training distance eCDFs (``equation:d``), every round's calibration (Alg. 1–3), the feedback log
and the JSON metadata; writes are atomic and only rank 0 writes under a sharded ``mlx.launch``.
"""

from __future__ import annotations

import os

import numpy as np
from mlx.utils import tree_flatten

from .adaptor import ExemplarAdaptor, exemplar_basis, normalize_mode
from .artifact import ArtifactError, load_artifact, pack_ragged, save_artifact, unpack_ragged
from .calibration import RoundCalibration
from .feedback import LOG_FILE as FEEDBACK_LOG
from .feedback import FeedbackState, dump_log, parse_log
from .io import put_float

#: why a stored robust min valid q~ is null (+inf): every prediction is rejected
ROBUST_INF_REASON = ("no robust threshold: the Cauchy robust min valid q~ is +inf (rounds without a valid "
                     "threshold reach the median, or a non-finite MAD), so every prediction is rejected")

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
    put_float(meta, "robust_min_valid", est.robust_min_valid_, ROBUST_INF_REASON)
    save_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION, groups, meta,
                  overwrite=overwrite, texts=texts)


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
    texts: dict = {}
    groups, meta = load_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION, texts=texts)
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
    _check_normalization(est, adaptor, d)
    if adaptor["input_mean"].ndim == 1:  # per-dimension statistics (DESIGN #2): shape the slots before loading
        model.set_normalization(np.zeros(d), np.ones(d))
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


def _check_normalization(est, adaptor: dict, d: int) -> None:
    """The stored input statistics must fit the stored ``normalize`` mode (DESIGN #2) and the input width."""
    mode = normalize_mode(est.normalize)
    mean, std = adaptor["input_mean"], adaptor["input_std"]
    want = (d,) if mode == "per-dimension" else ()
    if mean.shape != want or std.shape != want:
        raise ArtifactError(f"normalize {mode!r} needs input statistics of shape {want}, the artifact holds "
                            f"{mean.shape} and {std.shape}")
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std > 0)):
        raise ArtifactError("the stored input statistics are not finite, or a std is not positive")
    if mode == "none" and (float(mean) != 0.0 or float(std) != 1.0):
        raise ArtifactError(f"normalize 'none' but the stored statistics are mean {float(mean)}, std {float(std)}")


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
