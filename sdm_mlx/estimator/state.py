"""What a fitted :class:`~sdm_mlx.estimator.SDMEstimator` knows, in one place: :class:`FittedState`.

``fit`` builds one, :mod:`.persistence` writes one and reads one back as data, and the estimator exposes each
field as the scikit-learn style fitted attribute ``<field>_`` (``support_vectors`` → ``support_vectors_``).
A new piece of fitted state is added here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np


@dataclass
class FittedState:
    """The fitted state of an SDM estimator (the best round's support set and adaptor, and all J rounds).

    Attributes
    ----------
    model : ExemplarAdaptor
        The best round's exemplar adaptor (z' and h'; DESIGN #3, :class:`~sdm_mlx.core.adaptor.ExemplarAdaptor`).
    classes : ndarray
        The class labels, sorted; predictions are indices into it.
    num_classes, input_dim, k, best_round : int
        C, the feature width D, the q cap k of Alg. 1 and the index of the best of the J rounds.
    rounds : list of RoundCalibration
        Every round's calibration (Alg. 2, Alg. 3 inputs), re-thresholded by ``calibration_at``.
    round_summaries, history : list of dict
        Per-round summaries and the best round's per-epoch history.
    exemplar_basis : ndarray
        The basis the support coordinates were computed in (reproduces them bit for bit).
    support_vectors, support_labels, support_predictions : ndarray
        The support set: exemplar vectors h' [N, min(M, D)], labels and predictions ŷ [N].
    support_ids, calibration_ids : list
        Row ids of the support set and of the best round's calibration half.
    calibration_logits, calibration_labels : ndarray or None
        z' and labels of the calibration rows (None in artifacts written before they were stored).
    calibration_distance_ecdfs, training_distance_ecdfs : list of ndarray
        Per-class eCDFs of the distance d (``equation:d``).
    feature_field : str or None
        The JSONL field the features were read from (None: the default, "auto" lookup).
    feature_parts : tuple of str or None
        The pooled parts of an LLM's states the features concatenate (:data:`sdm_mlx.llm.pooling.FEATURE_PARTS`
        order); None: not recorded (artifacts written before it, or features that are not LLM states).
    support_documents : dict
        ``{id key: document text}`` of support rows whose document was kept (shown with the exemplars).
    n_training_support : int or None
        Support rows that came from training (the rest were added as feedback); None: all of them.
    feedback_log : list of dict
        The feedback log (added and removed support rows).
    """

    model: object
    classes: np.ndarray
    num_classes: int
    input_dim: int
    k: int
    best_round: int
    rounds: list
    round_summaries: list
    history: list
    exemplar_basis: np.ndarray
    support_vectors: np.ndarray
    support_labels: np.ndarray
    support_predictions: np.ndarray
    support_ids: list
    calibration_ids: list
    calibration_logits: np.ndarray | None
    calibration_labels: np.ndarray | None
    calibration_distance_ecdfs: list
    training_distance_ecdfs: list
    feature_field: str | None = None
    feature_parts: tuple | None = None
    support_documents: dict = field(default_factory=dict)
    n_training_support: int | None = None
    feedback_log: list = field(default_factory=list)

    #: fields that are not fitted attributes of the estimator (its feedback state holds them)
    FEEDBACK = ("n_training_support", "feedback_log")

    def attributes(self) -> dict:
        """``{"<field>_": value}`` for every fitted attribute the estimator exposes."""
        return {f"{f.name}_": getattr(self, f.name) for f in fields(self) if f.name not in self.FEEDBACK}

    @classmethod
    def attribute_names(cls) -> list[str]:
        return [f"{f.name}_" for f in fields(cls) if f.name not in cls.FEEDBACK]
