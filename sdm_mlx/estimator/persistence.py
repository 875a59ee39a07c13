"""Persistence of :class:`~sdm_mlx.estimator.SDMEstimator`: its versioned safetensors + JSON artifact.

:func:`save_state` writes a :class:`~sdm_mlx.estimator.state.FittedState` and the estimator's parameters;
:func:`load_state` reads them back as data, and ``SDMEstimator.load`` builds the estimator from them
(persistence never reaches into the estimator).  The artifact (``sdm_mlx.storage.artifact``) holds the adaptor's
weights, the support set (exemplar vectors h', labels, predictions, basis), the calibration and
training distance eCDFs (``equation:d``), every round's calibration (Alg. 1–3), the feedback log
and the JSON metadata; writes are atomic and only rank 0 writes under a sharded ``mlx.launch``.
"""

from __future__ import annotations

import json
import os

import numpy as np
from mlx.utils import tree_flatten

from ..core.adaptor import ExemplarAdaptor, exemplar_basis, normalize_mode
from ..storage.artifact import ArtifactError, load_artifact, pack_ragged, save_artifact, unpack_ragged
from ..calibration import RoundCalibration
from .feedback import LOG_FILE as FEEDBACK_LOG
from .feedback import dump_log, parse_log
from .state import FittedState
from ..storage.files import atomic_write, put_float

#: why a stored robust min valid q~ is null (+inf): every prediction is rejected
ROBUST_INF_REASON = ("no robust threshold: the Cauchy robust min valid q~ is +inf (rounds without a valid "
                     "threshold reach the median, or a non-finite MAD), so every prediction is rejected")

#: the support rows' document texts ({id key: text}), kept for showing exemplars (sdm_mlx.evaluation.verdict_html)
DOCUMENTS_FILE = "support_documents.json"
TRAINING_REPORT = "training_report.json"  #: written by ``sdm-mlx train`` next to the artifact

ARTIFACT_KIND = "sdm_estimator"
ARTIFACT_VERSION = 1


def save_state(path, state: FittedState, params: dict, robust_min_valid: float, *, overwrite: bool = False,
               expected_digest: str | None = None) -> str:
    """Write ``state`` and ``params`` as an artifact directory at ``path`` (see ``SDMEstimator.save``);
    ``robust_min_valid`` is the calibration's at the current α' (shown in the metadata).  With
    ``expected_digest`` (the manifest digest of the version that was loaded from ``path``) the save is
    refused when another writer published a newer version meanwhile.  Returns the new manifest digest."""
    rounds = [r.to_arrays() for r in state.rounds]  # (arrays, meta) per round
    groups = _artifact_groups(state, [arrays for arrays, _ in rounds])
    meta = _artifact_meta(state, params, [round_meta for _, round_meta in rounds])
    texts = {}
    if state.feedback_log:
        meta["n_training_support"] = state.n_training_support
        texts[FEEDBACK_LOG] = dump_log(state.feedback_log)
    if state.support_documents:
        texts[DOCUMENTS_FILE] = json.dumps(state.support_documents, ensure_ascii=False, sort_keys=True)
    put_float(meta, "robust_min_valid", robust_min_valid, ROBUST_INF_REASON)
    kept = _kept_training_report(path, meta) if overwrite else None
    digest = save_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION, groups, meta,
                           overwrite=overwrite, texts=texts, expected_digest=expected_digest)
    if kept is not None:  # beside the artifact, not in its manifest (``sdm-mlx train`` rewrites it)
        with atomic_write(os.path.join(os.fspath(path), TRAINING_REPORT)) as f:
            f.write(kept)
    return digest


def _kept_training_report(path, meta: dict) -> str | None:
    """The ``training_report.json`` text of the artifact being replaced when it describes the same training (the
    same history and round summaries: e.g. a save after ``add_support``), so ``save(path, overwrite=True)`` keeps
    it; else None (a report of another training would mislead)."""
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


def _artifact_groups(state: FittedState, round_arrays: list) -> dict:
    """The artifact's array groups: adaptor weights, support set, distance eCDFs, calibration, rounds."""
    groups = {
        "adaptor": {k: np.array(v) for k, v in tree_flatten(state.model.parameters())},
        "support": {
            "vectors": state.support_vectors,
            "labels": state.support_labels,
            "predictions": state.support_predictions,
            **({} if state.exemplar_basis is None else {"basis": state.exemplar_basis}),
        },
        "distance_ecdfs": {
            **pack_ragged("calibration", state.calibration_distance_ecdfs),
            **pack_ragged("training", state.training_distance_ecdfs),
        },
    }
    if state.calibration_logits is not None:
        groups["calibration"] = {"logits": state.calibration_logits, "labels": state.calibration_labels}
    for j, arrays in enumerate(round_arrays):
        groups[f"round_{j}"] = arrays
    return groups


def _artifact_meta(state: FittedState, params: dict, round_meta: list) -> dict:
    """The artifact's JSON metadata (parameters, sizes, rounds, ids, classes)."""
    return {
        "params": params,
        "num_classes": state.num_classes,
        "input_dim": int(state.input_dim),
        "k": int(state.k),
        "best_round": int(state.best_round),
        "rounds": round_meta,
        "round_summaries": state.round_summaries,
        "history": state.history,
        "support_ids": state.support_ids,
        "calibration_ids": state.calibration_ids,
        "feature_field": state.feature_field,
        "feature_parts": None if state.feature_parts is None else list(state.feature_parts),
        "classes": state.classes.tolist(),
    }


def load_state(path) -> tuple[dict, FittedState, str | None]:
    """``(parameters, fitted state, manifest digest)`` read from the artifact at ``path`` (see
    ``SDMEstimator.load``); the digest identifies the version read (the writer protocol's stale-save check)."""
    texts: dict = {}
    info: dict = {}
    groups, meta = load_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION, texts=texts, info=info)
    try:
        state, m, d = _restore(groups, meta)
        params = dict(meta["params"])
    except (KeyError, ValueError, TypeError, IndexError) as e:
        if isinstance(e, ArtifactError):
            raise
        raise ArtifactError(f"{path}: artifact content is incomplete or inconsistent ({e!r})") from None
    state.n_training_support = _check_loaded(state, path, meta, m, d)
    state.feedback_log = parse_log(texts.get(FEEDBACK_LOG, ""), os.path.join(os.fspath(path), FEEDBACK_LOG))
    state.support_documents = _documents(texts.get(DOCUMENTS_FILE), path)
    return params, state, info.get("manifest_digest")


def _restore(groups: dict, meta: dict) -> tuple[FittedState, int, int]:
    """The fitted state in the artifact; (state, M, D) with (M, D) the adaptor's projection."""
    import mlx.core as mx

    C = int(meta["num_classes"])
    adaptor = groups["adaptor"]
    m, d = adaptor["projection.weight"].shape
    model = ExemplarAdaptor(d, m, C)
    _check_normalization(meta["params"].get("normalize", True), adaptor, d)
    if adaptor["input_mean"].ndim == 1:  # per-dimension statistics (DESIGN #2): shape the slots before loading
        model.set_normalization(np.zeros(d), np.ones(d))
    model.load_weights([(k, mx.array(v)) for k, v in adaptor.items()])
    # the stored basis reproduces the stored support coordinates bit for bit (absent in older artifacts)
    stored_basis = groups["support"].get("basis")
    cal = groups.get("calibration")  # absent in artifacts written before it was stored
    state = FittedState(
        model=model,
        classes=np.asarray(meta["classes"]) if "classes" in meta else np.arange(C),  # absent: indices
        num_classes=C,
        input_dim=int(meta["input_dim"]),
        k=int(meta["k"]),
        best_round=int(meta["best_round"]),
        rounds=[RoundCalibration.from_arrays(groups[f"round_{j}"], rm) for j, rm in enumerate(meta["rounds"])],
        round_summaries=meta["round_summaries"],
        history=meta["history"],
        exemplar_basis=stored_basis.astype(np.float32) if stored_basis is not None else exemplar_basis(model),
        support_vectors=groups["support"]["vectors"],
        support_labels=groups["support"]["labels"].astype(np.int64),
        support_predictions=groups["support"]["predictions"].astype(np.int64),
        support_ids=meta["support_ids"],
        calibration_ids=meta["calibration_ids"],
        calibration_logits=None if cal is None else cal["logits"].astype(np.float32),
        calibration_labels=None if cal is None else cal["labels"].astype(np.int64),
        calibration_distance_ecdfs=unpack_ragged("calibration", groups["distance_ecdfs"], C),
        training_distance_ecdfs=unpack_ragged("training", groups["distance_ecdfs"], C),
        feature_field=meta.get("feature_field"),  # absent before it was stored: "auto"
        feature_parts=_stored_parts(meta.get("feature_parts")),  # absent before it was stored: None
    )
    return state, m, d


def _stored_parts(parts) -> tuple | None:
    if parts is None:
        return None
    from ..llm.pooling import check_feature_parts

    return check_feature_parts(parts)


def _check_normalization(normalize, adaptor: dict, d: int) -> None:
    """The stored input statistics must fit the stored ``normalize`` mode (DESIGN #2) and the input width."""
    mode = normalize_mode(normalize)
    mean, std = adaptor["input_mean"], adaptor["input_std"]
    want = (d,) if mode == "per-dimension" else ()
    if mean.shape != want or std.shape != want:
        raise ArtifactError(f"normalize {mode!r} needs input statistics of shape {want}, the artifact holds "
                            f"{mean.shape} and {std.shape}")
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std > 0)):
        raise ArtifactError("the stored input statistics are not finite, or a std is not positive")
    if mode == "none" and (float(mean) != 0.0 or float(std) != 1.0):
        raise ArtifactError(f"normalize 'none' but the stored statistics are mean {float(mean)}, std {float(std)}")


def _check_loaded(state: FittedState, path, meta: dict, m: int, d: int) -> int:
    """Cross-check the loaded support set; the number of training support rows (before feedback)."""
    if len(state.support_ids) != state.support_vectors.shape[0]:
        raise ArtifactError(f"{path}: support ids and vectors disagree in length")
    if state.support_vectors.shape[1] != min(m, d):
        raise ArtifactError(
            f"{path}: support vectors have width {state.support_vectors.shape[1]}, expected min(M, D) = {min(m, d)}"
        )
    n_train = meta.get("n_training_support", len(state.support_ids))
    if not isinstance(n_train, int) or not 1 <= n_train <= len(state.support_ids):
        raise ArtifactError(
            f"{path}: n_training_support {n_train!r} does not fit {len(state.support_ids)} support rows")
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
