"""Input checks shared by the calibration steps: α′ (``defn:index-conditional-calibration``), finite
matrices and vectors, labels, sorted per-class arrays."""

from __future__ import annotations

import numpy as np

from .. import validation
from ..errors import InputError


def check_alpha(alpha: float, num_classes: int) -> float:
    """Validate α' for ``defn:index-conditional-calibration``: max(0.5, 1/C) < α < 1 (DESIGN #23)."""
    return validation.alpha(alpha, num_classes)


def _finite(name: str, arr) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.kind not in "biuf":
        raise InputError(f"{name} must be numeric, got dtype {arr.dtype}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InputError(f"{name} contains NaN or Inf")
    return arr


def _labels(name: str, y, num_classes: int, n: int | None = None) -> np.ndarray:
    return validation.label_indices(y, name, num_classes, n)


def _matrix(name: str, x, n: int | None = None, c: int | None = None) -> np.ndarray:
    x = _finite(name, x)
    if x.ndim != 2:
        raise InputError(f"{name} must be [N, C], got shape {x.shape}")
    if n is not None and x.shape[0] != n:
        raise InputError(f"{name} has {x.shape[0]} rows, expected {n}")
    if c is not None and x.shape[1] != c:
        raise InputError(f"{name} has {x.shape[1]} columns, expected {c}")
    return x


def _vector(name: str, x, n: int | None = None) -> np.ndarray:
    x = _finite(name, x).reshape(-1)
    if n is not None and x.shape[0] != n:
        raise InputError(f"{name} has {x.shape[0]} rows, expected {n}")
    return x


#: most comparisons (rows x table entries) :meth:`_SortedTable.below` makes instead of one searchsorted per class
COUNT_BY_COMPARISON = 1 << 15


class _SortedTable:
    """Per-class sorted float arrays (:func:`_check_lists`) as one [C, M] table padded with +inf, for counting
    the entries below a value in every class at once: the counts of ``searchsorted(side="left")``, in two
    array operations instead of a few per class (a small batch's cost is the number of operations)."""

    def __init__(self, lists: list[np.ndarray]):
        self.sizes = np.array([a.size for a in lists], dtype=np.int64)
        floats = len(lists) > 0 and all(a.dtype.kind == "f" for a in lists)
        dtype = np.result_type(*[a.dtype for a in lists]) if floats else np.float64
        self.table = np.full((len(lists), max(1, int(self.sizes.max(initial=0)))), np.inf, dtype=dtype)
        for c, a in enumerate(lists):
            self.table[c, : a.size] = a
        self.last = np.array([a[-1] if a.size else np.inf for a in lists], dtype=dtype)  # each class's largest
        self.divisor = np.maximum(self.sizes, 1)  # the sizes, 1 for a class without entries (0 below it)
        self.usable = floats

    def below(self, x: np.ndarray) -> np.ndarray | None:
        """[N, C]: how many of class c's entries are < x[i, c] (x [N, C]) or < x[i] (x [N]); None when the
        batch is too large for counting by comparison (then one searchsorted per class is cheaper)."""
        if not self.usable or x.shape[0] * self.table.size > COUNT_BY_COMPARISON:
            return None
        return np.add.reduce(self.table < (x[:, :, None] if x.ndim == 2 else x[:, None, None]), axis=2)


def _check_lists(name: str, lists, num_classes: int) -> list[np.ndarray]:
    if len(lists) != num_classes:
        raise InputError(f"{name} must hold one array per class ({num_classes}), got {len(lists)}")
    out = []
    for c, a in enumerate(lists):
        a = _finite(f"{name}[{c}]", a).reshape(-1)
        if a.size > 1 and np.any(a[1:] < a[:-1]):
            raise InputError(f"{name}[{c}] must be sorted ascending")
        out.append(a)
    return out
