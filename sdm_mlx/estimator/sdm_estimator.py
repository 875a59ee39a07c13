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

It is the one class users hold -- parameters, fit, estimate, recalibration, feedback and save/load -- and each of
those delegates the work to its own module (:mod:`.training`, :mod:`.chunking`, :mod:`.persistence`,
:mod:`sdm_mlx.calibration`).  Its public methods are all on the class; three groups come from bases in sibling
modules, as scikit-learn's ``BaseEstimator`` gives its parameters: :mod:`.params` (the parameter protocol),
:mod:`.alpha_levels` (the calibration at α' and the grid's levels, ``recalibrate``) and :mod:`.support` (feedback
edits of the support set, kept documents).  :mod:`.fitting` checks ``fit``'s rows and classes and runs its rounds.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from ..core.adaptor import InvariantForward
from .. import validation
from ..calibration import NestedCalibration, estimate_nested
from .chunking import PREDICT_CHUNK_ROWS, concat_predictions, iter_estimates
from .config import EstimatorConfig
from .config import PAPER_SETTINGS
from ..calibration.diagnosis import admission_diagnosis, diagnosis_message
from ..errors import ArtifactError, InputError, NotFittedError, not_fitted_error  # noqa: F401 (re-exported)
from .persistence import load_state, save_state
from .state import FittedState
from .alpha_levels import RESET, AlphaLevels  # noqa: F401 (RESET: re-exported)
from .feedback import FeedbackState
from .fitting import check_classes, pooled_data, train_and_calibrate
from .params import ParamsMixin
from .support import SupportEdits
from ..core.distance import distance_quantile
from ..index import make_index
from ..runtime.callbacks import as_callback
from ..results import Predictions
from .training import TrainConfig
from ..core.activation import sdm_numpy

_D = EstimatorConfig()  #: the defaults (one place: sdm_mlx/estimator/config.py)


# ---------------------------------------------------------------------------------------------
# the estimator
# ---------------------------------------------------------------------------------------------
class SDMEstimator(ParamsMixin, AlphaLevels, SupportEdits):
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
    # scikit-learn's get_params/clone read this signature: one keyword per parameter, defaults from _D (one source)
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

    def _train_config(self) -> TrainConfig:
        return TrainConfig.of(self.get_params())

    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "model_")

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise not_fitted_error("this SDMEstimator is not fitted yet: call fit() or SDMEstimator.load()")

    # -- fit ---------------------------------------------------------------------------------
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
        default lookup).  ``feature_parts``: the pooled parts of an LLM's states the features concatenate
        (``"last"``, ``"mean,last"``, ...), kept as ``feature_parts_`` for verified generation (DESIGN #21).

        Eleven parameters, on purpose: scikit-learn's ``fit(X, y)`` with this estimator's calibration split and row
        ids beside them (``X_cal``, ``y_cal``, ``ids_train``, ``ids_cal``) and five optional keywords.
        """
        callback = as_callback(callback, self.verbose)
        if feature_parts is not None:
            from ..llm.pooling import check_feature_parts
            feature_parts = check_feature_parts(feature_parts)
        rows = pooled_data(X, y, X_cal, y_cal, ids_train=ids_train, ids_cal=ids_cal, num_classes=num_classes)
        X, classes, y, ids = rows
        C = len(classes)
        alpha = check_classes(self, y, C)
        config = self._train_config()
        config.validate()

        best, best_j, summaries, rounds = train_and_calibrate(self, rows, alpha, config, checkpoint=checkpoint,
                                                              callback=callback)
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

    # -- predict -----------------------------------------------------------------------------
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

