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
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
from mlx.utils import tree_flatten

from .adaptor import ExemplarAdaptor, exemplar_basis, forward_with_coordinates
from .artifact import ArtifactError, load_artifact, pack_ragged, save_artifact, unpack_ragged
from .calibration import RoundCalibration, aggregate_rounds, calibrate_round, check_alpha, estimate_from_round
from .data import check_features, check_labels
from .defaults import ESTIMATOR_DEFAULTS as D
from .defaults import PAPER_SETTINGS
from .diagnosis import admission_diagnosis, diagnosis_message
from .distance import distance_quantile
from .index import good_neighbours_by_class, make_index
from .progress import log
from .train import TrainConfig, sdm_numpy, train_rounds

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

    Defaults: :data:`sdm_mlx.defaults.ESTIMATOR_DEFAULTS` (evidence in ``docs/defaults.md``);
    ``SDMEstimator.paper(**overrides)`` gives the paper's exact Alg. 1 settings.
    Parameters: ``alpha`` α' (max(0.5, 1/C) < α < 1); ``iterations`` J;
    ``epochs`` per round (a cap when ``patience`` is set); ``patience`` convergence-aware stopping:
    end a round after this many epochs without a better balanced median calibration q (None: run
    every epoch, as the paper); ``exemplar_dim`` M; ``batch_size``; ``learning_rate`` (Adam);
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
        alpha: float = D["alpha"],
        iterations: int = D["iterations"],
        epochs: int = D["epochs"],
        exemplar_dim: int = D["exemplar_dim"],
        batch_size: int = D["batch_size"],
        learning_rate: float = D["learning_rate"],
        k: int | None = D["k"],
        normalize: bool = D["normalize"],
        stratified: bool = D["stratified"],
        index_backend: str = D["index_backend"],
        rescaler_max_epochs: int = D["rescaler_max_epochs"],
        rescaler_patience: int = D["rescaler_patience"],
        rescaler_learning_rate: float = D["rescaler_learning_rate"],
        rescaler_engine: str = D["rescaler_engine"],
        n_exemplars: int = D["n_exemplars"],
        seed: int = D["seed"],
        verbose: bool = True,
        class_names: list | None = None,
        patience: int | None = D["patience"],
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
        self.patience = patience
        self._index = None

    @classmethod
    def paper(cls, **overrides) -> "SDMEstimator":
        """An estimator with the paper's exact Alg. 1 settings (:data:`sdm_mlx.defaults.PAPER_SETTINGS`)."""
        return cls(**{**PAPER_SETTINGS, **overrides})

    # -- parameters -------------------------------------------------------------------------
    _PARAMS = (
        "alpha", "iterations", "epochs", "exemplar_dim", "batch_size", "learning_rate", "k", "normalize",
        "stratified", "index_backend", "rescaler_max_epochs", "rescaler_patience", "rescaler_learning_rate",
        "rescaler_engine", "n_exemplars", "seed", "verbose", "class_names", "patience",
    )

    def get_params(self) -> dict:
        return {name: getattr(self, name) for name in self._PARAMS}

    def _train_config(self) -> TrainConfig:
        return TrainConfig(
            epochs=self.epochs, batch_size=self.batch_size, learning_rate=self.learning_rate,
            exemplar_dim=self.exemplar_dim, k=self.k, normalize=self.normalize, iterations=self.iterations,
            stratified=self.stratified, seed=self.seed, index_backend=self.index_backend, patience=self.patience,
        )

    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "model_")

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise RuntimeError("this SDMEstimator is not fitted yet: call fit() or SDMEstimator.load()")

    # -- fit ---------------------------------------------------------------------------------
    def fit(self, X_train, y_train, X_cal=None, y_cal=None, ids_train=None, ids_cal=None, num_classes=None,
            checkpoint=None):
        """Train and calibrate (Alg. 1, Alg. 2, Alg. 3, Cauchy) on train (+ calibration) rows; returns self.

        The training and calibration rows are pooled and re-split in half per class for each of
        the J rounds (DESIGN #9), as in the paper.  ``checkpoint``: a directory where the finished
        rounds are saved after each round (:mod:`sdm_mlx.checkpoint`); a later ``fit`` with the same
        settings and data continues from it (bit-identical to an uninterrupted fit), with other
        settings or data it starts over.  The checkpoint is left in place: remove it with
        :func:`sdm_mlx.checkpoint.remove_checkpoint` once the model is saved.
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
        min_cal = math.ceil(1.0 / (1.0 - alpha))
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

        best, best_j, summaries, rounds = self._train_and_calibrate(X, y, ids, C, alpha, config, checkpoint)
        self.num_classes_ = C
        self.input_dim_ = X.shape[1]
        self.k_ = best.k
        self.best_round_ = best_j
        self.rounds_ = rounds
        self.round_summaries_ = summaries
        self.history_ = best.history
        self.model_ = best.model
        self.__dict__.pop("_basis", None)
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

    def _train_and_calibrate(self, X, y, ids, C, alpha, config, checkpoint):
        """Alg. 1 rounds with per-round calibration; resumes from and writes ``checkpoint`` if given."""
        from .checkpoint import check_checkpoint_path, fingerprint, load_checkpoint, save_checkpoint

        rounds: list[RoundCalibration] = []
        progress, on_progress = None, None
        self.resumed_rounds_ = 0
        if checkpoint is not None:
            check_checkpoint_path(checkpoint)
            fp = fingerprint({**self.get_params(), "alpha": alpha}, X, y, ids, C)
            loaded, why = load_checkpoint(checkpoint, fp)
            if loaded is not None:
                progress, rounds = loaded
                self.resumed_rounds_ = progress.next_round
                log(f"resuming from {checkpoint}: {progress.next_round} of {config.iterations} rounds already done",
                    True)
            elif why:
                log(f"not resuming from {checkpoint}: {why}; starting over", True)

            def on_progress(p):
                save_checkpoint(checkpoint, fp, p, rounds)

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

        best, best_j, summaries = train_rounds(X, y, C, config, on_round=on_round, verbose=self.verbose,
                                               progress=progress, on_progress=on_progress)
        for summary, cal in zip(summaries, rounds):
            summary["min_valid_qbin"] = float(cal.min_valid) if math.isfinite(cal.min_valid) else None
        return best, best_j, summaries, rounds

    def _apply_alpha(self, alpha: float) -> None:
        alpha = check_alpha(alpha, self.num_classes_)
        self.alpha = alpha
        best = self.rounds_[self.best_round_]
        self.calibration_ = best if best.alpha == alpha else best.with_alpha(alpha)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.robust_min_valid_, self.offsets_ = aggregate_rounds(self.rounds_, self.best_round_, alpha)
        summaries = getattr(self, "round_summaries_", None) or []
        best_summary = summaries[self.best_round_] if len(summaries) > self.best_round_ else {}
        self.admission_ = admission_diagnosis(self.rounds_, self.best_round_, alpha, self.robust_min_valid_,
                                              self.class_names, best_summary.get("projection_movement"))
        for w in caught:  # the Cauchy warning is part of the diagnosis below
            if not (issubclass(w.category, RuntimeWarning) and "Cauchy" in str(w.message)):
                warnings.warn(w.message, stacklevel=3)
        if not self.admission_["can_admit"]:
            warnings.warn(diagnosis_message(self.admission_), RuntimeWarning, stacklevel=3)

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

    def _forward(self, X, batch_size: int = 1024):
        X = check_features(X, "features", dim=self.input_dim_)
        if not hasattr(self, "_basis"):
            self._basis = exemplar_basis(self.model_)
        return forward_with_coordinates(self.model_, X, batch_size, self._basis)

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

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write a versioned safetensors + JSON artifact directory atomically."""
        self._check_fitted()
        C = self.num_classes_
        groups = {
            "adaptor": {k: np.array(v) for k, v in tree_flatten(self.model_.parameters())},
            "support": {
                "vectors": self.support_vectors_,
                "labels": self.support_labels_,
                "predictions": self.support_predictions_,
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
            "robust_min_valid": float(self.robust_min_valid_),
        }
        save_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION, groups, json.loads(json.dumps(meta, default=_json_default)))

    @classmethod
    def load(cls, path) -> "SDMEstimator":
        """Load an artifact written by :meth:`save` (verifies format version and checksums)."""
        groups, meta = load_artifact(path, ARTIFACT_KIND, ARTIFACT_VERSION)
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
            est.support_labels_ = groups["support"]["labels"].astype(np.int64)
            est.support_predictions_ = groups["support"]["predictions"].astype(np.int64)
            est.support_ids_ = meta["support_ids"]
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
