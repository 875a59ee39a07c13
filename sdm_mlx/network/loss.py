"""SDM-network next-token loss, ``eq:sdm-network-next-token-training-loss`` (DESIGN #17, #18).

For a mini-batch of N tokens with final-norm hidden states ``h_n``, targets
``t_n = token + |V|`` (the positive half of the joint vocabulary) and the
document-level Similarity ``q_n`` and Distance quantile ``d_n`` of the verifier:

    f_gen  = log_{2+q} sdm(concat(z_neg, z_pos))       [N, 2|V|]
    f_ref  = log_{2+q} sdm(concat(z_ref, z_ref))       [N, 2|V|]   (no gradient)
    L      = mean_n  −f_gen[n, t_n]
    i_n    = 1 except 0 at argmax z_ref, argmax z_ref + |V|, argmax z_neg,
             argmax z_pos + |V| and t_n                 (``eq:regularization-mask``)
    R      = mean_n ‖ i_n ⊙ (f_ref − f_gen) ‖_2          (plain per-row L2, batch mean)
    s      = ln L / ln R                                (stop_gradient)
    R'     = sqrt( max(R, 1) ^ clip(s, 0, 1) )          (``eq:regularization-rescale``)
    loss   = L + β R'

Edge cases of ``s`` (not covered by the paper): a NaN ratio (L = 1 and R = 1,
or L = 0 with R = 1) is taken as s = 0; ±inf clip to 1 / 0.  Whenever R ≤ 1,
``max(R, 1) = 1`` so R' = 1 with zero gradient, whatever s is.  The per-row norm
has a zero (not NaN) gradient when the masked difference is exactly 0 (as at
initialisation, where W_pos = W_ref): the value is the plain L2 norm, no eps.

The arg-maxima are taken over the logits; for d > 0 they equal the arg-maxima
of the two halves of the log-SDM vectors (the paper's scaffolding), and for
d = 0 both log-SDM vectors are uniform so the mask does not matter.

β schedule (paper Listing, DESIGN #17): within each epoch mini-batch b (0-based)
of B uses ``β_b = β_min + b (β_max − β_min) / B``, resetting every epoch.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..core.activation import log_sdm
from ..errors import InputError


def regularization_mask(z_ref: mx.array, z_neg: mx.array, z_pos: mx.array, targets: mx.array) -> mx.array:
    """Mask ``i`` of ``eq:regularization-mask``: float32 ``[N, 2|V|]``, 1 everywhere except 0 at the five indices.

    ``targets`` are joint indices (``token + |V|`` for completion tokens).  Indices
    that coincide are zeroed once (the mask is a product of the five one-hot
    complements, as in the paper's scaffolding).
    """
    vocab = z_ref.shape[-1]
    n = z_ref.shape[0]
    cols = mx.arange(2 * vocab, dtype=mx.int32)[None, :]
    a_ref = mx.argmax(z_ref, axis=-1).astype(mx.int32)[:, None]
    a_neg = mx.argmax(z_neg, axis=-1).astype(mx.int32)[:, None]
    a_pos = mx.argmax(z_pos, axis=-1).astype(mx.int32)[:, None] + vocab
    t = targets.astype(mx.int32).reshape(n, 1)
    zero = (cols == a_ref) | (cols == a_ref + vocab) | (cols == a_neg) | (cols == a_pos) | (cols == t)
    return mx.stop_gradient(mx.where(zero, 0.0, 1.0).astype(mx.float32))


def _row_l2(x: mx.array) -> mx.array:
    """Plain per-row L2 norm with a zero gradient at 0 (instead of NaN)."""
    sq = mx.sum(x * x, axis=-1)
    pos = sq > 0
    return mx.where(pos, mx.sqrt(mx.where(pos, sq, 1.0)), 0.0)


def rescale_exponent(nll: mx.array, reg: mx.array) -> mx.array:
    """clip(s, 0, 1) with s = ln L / ln R computed without gradient (NaN ⇒ 0)."""
    s = mx.stop_gradient(mx.log(nll) / mx.log(reg))
    s = mx.where(mx.isnan(s), 0.0, s)
    return mx.clip(s, 0.0, 1.0)


def rescaled_regularizer(nll: mx.array, reg: mx.array) -> mx.array:
    """R' = sqrt(max(R, 1) ^ clip(s, 0, 1)) of ``eq:regularization-rescale``."""
    s = rescale_exponent(nll, reg)
    return mx.sqrt(mx.power(mx.maximum(reg, 1.0), s))


def network_loss_terms(z_ref: mx.array, z_neg: mx.array, z_pos: mx.array, targets: mx.array, q, d):
    """Per-token ``(−f_gen[n, t_n], ‖i_n ⊙ (f_ref − f_gen)‖_2)``, each ``[N]``: L and R are their batch means.

    (Data-parallel training sums them per rank, :mod:`.data_parallel`.)
    """
    z_ref = mx.stop_gradient(z_ref)
    joint = mx.concatenate([z_neg, z_pos], axis=-1)
    f_gen = log_sdm(joint, q, d)
    f_ref = mx.stop_gradient(log_sdm(mx.concatenate([z_ref, z_ref], axis=-1), q, d))
    t = targets.astype(mx.int32).reshape(-1, 1)
    nll_rows = -mx.take_along_axis(f_gen, t, axis=-1).squeeze(-1)
    mask = regularization_mask(z_ref, z_neg, z_pos, targets)
    return nll_rows, _row_l2(mask * (f_ref - f_gen))


def network_loss(
    z_ref: mx.array,
    z_neg: mx.array,
    z_pos: mx.array,
    targets: mx.array,
    q,
    d,
    *, beta,
) -> tuple[mx.array, tuple[mx.array, mx.array, mx.array]]:
    """``(total, (L, R, R'))`` of ``eq:sdm-network-next-token-training-loss`` for one mini-batch.

    ``z_*``: ``[N, |V|]`` logits; ``targets``: ``[N]`` joint indices in ``[0, 2|V|)``;
    ``q``, ``d``: ``[N]`` per token (the document's); ``beta``: scalar (pass an
    ``mx.array`` inside compiled code so a new β does not retrace).
    """
    nll_rows, reg_rows = network_loss_terms(z_ref, z_neg, z_pos, targets, q, d)
    nll = nll_rows.mean()
    reg = reg_rows.mean()
    reg_rescaled = rescaled_regularizer(nll, reg)
    total = nll + beta * reg_rescaled
    return total, (nll, reg, reg_rescaled)


def beta_schedule(num_batches: int, beta_min: float = 0.0, beta_max: float = 0.1) -> np.ndarray:
    """β for each mini-batch of one epoch: ``β_min + b (β_max − β_min) / num_batches``, b = 0 .. num_batches−1."""
    if num_batches < 1:
        return np.zeros(0, dtype=np.float64)
    if beta_min < 0 or beta_max < 0:
        raise InputError(f"beta_min and beta_max must be >= 0, got {beta_min}, {beta_max}")
    step = (beta_max - beta_min) / num_batches
    return beta_min + step * np.arange(num_batches, dtype=np.float64)
