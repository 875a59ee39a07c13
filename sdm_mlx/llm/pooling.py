"""Which hidden states a feature pools, and the one pooling (DESIGN #21).

The definitions of the positions are in :mod:`sdm_mlx.llm.embed` (its docstring): a feature of a document is
``concat(mean(h_f .. h_{n-1}), h_{n-1})`` over its ``n`` kept positions.  This module holds the arithmetic
that every caller shares: how many positions to keep (:func:`kept_positions`, and :func:`generated_n_kept` for
a prompt plus generated tokens), where the mean starts (:func:`pooled_from`, :func:`common_prefix_length`) and
the pooling itself (:func:`pool_states`, :func:`pool_hidden` for one document).  It runs no model:
:mod:`.embed` runs the trunk and pools with these functions, and so do the decoding and training code.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InputError
from .tokens import DEFAULT_DELIMITER, delimiter_token_index

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "POSITIONS",
    "POOLINGS",
    "ON_MISSING",
    "kept_positions",
    "generated_n_kept",
    "pool_states",
    "pool_hidden",
    "common_prefix_length",
    "pooled_from",
    "FEATURE_PARTS",
    "DEFAULT_FEATURE_PARTS",
    "UNRECORDED_FEATURE_PARTS",
    "verifier_parts",
    "check_feature_parts",
]

#: Default number of kept positions (the research code's 500-position cut).
DEFAULT_MAX_LENGTH = 500
POSITIONS = ("delimiter", "last")
#: Mean half of the feature: over all kept positions (the paper's) or without the shared prompt prefix (DESIGN #21).
POOLINGS = ("all", "non-shared")
ON_MISSING = ("error", "last", "prompt")
#: The pooled parts a feature may concatenate, in the order they are concatenated: the element-wise max over
#: the kept positions (the author's current encoding adds it), the mean, and the last kept state (DESIGN #21).
FEATURE_PARTS = ("max", "mean", "last")
#: The default feature: ``concat(mean, last)`` (DESIGN #21), 2D wide.  The one owner of the default: the embed
#: verb, recipes, the answers stage and Alg. 4's own verification layer read it from here.
DEFAULT_FEATURE_PARTS = ("mean", "last")
#: What a verification layer or a features file that records no parts was made of: every feature before the parts
#: became an option was ``concat(mean, last)``.  Fixed, whatever the default becomes.
UNRECORDED_FEATURE_PARTS = ("mean", "last")


def check_feature_parts(parts) -> tuple[str, ...]:
    """``parts`` as a tuple in :data:`FEATURE_PARTS` order, after checking it names known, distinct parts.

    Accepts a sequence or a comma-separated string (``"max,mean,last"``)."""
    if isinstance(parts, str):
        parts = [p.strip() for p in parts.split(",") if p.strip()]
    parts = tuple(parts)
    unknown = [p for p in parts if p not in FEATURE_PARTS]
    if not parts or unknown or len(set(parts)) != len(parts):
        raise InputError(f"feature parts must be distinct names from {FEATURE_PARTS} (e.g. 'mean,last' or "
                         f"'max,mean,last'), got {parts!r}")
    return tuple(p for p in FEATURE_PARTS if p in parts)


def part_columns(recorded, wanted, width: int, where: str, fix: str) -> np.ndarray:
    """Column indices of the parts ``wanted`` in features of ``width`` columns that concatenate the parts
    ``recorded`` (each ``width / len(recorded)`` wide); :class:`~sdm_mlx.errors.InputError` naming ``where`` and
    ``fix`` when a wanted part is not recorded."""
    recorded, wanted = tuple(recorded), tuple(wanted)
    if not set(wanted) <= set(recorded):
        raise InputError(f"{where}: the rows record the features {','.join(recorded)}, not {','.join(wanted)}; "
                         f"{fix}")
    if not recorded or width % len(recorded):
        raise InputError(f"{where}: feature width {width} is not a multiple of {len(recorded)} parts")
    d = width // len(recorded)
    return np.concatenate([np.arange(recorded.index(p) * d, (recorded.index(p) + 1) * d) for p in wanted])


def verifier_parts(verifier) -> tuple[str, ...]:
    """The pooled parts a verification layer (a fitted ``SDMEstimator``) was trained on: its recorded
    ``feature_parts_``, or :data:`UNRECORDED_FEATURE_PARTS` for a layer that recorded none (saved before the parts
    were recorded)."""
    return tuple(getattr(verifier, "feature_parts_", None) or UNRECORDED_FEATURE_PARTS)


def kept_positions(n_tokens: int, target: int, max_length: int) -> tuple[int, bool]:
    """``(n_kept, truncated)`` for a wanted count ``target`` of positions: ``min(target, max_length)``, at least 1."""
    if max_length < 1:
        raise InputError("max_length must be >= 1")
    target = max(1, min(int(target), int(n_tokens)))
    return min(target, max_length), target > max_length


def generated_n_kept(
    tokenizer,
    prompt_length: int,
    generated_ids: Sequence[int],
    delimiter: str = DEFAULT_DELIMITER,
    max_length: int = DEFAULT_MAX_LENGTH,
    on_missing: str = "prompt",
) -> tuple[int, dict]:
    """How many hidden states of *prompt + generated tokens* to pool (use (b) of :mod:`sdm_mlx.llm.embed`).

    Hidden state ``t`` is that of position ``t`` of ``prompt_ids + generated_ids``
    (the prompt's ``prompt_length`` states, then one per fed generated token).
    If generated token ``g_i`` (global index ``j = prompt_length + i``) holds
    the last delimiter of the generated text, ``n = j`` (the last pooled state
    predicts the delimiter).  If there is none (a parse failure),
    ``on_missing="prompt"`` pools the prompt states only (the research code's
    choice), ``"last"`` all states, ``"error"`` raises.  Returns ``(n_kept,
    info)`` with ``info = {"delimiter_index", "truncated", "missing_delimiter"}``.
    """
    if on_missing not in ON_MISSING:
        raise InputError(f"on_missing must be one of {ON_MISSING}")
    gen = list(generated_ids)
    i = delimiter_token_index(tokenizer, gen, delimiter=delimiter)
    total = prompt_length + len(gen)
    missing = i is None
    if missing:
        if on_missing == "error":
            raise InputError(f"generated text has no closing delimiter {delimiter!r}")
        target = prompt_length if on_missing == "prompt" else total
        j = -1
    else:
        j = prompt_length + i
        target = j
    n, truncated = kept_positions(total, target, max_length)
    return n, {"delimiter_index": j, "truncated": truncated, "missing_delimiter": missing}


def pool_states(states, n_kept, first=None, parts=DEFAULT_FEATURE_PARTS):
    """The one pooling of the features (DESIGN #21): per row ``concat(mean(h[first:n]), h[n-1])``, float32 ``mx.array``.

    ``states``: ``[B, T, D]`` hidden states (``mx.array`` or NumPy; positions
    past a row's ``n`` are ignored, so right padding is harmless); ``n_kept``:
    ``[B]`` kept positions ``n``; ``first``: ``[B]`` first pooled position of
    the mean (default 0: the paper's pooling over all kept positions; see
    :func:`pooled_from` for ``pooling="non-shared"``).  The second half is always
    the state at ``n - 1``.  ``parts`` (checked by the caller, :func:`check_feature_parts`) chooses
    what is concatenated, in :data:`FEATURE_PARTS` order: ``("max", "mean", "last")`` prepends the
    element-wise max over the same positions as the mean (``[B, 3D]``).
    """
    import mlx.core as mx

    h = states if isinstance(states, mx.array) else mx.array(np.asarray(states, dtype=np.float32))
    h = h.astype(mx.float32)
    n = mx.array(np.asarray(n_kept, dtype=np.int32).reshape(-1))
    f = mx.zeros_like(n) if first is None else mx.array(np.asarray(first, dtype=np.int32).reshape(-1))
    t = mx.arange(h.shape[1])[None, :]
    mask = ((t >= f[:, None]) & (t < n[:, None]))[..., None]
    pooled = {}
    if "max" in parts:
        pooled["max"] = mx.where(mask, h, -mx.inf).max(axis=1)
    if "mean" in parts:
        pooled["mean"] = mx.where(mask, h, 0.0).sum(axis=1) / (n - f).astype(mx.float32)[:, None]
    if "last" in parts:
        pooled["last"] = mx.take_along_axis(h, (n - 1)[:, None, None], axis=1)[:, 0, :]
    return mx.concatenate([pooled[p] for p in parts], axis=1)


def pool_hidden(hidden, n_kept: int, first: int = 0, parts=DEFAULT_FEATURE_PARTS) -> np.ndarray:
    """:func:`pool_states` of one document's ``[T, D]`` states (``mx.array``, pooled in MLX without a NumPy
    round trip, or NumPy), as float32 NumPy ``[len(parts) * D]``."""
    import mlx.core as mx

    h = hidden if isinstance(hidden, mx.array) else np.asarray(hidden, dtype=np.float32)
    if h.ndim != 2 or not 1 <= n_kept <= h.shape[0] or not 0 <= first < n_kept:
        raise InputError(f"need 0 <= first < n_kept <= T for hidden states of shape {tuple(h.shape)}, "
                         f"got first={first}, n_kept={n_kept}")
    return np.array(pool_states(h[None], [n_kept], [first], parts)[0], dtype=np.float32)


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of token-id sequences (0 for none; a lone sequence's own length)."""
    seqs = [list(s) for s in sequences]
    if not seqs:
        return 0
    width = min(len(s) for s in seqs)
    if width == 0:
        return 0
    grid = np.array([s[:width] for s in seqs], dtype=np.int64)
    differs = (grid != grid[0]).any(axis=0)
    return int(np.argmax(differs)) if differs.any() else width


def pooled_from(ids: Sequence[int], n_kept: int, pooling: str, shared_prefix: Sequence[int] | None) -> int:
    """First position of the mean: 0 for ``"all"``; for ``"non-shared"`` the length of the common prefix of
    ``ids`` and ``shared_prefix`` (the prompt part every row shares), at most ``n_kept - 1``."""
    if pooling not in POOLINGS:
        raise InputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if pooling == "all" or not shared_prefix:
        return 0
    return min(common_prefix_length([list(ids[:n_kept]), list(shared_prefix)]), n_kept - 1)
