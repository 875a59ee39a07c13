"""The base class of the baseline selective classifiers and the input helpers they share (see
:mod:`sdm_mlx.evaluation.baselines` for the contract: ``fit(z_cal, y_cal, alpha)``, ``predict(z)``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax, softmax

from ..validation import label_indices, level
from ..errors import InputError


def _logits(z, name: str = "z") -> np.ndarray:
    arr = np.asarray(z, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] < 1:
        raise InputError(f"{name} must be [N, C], got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise InputError(f"{name} contains non-finite values")
    return arr


def _label_array(y, n: int, num_classes: int) -> np.ndarray:
    return label_indices(y, "y", num_classes, n)


def _check_alpha(alpha) -> float:
    return level(alpha, one=True)


def _sorted_probs(probs: np.ndarray, keys: np.ndarray | None = None):
    """Descending order of ``keys`` (default: the probabilities; ties -> lowest index), the
    probabilities in that order and their cumsum.  Passing the logits as ``keys`` keeps the
    rank-1 label equal to ``argmax z`` even where softmax rounds two classes to one value."""
    order = np.argsort(-(probs if keys is None else keys), axis=1, kind="stable")
    ordered = np.take_along_axis(probs, order, axis=1)
    return order, ordered, np.cumsum(ordered, axis=1)


def _rank_penalties(num_classes: int, lam: float, k_reg: int) -> np.ndarray:
    """λ·(o - k_reg)^+ for ranks o = 1..C (RAPS regularisation)."""
    ranks = np.arange(1, num_classes + 1, dtype=np.float64)
    return lam * np.maximum(ranks - k_reg, 0.0)


class Baseline:
    """Common interface: ``fit(z_cal, y_cal, alpha)`` then ``predict(z)``."""

    #: registry name
    name = "baseline"

    def __init__(self) -> None:
        self.alpha: float | None = None
        self.num_classes: int | None = None

    # -- interface -----------------------------------------------------------
    def fit(self, z_cal, y_cal, alpha: float) -> "Baseline":
        z = _logits(z_cal, "z_cal")
        y = _label_array(y_cal, z.shape[0], z.shape[1])
        self.alpha = _check_alpha(alpha)
        self.num_classes = int(z.shape[1])
        self._fit(z, y)
        return self

    def predict(self, z) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return ``(y_pred [N] int64, admitted [N] bool, score [N] float64)``."""
        if self.alpha is None:
            raise RuntimeError(f"{type(self).__name__} must be fit before predict")
        z = _logits(z)
        if z.shape[1] != self.num_classes:
            raise InputError(f"expected {self.num_classes} classes, got {z.shape[1]}")
        probs = self.probabilities(z)
        y_pred = np.argmax(z, axis=1).astype(np.int64)
        score = probs[np.arange(z.shape[0]), y_pred]
        return y_pred, self._admit(z, probs, score), score

    def probabilities(self, z) -> np.ndarray:
        """The probability estimate [N, C] the baseline is built on (softmax by default)."""
        return softmax(_logits(z), axis=1)

    def get_params(self) -> dict[str, Any]:
        """JSON-serialisable fitted state and settings."""
        return {"name": self.name, "alpha": self.alpha, "num_classes": self.num_classes}

    # -- hooks ---------------------------------------------------------------
    def _fit(self, z: np.ndarray, y: np.ndarray) -> None:
        pass

    def _admit(self, z: np.ndarray, probs: np.ndarray, score: np.ndarray) -> np.ndarray:
        raise NotImplementedError

def fit_temperature(z_cal, y_cal, *, bounds: tuple[float, float] = (1e-3, 1e3),
                    xatol: float = 1e-7) -> float:
    """Temperature T > 0 minimising the mean NLL  -(1/n) Σ log softmax(z_i / T)_{y_i}
    (Guo et al. 2017, §4.2), by bounded Brent minimisation over log T in ``log(bounds)``.

    The NLL is convex in 1/T, hence unimodal in log T, so the bounded scalar search finds the
    global minimum inside the bounds; if the calibration set is perfectly separated the
    optimum is T → 0 and a small T (where the float64 NLL is already 0, not necessarily the
    lower bound) is returned.
    """
    z = _logits(z_cal, "z_cal")
    y = _label_array(y_cal, z.shape[0], z.shape[1])
    if z.shape[0] == 0:
        raise InputError("empty calibration set")
    lo, hi = (float(b) for b in bounds)
    if not 0.0 < lo < hi:
        raise InputError(f"bounds must satisfy 0 < lo < hi, got {bounds}")
    rows = np.arange(z.shape[0])

    def nll(log_t: float) -> float:
        return float(-log_softmax(z * math.exp(-log_t), axis=1)[rows, y].mean())

    res = minimize_scalar(nll, bounds=(math.log(lo), math.log(hi)), method="bounded",
                          options={"xatol": xatol})
    return float(math.exp(res.x))
