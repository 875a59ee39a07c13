"""Typed, immutable results of the index-conditional SDM estimator (``eq:index-conditional-sdm-estimator``).

:class:`Estimate` is what :func:`sdm_mlx.calibration.estimate` returns: the per-row fields shared by the
three estimators and one :class:`Variant` each for the centroid, lower (p̂_lower) and upper estimators.
:class:`Predictions` (what :meth:`SDMEstimator.estimate` returns) adds the forward pass (z', q, d0, d,
SDM output) and the nearest training exemplars.

The JSON row schema (``Predictions.to_dicts``, ``sdm-mlx predict``) and the verifier's verdict record are
derived from the dataclass fields: every field that appears in a JSON row carries ``metadata`` with its
key (:func:`_col`), so a new field is added in exactly one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter

import numpy as np

#: variant name → the suffix its per-variant keys carry in a JSON row (``q_tilde_lower``); the centroid has none
VARIANT_SUFFIX = {"centroid": "", "lower": "_lower", "upper": "_upper"}


def _col(key: str, cast=float, *, verdict: bool = False, variants=tuple(VARIANT_SUFFIX)) -> dict:
    """Field metadata: JSON ``key`` (``{suffix}``/``{name}`` filled per variant), scalar ``cast`` (None: a
    per-row vector as a list), whether the verifier's verdict record copies it, and (for a
    :class:`Variant` field) which variants export it."""
    return {"json": key, "cast": cast, "verdict": verdict, "variants": variants}


def _reason(value) -> str | None:
    return value or None


def _region(value) -> float | None:
    """An α region (NaN: admitted at no grid level) as a JSON number or null."""
    value = float(value)
    return None if value != value else value


@dataclass(frozen=True)
class Variant:
    """One of the three estimators (centroid, lower, upper) for N rows; arrays are not copied."""

    p: np.ndarray = field(metadata=_col("p_{name}"))  #: clip(o_ŷ − offset, 0, 1)
    q_tilde: np.ndarray = field(metadata=_col("q_tilde{suffix}"))  #: processed soft q bin q~ (0 when OOD)
    hard_bin: np.ndarray = field(metadata=_col("hard_bin{suffix}", int))  #: floor(q~), 0 when OOD
    offset: np.ndarray = field(metadata=_col("offset", variants=("lower",)))  #: Cauchy offset m[ŷ][hard bin]
    v: np.ndarray  #: v (centroid) or its DKW bound (lower / upper) [N, C]
    ood: np.ndarray  #: OOD: SDM flip, floor(q~) ≤ 0 or o without a unique argmax at ŷ
    o: np.ndarray  #: rescaled output softmax(W''v · ln(2+q~)) [N, C], before the offset
    valid: np.ndarray  #: this variant's index-conditional validity (lower: ``admitted``)


@dataclass(frozen=True)
class Estimate:
    """The index-conditional estimate for N rows (``eq:index-conditional-sdm-estimator``)."""

    prediction: np.ndarray = field(metadata=_col("prediction", int, verdict=True))  #: ŷ = argmax z'
    admitted: np.ndarray = field(metadata=_col("admitted", bool, verdict=True))  #: False = ⊥ (rejected)
    rejection_reason: np.ndarray = field(metadata=_col("rejection_reason", _reason, verdict=True))  #: "" if admitted
    lower: Variant  #: the lower estimator: p̂_lower (``admitted`` is its validity)
    centroid: Variant
    upper: Variant
    n_hat: np.ndarray = field(metadata=_col("n_hat", None))  #: effective sample size n̂ per class [N, C] (−1: none)
    sdm_flip: np.ndarray  #: the SDM output has no unique argmax equal to ŷ
    epsilon: np.ndarray  #: DKW ε per class [N, C]
    #: largest grid α whose (nested) region holds the row by the lower estimator, NaN: none (DESIGN #25)
    alpha_region_lower: np.ndarray = field(metadata=_col("alpha_region_lower", _region, verdict=True))
    #: the same by the centroid estimator (DESIGN #25)
    alpha_region_centroid: np.ndarray = field(metadata=_col("alpha_region_centroid", _region, verdict=True))
    #: "allow" / "review" / "reject" from the region and the decision policy (DESIGN #25)
    decision: np.ndarray = field(metadata=_col("decision", str, verdict=True))

    @property
    def p_hat(self) -> np.ndarray:
        """p̂_lower where admitted, NaN where ⊥."""
        return np.where(self.admitted, self.lower.p, np.nan)

    def variants(self) -> dict[str, Variant]:
        return {name: getattr(self, name) for name in VARIANT_SUFFIX}

    def __len__(self) -> int:
        return int(self.prediction.shape[0])


@dataclass(frozen=True)
class Column:
    """One key of a JSON row: where its array lives and how one row's value is cast."""

    key: str
    path: tuple  #: attribute path from a Predictions object
    cast: object
    verdict: bool

    def array(self, obj):
        for name in self.path:
            obj = getattr(obj, name)
        return obj

    def value(self, array, i):
        return array[i].tolist() if self.cast is None else self.cast(array[i])

    def values(self, array) -> list:
        """:meth:`value` of every row, in one conversion of the whole array (the same values and types)."""
        if not isinstance(array, np.ndarray):
            return [self.cast(x) for x in array]
        items = array.tolist()
        if self.cast is None or _PLAIN.get(self.cast) == array.dtype.kind:
            return items  # tolist gives what the cast would: Python int, float or bool
        return [self.cast(x) for x in items]

    @property
    def getter(self):
        """``obj ↦`` the array behind this column (:meth:`array`, as one C-level attribute lookup)."""
        return attrgetter(".".join(self.path))


#: casts whose value ``tolist`` already gives for an array of this dtype kind
_PLAIN = {int: "i", float: "f", bool: "b"}


def _columns_of(cls, prefix: tuple) -> list[Column]:
    out = []
    for f in fields(cls):
        meta = f.metadata
        if "json" in meta:
            out.append(Column(meta["json"], prefix + (f.name,), meta["cast"], meta["verdict"]))
        elif f.type in ("Variant", Variant):
            name = f.name
            for vf in fields(Variant):
                m = vf.metadata
                if "json" in m and name in m["variants"]:
                    key = m["json"].format(suffix=VARIANT_SUFFIX[name], name=name)
                    verdict = key in _VARIANT_VERDICT
                    out.append(Column(key, prefix + (name, vf.name), m["cast"], verdict))
        elif f.type in ("Estimate", Estimate):
            out.extend(_columns_of(Estimate, prefix + (f.name,)))
    return out


#: per-variant keys the verifier's verdict copies (its record of the estimate behind p̂_lower)
_VARIANT_VERDICT = ("p_lower", "p_centroid", "p_upper", "q_tilde_lower", "hard_bin_lower")


@dataclass(frozen=True)
class Predictions:
    """Per-row results of :meth:`SDMEstimator.estimate` (N rows); ``to_dicts()`` gives the JSON rows."""

    ids: list = field(metadata=_col("id", lambda x: x))
    estimate: Estimate  #: the index-conditional estimate (its JSON columns follow ``id``)
    q: np.ndarray = field(metadata=_col("q", int, verdict=True))  #: Similarity
    d0: np.ndarray = field(metadata=_col("d0", float, verdict=True))  #: squared L2 to the nearest exemplar
    d: np.ndarray = field(metadata=_col("d", float, verdict=True))  #: Distance quantile
    logits: np.ndarray = field(metadata=_col("logits", None))  #: z' [N, C]
    sdm: np.ndarray = field(metadata=_col("sdm", None))  #: SDM activation output [N, C]
    exemplar_index: np.ndarray  #: [N, n] support indices (−1 padding)
    exemplar_distance: np.ndarray  #: [N, n] squared L2
    support_ids: list = field(repr=False, default_factory=list)
    support_labels: np.ndarray | None = field(repr=False, default=None)
    support_predictions: np.ndarray | None = field(repr=False, default=None)
    class_names: list | None = None

    def __len__(self) -> int:
        return len(self.ids)

    # the fields most callers read, without the variant path
    prediction = property(lambda self: self.estimate.prediction)
    admitted = property(lambda self: self.estimate.admitted)
    rejection_reason = property(lambda self: self.estimate.rejection_reason)
    n_hat = property(lambda self: self.estimate.n_hat)
    p_lower = property(lambda self: self.estimate.lower.p)
    p_centroid = property(lambda self: self.estimate.centroid.p)
    p_upper = property(lambda self: self.estimate.upper.p)

    def column(self, key: str) -> np.ndarray:
        """The whole array behind one JSON key (e.g. ``"q_tilde_lower"`` is ``estimate.lower.q_tilde``)."""
        col = _COLUMN_BY_KEY.get(key)
        if col is None:
            raise KeyError(f"no JSON column {key!r}; columns: {list(_COLUMN_BY_KEY)}")
        return col.array(self)

    def __getattr__(self, name: str):
        """Every JSON column is also an attribute (``pred.q_tilde_lower``), read through :meth:`column`."""
        if name.startswith("_") or name not in _COLUMN_BY_KEY:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.column(name)

    def exemplars(self, row: int) -> list[dict]:
        """Nearest training exemplars of one row: id, label, predicted label, squared distance."""
        out = []
        for j, dist in zip(self.exemplar_index[row], self.exemplar_distance[row]):
            if j < 0:
                continue
            out.append({"id": self.support_ids[j], "label": int(self.support_labels[j]),
                        "predicted_label": int(self.support_predictions[j]), "squared_distance": float(dist)})
        return out

    def _all_exemplars(self) -> list[list[dict]]:
        """:meth:`exemplars` of every row, the support rows' labels and predictions gathered at once."""
        index = np.asarray(self.exemplar_index)
        if (index.size == 0 or self.support_labels is None or self.support_predictions is None
                or len(self.support_labels) == 0 or len(self.support_predictions) == 0):
            return [self.exemplars(i) for i in range(len(self))]
        at = np.maximum(index, 0)  # −1 (padding) is skipped below
        labels, predictions = np.asarray(self.support_labels)[at], np.asarray(self.support_predictions)[at]
        distances = np.asarray(self.exemplar_distance)
        if labels.dtype.kind != "i" or predictions.dtype.kind != "i" or distances.dtype.kind != "f":
            return [self.exemplars(i) for i in range(len(self))]  # (tolist would not give int / float)
        ids = self.support_ids
        return [[{"id": ids[j], "label": lab, "predicted_label": pred, "squared_distance": dist}
                 for j, lab, pred, dist in zip(*row) if j >= 0]
                for row in zip(index.tolist(), labels.tolist(), predictions.tolist(), distances.tolist())]

    def to_dicts(self) -> list[dict]:
        """One JSON-serialisable dict per row (ids preserved, input order): :data:`ROW_COLUMNS`, then
        ``exemplars`` and, with class names, ``prediction_name``.  Each column is converted in one go
        (:meth:`Column.values`), not value by value."""
        columns = [col.values(get(self)) for col, get in _ROW_GETTERS]
        exemplars = self._all_exemplars()
        names = self.class_names
        predictions = np.asarray(self.prediction).tolist() if names else None
        rows = []
        for i, values in enumerate(zip(*columns)):
            row = dict(zip(_ROW_KEYS, values))
            row["exemplars"] = exemplars[i]
            if names:
                row["prediction_name"] = names[int(predictions[i])]
            rows.append(row)
        return rows


#: the JSON row schema, derived from the fields of Predictions, Estimate and Variant
ROW_COLUMNS: tuple[Column, ...] = tuple(_columns_of(Predictions, ()))
#: keys of a JSON row the verifier's verdict record copies
VERDICT_KEYS: tuple[str, ...] = tuple(c.key for c in ROW_COLUMNS if c.verdict)
#: verdict keys whose value is a float (made JSON-safe: NaN / inf → null)
VERDICT_FLOAT_KEYS: tuple[str, ...] = tuple(c.key for c in ROW_COLUMNS if c.verdict and c.cast is float)
_COLUMN_BY_KEY: dict[str, Column] = {c.key: c for c in ROW_COLUMNS}
_ROW_KEYS: tuple[str, ...] = tuple(c.key for c in ROW_COLUMNS)
_ROW_GETTERS: tuple = tuple((c, c.getter) for c in ROW_COLUMNS)
