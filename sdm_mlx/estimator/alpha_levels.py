"""The calibration of :class:`~sdm_mlx.estimator.sdm_estimator.SDMEstimator` at α' and at the other levels of its
grid (Alg. 3 + the Cauchy aggregation over the stored rounds, DESIGN #25): the read-only views of ``nested_`` at α',
the re-thresholded calibrations, and ``recalibrate``.  A mixin: ``nested_`` has one owner, the estimator's
``_apply_alpha``, which stores it."""

from __future__ import annotations

import warnings

import numpy as np

from .. import validation
from ..calibration import Calibration, NestedCalibration

#: ``recalibrate``'s value that returns a grid or policy setting to its default (None keeps the model's)
RESET = "default"


class AlphaLevels:
    """α' and the grid's levels of a fitted estimator (``rounds_``, ``best_round_``, ``nested_``)."""

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
