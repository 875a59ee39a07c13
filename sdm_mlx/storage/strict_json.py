"""Strict RFC 8259 JSON, the only JSON sdm_mlx writes.

* :func:`strict` / :func:`dumps` — values as plain JSON: NumPy scalars and arrays and dataclasses are
  converted, non-finite floats become ``null`` (:func:`finite_or_none`); ``NaN``/``Infinity`` never appear.
* :func:`put_float` / :func:`get_float` — a non-finite number whose ``null`` carries meaning is stored with a
  ``<key>_reason`` field saying which, and read back as ``±inf``/``nan``.
* :func:`loads_strict` — the reader of our own outputs, which refuses ``NaN``/``Infinity``.

The files these go to are written by :mod:`sdm_mlx.storage.files` (which re-exports these names).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, is_dataclass

import numpy as np

from ..errors import InputError

__all__ = ["finite_or_none", "strict", "dumps", "put_float", "get_float", "loads_strict"]


def finite_or_none(x):
    """``float(x)``, or None for None / NaN / ±inf (JSON has no non-finite numbers)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


#: the exact types :func:`strict` returns unchanged
_JSON_SCALARS = frozenset({str, int, bool, type(None)})


def strict(obj):
    """``obj`` as plain JSON values: NumPy scalars/arrays and dataclasses converted, non-finite floats → None."""
    # the plain JSON types first, by exact type (a verdict's row is made of them), their items inline
    kind = type(obj)
    if kind is float:
        return obj if math.isfinite(obj) else None
    if kind in _JSON_SCALARS:
        return obj
    if kind is dict:
        return {str(k): v if type(v) in _JSON_SCALARS else (v if math.isfinite(v) else None) if type(v) is float
                else strict(v) for k, v in obj.items()}
    if kind is list:
        return [v if type(v) in _JSON_SCALARS else (v if math.isfinite(v) else None) if type(v) is float else strict(v)
                for v in obj]
    return _strict_other(obj)


def _strict_other(obj):
    """:func:`strict` of anything but an exact float, str, int, bool, None, dict or list."""
    if isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, np.bool_):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, dict):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return strict(obj.tolist())
    if is_dataclass(obj) and not isinstance(obj, type):
        return strict(asdict(obj))
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"cannot write a {type(obj).__name__} as JSON")


def dumps(obj, indent: int | None = None, sort_keys: bool = False) -> str:
    """Strict RFC 8259 JSON text of ``obj`` (never NaN/Infinity; see :func:`strict`)."""
    return json.dumps(strict(obj), indent=indent, sort_keys=sort_keys, allow_nan=False, ensure_ascii=False)


def put_float(d: dict, key: str, value, reason_if_inf: str, reason_if_nan: str | None = None) -> dict:
    """``d[key] = value``; a non-finite value is stored as ``null`` with ``d[key + "_reason"]`` saying why
    (``+inf: ...`` / ``-inf: ...`` / ``nan: ...``) so that :func:`get_float` can restore it."""
    value = None if value is None else float(value)
    if value is None or math.isfinite(value):
        d[key] = value
        return d
    d[key] = None
    if math.isnan(value):
        d[key + "_reason"] = f"nan: {reason_if_nan or 'undefined'}"
    else:
        d[key + "_reason"] = f"{'+' if value > 0 else '-'}inf: {reason_if_inf}"
    return d


def get_float(d: dict, key: str):
    """Inverse of :func:`put_float` (also reads older files that hold a bare number or ``Infinity``)."""
    value = d[key]
    if value is not None:
        return float(value)
    reason = str(d.get(key + "_reason", ""))
    if reason.startswith("+inf"):
        return math.inf
    if reason.startswith("-inf"):
        return -math.inf
    if reason.startswith("nan"):
        return math.nan
    return None


def _reject_constant(name):
    raise InputError(f"non-standard JSON constant {name}")


def loads_strict(text: str):
    """Parse JSON text rejecting NaN/Infinity (used by the tests and by readers of our own outputs)."""
    return json.loads(text, parse_constant=_reject_constant)
