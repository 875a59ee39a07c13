"""Nested calibration: the index-conditional estimator at a descending grid of α levels from the same J
rounds, each row's α region and a policy decision (DESIGN #25).

Every level is the paper's estimator (``eq:index-conditional-sdm-estimator``) re-thresholded at that α:
Alg. 3 (``alg:estimate-soft-q-bin``) on the best round, the Cauchy robust min valid q~
(``eq:cauchyMinValidQBin``) and offsets (``eq:cauchyIteratedLower``) over all J rounds, and DKW ε
(``equation:dkw``) at α.  Nothing is retrained: :meth:`NestedCalibration.from_rounds` only re-runs Alg. 3
and the Cauchy aggregation on the stored rounds.

The paper's per-level admissions A(α) need not be nested (ψ_c, the robust threshold and o_lower move
with α in no fixed direction), so a row's region is *anchored at the model's α'* (DESIGN #25):

* admitted at α' → the largest grid α reached by consecutive admissions from α' upwards;
* rejected at α' → the largest grid α below α' at which it is admitted (``NaN``: none).

The reported ladder is "admitted at α ⟺ region ≥ α": nested by construction, equal to ``admitted`` at
α', and a row is always admitted by the paper's rule at its own region level.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from ..errors import InputError
from ..results import Estimate
from ._checks import check_alpha
from .conditional import _ladder_estimate, _one_level, _rows
from .ladder import Ladder
from .rounds import Calibration

#: The default grid: 0.99, 0.98, …, 0.80 (the model's α' is always added).
DEFAULT_ALPHA_GRID = tuple(round(0.99 - 0.01 * i, 2) for i in range(20))
#: decisions of :func:`decisions`, most permissive first
DECISIONS = ("allow", "review", "reject")


def alpha_grid(grid: Sequence[float] | None, alpha: float, num_classes: int) -> tuple[float, ...]:
    """The validated levels, descending, without duplicates, α' included (``grid`` None: the default).

    ``alpha``: a validated α' (:func:`sdm_mlx.validation.alpha`); the grid's levels are checked here."""
    levels = DEFAULT_ALPHA_GRID if grid is None else grid
    if isinstance(levels, (str, bytes)) or not hasattr(levels, "__iter__"):
        raise InputError(f"alpha_grid must be a list of levels, got {grid!r}")
    checked = []
    for a in levels:
        try:
            checked.append(check_alpha(a, num_classes))
        except InputError as e:
            raise InputError(f"alpha_grid: {e}") from None
    return tuple(sorted(set(checked) | {alpha}, reverse=True))


@dataclass(frozen=True)
class DecisionPolicy:
    """allow when the region is ≥ ``allow``, review when ≥ ``review``, else reject (``region``: which one)."""

    allow: float
    review: float
    region: str = "lower"

    def __post_init__(self):
        if self.region not in ("lower", "centroid"):
            raise InputError(f"decision region must be 'lower' or 'centroid', got {self.region!r}")
        if not (0.0 < self.review <= self.allow < 1.0):
            raise InputError(f"decision levels must satisfy 0 < review <= allow < 1, got review={self.review!r}, "
                             f"allow={self.allow!r}: give alpha_review (--alpha-review) at most alpha_allow "
                             "(--alpha-allow, default alpha')")


@dataclass(frozen=True)
class NestedCalibration:
    """One :class:`Calibration` per grid level (descending α, α' among them) and the decision policy."""

    alpha: float  #: the model's α' (``admitted`` is the estimator at this level)
    levels: tuple  #: Calibration per level, α descending
    policy: DecisionPolicy

    @cached_property
    def grid(self) -> tuple[float, ...]:
        """The levels' α, descending."""
        return tuple(c.alpha for c in self.levels)

    @cached_property
    def anchor(self) -> int:
        """Index of α' in :attr:`grid`."""
        return self.grid.index(self.alpha)

    @cached_property
    def grid_array(self) -> np.ndarray:
        """:attr:`grid` as float64 (read for every batch)."""
        return np.asarray(self.grid, dtype=np.float64)

    @cached_property
    def ladder(self) -> Ladder:
        """Every level's constants, validated and stacked once (:class:`~sdm_mlx.calibration.ladder.Ladder`)."""
        return Ladder(self.levels)

    @property
    def calibration(self) -> Calibration:
        """The level at the model's α' (what ``admitted`` is the estimator of)."""
        return self.levels[self.anchor]

    def at(self, alpha: float) -> Calibration:
        """The level's Calibration (α must be on the grid)."""
        if alpha not in self.grid:
            raise InputError(f"alpha {alpha!r} is not on the grid {list(self.grid)}")
        return self.levels[self.grid.index(alpha)]

    @classmethod
    def from_rounds(cls, rounds, best_index: int, alpha: float, grid=None, *, allow: float | None = None,
                    review: float | None = None, region: str = "lower") -> "NestedCalibration":
        """Every level by Alg. 3 + Cauchy over the stored rounds (no retraining), each computed once; policy
        defaults: allow = α', review = the lowest grid level.  ``alpha``: a validated α'
        (:func:`sdm_mlx.validation.alpha`); the grid and the policy levels are checked here."""
        C = rounds[0].num_classes
        levels = alpha_grid(grid, alpha, C)
        cals = tuple(Calibration.from_rounds(rounds, best_index, a) for a in levels)
        policy = decision_policy(levels, alpha, allow, review, region)
        return cls(alpha=float(alpha), levels=cals, policy=policy)

    @classmethod
    def single(cls, calibration: Calibration) -> "NestedCalibration":
        """A one-level grid {α'}: region α' iff admitted, allow or reject."""
        a = calibration.alpha
        return cls(alpha=a, levels=(calibration,), policy=DecisionPolicy(allow=a, review=a))


def decision_policy(levels: Sequence[float], alpha: float, allow=None, review=None,
                    region: str = "lower") -> DecisionPolicy:
    """The policy with its defaults filled: allow = α', review = min(grid) (never above allow)."""
    allow = float(alpha) if allow is None else float(check_alpha(allow, 2))
    review = min(min(levels), allow) if review is None else float(check_alpha(review, 2))
    return DecisionPolicy(allow=allow, review=review, region=region)


def anchored_region(admitted: np.ndarray, grid: Sequence[float], anchor: int) -> np.ndarray:
    """Per row, the region α (NaN: none) from the paper's admissions ``admitted`` [N, L] (grid descending),
    anchored at level ``anchor`` (α'): see the module docstring.  Vectorised over rows."""
    A = np.asarray(admitted, dtype=bool)
    grid = np.asarray(grid, dtype=np.float64)
    n, L = A.shape
    if L != grid.size or not 0 <= anchor < L:
        raise InputError(f"admissions [N, {L}] do not fit a grid of {grid.size} levels with anchor {anchor}")
    # admitted at α': consecutive admissions from the anchor towards higher α (lower indices)
    run = np.add.reduce(A[:, anchor::-1].cumprod(axis=1), axis=1)
    at_anchor = A[:, anchor]
    region = np.where(at_anchor, grid[anchor + 1 - np.maximum(run, 1)], np.nan)
    # rejected at α': the highest level below α' that admits the row
    below = A[:, anchor + 1:]
    if below.shape[1]:
        hit = ~at_anchor & np.logical_or.reduce(below, axis=1)
        region = np.where(hit, grid[anchor + 1 + below.argmax(axis=1)], region)
    return region


def nested_admissions(region: np.ndarray, grid: Sequence[float]) -> np.ndarray:
    """bool [N, L]: admitted at level α iff region ≥ α (the reported, nested ladder)."""
    region = np.asarray(region, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return region[:, None] >= np.asarray(grid, dtype=np.float64)[None, :]


def decisions(region: np.ndarray, policy: DecisionPolicy) -> np.ndarray:
    """allow / review / reject per row from its region (NaN: reject), an object array of str."""
    region = np.asarray(region, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        allowed, reviewed = region >= policy.allow, region >= policy.review
    return _DECISION_OF[np.where(allowed, 0, np.where(reviewed, 1, 2))]


_DECISION_OF = np.array(DECISIONS, dtype=object)


def _admissions(nested: NestedCalibration, z, q, d, sdm, check_input: bool) -> tuple:
    """(the fields of the estimate at α' but its regions and decision, the paper's admissions of the lower
    and of the centroid estimator, bool [N, L] each): see :func:`level_admissions`."""
    rows = _rows(nested.calibration, z, q, d, sdm, check_input=check_input)
    return _ladder_estimate(nested.ladder, nested.anchor, rows)


def level_admissions(nested: NestedCalibration, z, q, d, sdm) -> tuple[Estimate, np.ndarray, np.ndarray]:
    """(the estimate at α', paper admissions of the lower and of the centroid estimator, bool [N, L] each).

    The threshold-free per-row work (v, the centroid's rescaled output, n̂) is done once for all levels;
    each level adds the lower variant at its ε and its thresholds, all levels stacked along the rows
    (:func:`~sdm_mlx.calibration.conditional._ladder_estimate`), and α' the upper variant and the reasons."""
    fields, lower, centroid = _admissions(nested, z, q, d, sdm, True)
    return _one_level(fields, nested.calibration.alpha), lower, centroid


def estimate_nested(nested: NestedCalibration, z, q, d, sdm, *, check_input: bool = True) -> Estimate:
    """The estimate at α' with ``alpha_region_lower``, ``alpha_region_centroid`` and ``decision`` over the grid.

    ``check_input=False``: z', q, d and the SDM output as the estimator computes them (finite; q, d ≥ 0; one
    row each), not checked again (:func:`~sdm_mlx.calibration.conditional._rows`)."""
    fields, lower, centroid = _admissions(nested, z, q, d, sdm, check_input)
    grid, anchor = nested.grid_array, nested.anchor
    n = lower.shape[0]
    # both estimators' regions in one pass (rows are independent)
    regions = anchored_region(np.concatenate([lower, centroid]), grid, anchor)
    region_lower, region_centroid = regions[:n], regions[n:]
    chosen = region_lower if nested.policy.region == "lower" else region_centroid
    return Estimate(**fields._asdict(), alpha_region_lower=region_lower, alpha_region_centroid=region_centroid,
                    decision=decisions(chosen, nested.policy))
