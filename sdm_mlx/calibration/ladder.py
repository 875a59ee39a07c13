"""The test-time constants of a model's calibration levels, validated once and stacked along the levels:
:class:`LevelArrays` (one level's arrays, :func:`check_level`) and :class:`Ladder` (every level's, for the
index-conditional estimator of :mod:`.conditional` at one level or at a nested grid, DESIGN #25).

A level is a :class:`~sdm_mlx.calibration.rounds.Calibration`; each one keeps its checked arrays and its
one-level ladder (``Calibration.checked``, ``Calibration.ladder``) and a nested calibration keeps the ladder of
its levels (``NestedCalibration.ladder``): a server scores one row per verdict, and rebuilding these per call
cost more than that row's arithmetic.  Imports no other module of the levels (they import this one).
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import NamedTuple

import numpy as np

from ..errors import InputError
from ._checks import _SortedTable, _check_lists, _finite, _vector, check_alpha
from .bounds import _dkw_log
from .cauchy import lookup_offsets


class LevelArrays(NamedTuple):
    """One level's arrays as the estimator reads them, validated by :func:`check_level`."""

    W: np.ndarray  #: W'' [C, C], as stored
    psi: np.ndarray  #: Alg. 3's ψ, float64 [C]
    min_valid: float  #: the model's own min valid q~ (+inf: none)
    robust_min: float  #: the Cauchy robust min valid q~ (+inf: none)
    offsets: np.ndarray  #: m[ŷ][bin], float64 [C, B] (B = 0: no offsets)
    output_ecdfs: list  #: per class, sorted calibration sdm_c (for v)
    sample_sizes: list  #: per class, sorted processed calibration q~ (for n̂)


def check_level(cal) -> LevelArrays:
    """The arrays of a :class:`~sdm_mlx.calibration.rounds.Calibration`, validated (a level can be built by
    hand and given to :func:`~sdm_mlx.calibration.conditional.estimate`: this is its boundary)."""
    W = _finite("W", cal.W)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise InputError(f"W must be [C, C], got shape {W.shape}")
    C = W.shape[0]
    check_alpha(cal.alpha, C)
    psi = _vector("psi", cal.psi).astype(np.float64)
    if psi.shape[0] != C:
        raise InputError(f"psi must have {C} entries, got {psi.shape[0]}")
    min_valid_own, robust_min = float(cal.min_valid), float(cal.robust_min_valid)
    if math.isnan(min_valid_own) or math.isnan(robust_min):
        raise InputError("min valid q~ thresholds must not be NaN (+inf means 'none')")
    offsets = np.zeros((C, 0)) if cal.offsets is None else np.asarray(cal.offsets, dtype=np.float64)
    if offsets.size and (offsets.ndim != 2 or offsets.shape[0] != C or not np.all(np.isfinite(offsets))):
        raise InputError(f"offsets must be a finite [C, B] array with C = {C}")
    ecdfs = _check_lists("output_ecdfs", cal.output_ecdfs, C)
    arrays = _check_lists("sample_size_arrays", cal.sample_size_arrays, C)
    return LevelArrays(W, psi, min_valid_own, robust_min, offsets, ecdfs, arrays)


class Layout(NamedTuple):
    """The index arrays of one stacked pass (:meth:`Ladder.layout`): the lower variant of each level, (the upper
    variant of one level,) then the centroid at each level, each a block of N rows."""

    source: np.ndarray  #: the input row of each stacked row
    at_k: np.ndarray  #: 0..k N − 1 (the rows with a geometry of their own: lower, upper)
    at: np.ndarray  #: 0..(k + m) N − 1 (every stacked row)
    block_levels: np.ndarray  #: the level of each block
    level: np.ndarray  #: the level of each row
    psi: np.ndarray  #: each row's level's ψ [R, C]
    min_valid: np.ndarray  #: each row's level's min valid q~ [R]
    robust_min: np.ndarray  #: each row's level's robust min valid q~ [R]


#: :meth:`Ladder.layout` keeps the index arrays of passes of at most this many stacked rows
_KEPT_LAYOUT_ROWS = 2048


class Ladder:
    """The per-level constants of calibrations of one model (a nested grid, DESIGN #25, or one level),
    validated and stacked along the levels once: W'' in float64, ln(2/(1−α)) of DKW ε, ψ, the two minima
    and the offset tables (and, when first needed, the output eCDFs and sample sizes as tables, and the
    index arrays of a batch size)."""

    def __init__(self, calibrations):
        self.checked = [c.checked for c in calibrations]
        self.size = len(self.checked)
        first = self.checked[0].W
        #: every level has the same W'' (then levels can be stacked along the rows)
        self.one_model = all(c.W is first or np.array_equal(c.W, first) for c in self.checked)
        self.W = [np.asarray(c.W, dtype=np.float64) for c in self.checked]
        self.log_terms = np.array([_dkw_log(c.alpha) for c in calibrations])
        self.psi = np.stack([c.psi for c in self.checked])  # [L, C]
        self.min_valid = np.array([c.min_valid for c in self.checked])
        self.robust_min = np.array([c.robust_min for c in self.checked])
        self.tables = [c.offsets for c in self.checked]  # offsets m[ŷ][bin], float64 [C, B] each
        same_shape = all(t.shape == self.tables[0].shape for t in self.tables)
        self.offsets = np.stack(self.tables) if same_shape else None  # [L, C, B]
        self._layouts = {}

    @cached_property
    def ecdf_table(self) -> _SortedTable:
        """The first level's output eCDFs (every level's, for one model) as one table, for v."""
        return _SortedTable(self.checked[0].output_ecdfs)

    @cached_property
    def size_table(self) -> _SortedTable:
        """The first level's sample-size arrays (every level's, for one model) as one table, for n̂."""
        return _SortedTable(self.checked[0].sample_sizes)

    def layout(self, n: int, j0: int, j1: int, keep: int | None) -> Layout:
        """The :class:`Layout` of a pass over N = ``n`` rows at levels j0..j1−1 (``keep``: the level with the
        upper variant, or None).  It depends on the shapes alone: small ones (a server's batches) are kept,
        read-only."""
        key = (n, j0, j1, keep)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        m = j1 - j0
        k = m if keep is None else m + 1  # blocks with a geometry of their own (lower, upper)
        levels = np.arange(j0, j1)
        block_levels = np.concatenate([levels, levels] if keep is None else [levels, [keep], levels])
        level = block_levels.repeat(n)
        layout = Layout(source=np.arange((k + m) * n) % n, at_k=np.arange(k * n), at=np.arange((k + m) * n),
                        block_levels=block_levels, level=level, psi=self.psi[level],
                        min_valid=self.min_valid[level], robust_min=self.robust_min[level])
        if level.size <= _KEPT_LAYOUT_ROWS:
            for a in layout:
                a.flags.writeable = False
            if len(self._layouts) >= 64:
                self._layouts.clear()
            self._layouts[key] = layout
        return layout

    def offsets_at(self, block_levels, level, y_hat, y_stacked, bins) -> np.ndarray:
        """m[ŷ][bin] of blocks of N rows stacked along the rows, block b at level ``block_levels[b]`` (``level``:
        each row's level, ``y_stacked``: each row's ŷ; ``y_hat``: one block's)."""
        if self.offsets is not None:  # every level's table as one [L, C, B] array
            return lookup_offsets(self.offsets, y_stacked, bins, level=level)
        n = y_hat.shape[0]
        return np.concatenate([lookup_offsets(self.tables[j], y_hat, bins[b * n:(b + 1) * n])
                               for b, j in enumerate(block_levels.tolist())])
