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
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
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
