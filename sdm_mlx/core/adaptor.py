"""The exemplar adaptor: frozen features x → exemplar vector h' → logits z'.

The paper's 1-D CNN has kernel = stride = D (the full input width) and one
input channel, so it is exactly a dense affine map; with no nonlinearity the
adaptor is (DESIGN #3)

    x_norm = (x − μ) / σ          (DESIGN #2: μ, σ (ddof=1) fitted on the training split — one scalar
                                   each ("scalar"), one per feature dimension ("per-dimension"), or
                                   μ = 0, σ = 1 ("none"))
    h'     = W_g x_norm + b_g     Linear(D, M): the exemplar vector
    z'     = W' h' + b'           Linear(M, C): the logits (Magnitude)

Every weight and bias is initialised U(±1/sqrt(fan_in)) from an explicit MLX key.

Exemplar coordinates.  The support index only needs squared L2 distances
between exemplar vectors.  When D < M, every h' lies in a D-dimensional affine
subspace: with the thin QR factorisation W_g = Q R (Q: M×D orthonormal
columns; R computed as the Cholesky factor of W_gᵀ W_g), ‖h'_i − h'_j‖² = ‖R (x_i − x_j)_norm‖², so distances (and hence q,
d0, d and every neighbour) are computed exactly on the D-dim coordinates
``x_norm Rᵀ`` at M/D times less cost.  When D ≥ M the coordinates are h'
itself.  :class:`InvariantForward` returns whichever applies, batch-invariantly.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .exact_product import CHUNK_ROWS, ExactRowProduct, shared_products
from ..errors import InputError


def _uniform_linear(fan_in: int, fan_out: int, key: mx.array) -> nn.Linear:
    layer = nn.Linear(fan_in, fan_out)
    bound = 1.0 / np.sqrt(fan_in)
    kw, kb = mx.random.split(key)
    layer.weight = mx.random.uniform(-bound, bound, (fan_out, fan_in), key=kw)
    layer.bias = mx.random.uniform(-bound, bound, (fan_out,), key=kb)
    return layer


class ExemplarAdaptor(nn.Module):
    """Exemplar adaptor giving z' for ``eq:sdmActivation``: Linear(D, M) → h', Linear(M, C) → z'."""

    def __init__(self, input_dim: int, exemplar_dim: int, num_classes: int, seed: int = 0):
        super().__init__()
        k1, k2 = mx.random.split(mx.random.key(seed))
        self.projection = _uniform_linear(input_dim, exemplar_dim, k1)
        self.classifier = _uniform_linear(exemplar_dim, num_classes, k2)
        self.input_mean = mx.array(0.0)
        self.input_std = mx.array(1.0)
        self.freeze(keys=["input_mean", "input_std"], recurse=False)

    @property
    def dims(self) -> tuple[int, int, int]:
        m, d = self.projection.weight.shape
        return d, m, self.classifier.weight.shape[0]

    def set_normalization(self, mean, std) -> None:
        """Set μ, σ applied to the inputs: scalars, or one value per input dimension (every σ must be > 0)."""
        mean = np.asarray(mean, dtype=np.float64)
        std = np.asarray(std, dtype=np.float64)
        d = self.dims[0]
        if mean.shape != std.shape or mean.shape not in ((), (d,)):
            raise InputError(f"normalisation needs scalar or [{d}] mean and std, got shapes {mean.shape}, {std.shape}")
        if not np.all(np.isfinite(mean)) or not np.all(np.isfinite(std)) or not np.all(std > 0):
            raise InputError("normalisation needs finite means and positive stds")
        self.input_mean = mx.array(mean.astype(np.float32))
        self.input_std = mx.array(std.astype(np.float32))
        self.freeze(keys=["input_mean", "input_std"], recurse=False)

    @property
    def normalization_shape(self) -> tuple:
        """``()`` for scalar μ, σ; ``(D,)`` per dimension."""
        return tuple(self.input_mean.shape)

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Return (z' [N, C], h' [N, M])."""
        h = self.projection((x - self.input_mean) / self.input_std)
        return self.classifier(h), h


def scalar_normalization(x: np.ndarray) -> tuple[float, float]:
    """One scalar mean and sample std (ddof=1) over every element of the training features."""
    x = np.asarray(x, dtype=np.float64)
    if x.size < 2:
        raise InputError("need at least two feature values to compute the normalisation std")
    std = float(x.std(ddof=1))
    if not std > 0:
        raise InputError("training features are constant (std = 0); disable normalisation or check the data")
    return float(x.mean()), std


def per_dimension_normalization(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sample std (ddof=1) of every feature dimension over the training rows (float64 ``[D]`` each).

    A dimension that is constant on the training rows gets σ = 1: it is only centred (it carries no
    signal the adaptor could use, and dividing by 0 would not be defined).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise InputError("per-dimension normalisation needs at least two training rows")
    mean = x.mean(axis=0)
    std = x.std(axis=0, ddof=1)
    return mean, np.where(std > 0, std, 1.0)


#: The input normalisations of DESIGN #2.
NORMALIZE_MODES = ("scalar", "per-dimension", "none")


def normalize_mode(value) -> str:
    """The DESIGN #2 mode of ``value`` (``True``/``False`` are the older spellings of "scalar"/"none")."""
    if value is True:
        return "scalar"
    if value is False:
        return "none"
    if value not in NORMALIZE_MODES:
        raise InputError(f"normalize must be one of {', '.join(NORMALIZE_MODES)}, got {value!r}")
    return value


def fit_normalization(x: np.ndarray, mode) -> tuple | None:
    """``(mean, std)`` of the training rows ``x`` for a DESIGN #2 mode (None for "none")."""
    mode = normalize_mode(mode)
    if mode == "none":
        return None
    return scalar_normalization(x) if mode == "scalar" else per_dimension_normalization(x)


def exemplar_basis(model: ExemplarAdaptor) -> np.ndarray | None:
    """Rᵀ [D, D] with ‖h'_i − h'_j‖ = ‖(x_i − x_j)_norm Rᵀ‖ when D < M, else None.

    R is the Cholesky factor of the Gram matrix, W_gᵀ W_g = Rᵀ R (the R of the thin QR
    W_g = Q R up to row signs), the Gram matrix an exact product (:mod:`sdm_mlx.core.exact_product`).
    Not ``np.linalg.qr``: right after MLX's float64 GEMMs it was measured at ~0.8 s per call on
    the shared 2-core machine (two OpenBLAS thread pools), against < 1 ms for this.
    """
    w = np.array(model.projection.weight, dtype=np.float64)  # [M, D]
    if w.shape[1] >= w.shape[0]:
        return None
    gram = ExactRowProduct(w.T)(w.T)  # W_gᵀ W_g [D, D]
    try:
        lower = np.linalg.cholesky(gram)  # = Rᵀ
    except np.linalg.LinAlgError:  # W_g rank-deficient: fall back to QR
        lower = np.linalg.qr(w)[1].T
    return np.ascontiguousarray(lower, dtype=np.float32)


_NO_BASIS = object()


class InvariantForward:
    """Batch-invariant scoring forward: rows ↦ (z' [N, C], exemplar coordinates [N, min(D, M)]), float32.

    Every value that feeds q, d0, d and z' at calibration and predict time comes from here
    (the training loop's gradients keep the fast batched MLX forward).  Each row's result is
    a function of that row and the weights alone, bit for bit, whatever the batch around it
    (docs/how-it-works.md): the linear maps are error-free float64 products
    (:class:`~sdm_mlx.core.exact_product.ExactRowProduct`), rounded once to float32.

    * D ≥ M: h' = W_g x_norm + b_g (the coordinates), z' = W' h' + b' (h' in float32, as in the model);
    * D < M: coordinates = x_norm Rᵀ (``basis``, see the module doc) and z' = (W' W_g) x_norm + (W' b_g + b'),
      the two maps folded once in float64 so no row pays for the M-wide h'.

    x_norm = (x − μ) / σ is evaluated in float64.  ``basis`` is :func:`exemplar_basis` of the
    model (computed when not given); pass the stored one to reproduce stored support vectors.
    """

    def __init__(self, model: ExemplarAdaptor, basis=_NO_BASIS):
        self.basis = exemplar_basis(model) if basis is _NO_BASIS else basis
        self.dims = model.dims
        self._mean = np.array(model.input_mean, dtype=np.float64)  # scalar or [D] (DESIGN #2)
        self._std = np.array(model.input_std, dtype=np.float64)
        w_g = np.array(model.projection.weight, dtype=np.float64)
        b_g = np.array(model.projection.bias, dtype=np.float64)
        w_c = np.array(model.classifier.weight, dtype=np.float64)
        b_c = np.array(model.classifier.bias, dtype=np.float64)
        if self.basis is None:
            self._hidden = ExactRowProduct(w_g, b_g)
            self._logits = ExactRowProduct(w_c, b_c)
        else:
            classifier = ExactRowProduct(w_c, b_c)
            folded_w = ExactRowProduct(w_c)(w_g.T).T  # W' W_g [C, D]
            folded_b = classifier(b_g[None, :])[0]  # W' b_g + b'
            self._logits = ExactRowProduct(folded_w, folded_b)
            self._coordinates = ExactRowProduct(np.asarray(self.basis, dtype=np.float64).T)

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(x)
        if x.shape[0] == 0:
            return np.zeros((0, self.dims[2]), np.float32), np.zeros((0, min(self.dims[:2])), np.float32)
        if x.shape[0] > CHUNK_ROWS:  # bounded float64 working memory; rows are independent (bit for bit)
            parts = [self._rows(x[s : s + CHUNK_ROWS]) for s in range(0, x.shape[0], CHUNK_ROWS)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        return self._rows(x)

    def _rows(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x_norm = np.subtract(x, self._mean, dtype=np.float64)  # (x in float64 − μ) / σ, without a float64 copy of x
        x_norm /= self._std
        if self.basis is None:
            h = self._hidden.rounded(x_norm)
            return self._logits.rounded(h), h
        logits, coordinates = shared_products(x_norm, (self._logits, self._coordinates), rounded=True)
        return logits, coordinates
