"""Split-conformal baselines: APS (Romano, Sesia & Candès 2020) and RAPS (Angelopoulos, Bates, Malik &
Jordan 2021), admitting a row iff its prediction set is a singleton (see :mod:`sdm_mlx.evaluation.baselines`).

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
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from scipy.special import softmax

from .baseline_core import Baseline, _label_array, _logits, _rank_penalties, _sorted_probs, fit_temperature
from ..errors import InputError


def conformal_quantile(scores, coverage: float) -> float:
    """The ⌈(n+1)·coverage⌉-th smallest of the n calibration scores (split-conformal
    quantile at level ⌈(n+1)(1-ε)⌉/n with coverage = 1 - ε); ``+inf`` if that rank
    exceeds n.  The rank is exact: coverage is read as the decimal it prints as (``str``), so
    (19+1)·0.95 is 19, not 19.000000000000004 → 20."""
    s = np.sort(np.asarray(scores, dtype=np.float64).reshape(-1))
    n = s.size
    if n == 0:
        raise InputError("empty calibration set")
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
            raise InputError("empty calibration set")
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
            raise InputError(f"expected {self.num_classes} classes, got {z.shape[1]}")
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
            raise InputError("lam must be >= 0")
        if int(k_reg) < 0:
            raise InputError("k_reg must be >= 0")
        self.lam = float(lam)
        self.k_reg = int(k_reg)
