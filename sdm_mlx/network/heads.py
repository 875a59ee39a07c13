"""The duplicated LM head of an SDM network (paper §"Negative+Positive Vocabulary Normalization").

M_ref = M_neg is the frozen ``mlx_lm.load()`` model, unchanged (quantised or
not).  Only its final linear layer is duplicated (DESIGN #19): the trainable
positive head ``W_pos`` is a float32 copy of the model's ``lm_head`` — or of
the tied embedding matrix (``embed_tokens.as_linear``) — dequantised with
``mx.dequantize`` when the model is quantised.  The transformer trunk is shared
and frozen, so

    h      = final-norm hidden state (the LM head's input, float32)
    z_ref  = z_neg = W_ref h        (the base model's own head, frozen)
    z_pos  = W_pos h                (float32, trainable)
    joint  = concat(z_neg, z_pos)   over 2|V| entries

and a joint index ``i`` maps back to the vocabulary token ``i mod |V|``.  The
base model is held *outside* the MLX parameter tree of :class:`SDMHeads`, so
``heads.trainable_parameters()`` is exactly ``{"pos": {"weight": W_pos}}``.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..llm import embed as _embed
from ..llm.model import model_dims
from ..errors import ArtifactError, InputError


class HeadShapeError(ArtifactError):
    """A positive head whose shape does not match the base model's vocabulary / hidden size (a user error:
    usually a head trained on another base model; also a ``ValueError``)."""


class PositiveHead(nn.Module):
    """Bias-free float32 linear layer ``z = h W^T`` with ``W`` of shape ``[|V|, D]`` (no random init)."""

    def __init__(self, weight: mx.array):
        super().__init__()
        if weight.ndim != 2:
            raise HeadShapeError(f"positive head weight must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
        self.weight = weight.astype(mx.float32)

    def __call__(self, h: mx.array) -> mx.array:
        return h @ self.weight.T


def is_tied(model) -> bool:
    """True if the model's output layer is its (tied) input embedding."""
    return getattr(model, "lm_head", None) is None


#: How z_ref = z_neg is computed: with the model's own head ("model": quantised heads use quantised
#: matmuls) or with a frozen float32 (dequantised) copy ("float32": +4·|V|·D bytes; the research code's
#: reference heads were float copies, and MLX's CPU quantised matmul is slow — ~10 s per 50-token step
#: for Phi-3.5's 4-bit head on a 2-core Linux CPU, vs 0.16 s in float32).
REFERENCE_HEADS = ("model", "float32")


class SDMHeads(nn.Module):
    """Frozen reference/negative head (the base model's) + trainable float32 positive head ``pos``.

    ``SDMHeads(model)`` initialises ``W_pos`` as a float32 copy of the model's
    head; ``SDMHeads(model, pos_weight)`` attaches a given ``[|V|, D]`` weight
    (shape-checked).  ``reference_head`` chooses how z_ref = z_neg is computed
    (see :data:`REFERENCE_HEADS`).  The model is frozen (``model.freeze()``) and
    kept out of this module's parameters.
    """

    def __init__(self, model, pos_weight=None, reference_head: str = "model"):
        super().__init__()
        _embed.trunk(model)  # validates the model layout
        if reference_head not in REFERENCE_HEADS:
            raise InputError(f"reference_head must be one of {REFERENCE_HEADS}, got {reference_head!r}")
        object.__setattr__(self, "_model", model)  # not part of the parameter tree
        model.freeze()
        vocab, hidden = model_dims(model)
        ref_w = None
        if reference_head == "float32":
            ref_w = _embed.lm_head_weight(model)
            mx.eval(ref_w)
        object.__setattr__(self, "_ref_w", ref_w)  # frozen float32 copy (not a parameter), or None
        object.__setattr__(self, "reference_head", reference_head)
        if pos_weight is None:
            w = _embed.lm_head_weight(model) if ref_w is None else ref_w
        else:
            w = pos_weight if isinstance(pos_weight, mx.array) else mx.array(np.asarray(pos_weight))
            if tuple(w.shape) != (vocab, hidden):
                raise HeadShapeError(
                    f"positive head has shape {tuple(w.shape)} but the base model's LM head is "
                    f"[{vocab}, {hidden}] (vocabulary x hidden size): the head was trained for a different model"
                )
        self.pos = PositiveHead(mx.array(w, dtype=mx.float32))
        mx.eval(self.pos.weight)
        object.__setattr__(self, "vocab_size", vocab)
        object.__setattr__(self, "hidden_size", hidden)
        object.__setattr__(self, "tied", is_tied(model))

    @property
    def model(self):
        """The frozen base model (M_ref = M_neg)."""
        return self._model

    # -- logits ------------------------------------------------------------------------------
    def ref_logits(self, h: mx.array) -> mx.array:
        """z_ref = the base model's head applied to float32 hidden states (no gradient)."""
        if self._ref_w is not None:
            return mx.stop_gradient(h.astype(mx.float32) @ self._ref_w.T)
        return mx.stop_gradient(_embed.logits_from_hidden(self._model, h).astype(mx.float32))

    def neg_logits(self, h: mx.array) -> mx.array:
        """z_neg: identical to z_ref here (W_neg = W_ref, trunk shared and frozen)."""
        return self.ref_logits(h)

    def pos_logits(self, h: mx.array) -> mx.array:
        """z_pos = W_pos h (float32, differentiable in W_pos)."""
        return self.pos(h.astype(mx.float32))

    def joint_logits(self, h: mx.array) -> mx.array:
        """concat(z_neg, z_pos) along the last axis: 2|V| entries."""
        return mx.concatenate([self.neg_logits(h), self.pos_logits(h)], axis=-1)

    def next_tokens(self, h: mx.array) -> mx.array:
        """Greedy joint decoding: ``argmax(concat(z_neg, z_pos)) mod |V|`` (int32, shape ``h.shape[:-1]``)."""
        return joint_argmax(self.neg_logits(h), self.pos_logits(h))

    # -- hidden states -----------------------------------------------------------------------
    def hidden_states(self, token_ids_batch, cache=None) -> mx.array:
        """Final-norm hidden states (float32 ``[B, T, D]``) of the frozen trunk (see :func:`sdm_mlx.llm.embed.hidden_states`)."""
        return _embed.hidden_states(self._model, token_ids_batch, cache=cache)

    def weight_numpy(self) -> np.ndarray:
        """W_pos as float32 NumPy ``[|V|, D]``."""
        return np.array(self.pos.weight, dtype=np.float32)


def joint_argmax(z_neg: mx.array, z_pos: mx.array) -> mx.array:
    """Token ids ``argmax(concat(z_neg, z_pos), -1) mod |V|`` (ties: the lowest joint index, i.e. neg first)."""
    vocab = z_neg.shape[-1]
    idx = mx.argmax(mx.concatenate([z_neg, z_pos], axis=-1), axis=-1)
    return (idx % vocab).astype(mx.int32)


def token_hidden_states(
    model,
    sequences: Sequence[Sequence[int]],
    positions: Sequence[Sequence[int]],
    batch_size: int = 8,
    progress=None,
    prefix_ids: Sequence[int] | None = None,
) -> np.ndarray:
    """Final-norm hidden states at chosen positions, concatenated over sequences: float32 ``[sum len, D]``.

    ``positions[i]`` are indices into ``sequences[i]``; only ``sequences[i][:max(positions[i]) + 1]``
    is run (the model is causal).  The token prefix every cut sequence shares (up to the first chosen
    position; with ``prefix_ids``, also shared with it: data-parallel ranks pass the whole set's) is
    prefilled once into an mlx-lm prompt cache, its keys and values broadcast over each batch, and only each row's
    own tokens run (exact for causal models, as in :func:`sdm_mlx.llm.embed.document_features`).  Sequences are
    processed ``batch_size`` at a time, longest first, with right padding.  Used to cache the frozen states of the
    y = 1 completion tokens once (DESIGN #19).
    """
    n = len(sequences)
    if len(positions) != n:
        raise InputError("positions must have one entry per sequence")
    need = [int(max(p)) + 1 if len(p) else 0 for p in positions]
    cut = [list(sequences[i][: need[i]]) for i in range(n) if need[i] > 0]
    shared = 0
    if cut:
        first = min(int(min(p)) for p in positions if len(p))
        shared = min(_embed.common_prefix_length(cut + ([list(prefix_ids)] if prefix_ids is not None else [])),
                     first)
    prefix = _embed.run_shared_prefix(model, cut[0][:shared]) if shared else None
    shared = prefix.length if prefix is not None else 0
    order = sorted(range(n), key=lambda i: -need[i])
    parts: list = [None] * n
    for b0 in range(0, n, batch_size):
        idx = [i for i in order[b0 : b0 + batch_size] if need[i] > 0]
        if not idx:
            continue
        cache = _embed.prefix_caches(prefix) if prefix is not None else None
        h = _embed.hidden_states(model, [list(sequences[i][shared : need[i]]) for i in idx], cache=cache)
        mx.eval(h)
        for k, i in enumerate(idx):
            at = np.asarray(positions[i], dtype=np.int32) - shared
            parts[i] = np.array(h[k][mx.array(at)], dtype=np.float32)
        if progress is not None:
            progress(len(idx))
    width = None
    for p in parts:
        if p is not None:
            width = p.shape[1]
            break
    if width is None:
        return np.zeros((0, 0), dtype=np.float32)
    return np.concatenate([p for p in parts if p is not None], axis=0)
