"""The SDM activation function, its log with change of base, and the SDM NLL loss.

Paper: ``eq:sdmActivation`` and ``eq:sdm-loss``.  All functions are pure MLX,
differentiable and batched: ``z`` is ``[N, C]``, ``q`` and ``d`` are ``[N]``
(one Similarity and one Distance quantile per row).

    sdm(z')_i = (2+q)^(d·z'_i) / Σ_c (2+q)^(d·z'_c) = softmax(z' · d · ln(2+q))_i

so q = e−2, d = 1 is exactly the softmax and d = 0 is the uniform distribution.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..errors import InputError

#: The offset added to q in the base of the exponent, ``2 + q``.
Q_OFFSET = 2.0

#: q value that makes the base ``2 + q`` equal to e (SDM = softmax when d = 1).
Q_SOFTMAX = math.e - Q_OFFSET


def _as_row_vector(x, n: int) -> mx.array:
    x = mx.array(x, dtype=mx.float32) if not isinstance(x, mx.array) else x.astype(mx.float32)
    if x.ndim == 0:
        x = mx.broadcast_to(x, (n,))
    return x.reshape(-1)


def _log_base(q: mx.array) -> mx.array:
    """ln(2+q) = 1 + ln(1 + (q − (e−2))/e) elementwise: exactly 1 at q = e−2, so SDM(d=1) is exactly softmax."""
    return 1.0 + mx.log1p((q - Q_SOFTMAX) / math.e)


def _scaled_logits(z: mx.array, q, d) -> tuple[mx.array, mx.array]:
    """Return (z'·d·ln(2+q), ln(2+q)[:, None])."""
    n = z.shape[0]
    log_base = _log_base(_as_row_vector(q, n))[:, None]
    return z * (_as_row_vector(d, n)[:, None] * log_base), log_base


def sdm(z: mx.array, q, d) -> mx.array:
    """SDM activation, ``eq:sdmActivation``: (2+q)^(d·z'_i) / Σ_c (2+q)^(d·z'_c), row-wise."""
    scaled, _ = _scaled_logits(z, q, d)
    return mx.softmax(scaled, axis=-1)


def sdm_numpy(z: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """:func:`sdm` of host arrays [N, C], [N], [N], evaluated eagerly to NumPy (the estimator's scoring path).

    The same float32 operations as :func:`sdm`, with q and d handed to MLX as columns [N, 1] already: no
    reshapes in the graph, whose evaluation (a few µs per operation) is most of a single row's cost."""
    n = z.shape[0]
    q_col = mx.array(np.asarray(q).astype(np.float32).reshape(n, 1))
    d_col = mx.array(np.asarray(d).astype(np.float32).reshape(n, 1))
    return np.array(mx.softmax(mx.array(z) * (d_col * _log_base(q_col)), axis=-1))


def log_sdm(z: mx.array, q, d) -> mx.array:
    """log_{2+q} of the SDM activation, ``eq:sdm-loss`` (exact log-softmax divided by ln(2+q))."""
    scaled, log_base = _scaled_logits(z, q, d)
    log_probs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    return log_probs / log_base


def sdm_nll_loss(z: mx.array, y: mx.array, q, d, reduction: str = "mean") -> mx.array:
    """SDM NLL loss with change of base, ``eq:sdm-loss``: −log_{2+q} sdm(z')_y (mean over rows)."""
    logp = log_sdm(z, q, d)
    nll = -mx.take_along_axis(logp, y.astype(mx.int32).reshape(-1, 1), axis=-1).squeeze(-1)
    if reduction == "mean":
        return nll.mean()
    if reduction == "sum":
        return nll.sum()
    if reduction == "none":
        return nll
    raise InputError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
