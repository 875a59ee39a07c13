"""The exemplar adaptor: frozen features x → exemplar vector h' → logits z'.

The paper's 1-D CNN has kernel = stride = D (the full input width) and one
input channel, so it is exactly a dense affine map; with no nonlinearity the
adaptor is (DESIGN #3)

    x_norm = (x − μ) / σ          (one scalar μ, σ (ddof=1) over the training split)
    h'     = W_g x_norm + b_g     Linear(D, M): the exemplar vector
    z'     = W' h' + b'           Linear(M, C): the logits (Magnitude)

Every weight and bias is initialised U(±1/sqrt(fan_in)) from an explicit MLX key.

Exemplar coordinates.  The support index only needs squared L2 distances
between exemplar vectors.  When D < M, every h' lies in a D-dimensional affine
subspace: with the thin QR factorisation W_g = Q R (Q: M×D orthonormal
columns), ‖h'_i − h'_j‖² = ‖R (x_i − x_j)_norm‖², so distances (and hence q,
d0, d and every neighbour) are computed exactly on the D-dim coordinates
``x_norm Rᵀ`` at M/D times less cost.  When D ≥ M the coordinates are h'
itself.  :func:`exemplar_coordinates` returns whichever applies.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


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

    def set_normalization(self, mean: float, std: float) -> None:
        """Set the scalar μ, σ applied to every input (σ must be > 0)."""
        if not np.isfinite(mean) or not np.isfinite(std) or std <= 0:
            raise ValueError(f"normalisation needs a finite mean and a positive std, got mean={mean}, std={std}")
        self.input_mean = mx.array(float(mean))
        self.input_std = mx.array(float(std))
        self.freeze(keys=["input_mean", "input_std"], recurse=False)

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Return (z' [N, C], h' [N, M])."""
        h = self.projection((x - self.input_mean) / self.input_std)
        return self.classifier(h), h


def scalar_normalization(x: np.ndarray) -> tuple[float, float]:
    """One scalar mean and sample std (ddof=1) over every element of the training features."""
    x = np.asarray(x, dtype=np.float64)
    if x.size < 2:
        raise ValueError("need at least two feature values to compute the normalisation std")
    std = float(x.std(ddof=1))
    if not std > 0:
        raise ValueError("training features are constant (std = 0); disable normalisation or check the data")
    return float(x.mean()), std


def exemplar_basis(model: ExemplarAdaptor) -> np.ndarray | None:
    """Rᵀ [D, D] with ‖h'_i − h'_j‖ = ‖(x_i − x_j)_norm Rᵀ‖ (W_g = QR) when D < M, else None."""
    w = np.array(model.projection.weight, dtype=np.float64)  # [M, D]
    if w.shape[1] >= w.shape[0]:
        return None
    _, r = np.linalg.qr(w)
    return np.ascontiguousarray(r.T, dtype=np.float32)


_NO_BASIS = object()


def forward_with_coordinates(model: ExemplarAdaptor, x: np.ndarray, batch_size: int = 1024, basis=_NO_BASIS):
    """(z' [N, C], exemplar coordinates [N, min(D, M)]) — distance-equivalent to h' (see module doc).

    ``basis`` is :func:`exemplar_basis` of the model (computed here when not given).
    """
    if basis is _NO_BASIS:
        basis = exemplar_basis(model)
    if basis is None:
        return forward_in_batches(model, x, batch_size)
    basis_mx = mx.array(basis)
    zs, cs = [], []
    for start in range(0, x.shape[0], batch_size):
        xb = mx.array(x[start : start + batch_size])
        z, _ = model(xb)
        c = ((xb - model.input_mean) / model.input_std) @ basis_mx
        mx.eval(z, c)
        zs.append(np.array(z))
        cs.append(np.array(c))
    if not zs:
        return np.zeros((0, model.dims[2]), np.float32), np.zeros((0, basis.shape[1]), np.float32)
    return np.concatenate(zs), np.concatenate(cs)


def forward_in_batches(model: ExemplarAdaptor, x: np.ndarray, batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """(z' [N, C], h' [N, M]) as float32 NumPy, evaluated in batches without gradients."""
    zs, hs = [], []
    for start in range(0, x.shape[0], batch_size):
        z, h = model(mx.array(x[start : start + batch_size]))
        mx.eval(z, h)
        zs.append(np.array(z))
        hs.append(np.array(h))
    d, m, c = model.dims
    if not zs:
        return np.zeros((0, c), np.float32), np.zeros((0, m), np.float32)
    return np.concatenate(zs), np.concatenate(hs)
