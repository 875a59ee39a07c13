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
train+calibration rows (:mod:`sdm_mlx.estimator.training`), calibrates every round
(rescaler W'' by Alg. 2, Alg. 3 min valid q~ and ψ, per-bin medians:
:mod:`sdm_mlx.calibration`), keeps the round with the highest balanced median
calibration q, and aggregates the Cauchy robust min valid q~ and offsets over
all J rounds.  ``estimate`` gives, per row, the index-conditional estimate
p̂_lower or ⊥ (``admitted = False``) with the reason, plus every quantity the
paper reports and the nearest training exemplars.

Why this module is over 400 lines: it is the one class users hold -- parameters, fit, estimate, recalibration,
feedback and save/load -- and each of those delegates the work to its own module (:mod:`.training`,
:mod:`.chunking`, :mod:`.feedback`, :mod:`.persistence`, :mod:`sdm_mlx.calibration`); splitting the class
itself over files would hide its API.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings

import numpy as np

from ..core.adaptor import InvariantForward
from .. import validation
from ..calibration import (Calibration, NestedCalibration, RescalerSettings, calibrate_round, estimate_nested,
                           exact_one_minus)
from ..calibration.nested import alpha_grid, decision_policy
from .chunking import PREDICT_CHUNK_ROWS, concat_predictions, iter_estimates
from .config import EstimatorConfig
from .config import PAPER_SETTINGS
from ..calibration.diagnosis import admission_diagnosis, diagnosis_message
from ..errors import ArtifactError, InputError, NotFittedError, not_fitted_error
from .persistence import load_state, save_state
from .state import FittedState
from ..storage.datasets import id_key
from .feedback import FeedbackState, label_indices_for, log_entries, new_ids
from ..core.distance import distance_quantile
from ..index import good_neighbours_by_class, make_index
from ..runtime.callbacks import as_callback
from ..results import Predictions
from .rounds import RoundCalibrator, train_rounds
from .training import TrainConfig
from ..core.activation import sdm_numpy

_D = EstimatorConfig()  #: the defaults (one place: sdm_mlx/estimator/config.py)
#: ``recalibrate``'s value that returns a grid or policy setting to its default (None keeps the model's)
RESET = "default"


# ---------------------------------------------------------------------------------------------
# the estimator
# ---------------------------------------------------------------------------------------------
class SDMEstimator:
    """The SDM estimator of the paper (adaptor → q, d → SDM → W'' → DKW → Alg. 3 → Cauchy → p̂_lower / ⊥).

    A scikit-learn classifier: ``fit(X, y)``, ``predict`` (labels), ``predict_proba`` (SDM output),
    ``score`` (accuracy), ``get_params`` / ``set_params`` / ``sklearn.base.clone``; ``estimate`` gives the
    full per-row results.  Parameters are stored as given and validated in ``fit``.

    Defaults: :class:`sdm_mlx.estimator.config.EstimatorConfig` (evidence in ``docs/defaults.md``);
    ``SDMEstimator.paper(**overrides)`` gives the paper's exact Alg. 1 settings.  All parameters are keywords.

    Parameters
    ----------
    alpha : float
        α', the target conditional accuracy; max(0.5, 1/C) < α < 1 (DESIGN #23).
    alpha_grid : sequence of float or None
        The levels of the nested calibration (None: 0.99, 0.98, …, 0.80; α' is always added; DESIGN #25).
    alpha_allow, alpha_review : float or None
        The decision policy over each row's α region: allow at or above ``alpha_allow`` (None: α'), review at or
        above ``alpha_review`` (None: the lowest grid level), else reject (DESIGN #25).
    iterations : int
        J, the rounds over re-splits of the pooled train + calibration rows (DESIGN #9).
    epochs : int
        Epochs per round (a cap when ``patience`` is set).
    exemplar_dim : int
        M, the width of the exemplar vectors h'.
    batch_size, learning_rate : int, float
        Alg. 1's mini-batch size and Adam learning rate.
    k : int or None
        Neighbours scanned for q (None: the largest class count of the training split).
    normalize : {"scalar", "per-dimension", "none"}
        Input normalisation (DESIGN #2), statistics fitted on the training split: "scalar" (default; one mean and
        std), "per-dimension" (one per feature dimension: LLM hidden states) or "none".
    stratified : bool
        Re-split each round per class.
    index_backend : {"exact", "hnsw"}
        The support index: exact (MLX) or hnswlib (approximate).
    rescaler_max_epochs, rescaler_patience, rescaler_learning_rate : int, int, float
        Alg. 2's training of the rescaler W'' (DESIGN #10).
    rescaler_engine : {"numpy", "mlx"}
        "numpy": the sequential batch-1 Adam loop on the host (~10x faster on CPU); "mlx": a compiled MLX step
        (the same math, tested to agree).
    n_exemplars : int
        Nearest training exemplars returned per row by ``estimate`` (DESIGN #22).
    seed : int
        Seed of the splits and the initialisation.
    verbose : bool
        Progress on stderr (off by default; the CLI turns it on).
    class_names : list or None
        Display names, one per class of ``classes_``.
    patience : int or None
        End a round after this many epochs without a better balanced median calibration q (None: every
        epoch, as the paper).
    shard_index : bool
        Under ``mlx.launch`` with more than one rank, split the exact index over the ranks.
    shard_timeout : float
        Seconds a sharded-index collective waits for a dead or hung rank (``docs/distributed.md``).

    Attributes
    ----------
    The fitted state, one attribute per field of :class:`~sdm_mlx.estimator.state.FittedState` (its
    docstring describes each): ``model_``, ``classes_``, ``num_classes_``, ``input_dim_``, ``k_``,
    ``best_round_``, ``rounds_``, ``round_summaries_``, ``history_``, ``exemplar_basis_``, ``support_vectors_``,
    ``support_labels_``, ``support_predictions_``, ``support_ids_``, ``calibration_ids_``,
    ``calibration_logits_``, ``calibration_labels_``, ``calibration_distance_ecdfs_``,
    ``training_distance_ecdfs_``, ``feature_field_``, ``feature_parts_``; and, derived at the current α':
    nested_ : NestedCalibration
        The one store of what α' derives: every level of the grid (Alg. 3 + Cauchy over the stored rounds, each
        level computed once) and the decision policy; set by ``fit``, ``recalibrate`` and ``load``.
    calibration_ : Calibration
        Read-only view: the level of ``nested_`` at α', the test-time calibration.
    robust_min_valid_, offsets_ : float, ndarray
        Read-only views: that level's Cauchy robust minimum valid q~ and per-class offsets.
    admission_ : dict
        Whether any row can be admitted at α', and why not (``calibration/diagnosis.py``).
    resumed_rounds_ : int
        Rounds taken from a checkpoint by the last ``fit``.
    n_features_in_ : int
        The feature width D (scikit-learn's name).
    feedback_state_ : FeedbackState
        The training-support size and the feedback log.
    """

    # Written out, so the names repeat EstimatorConfig's fields (a pair `duplicates` reports, kept on purpose):
    # scikit-learn reads an estimator's parameters from its explicit __init__ signature (get_params, clone), and
    # help() and editors show it; a generated signature would hide the API.  The defaults have one source
    # (EstimatorConfig) and tests/estimator/test_defaults.py checks that both lists hold the same names.
    def __init__(
        self,
        *,
        alpha: float = _D.alpha,
        alpha_grid: list | None = _D.alpha_grid,
        alpha_allow: float | None = _D.alpha_allow,
        alpha_review: float | None = _D.alpha_review,
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
        given = locals()
        for name in self._get_param_names():  # stored as given, validated in fit (scikit-learn)
            setattr(self, name, given[name])

    @classmethod
    def paper(cls, **overrides) -> "SDMEstimator":
        """An estimator with the paper's exact Alg. 1 settings (:data:`sdm_mlx.estimator.config.PAPER_SETTINGS`)."""
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
        return TrainConfig.of(self.get_params())

    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "model_")

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise not_fitted_error("this SDMEstimator is not fitted yet: call fit() or SDMEstimator.load()")

    # -- fit ---------------------------------------------------------------------------------
    def _pooled_data(self, X, y, X_cal, y_cal, *, ids_train, ids_cal, num_classes):
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
        levels = alpha_grid(self.alpha_grid, alpha, C)  # checked before training (DESIGN #25)
        decision_policy(levels, alpha, self.alpha_allow, self.alpha_review)
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

    def fit(self, X, y, X_cal=None, y_cal=None, ids_train=None, ids_cal=None, *, num_classes=None, checkpoint=None,
            callback=None, feature_field=None, feature_parts=None):
        """Train and calibrate (Alg. 1, Alg. 2, Alg. 3, Cauchy) on train (+ calibration) rows; returns self.

        The training and calibration rows are pooled and re-split in half per class for each of
        the J rounds (DESIGN #9), as in the paper.  Labels: any sortable hashable values
        (``classes_`` = the sorted distinct labels), or, with ``num_classes``, class indices 0..C−1.
        ``checkpoint``: a directory where the finished rounds are saved after each round
        (:mod:`sdm_mlx.estimator.checkpoint`); a later ``fit`` with the same settings and data continues from it
        (bit-identical to an uninterrupted fit), with other settings or data it starts over.  The
        checkpoint is left in place: remove it with :func:`sdm_mlx.estimator.checkpoint.remove_checkpoint` once
        the model is saved.  ``callback``: a :class:`sdm_mlx.runtime.callbacks.Callback` receiving progress
        (default: silent, or tqdm progress on stderr with ``verbose=True``).  ``feature_field``: the JSONL field
        the features were read from, kept as the fitted ``feature_field_`` (saved with the model; None: the
        default lookup).  ``feature_parts``: when the features are an LLM's pooled states, the parts they
        concatenate (``"mean,last"``, ``"last"``, ``"max,mean,last"``: :data:`sdm_mlx.llm.pooling.FEATURE_PARTS`),
        kept as ``feature_parts_`` so that verified generation pools its decodings the same way (None: not
        recorded; generation then assumes concat(mean, last), DESIGN #21).

        Eleven parameters, on purpose: scikit-learn's ``fit(X, y)`` with this estimator's calibration split and row
        ids beside them (``X_cal``, ``y_cal``, ``ids_train``, ``ids_cal``) and five optional keywords.
        """
        callback = as_callback(callback, self.verbose)
        if feature_parts is not None:
            from ..llm.pooling import check_feature_parts

            feature_parts = check_feature_parts(feature_parts)
        X, classes, y, ids = self._pooled_data(X, y, X_cal, y_cal, ids_train=ids_train, ids_cal=ids_cal,
                                               num_classes=num_classes)
        C = len(classes)
        alpha = self._check_classes(y, C)
        config = self._train_config()
        config.validate()

        best, best_j, summaries, rounds = self._train_and_calibrate(X, y, ids, C, alpha, config,
                                                                    checkpoint=checkpoint, callback=callback)
        self._set_fitted(FittedState(
            model=best.model, classes=classes, num_classes=C, input_dim=X.shape[1], k=best.k, best_round=best_j,
            rounds=rounds, round_summaries=summaries, history=best.history,
            exemplar_basis=best.basis,  # the basis the support coordinates were computed in
            support_vectors=best.train.h, support_labels=y[best.train_idx], support_predictions=best.train.y_hat,
            support_ids=[ids[i] for i in best.train_idx], calibration_ids=[ids[i] for i in best.cal_idx],
            calibration_logits=np.asarray(best.calibration.z, dtype=np.float32),  # z' of the calibration rows
            calibration_labels=y[best.cal_idx], calibration_distance_ecdfs=best.calibration_distance_ecdfs,
            training_distance_ecdfs=best.train_distance_ecdfs, feature_field=feature_field,
            feature_parts=feature_parts,
        ))
        self._apply_alpha(alpha)
        callback.message(f"fitted: best round {best_j + 1}/{len(rounds)} (epoch {best.best_epoch}), min valid q~ "
                         f"{self.calibration_.min_valid:.3f}, robust min valid q~ {self.robust_min_valid_:.3f}")
        return self

    def _train_and_calibrate(self, X, y, ids, C, alpha, config, *, checkpoint, callback):
        """Alg. 1 rounds with per-round calibration; resumes from and writes ``checkpoint`` if given."""
        rescaler = RescalerSettings(max_epochs=self.rescaler_max_epochs, patience=self.rescaler_patience,
                                    learning_rate=self.rescaler_learning_rate, engine=self.rescaler_engine)
        calibrator = RoundCalibrator(calibrate_round, y, alpha, self.seed, rescaler, callback=callback)
        progress, saver = None, None
        if checkpoint is not None:
            from .checkpoint import Checkpointer, check_checkpoint_path, fingerprint

            check_checkpoint_path(checkpoint)
            # the grid and the decision policy do not change training (DESIGN #25): not part of the fingerprint
            params = {k: v for k, v in self.get_params().items()
                      if k not in ("alpha_grid", "alpha_allow", "alpha_review")}
            fp = fingerprint({**params, "alpha": alpha}, X, y, ids, C)
            saver = Checkpointer(checkpoint, fp, calibrator.rounds, callback)
            progress = saver.resume(config.iterations)
        self.resumed_rounds_ = 0 if progress is None else progress.next_round
        best, best_j, summaries = train_rounds(X, y, C, config, callback, progress, calibrate=calibrator,
                                               save=None if saver is None else saver.save)
        rounds = calibrator.rounds
        for summary, cal in zip(summaries, rounds):
            summary["min_valid_qbin"] = float(cal.min_valid) if math.isfinite(cal.min_valid) else None
        return best, best_j, summaries, rounds

    def _set_fitted(self, state: FittedState) -> None:
        """Take ``state`` as this estimator's fitted state (from ``fit`` or ``load``) and build the index."""
        for name, value in state.attributes().items():
            setattr(self, name, value)
        self.n_features_in_ = state.input_dim
        self.__dict__.pop("_taken", None)
        n_train = state.n_training_support or len(state.support_ids)
        self._feedback = FeedbackState(self.support_ids_, n_train, list(state.feedback_log))
        self._prepare_predict()

    def fitted_state(self) -> FittedState:
        """The fitted state as one object (what :meth:`save` writes); the arrays are shared, not copied."""
        self._check_fitted()
        feedback = self.feedback_state_
        return FittedState(**{name[:-1]: getattr(self, name) for name in FittedState.attribute_names()},
                           n_training_support=feedback.n_training, feedback_log=feedback.log)

    def _prepare_predict(self) -> None:
        """The support index, the batch-invariant forward map and the good-neighbour mask, built once per fit /
        load (so that prediction never changes the estimator's state)."""
        self._index = make_index(self.support_vectors_, self.index_backend, shard=self.shard_index,
                                 shard_timeout=self.shard_timeout)
        self._forward_map = InvariantForward(self.model_, self.exemplar_basis_)
        self._keep_good()

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

    def nested_at(self, alpha: float) -> NestedCalibration:
        """Every level of ``alpha_grid`` (plus α') calibrated from the stored rounds, with the decision policy
        (DESIGN #25); est unchanged.  The levels' Cauchy warnings are not repeated (the admission report has them)."""
        self._check_fitted()
        alpha = validation.alpha(alpha, self.num_classes_)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return self._levels(alpha)

    def _levels(self, alpha: float) -> NestedCalibration:
        """Every level of the grid at the validated α' (Alg. 3 and the Cauchy aggregation once per level)."""
        return NestedCalibration.from_rounds(self.rounds_, self.best_round_, alpha, self.alpha_grid,
                                             allow=self.alpha_allow, review=self.alpha_review)

    # -- the calibration at α': one store (nested_), read-only views of its level at α' ------------------
    @property
    def calibration_(self) -> Calibration:
        """The test-time calibration at the model's α' (Alg. 3 + Cauchy over the stored rounds): the level of
        ``nested_`` at α'."""
        return self.nested_.calibration

    @property
    def robust_min_valid_(self) -> float:
        """The Cauchy robust min valid q~ at the model's α' (of :attr:`calibration_`)."""
        return self.calibration_.robust_min_valid

    @property
    def offsets_(self) -> np.ndarray | None:
        """The Cauchy per-(ŷ, bin) offsets at the model's α' (of :attr:`calibration_`)."""
        return self.calibration_.offsets

    def _apply_alpha(self, alpha: float) -> None:
        """Store the calibration at the validated α' (every level of the grid, each computed once) and the
        admission diagnosis (a warning when nothing can be admitted)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nested = self._levels(alpha)
        self.alpha = nested.alpha
        self.nested_ = nested
        summaries = getattr(self, "round_summaries_", None) or []
        best_summary = summaries[self.best_round_] if len(summaries) > self.best_round_ else {}
        self.admission_ = admission_diagnosis(self.rounds_, self.best_round_, nested.alpha, self.robust_min_valid_,
                                              self.class_names, best_summary.get("projection_movement"))
        shown = set()
        for w in caught:  # the Cauchy warning is part of the diagnosis below; each other warning once
            key = (w.category, str(w.message))
            if not (issubclass(w.category, RuntimeWarning) and "Cauchy" in str(w.message)) and key not in shown:
                shown.add(key)
                warnings.warn(w.message, w.category, stacklevel=3)
        if not self.admission_["can_admit"]:
            warnings.warn(diagnosis_message(self.admission_), RuntimeWarning, stacklevel=3)

    def recalibrate(self, alpha: float | None = None, alpha_grid=None, alpha_allow=None, alpha_review=None):
        """Store a new α' and / or α grid and decision policy in this model (Alg. 3 + Cauchy over the stored
        rounds, no retraining; DESIGN #25); returns self.  None keeps the model's setting; ``"default"``
        returns ``alpha_grid``, ``alpha_allow`` or ``alpha_review`` to its default (the default grid, α',
        the grid's lowest level).

        To estimate at another α' without changing the model, use ``estimate(X, alpha=...)``."""
        self._check_fitted()
        old = (self.alpha_grid, self.alpha_allow, self.alpha_review)
        for name, value in (("alpha_grid", alpha_grid), ("alpha_allow", alpha_allow), ("alpha_review", alpha_review)):
            if isinstance(value, str) and value == RESET:
                setattr(self, name, None)
            elif value is not None:
                setattr(self, name, list(value) if name == "alpha_grid" else value)
        try:
            self._apply_alpha(validation.alpha(self.alpha if alpha is None else alpha, self.num_classes_))
        except Exception:
            self.alpha_grid, self.alpha_allow, self.alpha_review = old
            raise
        return self

    # -- predict -----------------------------------------------------------------------------
    @property
    def index_(self):
        """The support index (exact or HNSW) over the support set's exemplar coordinates."""
        self._check_fitted()
        return self._index

    def _good(self) -> np.ndarray:
        """[C, N_support] bool: support j counts towards q of class c iff label_j == pred_j == c.  The mask kept
        by :meth:`_keep_good` while the support arrays are the same objects (fit, load and feedback replace
        them, never change them in place); else computed (prediction does not change the estimator)."""
        labels, predictions, C = self.support_labels_, self.support_predictions_, self.num_classes_
        kept = self.__dict__.get("_good_mask")
        if kept is not None and kept[0] is labels and kept[1] is predictions and kept[2] == C:
            return kept[3]
        return good_neighbours_by_class(labels, predictions, C)

    def _keep_good(self) -> None:
        """Keep :meth:`_good`'s mask (read-only) for the current support arrays: rebuilt per call it cost a
        single-row prediction ~15 µs; called where the support set is set (fit, load, feedback)."""
        labels, predictions, C = self.support_labels_, self.support_predictions_, self.num_classes_
        good = good_neighbours_by_class(labels, predictions, C)
        good.flags.writeable = False
        self._good_mask = (labels, predictions, C, good)

    def _features(self, X) -> np.ndarray:
        """User features validated against the model: finite float32 [N, input_dim_] (the one check of X on
        the way in; everything after it takes the checked array)."""
        self._check_fitted()
        return validation.features(X, "features", dim=self.input_dim_, model=type(self).__name__)

    def _forward(self, X):
        """(z', exemplar coordinates) per row of user features, batch-invariant
        (:class:`~sdm_mlx.core.adaptor.InvariantForward`)."""
        return self._forward_map(self._features(X))

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

    def _scores(self, X: np.ndarray, n_exemplars: int):
        """(z', q, d0, d, SDM output, exemplar distances, exemplar indices) per row of checked features; the
        arrays made from them (h', ŷ, the good-neighbour mask, q, d) are not checked again downstream."""
        z, h = self._forward_map(X)  # float32 [N, C], [N, min(D, M)]
        y_hat = z.argmax(axis=1)  # int64 [N]
        q, d0, ex_d, ex_i = self.index_.similarity_and_neighbours(h, y_hat, self._good(), self.k_, n_exemplars,
                                                                  check_input=False)
        d = distance_quantile(d0, self.calibration_distance_ecdfs_)
        return z, q, d0, d, sdm_numpy(z, q, d), ex_d, ex_i

    def predict(self, X) -> np.ndarray:
        """Class labels ŷ = argmax z' [N], in the label space ``fit`` was given (``classes_``)."""
        self._check_fitted()
        return self.classes_[self.logits(X).argmax(axis=1)]

    def predict_selective(self, X, alpha: float | None = None) -> np.ndarray:
        """Class labels where admitted, ``None`` where rejected (⊥) [N] (object array): what
        :func:`sdm_mlx.evaluation.selective.selective_score` scores (``make_scorer(..., response_method=("predict_selective",))``)."""
        est = self.estimate(X, n_exemplars=0, alpha=alpha)
        labels = np.asarray(self.classes_, dtype=object)[np.asarray(est.prediction)]
        return np.where(np.asarray(est.admitted, dtype=bool), labels, None)

    def predict_proba(self, X) -> np.ndarray:
        """The SDM activation output sdm(z', q, d) [N, C] (rows sum to 1), columns in ``classes_`` order."""
        return self._scores(self._features(X), 0)[4]

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
        :data:`~sdm_mlx.estimator.chunking.PREDICT_CHUNK_ROWS` rows are scored chunk by chunk (bounded working
        memory, the same answers: :mod:`sdm_mlx.estimator.chunking`); ``progress`` draws a bar on stderr.
        """
        self._check_fitted()
        n = X.shape[0] if hasattr(X, "shape") and len(X.shape) else None
        if n is None or n <= PREDICT_CHUNK_ROWS:
            return self._estimate_checked(self._features(X), ids, n_exemplars=n_exemplars, alpha=alpha)
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
        cal = self.nested_ if alpha is None else self.nested_at(alpha)

        def score(rows, row_ids):
            return self._estimate_checked(self._features(rows), row_ids, n_exemplars=n_exemplars, alpha=cal)

        return iter_estimates(score, X, ids, chunk_rows, progress)

    def _estimate_checked(self, X: np.ndarray, ids=None, *, n_exemplars: int | None = None,
                         alpha=None) -> Predictions:
        """:meth:`estimate` of one batch of features that were validated already, neither checked nor chunked
        again: the entry of callers that validated at their own boundary.

        ``X``: finite float32 [N, ``input_dim_``], as :func:`sdm_mlx.validation.features` returns it or the
        JSONL reader (:func:`~sdm_mlx.storage.datasets.parse_rows`, then
        :func:`~sdm_mlx.storage.datasets.check_model_width`) reads it; the caller owns the chunk loop
        (:func:`sdm_mlx.estimator.chunking.estimate_read_chunks`).  ``alpha``: None, an α' or a
        :class:`~sdm_mlx.calibration.NestedCalibration`.  User input goes through :meth:`estimate`."""
        self._check_fitted()
        n_ex = self.n_exemplars if n_exemplars is None else int(n_exemplars)
        z, q, d0, d, s, ex_d, ex_i = self._scores(X, n_ex)
        n = z.shape[0]
        ids = list(ids) if ids is not None else list(range(n))
        if len(ids) != n:
            raise InputError(f"got {len(ids)} ids for {n} rows")
        if isinstance(alpha, NestedCalibration):
            cal = alpha
        else:
            cal = self.nested_ if alpha is None else self.nested_at(alpha)
        return Predictions(
            ids=ids, logits=z, q=q, d0=d0, d=d, sdm=s, estimate=estimate_nested(cal, z, q, d, s, check_input=False),
            exemplar_index=ex_i, exemplar_distance=ex_d, support_ids=self.support_ids_,
            support_labels=self.support_labels_, support_predictions=self.support_predictions_,
            class_names=self.class_names,
        )

    def keep_documents(self, ids, documents) -> int:
        """Keep the texts of the support rows among ``ids`` (None: no text), to show exemplars with their
        document (``sdm-mlx predict --html``); saved with the model.  Returns how many were kept."""
        if len(ids) != len(documents):
            raise InputError(f"got {len(documents)} documents for {len(ids)} ids")
        self._check_fitted()
        support = {id_key(i) for i in self.support_ids_}
        kept = {id_key(i): str(d) for i, d in zip(ids, documents) if d is not None and id_key(i) in support}
        self.support_documents_ = {**getattr(self, "support_documents_", {}), **kept}
        return len(kept)

    def exemplar_document(self, support_id):
        """The kept document text of a support row (None: not kept)."""
        return getattr(self, "support_documents_", {}).get(id_key(support_id))

    # -- feedback: support-set updates (sdm_mlx.estimator.feedback) -------------------------------------
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
        calibration split, which feedback does not change (see :mod:`sdm_mlx.estimator.feedback`).

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
        z, h = self._forward_map(X)
        pred = z.argmax(axis=1).astype(np.int64)
        if self._index is not None:
            self._index.append(h)
        self.support_vectors_ = np.concatenate([self.support_vectors_, h.astype(self.support_vectors_.dtype)])
        self.support_labels_ = np.concatenate([self.support_labels_, y])
        self.support_predictions_ = np.concatenate([self.support_predictions_, pred])
        self.support_ids_ = self.support_ids_ + ids
        self._keep_good()
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
        self._keep_good()
        state.support_ids = self.support_ids_
        self.__dict__.pop("_taken", None)
        entries = log_entries("remove", *map(list, zip(*removed)), source)
        state.log.extend(entries)
        return entries

    # -- persistence (sdm_mlx/estimator/persistence.py) ----------------------------------------
    def save(self, path, overwrite: bool = False) -> None:
        """Write a versioned safetensors + JSON artifact directory atomically.

        An existing artifact at ``path`` is replaced only with ``overwrite=True``; any other existing
        non-empty directory (or a file) is refused with :class:`~sdm_mlx.errors.ArtifactError` and left untouched.
        Fitted under ``mlx.launch`` with a sharded index, rank 0 alone writes (the other ranks return)."""
        self._check_fitted()
        if getattr(self._index, "group", None) is not None and self._index.group.rank() != 0:
            return  # sharded under mlx.launch: rank 0 alone writes the artifact (docs/distributed.md)
        # saving back over the version it was loaded from: refused if another writer replaced it meanwhile
        origin = getattr(self, "_artifact_origin", None)
        real = os.path.realpath(os.fspath(path))
        expected = origin[1] if overwrite and origin is not None and origin[0] == real else None
        digest = save_state(path, self.fitted_state(), self.get_params(), self.robust_min_valid_,
                            overwrite=overwrite, expected_digest=expected)
        self._artifact_origin = (real, digest)

    @classmethod
    def load(cls, path, shard_index: bool | None = None) -> "SDMEstimator":
        """Load an artifact written by :meth:`save` (verifies format version and checksums).

        ``shard_index`` overrides the stored setting (under ``mlx.launch``: split the exact index over the
        ranks or not); None keeps the model's."""
        params, state, digest = load_state(path)
        try:
            est = cls(**params)
        except TypeError as e:
            raise ArtifactError(f"{path}: artifact content is incomplete or inconsistent ({e!r})") from None
        if shard_index is not None:
            est.shard_index = bool(shard_index)
        est._set_fitted(state)
        est._apply_alpha(validation.alpha(est.alpha, est.num_classes_))
        est._artifact_origin = (os.path.realpath(os.fspath(path)), digest)
        return est


def _same(a, b) -> bool:
    """Equal parameter values for ``__repr__`` (arrays and lists compared by value)."""
    try:
        return bool(np.all(a == b)) and type(a) is type(b)
    except Exception:
        return False
