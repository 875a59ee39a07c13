"""``SDMEstimator``: the paper's complete SDM estimator behind a scikit-learn style API.

    est = SDMEstimator(alpha=0.95, iterations=10, epochs=50).fit(X_train, y_train, X_cal, y_cal)
    est.predict(X_test)                    # class labels (scikit-learn), in the labels fit was given
    est.predict_proba(X_test)              # the SDM output [N, C] (rows sum to 1)
    res = est.estimate(X_test)             # full per-row results: res.p_lower, res.admitted, res.estimate.lower...
    rows = res.to_dicts()                  # one JSON-ready dict per row
    est.estimate(X_test, alpha=0.9)        # re-thresholded at another α' (Alg. 3), est unchanged
    est.save("model_dir"); est = SDMEstimator.load("model_dir")
    est.recalibrate(alpha=0.9)             # store a new α' in the model, without retraining the adaptor

``fit`` runs Alg. 1 for J rounds over stratified re-splits of the pooled
train+calibration rows (:mod:`sdm_mlx.train`), calibrates every round
(rescaler W'' by Alg. 2, Alg. 3 min valid q~ and ψ, per-bin medians:
:mod:`sdm_mlx.calibration`), keeps the round with the highest balanced median
calibration q, and aggregates the Cauchy robust min valid q~ and offsets over
all J rounds.  ``estimate`` gives, per row, the index-conditional estimate
p̂_lower or ⊥ (``admitted = False``) with the reason, plus every quantity the
paper reports and the nearest training exemplars.
"""

from __future__ import annotations

import inspect
import math
import warnings

import numpy as np

from .adaptor import InvariantForward
from . import validation
from .calibration import Calibration, calibrate_round, estimate, exact_one_minus
from .chunked import PREDICT_CHUNK_ROWS, concat_predictions, iter_estimates
from .defaults import EstimatorConfig
from .defaults import PAPER_SETTINGS
from .diagnosis import admission_diagnosis, diagnosis_message
from .errors import InputError, NotFittedError
from .estimator_io import load_estimator, save_estimator
from .data import id_key
from .feedback import FeedbackState, label_indices_for, log_entries, new_ids
from .distance import distance_quantile
from .index import good_neighbours_by_class, make_index
from .callbacks import CallbackList, as_callback
from .results import Predictions
from .train import RoundCalibrator, TrainConfig, sdm_numpy, train_rounds

_D = EstimatorConfig()  #: the defaults (one place: sdm_mlx/defaults.py)


# ---------------------------------------------------------------------------------------------
# the estimator
# ---------------------------------------------------------------------------------------------
class SDMEstimator:
    """The SDM estimator of the paper (adaptor → q, d → SDM → W'' → DKW → Alg. 3 → Cauchy → p̂_lower / ⊥).

    A scikit-learn classifier: ``fit(X, y)``, ``predict`` (labels), ``predict_proba`` (SDM output),
    ``score`` (accuracy), ``get_params`` / ``set_params`` / ``sklearn.base.clone``; ``estimate`` gives the
    full per-row results.  Parameters are stored as given and validated in ``fit``.

    Defaults: :class:`sdm_mlx.defaults.EstimatorConfig` (evidence in ``docs/defaults.md``);
    ``SDMEstimator.paper(**overrides)`` gives the paper's exact Alg. 1 settings.
    Parameters: ``alpha`` α' (max(0.5, 1/C) < α < 1); ``iterations`` J;
    ``epochs`` per round (a cap when ``patience`` is set); ``patience`` convergence-aware stopping:
    end a round after this many epochs without a better balanced median calibration q (None: run
    every epoch, as the paper); ``exemplar_dim`` M; ``batch_size``; ``learning_rate`` (Adam);
    ``k`` neighbours scanned for q (None: largest class count of the training split);
    ``normalize`` input normalisation (DESIGN #2): "scalar" (default; one mean and std over the
    training split), "per-dimension" (one per feature dimension: LLM hidden states) or "none"; ``stratified`` J re-splits per class;
    ``index_backend`` "exact" (MLX) or "hnsw" (approximate); rescaler settings
    (Alg. 2: ``rescaler_max_epochs``, ``rescaler_patience``, ``rescaler_learning_rate``,
    ``rescaler_engine`` "numpy" (default: the sequential batch-1 Adam loop on the host, ~10x faster than
    per-row MLX dispatch) or "mlx" (compiled MLX step; the same math, tested to agree)); ``n_exemplars``
    nearest training exemplars returned per row by ``estimate``; ``seed``; ``verbose`` progress on stderr
    (off by default; the CLI turns it on); ``class_names`` display names, one per class of ``classes_``;
    ``shard_index`` under ``mlx.launch`` (more than one rank) split the exact index over the ranks, with
    ``shard_timeout`` seconds for a dead or hung rank (``docs/distributed.md``).
    """

    def __init__(
        self,
        alpha: float = _D.alpha,
        iterations: int = _D.iterations,
        epochs: int = _D.epochs,
        exemplar_dim: int = _D.exemplar_dim,
        batch_size: int = _D.batch_size,
        learning_rate: float = _D.learning_rate,
        k: int | None = _D.k,
        normalize: str = _D.normalize,
        stratified: bool = _D.stratified,
        index_backend: str = _D.index_backend,
        rescaler_max_epochs: int = _D.rescaler_max_epochs,
        rescaler_patience: int = _D.rescaler_patience,
        rescaler_learning_rate: float = _D.rescaler_learning_rate,
        rescaler_engine: str = _D.rescaler_engine,
        n_exemplars: int = _D.n_exemplars,
        seed: int = _D.seed,
        verbose: bool = False,
        class_names: list | None = None,
        patience: int | None = _D.patience,
        shard_index: bool = _D.shard_index,
        shard_timeout: float = _D.shard_timeout,
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
        self.shard_index = shard_index
        self.shard_timeout = shard_timeout

    @classmethod
    def paper(cls, **overrides) -> "SDMEstimator":
        """An estimator with the paper's exact Alg. 1 settings (:data:`sdm_mlx.defaults.PAPER_SETTINGS`)."""
        return cls(**{**PAPER_SETTINGS, **overrides})

    # -- parameters (scikit-learn protocol) ------------------------------------------------------
    @classmethod
    def _get_param_names(cls) -> list[str]:
        """The ``__init__`` parameters, in signature order (what get_params / clone / save use)."""
        return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]

    def get_params(self, deep: bool = True) -> dict:
        """``{parameter: value}`` as given to ``__init__`` / ``set_params`` (no nested estimators: ``deep`` is moot)."""
        return {name: getattr(self, name) for name in self._get_param_names()}

    def set_params(self, **params) -> "SDMEstimator":
        """Set parameters by name (validated at the next ``fit``); returns self."""
        valid = self._get_param_names()
        for name, value in params.items():
            if name not in valid:
                raise InputError(f"invalid parameter {name!r} for SDMEstimator; valid parameters: {valid}")
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        defaults = type(self)().get_params()
        changed = [f"{k}={v!r}" for k, v in self.get_params().items() if not _same(v, defaults[k])]
        return f"SDMEstimator({', '.join(changed)})"

    def __sklearn_tags__(self):
        """scikit-learn ≥ 1.6 tags: a classifier (only called by scikit-learn, which is then installed)."""
        from sklearn.utils import ClassifierTags, Tags, TargetTags

        return Tags(estimator_type="classifier", target_tags=TargetTags(required=True),
                    classifier_tags=ClassifierTags(poor_score=True))

    _estimator_type = "classifier"

    def _train_config(self) -> TrainConfig:
        return TrainConfig(
            epochs=self.epochs, batch_size=self.batch_size, learning_rate=self.learning_rate,
            exemplar_dim=self.exemplar_dim, k=self.k, normalize=self.normalize, iterations=self.iterations,
            stratified=self.stratified, seed=self.seed, index_backend=self.index_backend, patience=self.patience,
            shard_index=self.shard_index, shard_timeout=self.shard_timeout,
        )

    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "model_")

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise NotFittedError("this SDMEstimator is not fitted yet: call fit() or SDMEstimator.load()")

    # -- fit ---------------------------------------------------------------------------------
    def _pooled_data(self, X, y, X_cal, y_cal, ids_train, ids_cal, num_classes):
        """(X, classes_, y as indices, ids) of train (+ calibration) rows, validated once."""
        X = validation.features(X, "training features")
        if y is None:
            raise InputError("SDMEstimator requires y to be passed, but the target y is None")
        ys = [np.asarray(y)]
        if ys[0].shape[:1] != (X.shape[0],):
            raise InputError(f"training labels: shape {ys[0].shape} for {X.shape[0]} rows (one label per row)")
        ids = list(ids_train) if ids_train is not None else [f"train-{i}" for i in range(X.shape[0])]
        if X_cal is not None:
            if y_cal is None:
                raise InputError("calibration features given without calibration labels (y_cal)")
            Xc = validation.features(X_cal, "calibration features", dim=X.shape[1])
            yc = np.asarray(y_cal)
            if yc.shape[:1] != (Xc.shape[0],):
                raise InputError(f"calibration labels: shape {yc.shape} for {Xc.shape[0]} rows (one label per row)")
            X = np.concatenate([X, Xc])
            ys.append(yc)
            ids += list(ids_cal) if ids_cal is not None else [f"cal-{i}" for i in range(Xc.shape[0])]
        if len(ids) != X.shape[0]:
            raise InputError(f"got {len(ids)} ids for {X.shape[0]} rows")
        ys = [validation.one_d(a, name) for a, name in zip(ys, ("training labels", "calibration labels"))]
        labels = np.concatenate(ys) if len(ys) > 1 else ys[0]
        classes, y_idx = validation.encode_labels(labels, "labels", num_classes)
        return X, classes, y_idx, ids

    def _check_classes(self, y: np.ndarray, C: int) -> float:
        """Per-class row counts, class names and α' for C classes; returns the validated α'."""
        if C < 2:
            raise InputError("need at least two classes (a single-class problem cannot be calibrated); "
                             f"the labels hold {C} class")
        counts = np.bincount(y, minlength=C)
        thin = np.flatnonzero(counts < 4).tolist()
        if thin:
            raise InputError(
                f"class(es) {thin} have fewer than 4 rows in the pooled data (counts {counts.tolist()}); every "
                "class needs rows in both the training and the calibration half"
            )
        alpha = validation.alpha(self.alpha, C)
        min_cal = math.ceil(1 / exact_one_minus(alpha))  # smallest n with a quantile index ≥ 1 (exact)
        if (counts // 2 < min_cal).any():
            warnings.warn(
                f"calibration halves will hold fewer than 1/(1-α) = {min_cal} rows of some class "
                f"(class counts {counts.tolist()}): Alg. 3 then uses the class minimum as the α quantile and "
                "most predictions will be rejected",
                stacklevel=3,
            )
        if self.class_names is not None and len(self.class_names) != C:
            raise InputError(f"class_names has {len(self.class_names)} names for {C} classes")
        return alpha

    def fit(self, X, y, X_cal=None, y_cal=None, ids_train=None, ids_cal=None, num_classes=None, checkpoint=None,
            callback=None):
        """Train and calibrate (Alg. 1, Alg. 2, Alg. 3, Cauchy) on train (+ calibration) rows; returns self.

        The training and calibration rows are pooled and re-split in half per class for each of
        the J rounds (DESIGN #9), as in the paper.  Labels: any sortable hashable values
        (``classes_`` = the sorted distinct labels), or, with ``num_classes``, class indices 0..C−1.
        ``checkpoint``: a directory where the finished rounds are saved after each round
        (:mod:`sdm_mlx.checkpoint`); a later ``fit`` with the same settings and data continues from it
        (bit-identical to an uninterrupted fit), with other settings or data it starts over.  The
        checkpoint is left in place: remove it with :func:`sdm_mlx.checkpoint.remove_checkpoint` once
        the model is saved.  ``callback``: a :class:`sdm_mlx.callbacks.Callback` receiving progress
        (default: silent, or tqdm progress on stderr with ``verbose=True``).
        """
        callback = as_callback(callback, self.verbose)
        X, classes, y, ids = self._pooled_data(X, y, X_cal, y_cal, ids_train, ids_cal, num_classes)
        C = len(classes)
        alpha = self._check_classes(y, C)
        config = self._train_config()
        config.validate()

        best, best_j, summaries, rounds = self._train_and_calibrate(X, y, ids, C, alpha, config, checkpoint,
                                                                    callback)
        self.classes_ = classes
        self.n_features_in_ = X.shape[1]
        self._store_fit(X, y, ids, C, best, best_j, rounds, summaries)
        self._apply_alpha(alpha)
        callback.message(f"fitted: best round {best_j + 1}/{len(rounds)} (epoch {best.best_epoch}), min valid q~ "
                         f"{self.calibration_.min_valid:.3f}, robust min valid q~ {self.robust_min_valid_:.3f}")
        return self

    def _train_and_calibrate(self, X, y, ids, C, alpha, config, checkpoint, callback):
        """Alg. 1 rounds with per-round calibration; resumes from and writes ``checkpoint`` if given."""
        rescaler = dict(max_epochs=self.rescaler_max_epochs, patience=self.rescaler_patience,
                        learning_rate=self.rescaler_learning_rate, engine=self.rescaler_engine)
        calibrator = RoundCalibrator(calibrate_round, y, alpha, C, self.seed, rescaler, callback)
        progress, saver = None, None
        if checkpoint is not None:
            from .checkpoint import Checkpointer, check_checkpoint_path, fingerprint

            check_checkpoint_path(checkpoint)
            fp = fingerprint({**self.get_params(), "alpha": alpha}, X, y, ids, C)
            saver = Checkpointer(checkpoint, fp, calibrator.rounds, callback)
            progress = saver.resume(config.iterations)
        self.resumed_rounds_ = 0 if progress is None else progress.next_round
        best, best_j, summaries = train_rounds(X, y, C, config, CallbackList([calibrator, callback, saver]),
                                               progress=progress)
        rounds = calibrator.rounds
        for summary, cal in zip(summaries, rounds):
            summary["min_valid_qbin"] = float(cal.min_valid) if math.isfinite(cal.min_valid) else None
        return best, best_j, summaries, rounds

    def _store_fit(self, X, y, ids, C, best, best_j, rounds, summaries) -> None:
        """The fitted state of the best round (support set, adaptor, eCDFs) and of all rounds."""
        self.num_classes_ = C
        self.input_dim_ = X.shape[1]
        self.k_ = best.k
        self.best_round_ = best_j
        self.rounds_ = rounds
        self.round_summaries_ = summaries
        self.history_ = best.history
        self.model_ = best.model
        self.exemplar_basis_ = best.basis  # the basis the support coordinates were computed in
        self.support_vectors_ = best.train.h
        self.support_labels_ = y[best.train_idx]
        self.support_predictions_ = best.train.y_hat
        self.support_ids_ = [ids[i] for i in best.train_idx]
        self.calibration_ids_ = [ids[i] for i in best.cal_idx]
        self.calibration_logits_ = np.asarray(best.calibration.z, dtype=np.float32)  # z' of calibration_ids_ rows
        self.calibration_labels_ = y[best.cal_idx]
        self.calibration_distance_ecdfs_ = best.calibration_distance_ecdfs
        self.training_distance_ecdfs_ = best.train_distance_ecdfs
        self._prepare_predict()

    def _prepare_predict(self) -> None:
        """The support index and the batch-invariant forward map, built once per fit / load (so that
        prediction never changes the estimator's state)."""
        self._index = make_index(self.support_vectors_, self.index_backend, shard=self.shard_index,
                                 shard_timeout=self.shard_timeout)
        self._forward_map = InvariantForward(self.model_, self.exemplar_basis_)

    def calibration_at(self, alpha: float) -> Calibration:
        """The test-time calibration re-thresholded at α' (Alg. 3 + Cauchy over the stored rounds); est unchanged."""
        self._check_fitted()
        alpha = validation.alpha(alpha, self.num_classes_)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cal = Calibration.from_rounds(self.rounds_, self.best_round_, alpha)
        for w in caught:
            warnings.warn(w.message, stacklevel=3)
        return cal

    def _apply_alpha(self, alpha: float) -> None:
        """Store the calibration at α' and the admission diagnosis (a warning when nothing can be admitted)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cal = self.calibration_at(alpha)
        self.alpha = cal.alpha
        self.calibration_ = cal
        self.robust_min_valid_, self.offsets_ = cal.robust_min_valid, cal.offsets
        summaries = getattr(self, "round_summaries_", None) or []
        best_summary = summaries[self.best_round_] if len(summaries) > self.best_round_ else {}
        self.admission_ = admission_diagnosis(self.rounds_, self.best_round_, cal.alpha, self.robust_min_valid_,
                                              self.class_names, best_summary.get("projection_movement"))
        for w in caught:  # the Cauchy warning is part of the diagnosis below
            if not (issubclass(w.category, RuntimeWarning) and "Cauchy" in str(w.message)):
                warnings.warn(w.message, w.category, stacklevel=3)
        if not self.admission_["can_admit"]:
            warnings.warn(diagnosis_message(self.admission_), RuntimeWarning, stacklevel=3)

    def recalibrate(self, alpha: float):
        """Store a new α' in this model (Alg. 3 + Cauchy over the stored rounds, no retraining); returns self.

        To estimate at another α' without changing the model, use ``estimate(X, alpha=...)``."""
        self._check_fitted()
        self._apply_alpha(alpha)
        return self

    # -- predict -----------------------------------------------------------------------------
    @property
    def index_(self):
        """The support index (exact or HNSW) over the support set's exemplar coordinates."""
        self._check_fitted()
        return self._index

    def _good(self) -> np.ndarray:
        return good_neighbours_by_class(self.support_labels_, self.support_predictions_, self.num_classes_)

    def _forward(self, X):
        """(z', exemplar coordinates) per row, batch-invariant (:class:`~sdm_mlx.adaptor.InvariantForward`)."""
        self._check_fitted()
        X = validation.features(X, "features", dim=self.input_dim_, model=type(self).__name__)
        return self._forward_map(X)

    def logits(self, X) -> np.ndarray:
        """The adaptor's logits z' [N, C] (float32) for rows of X (what the baselines are fit on)."""
        return self._forward(X)[0]

    def similarity_distance(self, X, distance_ecdfs: str = "calibration"):
        """(q, d, ŷ) per row: support search without self-exclusion; d from the chosen distance eCDFs."""
        if distance_ecdfs not in ("calibration", "training"):
            raise InputError("distance_ecdfs must be 'calibration' or 'training'")
        z, h = self._forward(X)
        y_hat = z.argmax(axis=1)
        q, d0 = self.index_.similarity(h, y_hat, self._good(), self.k_)
        ecdfs = self.calibration_distance_ecdfs_ if distance_ecdfs == "calibration" else self.training_distance_ecdfs_
        return q, distance_quantile(d0, ecdfs), y_hat

    def _scores(self, X, n_exemplars: int):
        """(z', q, d0, d, SDM output, exemplar distances, exemplar indices) per row."""
        z, h = self._forward(X)
        y_hat = z.argmax(axis=1)
        q, d0, ex_d, ex_i = self.index_.similarity_and_neighbours(h, y_hat, self._good(), self.k_, n_exemplars)
        d = distance_quantile(d0, self.calibration_distance_ecdfs_)
        return z, q, d0, d, sdm_numpy(z, q, d), ex_d, ex_i

    def predict(self, X) -> np.ndarray:
        """Class labels ŷ = argmax z' [N], in the label space ``fit`` was given (``classes_``)."""
        self._check_fitted()
        return self.classes_[self.logits(X).argmax(axis=1)]

    def predict_proba(self, X) -> np.ndarray:
        """The SDM activation output sdm(z', q, d) [N, C] (rows sum to 1), columns in ``classes_`` order."""
        return self._scores(X, 0)[4]

    def score(self, X, y, sample_weight=None) -> float:
        """Mean accuracy of ``predict(X)`` against ``y`` (scikit-learn's ClassifierMixin.score)."""
        y = np.asarray(y).reshape(-1)
        correct = (self.predict(X) == y).astype(np.float64)
        if correct.shape[0] != y.shape[0]:
            raise InputError(f"score: {y.shape[0]} labels for {correct.shape[0]} rows")
        return float(np.average(correct, weights=sample_weight))

    def estimate(self, X, ids=None, n_exemplars: int | None = None, alpha: float | None = None,
                 progress: bool = False) -> Predictions:
        """Full per-row results: index-conditional estimates (``eq:index-conditional-sdm-estimator``) and exemplars.

        ``alpha``: re-threshold at another α' (Alg. 3 + Cauchy over the stored rounds) for this call only;
        None uses the fitted α'.  The estimator is not modified.  More than
        :data:`~sdm_mlx.chunked.PREDICT_CHUNK_ROWS` rows are scored chunk by chunk (bounded working
        memory, the same answers: :mod:`sdm_mlx.chunked`); ``progress`` draws a bar on stderr.
        """
        self._check_fitted()
        n = X.shape[0] if hasattr(X, "shape") and len(X.shape) else None
        if n is None or n <= PREDICT_CHUNK_ROWS:
            return self._estimate_rows(X, ids, n_exemplars, alpha)
        return concat_predictions(list(self.iter_estimate(X, ids, n_exemplars, alpha, progress)))

    def iter_estimate(self, X, ids=None, n_exemplars: int | None = None, alpha: float | None = None,
                      progress: bool = False, chunk_rows: int = PREDICT_CHUNK_ROWS):
        """:meth:`estimate` of consecutive chunks of ``chunk_rows`` rows, one :class:`Predictions` per chunk.

        For streaming many rows to disk with bounded memory (``sdm-mlx predict``); the rows' answers are
        those of one :meth:`estimate` call, bit for bit.  ``progress`` draws a bar on stderr."""
        self._check_fitted()
        n = X.shape[0] if hasattr(X, "shape") and len(X.shape) else len(X)
        if ids is not None and len(ids) != n:
            raise InputError(f"got {len(ids)} ids for {n} rows")
        cal = self.calibration_ if alpha is None else self.calibration_at(alpha)

        def score(rows, row_ids):
            return self._estimate_rows(rows, row_ids, n_exemplars, cal)

        return iter_estimates(score, X, ids, chunk_rows, progress)

    def _estimate_rows(self, X, ids, n_exemplars, alpha) -> Predictions:
        """:meth:`estimate` of one batch (``alpha``: None, an α' or a :class:`Calibration`)."""
        n_ex = self.n_exemplars if n_exemplars is None else int(n_exemplars)
        z, q, d0, d, s, ex_d, ex_i = self._scores(X, n_ex)
        n = z.shape[0]
        ids = list(ids) if ids is not None else list(range(n))
        if len(ids) != n:
            raise InputError(f"got {len(ids)} ids for {n} rows")
        if isinstance(alpha, Calibration):
            cal = alpha
        else:
            cal = self.calibration_ if alpha is None else self.calibration_at(alpha)
        return Predictions(
            ids=ids, logits=z, q=q, d0=d0, d=d, sdm=s, estimate=estimate(cal, z, q, d, s),
            exemplar_index=ex_i, exemplar_distance=ex_d, support_ids=self.support_ids_,
            support_labels=self.support_labels_, support_predictions=self.support_predictions_,
            class_names=self.class_names,
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
        X = validation.features(X, "added support rows", dim=self.input_dim_, model=type(self).__name__)
        y = label_indices_for(y, X.shape[0], self.classes_, "added support labels")
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

    # -- persistence (sdm_mlx/estimator_io.py) ------------------------------------------------
    def save(self, path, overwrite: bool = False) -> None:
        """Write a versioned safetensors + JSON artifact directory atomically.

        An existing artifact at ``path`` is replaced only with ``overwrite=True``; any other existing
        non-empty directory (or a file) is refused with :class:`~sdm_mlx.errors.ArtifactError` and left untouched.
        Fitted under ``mlx.launch`` with a sharded index, rank 0 alone writes (the other ranks return)."""
        save_estimator(self, path, overwrite=overwrite)

    @classmethod
    def load(cls, path, shard_index: bool | None = None) -> "SDMEstimator":
        """Load an artifact written by :meth:`save` (verifies format version and checksums).

        ``shard_index`` overrides the stored setting (under ``mlx.launch``: split the exact index over the
        ranks or not); None keeps the model's."""
        return load_estimator(cls, path, shard_index=shard_index)


def _same(a, b) -> bool:
    """Equal parameter values for ``__repr__`` (arrays and lists compared by value)."""
    try:
        return bool(np.all(a == b)) and type(a) is type(b)
    except Exception:
        return False
