"""``SDMEstimator``: the paper's complete SDM estimator behind a scikit-learn style API.

    est = SDMEstimator(alpha=0.95, iterations=10, epochs=50).fit(X_train, y_train, X_cal, y_cal)
    pred = est.predict(X_test)            # arrays: pred.prediction, pred.p_lower, pred.admitted, ...
    rows = pred.to_dicts()                 # one JSON-ready dict per row
    est.save("model_dir"); est = SDMEstimator.load("model_dir")
    est.recalibrate(alpha=0.9)             # new α without retraining the adaptor

``fit`` runs Alg. 1 for J rounds over stratified re-splits of the pooled
train+calibration rows (:mod:`sdm_mlx.train`), calibrates every round
(rescaler W'' by Alg. 2, Alg. 3 min valid q~ and ψ, per-bin medians:
:mod:`sdm_mlx.calibration`), keeps the round with the highest balanced median
calibration q, and aggregates the Cauchy robust min valid q~ and offsets over
all J rounds.  ``predict`` gives, per row, the index-conditional estimate
p̂_lower or ⊥ (``admitted = False``) with the reason, plus every quantity the
paper reports and the nearest training exemplars.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
from mlx.utils import tree_flatten

from .adaptor import ExemplarAdaptor, InvariantForward, exemplar_basis
from .artifact import ArtifactError, load_artifact, pack_ragged, save_artifact, unpack_ragged
from .calibration import (
    RoundCalibration, aggregate_rounds, calibrate_round, check_alpha, estimate_from_round, exact_one_minus,
)
from .data import check_features, check_labels, id_key
from .errors import InputError
from .feedback import LOG_FILE as FEEDBACK_LOG
from .feedback import FeedbackState, check_labels_int, dump_log, log_entries, new_ids, parse_log
from .distance import distance_quantile
from .index import good_neighbours_by_class, make_index
from .io import put_float
from .progress import log
from .train import TrainConfig, sdm_numpy, train_rounds

#: why a stored robust min valid q~ is null (+inf): every prediction is rejected
ROBUST_INF_REASON = ("no robust threshold: the Cauchy robust min valid q~ is +inf (rounds without a valid "
                     "threshold reach the median, or a non-finite MAD), so every prediction is rejected")

ARTIFACT_KIND = "sdm_estimator"
ARTIFACT_VERSION = 1


# ---------------------------------------------------------------------------------------------
# per-row results
# ---------------------------------------------------------------------------------------------
@dataclass
class Predictions:
    """Per-row results of :meth:`SDMEstimator.predict` as arrays (N rows); ``to_dicts()`` for JSON rows."""

    ids: list
    prediction: np.ndarray  #: ŷ = argmax z'
    logits: np.ndarray  #: z' [N, C]
    q: np.ndarray  #: Similarity
    d0: np.ndarray  #: squared L2 distance to the nearest training exemplar
    d: np.ndarray  #: Distance quantile
    sdm: np.ndarray  #: SDM activation output [N, C]
    q_tilde: np.ndarray  #: soft q bin q~ (centroid; 0 when OOD)
    hard_bin: np.ndarray
    q_tilde_lower: np.ndarray
    hard_bin_lower: np.ndarray
    q_tilde_upper: np.ndarray
    hard_bin_upper: np.ndarray
    p_lower: np.ndarray
    p_centroid: np.ndarray
    p_upper: np.ndarray
    n_hat: np.ndarray  #: effective sample size per class [N, C]
    offset: np.ndarray  #: Cauchy offset subtracted from p_lower (m[ŷ][hard bin lower])
    admitted: np.ndarray  #: False = ⊥ (rejected)
    rejection_reason: np.ndarray  #: "" when admitted
    exemplar_index: np.ndarray  #: [N, n] support indices (−1 padding)
    exemplar_distance: np.ndarray  #: [N, n] squared L2
    support_ids: list = field(repr=False, default_factory=list)
    support_labels: np.ndarray | None = field(repr=False, default=None)
    support_predictions: np.ndarray | None = field(repr=False, default=None)
    class_names: list | None = None
    admitted_centroid: np.ndarray | None = None  #: p_centroid estimator's admission (calibration ``valid``)
    admitted_upper: np.ndarray | None = None  #: p_upper estimator's admission (calibration ``valid_upper``)

    def __len__(self) -> int:
        return len(self.ids)

    def exemplars(self, row: int) -> list[dict]:
        """Nearest training exemplars of one row: id, label, predicted label, squared distance."""
        out = []
        for j, dist in zip(self.exemplar_index[row], self.exemplar_distance[row]):
            if j < 0:
                continue
            out.append(
                {
                    "id": self.support_ids[j],
                    "label": int(self.support_labels[j]),
                    "predicted_label": int(self.support_predictions[j]),
                    "squared_distance": float(dist),
                }
            )
        return out

    def to_dicts(self) -> list[dict]:
        """One JSON-serialisable dict per row (ids preserved, input order)."""
        rows = []
        for i in range(len(self)):
            rows.append(
                {
                    "id": self.ids[i],
                    "prediction": int(self.prediction[i]),
                    "admitted": bool(self.admitted[i]),
                    "rejection_reason": self.rejection_reason[i] or None,
                    "p_lower": float(self.p_lower[i]),
                    "p_centroid": float(self.p_centroid[i]),
                    "p_upper": float(self.p_upper[i]),
                    "q": int(self.q[i]),
                    "d0": float(self.d0[i]),
                    "d": float(self.d[i]),
                    "logits": self.logits[i].tolist(),
                    "sdm": self.sdm[i].tolist(),
                    "q_tilde": float(self.q_tilde[i]),
                    "hard_bin": int(self.hard_bin[i]),
                    "q_tilde_lower": float(self.q_tilde_lower[i]),
                    "hard_bin_lower": int(self.hard_bin_lower[i]),
                    "q_tilde_upper": float(self.q_tilde_upper[i]),
                    "hard_bin_upper": int(self.hard_bin_upper[i]),
                    "n_hat": [int(x) for x in self.n_hat[i]],
                    "offset": float(self.offset[i]),
                    "exemplars": self.exemplars(i),
                }
            )
            if self.class_names:
                rows[-1]["prediction_name"] = self.class_names[int(self.prediction[i])]
        return rows


# ---------------------------------------------------------------------------------------------
# the estimator
# ---------------------------------------------------------------------------------------------
class SDMEstimator:
    """The SDM estimator of the paper (adaptor → q, d → SDM → W'' → DKW → Alg. 3 → Cauchy → p̂_lower / ⊥).

    Parameters (paper defaults): ``alpha`` α' (max(0.5, 1/C) < α < 1); ``iterations`` J;
    ``epochs`` per round; ``exemplar_dim`` M; ``batch_size``; ``learning_rate`` (Adam);
    ``k`` neighbours scanned for q (None: largest class count of the training split);
    ``normalize`` scalar input normalisation; ``stratified`` J re-splits per class;
    ``index_backend`` "exact" (MLX) or "hnsw" (approximate); rescaler settings
    (Alg. 2: ``rescaler_max_epochs``, ``rescaler_patience``, ``rescaler_learning_rate``,
    ``rescaler_engine`` "numpy" (default: the sequential batch-1 Adam loop on the host, ~10x faster than
    per-row MLX dispatch) or "mlx" (compiled MLX step; the same math, tested to agree)); ``n_exemplars`` nearest training exemplars
    returned per prediction; ``seed``; ``verbose`` progress on stderr; ``class_names``.
    """

    def __init__(
        self,
        alpha: float = 0.95,
        iterations: int = 10,
        epochs: int = 50,
        exemplar_dim: int = 1000,
        batch_size: int = 50,
        learning_rate: float = 1e-5,
        k: int | None = None,
        normalize: bool = True,
        stratified: bool = True,
        index_backend: str = "exact",
        rescaler_max_epochs: int = 1000,
        rescaler_patience: int = 10,
        rescaler_learning_rate: float = 1e-4,
        rescaler_engine: str = "numpy",
        n_exemplars: int = 5,
        seed: int = 0,
        verbose: bool = True,
        class_names: list | None = None,
    ):
        self.alpha = alpha
        self.iterations = iterations
        self.epochs = epochs
        self.exemplar_dim = exemplar_dim
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.k = k
        self.normalize = normalize
        self.stratified = stratified
        self.index_backend = index_backend
        self.rescaler_max_epochs = rescaler_max_epochs
        self.rescaler_patience = rescaler_patience
        self.rescaler_learning_rate = rescaler_learning_rate
        self.rescaler_engine = rescaler_engine
        self.n_exemplars = n_exemplars
        self.seed = seed
        self.verbose = verbose
        self.class_names = class_names
        self._index = None

    # -- parameters -------------------------------------------------------------------------
    _PARAMS = (
        "alpha", "iterations", "epochs", "exemplar_dim", "batch_size", "learning_rate", "k", "normalize",
        "stratified", "index_backend", "rescaler_max_epochs", "rescaler_patience", "rescaler_learning_rate",
        "rescaler_engine", "n_exemplars", "seed", "verbose", "class_names",
    )

    def get_params(self) -> dict:
        return {name: getattr(self, name) for name in self._PARAMS}

    def _train_config(self) -> TrainConfig:
        return TrainConfig(
            epochs=self.epochs, batch_size=self.batch_size, learning_rate=self.learning_rate,
            exemplar_dim=self.exemplar_dim, k=self.k, normalize=self.normalize, iterations=self.iterations,
            stratified=self.stratified, seed=self.seed, index_backend=self.index_backend,
        )

    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "model_")

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise RuntimeError("this SDMEstimator is not fitted yet: call fit() or SDMEstimator.load()")

    # -- fit ---------------------------------------------------------------------------------
    def fit(self, X_train, y_train, X_cal=None, y_cal=None, ids_train=None, ids_cal=None, num_classes=None):
        """Train and calibrate (Alg. 1, Alg. 2, Alg. 3, Cauchy) on train (+ calibration) rows; returns self.

        The training and calibration rows are pooled and re-split in half per class for each of
        the J rounds (DESIGN #9), as in the paper.
        """
        X = check_features(X_train, "training features")
        y = np.asarray(y_train).reshape(-1)
        if y.shape[0] != X.shape[0]:
            raise ValueError(f"training labels: {y.shape[0]} labels for {X.shape[0]} rows")
        ids = list(ids_train) if ids_train is not None else [f"train-{i}" for i in range(X.shape[0])]
        if X_cal is not None:
            Xc = check_features(X_cal, "calibration features", dim=X.shape[1])
            yc = np.asarray(y_cal).reshape(-1)
            if yc.shape[0] != Xc.shape[0]:
                raise ValueError(f"calibration labels: {yc.shape[0]} labels for {Xc.shape[0]} rows")
            X = np.concatenate([X, Xc])
            y = np.concatenate([y, yc])
            ids += list(ids_cal) if ids_cal is not None else [f"cal-{i}" for i in range(Xc.shape[0])]
        if len(ids) != X.shape[0]:
            raise ValueError(f"got {len(ids)} ids for {X.shape[0]} rows")
        if not np.issubdtype(y.dtype, np.integer):
            if np.issubdtype(y.dtype, np.floating) and np.all(np.mod(y, 1) == 0):
                y = y.astype(np.int64)
            else:
                raise ValueError("labels must be integer class indices 0..C-1")
        y = y.astype(np.int64)
        C = int(num_classes) if num_classes is not None else int(y.max()) + 1
        if C < 2:
            raise ValueError("need at least two classes (a single-class problem cannot be calibrated)")
        check_labels(y, C, "labels")
        counts = np.bincount(y, minlength=C)
        thin = np.flatnonzero(counts < 4).tolist()
        if thin:
            raise ValueError(
                f"class(es) {thin} have fewer than 4 rows in the pooled data (counts {counts.tolist()}); every "
                "class needs rows in both the training and the calibration half"
            )
        alpha = check_alpha(self.alpha, C)
        min_cal = math.ceil(1 / exact_one_minus(alpha))  # smallest n with a quantile index ≥ 1 (exact)
        if (counts // 2 < min_cal).any():
            warnings.warn(
                f"calibration halves will hold fewer than 1/(1-α) = {min_cal} rows of some class "
                f"(class counts {counts.tolist()}): Alg. 3 then uses the class minimum as the α quantile and "
                "most predictions will be rejected",
                stacklevel=2,
            )
        if self.class_names is not None and len(self.class_names) != C:
            raise ValueError(f"class_names has {len(self.class_names)} names for {C} classes")
        config = self._train_config()
        config.validate()

        rounds: list[RoundCalibration] = []

        def on_round(j, result):
            cal = calibrate_round(
                result.calibration.sdm, result.calibration.q, y[result.cal_idx], result.calibration.y_hat,
                alpha=alpha, seed=self.seed * 1000 + j, num_classes=C, max_epochs=self.rescaler_max_epochs,
                patience=self.rescaler_patience, learning_rate=self.rescaler_learning_rate,
                engine=self.rescaler_engine,
            )
            rounds.append(cal)
            if self.verbose:
                fit = cal.rescaler
                extra = f" (rescaler {fit.epochs_run} epochs, {fit.seconds:.1f}s)" if fit is not None else ""
                log(f"round {j + 1}: min valid q~ {cal.min_valid:.3f}, psi {np.round(cal.psi, 3).tolist()}{extra}")

        best, best_j, summaries = train_rounds(X, y, C, config, on_round=on_round, verbose=self.verbose)
        self.num_classes_ = C
        self.input_dim_ = X.shape[1]
        self.k_ = best.k
        self.best_round_ = best_j
        self.rounds_ = rounds
        self.round_summaries_ = summaries
        self.history_ = best.history
        self.model_ = best.model
        self.exemplar_basis_ = best.basis  # the basis the support coordinates were computed in
        self.__dict__.pop("_forward_map", None)
        self.support_vectors_ = best.train.h
        self.support_labels_ = y[best.train_idx]
        self.support_predictions_ = best.train.y_hat
        self.support_ids_ = [ids[i] for i in best.train_idx]
        self.calibration_ids_ = [ids[i] for i in best.cal_idx]
        self.calibration_logits_ = np.asarray(best.calibration.z, dtype=np.float32)  # z' of calibration_ids_ rows
        self.calibration_labels_ = y[best.cal_idx]
        self.calibration_distance_ecdfs_ = best.calibration_distance_ecdfs
        self.training_distance_ecdfs_ = best.train_distance_ecdfs
        self._index = None
        self._apply_alpha(alpha)
        if self.verbose:
            log(
                f"fitted: best round {best_j + 1}/{len(rounds)} (epoch {best.best_epoch}), min valid q~ "
                f"{self.calibration_.min_valid:.3f}, robust min valid q~ {self.robust_min_valid_:.3f}"
            )
        return self

    def _apply_alpha(self, alpha: float) -> None:
        alpha = check_alpha(alpha, self.num_classes_)
        self.alpha = alpha
        best = self.rounds_[self.best_round_]
        self.calibration_ = best if best.alpha == alpha else best.with_alpha(alpha)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.robust_min_valid_, self.offsets_ = aggregate_rounds(self.rounds_, self.best_round_, alpha)
        for w in caught:
            warnings.warn(w.message, stacklevel=3)

    def recalibrate(self, alpha: float):
        """Re-threshold at a new α' (Alg. 3 + Cauchy over the stored rounds) without retraining; returns self."""
        self._check_fitted()
        self._apply_alpha(alpha)
        return self

    # -- predict -----------------------------------------------------------------------------
    @property
    def index_(self):
        if self._index is None:
            self._index = make_index(self.support_vectors_, self.index_backend)
        return self._index

    def _good(self) -> np.ndarray:
        return good_neighbours_by_class(self.support_labels_, self.support_predictions_, self.num_classes_)

    def _forward(self, X):
        """(z', exemplar coordinates) per row, batch-invariant (:class:`~sdm_mlx.adaptor.InvariantForward`)."""
        X = check_features(X, "features", dim=self.input_dim_)
        forward = self.__dict__.get("_forward_map")
        if forward is None:
            forward = self._forward_map = InvariantForward(self.model_, self.exemplar_basis_)
        return forward(X)

    def similarity_distance(self, X, distance_ecdfs: str = "calibration"):
        """(q, d, ŷ) per row: support search without self-exclusion; d from the chosen distance eCDFs."""
        self._check_fitted()
        if distance_ecdfs not in ("calibration", "training"):
            raise ValueError("distance_ecdfs must be 'calibration' or 'training'")
        z, h = self._forward(X)
        y_hat = z.argmax(axis=1)
        q, d0 = self.index_.similarity(h, y_hat, self._good(), self.k_)
        ecdfs = self.calibration_distance_ecdfs_ if distance_ecdfs == "calibration" else self.training_distance_ecdfs_
        return q, distance_quantile(d0, ecdfs), y_hat

    def predict(self, X, ids=None, n_exemplars: int | None = None) -> Predictions:
        """Index-conditional estimates for rows of X (``eq:index-conditional-sdm-estimator``)."""
        self._check_fitted()
        z, h = self._forward(X)
        n = z.shape[0]
        ids = list(ids) if ids is not None else list(range(n))
        if len(ids) != n:
            raise ValueError(f"got {len(ids)} ids for {n} rows")
        y_hat = z.argmax(axis=1)
        n_ex = self.n_exemplars if n_exemplars is None else int(n_exemplars)
        q, d0, ex_d, ex_i = self.index_.similarity_and_neighbours(h, y_hat, self._good(), self.k_, n_ex)
        d = distance_quantile(d0, self.calibration_distance_ecdfs_)
        s = sdm_numpy(z, q, d)
        est = estimate_from_round(self.calibration_, self.robust_min_valid_, self.offsets_, z, q, d, s)
        return Predictions(
            ids=ids, prediction=y_hat, logits=z, q=q, d0=d0, d=d, sdm=s,
            q_tilde=est["q_tilde"], hard_bin=est["hard_bin"],
            q_tilde_lower=est["q_tilde_lower"], hard_bin_lower=est["hard_bin_lower"],
            q_tilde_upper=est["q_tilde_upper"], hard_bin_upper=est["hard_bin_upper"],
            p_lower=est["p_lower"], p_centroid=est["p_centroid"], p_upper=est["p_upper"],
            n_hat=est["n_hat"], offset=est["offset_lower"], admitted=est["admitted"],
            rejection_reason=est["rejection_reason"], exemplar_index=ex_i, exemplar_distance=ex_d,
            support_ids=self.support_ids_, support_labels=self.support_labels_,
            support_predictions=self.support_predictions_, class_names=self.class_names,
            admitted_centroid=est["valid"], admitted_upper=est["valid_upper"],
        )

    # -- feedback: support-set updates (sdm_mlx.feedback) -------------------------------------
    @property
    def feedback_state_(self) -> FeedbackState:
        """Training-support size and update log of the current support set (reset by a new fit)."""
        self._check_fitted()
        state = self.__dict__.get("_feedback")
        if state is None or state.support_ids is not self.support_ids_:
            state = self._feedback = FeedbackState(self.support_ids_, len(self.support_ids_))
        return state

    def _taken_ids(self) -> set:
        taken = self.__dict__.get("_taken")
        if taken is None or taken[0] is not self.support_ids_:
            keys = {id_key(i) for i in self.support_ids_} | {id_key(i) for i in self.calibration_ids_}
            taken = self._taken = (self.support_ids_, keys)
        return taken[1]

    def add_support(self, X, y, ids=None, source: str = "api") -> list[dict]:
        """Append labelled rows to the support set without retraining; returns their update-log entries.

        Each row's exemplar coordinates h' and prediction ŷ come from the batch-invariant forward
        that computed the training support's; (h', label, ŷ, id) is appended to the support set and
        its index (exact: rows appended; hnsw: ``add_items``, no rebuild).  A row counts towards q of
        class c iff label = ŷ = c, as every training support row does.

        Changes for later queries: q (``equation:q``, counted over the enlarged support; the cap k is
        kept), d0 and therefore d (d0's quantile against the FIXED calibration eCDFs), and the
        returned nearest exemplars.  Unchanged: the adaptor and z', the calibration eCDFs of d0,
        the rescaler W'', Alg. 3's ψ and min valid q~, the Cauchy robust threshold and offsets —
        q and d are defined over the training support, the calibration statistics over the
        calibration split, which feedback does not change (see :mod:`sdm_mlx.feedback`).

        ``ids`` (default: fresh ``feedback-<hex>`` ids) must be unique and must not be support or
        calibration ids of this model; ``source`` names who sent the rows (api, cli, server, mcp...).
        """
        state = self.feedback_state_
        X = check_features(X, "added support rows", dim=self.input_dim_)
        y = check_labels_int(y, X.shape[0], self.num_classes_, "added support labels")
        if not isinstance(source, str) or not source.strip():
            raise InputError("source must be a non-empty string")
        taken = self._taken_ids()
        ids = new_ids(ids, X.shape[0], taken, "added support ids")
        z, h = self._forward(X)
        pred = z.argmax(axis=1).astype(np.int64)
        if self._index is not None:
            self._index.append(h)
        self.support_vectors_ = np.concatenate([self.support_vectors_, h.astype(self.support_vectors_.dtype)])
        self.support_labels_ = np.concatenate([self.support_labels_, y])
        self.support_predictions_ = np.concatenate([self.support_predictions_, pred])
        self.support_ids_ = self.support_ids_ + ids
        state.support_ids = self.support_ids_
        taken.update(id_key(i) for i in ids)
        self._taken = (self.support_ids_, taken)
        entries = log_entries("add", ids, y, pred, source)
        state.log.extend(entries)
        return entries

    def remove_support(self, ids, source: str = "api") -> list[dict]:
        """Undo :meth:`add_support` for rows by id; returns the update-log entries.

        Only rows added by feedback can be removed: the training support is the set the calibration
        split was measured against.  Removing every added row restores the training support, and
        with it every prediction, bit for bit (exact index)."""
        state = self.feedback_state_
        n_train = state.n_training
        added = {id_key(i): p for p, i in enumerate(self.support_ids_[n_train:], n_train)}
        positions, seen = [], set()
        for rid in list(ids):
            key = id_key(rid)
            if key in seen:
                raise InputError(f"id {rid!r} is given twice")
            seen.add(key)
            if key in added:
                positions.append(added[key])
            elif key in self._taken_ids():
                raise InputError(f"id {rid!r} is a training support or calibration row; only rows added by "
                                 "feedback (add_support) can be removed")
            else:
                raise InputError(f"id {rid!r} is not a support row of this model")
        if not positions:
            raise InputError("no ids to remove")
        positions = np.asarray(positions, dtype=np.int64)
        removed = [(self.support_ids_[p], self.support_labels_[p], self.support_predictions_[p]) for p in positions]
        if self._index is not None:
            self._index.remove(positions)
        keep = np.ones(len(self.support_ids_), dtype=bool)
        keep[positions] = False
        self.support_vectors_ = self.support_vectors_[keep]
        self.support_labels_ = self.support_labels_[keep]
        self.support_predictions_ = self.support_predictions_[keep]
        self.support_ids_ = [i for i, k in zip(self.support_ids_, keep) if k]
        state.support_ids = self.support_ids_
        self.__dict__.pop("_taken", None)
        entries = log_entries("remove", *map(list, zip(*removed)), source)
        state.log.extend(entries)
        return entries

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path, overwrite: bool = False) -> None:
        """Write a versioned safetensors + JSON artifact directory atomically.

        An existing artifact at ``path`` is replaced only with ``overwrite=True``; any other existing
        non-empty directory (or a file) is refused with :class:`ArtifactError` and left untouched."""
        self._check_fitted()
        C = self.num_classes_
        groups = {
            "adaptor": {k: np.array(v) for k, v in tree_flatten(self.model_.parameters())},
            "support": {
                "vectors": self.support_vectors_,
                "labels": self.support_labels_,
                "predictions": self.support_predictions_,
                **({} if self.exemplar_basis_ is None else {"basis": self.exemplar_basis_}),
            },
            "distance_ecdfs": {
                **pack_ragged("calibration", self.calibration_distance_ecdfs_),
                **pack_ragged("training", self.training_distance_ecdfs_),
            },
        }
        if getattr(self, "calibration_logits_", None) is not None:
            groups["calibration"] = {"logits": self.calibration_logits_, "labels": self.calibration_labels_}
        round_meta = []
        for j, r in enumerate(self.rounds_):
            arrays, meta = r.to_arrays()
            groups[f"round_{j}"] = arrays
            round_meta.append(meta)
        params = self.get_params()
        meta = {
            "params": params,
            "num_classes": C,
            "input_dim": int(self.input_dim_),
            "k": int(self.k_),
            "best_round": int(self.best_round_),
            "rounds": round_meta,
            "round_summaries": self.round_summaries_,
            "history": self.history_,
            "support_ids": self.support_ids_,
            "calibration_ids": self.calibration_ids_,
            "feature_field": getattr(self, "feature_field_", None),
        }
        state = self.feedback_state_
        texts = {}
        if state.log:
            meta["n_training_support"] = state.n_training
            texts[FEEDBACK_LOG] = dump_log(state.log)
        put_float(meta, "robust_min_valid", self.robust_min_valid_, ROBUST_INF_REASON)
        save_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION, groups, json.loads(json.dumps(meta, default=_json_default)),
                      overwrite=overwrite, texts=texts)

    @classmethod
    def load(cls, path) -> "SDMEstimator":
        """Load an artifact written by :meth:`save` (verifies format version and checksums)."""
        texts: dict = {}
        groups, meta = load_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION, texts=texts)
        try:
            est = cls(**meta["params"])
            C = int(meta["num_classes"])
            adaptor = groups["adaptor"]
            m, d = adaptor["projection.weight"].shape
            model = ExemplarAdaptor(d, m, C)
            import mlx.core as mx

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
        except (KeyError, ValueError, TypeError, IndexError) as e:
            if isinstance(e, ArtifactError):
                raise
            raise ArtifactError(f"{path}: artifact content is incomplete or inconsistent ({e!r})") from None
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
        log = parse_log(texts.get(FEEDBACK_LOG, ""), os.path.join(os.fspath(path), FEEDBACK_LOG))
        est._feedback = FeedbackState(est.support_ids_, n_train, log)
        est._index = None
        est._apply_alpha(est.alpha)
        return est


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    raise TypeError(f"cannot serialise {type(o).__name__}")
