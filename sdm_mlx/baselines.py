"""Baseline selective classifiers over the same adaptor logits ``z [N, C]`` as the SDM
estimator (paper: Experiments: Classification, "Estimators").

Every baseline exposes ``fit(z_cal, y_cal, alpha) -> self`` (fitted on calibration
logits + labels) and ``predict(z) -> (y_pred, admitted, score)``:

* ``y_pred [N] int64`` -- ``argmax z`` (ties -> lowest index); no baseline changes the
  argmax (a temperature T > 0 preserves it and a conformal singleton is {argmax});
* ``admitted [N] bool`` -- the baseline's admission (non-rejection) decision at α';
* ``score [N] float64`` -- the baseline's probability for ŷ: ``max softmax(z)`` for
  :class:`NoReject`, :class:`SoftmaxThreshold`, :class:`APS` and :class:`RAPS` (unless
  they were built with ``temperature_scale=True``), ``max softmax(z / T)`` for
  :class:`TemperatureScaling`.  For the conformal baselines the admission decision is
  the prediction-set size, available from ``predict_sets``.

===================  ==================================================================
``no_reject``        admit every row (the raw accuracies; paper's NoReject)
``softmax``          admit iff max softmax(z) >= α'  (τ = 1)
``temperature``      Guo et al. 2017: T > 0 minimising the calibration NLL of softmax(z/T);
                     admit iff max softmax(z/T) >= α'
``aps``              Romano, Sesia & Candès 2020 (APS), target coverage α' (miscoverage
                     ε = 1 - α'); admit iff the prediction set is a singleton
``raps``             Angelopoulos, Bates, Malik & Jordan 2021 (RAPS), APS plus the rank
                     penalty λ·(o - k_reg)^+; admit iff the prediction set is a singleton
===================  ==================================================================

Conformal notation (RAPS paper, §2 / Algorithms 1-2; APS is the case λ = 0).  For a row
with probabilities π̂ (softmax of the logits) sorted in descending order (ties by lowest
index) and a label y:

* o(y)  -- rank of y (1-based);
* ρ(y)  -- Σ of π̂ over labels ranked before y (strictly more probable);
* generalised conformity score  E(x, y, u) = ρ(y) + u·π̂(y) + λ·(o(y) - k_reg)^+
  (Romano et al. Eq. (7)-style generalised inverse quantile score, RAPS §2 with the
  regularisation term); u = 1 for the non-randomised version, u ~ U(0, 1) otherwise.
* Calibration (RAPS Algorithm 1): E_i = E(x_i, y_i, u_i) on the n calibration rows and
  τ̂ = the ⌈(n+1)(1-ε)⌉-th smallest E_i, i.e. the empirical quantile at level
  ⌈(n+1)(1-ε)⌉/n, with 1 - ε = α'.  If ⌈(n+1)(1-ε)⌉ > n, τ̂ = +∞ and every set is the
  full label set (nothing is admitted).
* Prediction set (RAPS Algorithm 2):
  L = min(C, |{j : E(x, I_j, 1) ≤ τ̂}| + 1), the set is the L most probable labels.
  Randomised: with V = (τ̂ - ρ(I_L) - λ(L - k_reg)^+) / π̂(I_L), drop I_L when U > V
  (i.e. the set is exactly {y : E(x, y, U) ≤ τ̂}); an empty set is replaced by
  {argmax} unless ``allow_zero_sets=True`` (as in the RAPS reference implementation).
  Non-randomised (the default here): no drop, so L ≥ 1 always and, with k_reg ≥ 1, the
  set is a singleton iff π̂_max > τ̂.  For APS this is Romano et al.'s deterministic set
  (the first labels until the cumulative mass reaches τ̂) up to ties at exactly τ̂.

Defaults (documented choices; the paper's experiment used the RAPS reference code, which
randomises, Platt-scales the probabilities first and tunes k_reg / λ on a 30% split):
``randomized=False`` (a ``seed`` drives the U draws when ``randomized=True``),
``temperature_scale=False`` (plain softmax of the given logits), RAPS ``lam=0.01`` and
``k_reg=1`` (penalise every rank after the first).

All computation is host-side float64 NumPy (these are O(N·C log C) post-processing steps).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax, softmax

from .metrics import index_conditional_report
from .validation import label_indices, level

__all__ = [
    "Baseline",
    "NoReject",
    "SoftmaxThreshold",
    "TemperatureScaling",
    "APS",
    "RAPS",
    "BASELINES",
    "make_baseline",
    "fit_temperature",
    "conformal_quantile",
    "conformal_scores",
    "prediction_set_sizes",
    "run_baselines",
]


# --------------------------------------------------------------------------- helpers


def _logits(z, name: str = "z") -> np.ndarray:
    arr = np.asarray(z, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] < 1:
        raise ValueError(f"{name} must be [N, C], got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite values")
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


# --------------------------------------------------------------------------- base


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
            raise ValueError(f"expected {self.num_classes} classes, got {z.shape[1]}")
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


class NoReject(Baseline):
    """No selective filtering: predict argmax z and admit every row (paper: NoReject)."""

    name = "no_reject"

    def _admit(self, z, probs, score):
        return np.ones(z.shape[0], dtype=bool)


class SoftmaxThreshold(Baseline):
    """Admit iff ``max softmax(z) >= alpha`` (temperature τ = 1; paper: Softmax)."""

    name = "softmax"

    def _admit(self, z, probs, score):
        return score >= self.alpha


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
        raise ValueError("empty calibration set")
    lo, hi = (float(b) for b in bounds)
    if not 0.0 < lo < hi:
        raise ValueError(f"bounds must satisfy 0 < lo < hi, got {bounds}")
    rows = np.arange(z.shape[0])

    def nll(log_t: float) -> float:
        return float(-log_softmax(z * math.exp(-log_t), axis=1)[rows, y].mean())

    res = minimize_scalar(nll, bounds=(math.log(lo), math.log(hi)), method="bounded",
                          options={"xatol": xatol})
    return float(math.exp(res.x))


class TemperatureScaling(Baseline):
    """Temperature scaling (Guo et al. 2017): one parameter T > 0 fitted by NLL on the
    calibration set (:func:`fit_temperature`); admit iff ``max softmax(z / T) >= alpha``."""

    name = "temperature"

    def __init__(self, bounds: tuple[float, float] = (1e-3, 1e3)) -> None:
        super().__init__()
        self.bounds = (float(bounds[0]), float(bounds[1]))
        self.temperature: float | None = None

    def _fit(self, z, y):
        self.temperature = fit_temperature(z, y, bounds=self.bounds)

    def probabilities(self, z) -> np.ndarray:
        if self.temperature is None:
            raise RuntimeError("TemperatureScaling must be fit before use")
        return softmax(_logits(z) / self.temperature, axis=1)

    def _admit(self, z, probs, score):
        return score >= self.alpha

    def get_params(self):
        return {**super().get_params(), "temperature": self.temperature, "bounds": list(self.bounds)}


# --------------------------------------------------------------------------- conformal


def conformal_quantile(scores, coverage: float) -> float:
    """The ⌈(n+1)·coverage⌉-th smallest of the n calibration scores (split-conformal
    quantile at level ⌈(n+1)(1-ε)⌉/n with coverage = 1 - ε); ``+inf`` if that rank
    exceeds n.  The rank is exact: coverage is read as the decimal it prints as (``str``), so
    (19+1)·0.95 is 19, not 19.000000000000004 → 20."""
    s = np.sort(np.asarray(scores, dtype=np.float64).reshape(-1))
    n = s.size
    if n == 0:
        raise ValueError("empty calibration set")
    k = math.ceil((n + 1) * Fraction(str(float(coverage))))
    if k > n:
        return math.inf
    return float(s[max(k, 1) - 1])


def conformal_scores(probs, y, *, lam: float = 0.0, k_reg: int = 1, u=None,
                     keys=None) -> np.ndarray:
    """Generalised conformity scores E(x_i, y_i, u_i) = ρ(y_i) + u_i·π̂(y_i) + λ·(o(y_i) - k_reg)^+
    (Romano et al. 2020 APS score; RAPS 2021 §2 adds the penalty).  ``u=None`` means u = 1
    (non-randomised); otherwise ``u`` is an [N] array in [0, 1].  ``keys`` (e.g. the logits)
    overrides the values that define the ranking (default: ``probs``)."""
    p = np.asarray(probs, dtype=np.float64)
    n, num_classes = p.shape
    y = _label_array(y, n, num_classes)
    order, ordered, cumsum = _sorted_probs(p, None if keys is None else np.asarray(keys))
    rank0 = np.argmax(order == y[:, None], axis=1)  # 0-based rank of the true label
    rows = np.arange(n)
    p_y = ordered[rows, rank0]
    rho = cumsum[rows, rank0] - p_y
    uu = np.ones(n) if u is None else np.asarray(u, dtype=np.float64).reshape(n)
    return rho + uu * p_y + _rank_penalties(num_classes, lam, k_reg)[rank0]


def prediction_set_sizes(probs, tau: float, *, lam: float = 0.0, k_reg: int = 1, u=None,
                         allow_zero_sets: bool = False,
                         keys=None) -> tuple[np.ndarray, np.ndarray]:
    """RAPS Algorithm 2 set sizes for threshold ``tau``.

    Returns ``(sizes [N] int64, order [N, C])``: the set of row i is ``order[i, :sizes[i]]``.
    Non-randomised (``u=None``): L = min(C, |{j : E(x, I_j, 1) ≤ τ}| + 1).  Randomised:
    I_L is dropped when u > V = (τ - ρ(I_L) - λ(L - k_reg)^+) / π̂(I_L); a resulting empty
    set becomes {argmax} unless ``allow_zero_sets``.  ``keys`` as in :func:`conformal_scores`.
    """
    p = np.asarray(probs, dtype=np.float64)
    n, num_classes = p.shape
    order, ordered, cumsum = _sorted_probs(p, None if keys is None else np.asarray(keys))
    if math.isinf(tau) and tau > 0:
        return np.full(n, num_classes, dtype=np.int64), order
    pen = _rank_penalties(num_classes, lam, k_reg)
    e_full = cumsum + pen[None, :]
    sizes = np.minimum((e_full <= tau).sum(axis=1) + 1, num_classes).astype(np.int64)
    if u is not None:
        uu = np.asarray(u, dtype=np.float64).reshape(n)
        rows = np.arange(n)
        last = sizes - 1
        p_last = ordered[rows, last]
        rho_last = cumsum[rows, last] - p_last
        with np.errstate(divide="ignore", invalid="ignore"):
            v = (tau - rho_last - pen[last]) / p_last
        v = np.where(p_last > 0, v, np.inf)
        sizes = sizes - (uu > v).astype(np.int64)
        if not allow_zero_sets:
            sizes = np.maximum(sizes, 1)
    return sizes, order


class APS(Baseline):
    """Adaptive Prediction Sets (Romano, Sesia & Candès 2020) at coverage α' (miscoverage
    1 - α'); a row is admitted iff its prediction set is a singleton (then = {argmax}).

    Args:
        randomized: use u ~ U(0, 1) in calibration scores and set construction (RAPS
            Algorithms 1-2 with ``rand=True``); default False (deterministic sets).
        seed: seed of the NumPy generator for the U draws (randomised only); the generator
            is re-created at ``fit`` and advanced by each ``predict``.
        allow_zero_sets: randomised only; keep empty sets (never admitted) instead of
            replacing them by {argmax}.
        temperature_scale: first fit a temperature on the calibration set (as the RAPS
            paper/reference code do) and build sets on softmax(z / T); default False.

    Fitted attributes: ``tau`` (τ̂, possibly ``inf``), ``n_calibration``, ``temperature``.
    """

    name = "aps"

    def __init__(self, *, randomized: bool = False, seed: int | None = 0,
                 allow_zero_sets: bool = False, temperature_scale: bool = False) -> None:
        super().__init__()
        self.randomized = bool(randomized)
        self.seed = seed
        self.allow_zero_sets = bool(allow_zero_sets)
        self.temperature_scale = bool(temperature_scale)
        self.lam = 0.0
        self.k_reg = 1
        self.tau: float | None = None
        self.n_calibration: int | None = None
        self.temperature = 1.0
        self._rng = np.random.default_rng(seed)

    def _fit(self, z, y):
        if z.shape[0] == 0:
            raise ValueError("empty calibration set")
        self._rng = np.random.default_rng(self.seed)
        self.temperature = fit_temperature(z, y) if self.temperature_scale else 1.0
        probs = softmax(z / self.temperature, axis=1)
        u = self._rng.uniform(size=z.shape[0]) if self.randomized else None
        e = conformal_scores(probs, y, lam=self.lam, k_reg=self.k_reg, u=u, keys=z)
        self.tau = conformal_quantile(e, self.alpha)
        self.n_calibration = int(z.shape[0])

    def probabilities(self, z) -> np.ndarray:
        return softmax(_logits(z) / self.temperature, axis=1)

    def set_sizes(self, z) -> np.ndarray:
        """Prediction-set sizes [N] int64."""
        sizes, _ = self._sets(_logits(z))
        return sizes

    def predict_sets(self, z) -> np.ndarray:
        """Prediction sets as a bool mask [N, C] (consumes U draws when randomised)."""
        z = _logits(z)
        sizes, order = self._sets(z)
        mask = np.zeros(z.shape, dtype=bool)
        ranks = np.arange(z.shape[1])[None, :]
        np.put_along_axis(mask, order, ranks < sizes[:, None], axis=1)
        return mask

    def _sets(self, z):
        if self.tau is None:
            raise RuntimeError(f"{type(self).__name__} must be fit before predict")
        if z.shape[1] != self.num_classes:
            raise ValueError(f"expected {self.num_classes} classes, got {z.shape[1]}")
        probs = self.probabilities(z)
        u = self._rng.uniform(size=z.shape[0]) if self.randomized else None
        return prediction_set_sizes(probs, self.tau, lam=self.lam, k_reg=self.k_reg, u=u,
                                    allow_zero_sets=self.allow_zero_sets, keys=z)

    def _admit(self, z, probs, score):
        sizes, _ = self._sets(z)
        return sizes == 1

    def get_params(self):
        tau = self.tau
        return {**super().get_params(), "tau": None if tau is None or math.isinf(tau) else tau,
                "tau_is_infinite": bool(tau is not None and math.isinf(tau)),
                "n_calibration": self.n_calibration, "lam": self.lam, "k_reg": self.k_reg,
                "randomized": self.randomized, "seed": self.seed,
                "allow_zero_sets": self.allow_zero_sets,
                "temperature_scale": self.temperature_scale, "temperature": self.temperature}


class RAPS(APS):
    """Regularised Adaptive Prediction Sets (Angelopoulos, Bates, Malik & Jordan 2021): APS
    with the rank penalty λ·(o(y) - k_reg)^+ added to the conformity score; admitted iff the
    prediction set is a singleton.  Defaults ``lam=0.01``, ``k_reg=1`` (fixed, not tuned);
    other arguments as :class:`APS`.  ``lam=0`` reproduces APS exactly."""

    name = "raps"

    def __init__(self, *, lam: float = 0.01, k_reg: int = 1, randomized: bool = False,
                 seed: int | None = 0, allow_zero_sets: bool = False,
                 temperature_scale: bool = False) -> None:
        super().__init__(randomized=randomized, seed=seed, allow_zero_sets=allow_zero_sets,
                         temperature_scale=temperature_scale)
        if lam < 0:
            raise ValueError("lam must be >= 0")
        if int(k_reg) < 0:
            raise ValueError("k_reg must be >= 0")
        self.lam = float(lam)
        self.k_reg = int(k_reg)


# --------------------------------------------------------------------------- registry

#: name -> class, in the paper's table order.
BASELINES: dict[str, type[Baseline]] = {
    cls.name: cls for cls in (NoReject, SoftmaxThreshold, TemperatureScaling, APS, RAPS)
}


def make_baseline(name: str, **kwargs) -> Baseline:
    """Instantiate a baseline by registry name (``no_reject``, ``softmax``, ``temperature``,
    ``aps``, ``raps``) with constructor keyword arguments."""
    try:
        cls = BASELINES[name]
    except KeyError:
        raise ValueError(f"unknown baseline {name!r}; choose from {sorted(BASELINES)}") from None
    return cls(**kwargs)


def run_baselines(z_cal, y_cal, z_eval, y_eval, alpha: float, *, names=None,
                  options: dict[str, dict] | None = None) -> dict[str, dict[str, Any]]:
    """Fit each baseline on the calibration logits and evaluate it on the evaluation split.

    Returns ``{name: index_conditional_report(...)}`` (see :mod:`sdm_mlx.metrics`), in
    ``names`` order (default: all of :data:`BASELINES`).  ``options`` maps a name to its
    constructor keyword arguments.
    """
    z_eval = _logits(z_eval, "z_eval")
    y_eval = _label_array(y_eval, z_eval.shape[0], z_eval.shape[1])
    options = options or {}
    out = {}
    for name in (names or list(BASELINES)):
        est = make_baseline(name, **options.get(name, {})).fit(z_cal, y_cal, alpha)
        y_pred, admitted, _ = est.predict(z_eval)
        out[name] = index_conditional_report(y_eval, y_pred, admitted, z_eval.shape[1], alpha)
    return out
