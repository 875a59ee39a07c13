"""Hidden-state features of an mlx-lm language model (DESIGN #21).

Positions, explicitly
---------------------
For a token sequence ``x_0 .. x_{T-1}`` let ``h_t`` be the model's *final-norm*
hidden state at position ``t`` (the input of the LM head, ``model.model(x)`` in
mlx-lm's llama / phi3 / qwen2 / mistral-style models).  ``h_t`` is the state that
**predicts** ``x_{t+1}``.  A document's feature vector is::

    embedding = concat( mean(h_0 .. h_{n-1}),  h_{n-1} )   in R^{2D}, float32

where ``n`` (``n_kept``) is the number of kept positions:

* ``position="delimiter"`` (default; the paper's verifier input): let ``j`` be
  the index of the token that contains the **last** closing-delimiter character
  (default ``"}"``, the final brace of a JSON answer such as
  ``{"sentiment": "positive"}`` or ``{"correctness": true}``) inside the
  completion.  Then ``n = j``: the mean covers every position before the
  delimiter token (system, user, document and completion tokens) and the second
  half is ``h_{j-1}``, the state that predicts the delimiter token.  The
  delimiter token itself and anything after it (e.g. ``<|end|>``) never enter.
  The token is found from the tokenisation (incremental decoding), never as a
  fixed offset from the end: for Phi-3.5 it is ``"}`` (id 9092) after a string
  value and ``}`` (id 29913) after a bool.
* ``position="last"``: ``n = T``; the second half is ``h_{T-1}``, the state at
  the last token (it predicts whatever would follow the text).
* truncation: ``n = min(n, max_length)`` — only the first ``max_length``
  positions are ever used.  If the wanted position lies beyond them, the state
  at the last kept position ``max_length - 1`` is used instead and the document
  is flagged ``truncated`` (the research code's cut was 500 positions, with the
  last row at 496; here it is ``max_length - 1``).

Because the models are causal, ``h_0 .. h_{n-1}`` depend only on ``x_0 ..
x_{n-1}``: documents are cut to ``n`` tokens before the forward pass, batched
with right padding, and padded positions are masked out of the mean, so the
features do not depend on the batch composition (up to float rounding, ~1e-6).
For the same reason the states of a token prefix that every document of a call
shares (a chat template, system message and instruction: ~42 of ~59 tokens of
a factcheck verification prompt) are the same in every document: that prefix
runs through the model once, its keys and values are broadcast over each batch and
only each document's own tokens run; the prefix's states enter the mean as
they are (:func:`run_shared_prefix`, :func:`prefix_caches`).

Pooling (DESIGN #21): ``pooling="all"`` (default, the paper's) takes the mean
over all ``n`` kept positions; ``pooling="non-shared"`` starts the mean after
the document's common prefix with ``shared_prefix`` (the prompt part every row
shares), i.e. over the document and completion positions.  Every caller pools
with :func:`pool_states`; it and the position arithmetic live in :mod:`sdm_mlx.llm.pooling` (re-exported here).

Reuse by the SDM-network / verified-generation code
---------------------------------------------------
(a) force-decoded prompt + completion: :func:`prompt_completion_features`
    (texts or token lists), or :func:`document_features` with explicit
    ``completion_spans``;
(b) already-computed hidden states of a prompt plus generated tokens: compute
    ``n`` with :func:`generated_n_kept` and pool with :func:`pool_hidden`.
:func:`hidden_states`, :func:`logits_from_hidden` and :func:`lm_head_weight`
expose the trunk and the (tied or untied, possibly quantised) LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import InputError
from .model import (  # re-exported: callers find the model access in sdm_mlx.llm.embed
    hidden_states,
    lm_head_weight,
    load_model,
    load_tokenizer,
    logits_from_hidden,
    run_shared_prefix,
    SharedPrefix,
    prefix_caches,
    trunk,
)
from .pooling import (  # re-exported: callers find the positions and the pooling in sdm_mlx.llm.embed
    DEFAULT_FEATURE_PARTS,
    DEFAULT_MAX_LENGTH,
    FEATURE_PARTS,
    ON_MISSING,
    POOLINGS,
    POSITIONS,
    check_feature_parts,
    common_prefix_length,
    generated_n_kept,
    kept_positions,
    pool_hidden,
    pool_states,
    pooled_from,
)
from .tokens import (  # re-exported: callers find the text/token helpers in sdm_mlx.llm.embed
    DEFAULT_DELIMITER,
    chat_text,
    delimiter_token_index,
    delimiter_token_index_in_text,
    encode,
    eos_token_ids,
    prompt_tail,
)

__all__ = [
    "DEFAULT_FEATURE_PARTS",
    "FeatureOptions",
    "FEATURE_PARTS",
    "check_feature_parts",
    "DEFAULT_MAX_LENGTH",
    "POSITIONS",
    "ON_MISSING",
    "load_model",
    "load_tokenizer",
    "trunk",
    "hidden_states",
    "logits_from_hidden",
    "lm_head_weight",
    "kept_positions",
    "generated_n_kept",
    "pool_hidden",
    "pool_states",
    "pooled_from",
    "common_prefix_length",
    "POOLINGS",
    "DocumentError",
    "Features",
    "document_features",
    "prompt_completion_features",
    "DEFAULT_DELIMITER",
    "chat_text",
    "delimiter_token_index",
    "delimiter_token_index_in_text",
    "encode",
    "eos_token_ids",
    "prompt_tail",
]

# --------------------------------------------------------------------------- batched features


class DocumentError(InputError):
    """A problem with one document of a batch; ``index`` is its position in the input list (a user error:
    ``SDMError``, ``ValueError``)."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"document {index}: {reason}")
        self.index, self.reason = index, reason


@dataclass
class Features:
    """Per-document features and the positions they came from (all arrays have one entry per document).

    ``embeddings[i] = concat(mean(h_f..h_{n-1}), h_{n-1})`` with ``n = n_kept[i]`` and ``f =
    pooled_from[i]`` (0 for ``pooling="all"``; ``shared_prefix``: the token ids whose common prefix with
    a document ``pooling="non-shared"`` leaves out — record both with the features);
    ``delimiter_index[i]`` is the token index of the delimiter token (-1: not used
    or not found); ``n_tokens[i]`` the encoded length before truncation.
    """

    embeddings: np.ndarray
    n_tokens: np.ndarray
    n_kept: np.ndarray
    delimiter_index: np.ndarray
    truncated: np.ndarray
    missing_delimiter: np.ndarray
    pooled_from: np.ndarray | None = None
    pooling: str = "all"
    shared_prefix: list | None = None


def _plan(tokenizer, doc, span, position, delimiter, max_length, *, on_missing, idx):
    """Token ids and position bookkeeping for one document."""
    if isinstance(doc, str):
        ids = encode(tokenizer, doc)
    else:
        ids = [int(t) for t in doc]
    if not ids:
        raise DocumentError(idx, "empty after tokenisation")
    if position == "last":
        n, trunc = kept_positions(len(ids), len(ids), max_length)
        return ids, n, -1, trunc, False
    if isinstance(doc, str):
        j = delimiter_token_index_in_text(tokenizer, doc, ids, span, delimiter)
    else:
        a, b = (0, None) if span is None else span
        j = delimiter_token_index(tokenizer, ids, a, b, delimiter)
    if j is None or j == 0:
        if on_missing == "error":
            reason = (
                f"no closing delimiter {delimiter!r} in the completion"
                if j is None
                else f"the closing delimiter {delimiter!r} is the first token (no state predicts it)"
            )
            raise DocumentError(idx, reason + " (use position 'last' or on-missing 'last'/'prompt')")
        if on_missing == "last":
            target = len(ids)
        elif span is None:
            target = 0
        else:  # pool the prompt, i.e. the positions before the completion
            target = len(encode(tokenizer, doc[: span[0]])) if isinstance(doc, str) else span[0]
        n, trunc = kept_positions(len(ids), target, max_length)
        return ids, n, -1, trunc, True
    n, trunc = kept_positions(len(ids), j, max_length)
    return ids, n, j, trunc, False


def _check_feature_options(n_docs: int, completion_spans, position: str, on_missing: str, batch_size: int) -> list:
    """The completion spans (one per document), after checking the options of :func:`document_features`."""
    if position not in POSITIONS:
        raise InputError(f"position must be one of {POSITIONS}, got {position!r}")
    if on_missing not in ON_MISSING:
        raise InputError(f"on_missing must be one of {ON_MISSING}, got {on_missing!r}")
    if batch_size < 1:
        raise InputError("batch_size must be >= 1")
    spans = list(completion_spans) if completion_spans is not None else [None] * n_docs
    if len(spans) != n_docs:
        raise InputError("completion_spans must have one entry per document")
    return spans


def _pooled_batch(model, prefix: SharedPrefix | None, seqs: list, lens: list[int], first: list[int],
                  parts: tuple = DEFAULT_FEATURE_PARTS) -> np.ndarray:
    """Pooled features float32 [B, len(parts) * D] of one batch of kept tokens: the shared prefix comes from its cache
    and states, only each row's own tokens (right-padded) run through the trunk."""
    import mlx.core as mx

    p = prefix.length if prefix is not None else 0
    cache = prefix_caches(prefix) if p else None
    h = hidden_states(model, [s[p:] for s in seqs], cache=cache)
    if p:
        shared = mx.broadcast_to(prefix.states[None], (len(seqs),) + tuple(prefix.states.shape))
        h = mx.concatenate([shared, h], axis=1)
    feats = pool_states(h, lens, first, parts)
    mx.eval(feats)
    return np.array(feats, dtype=np.float32)


def _pooled_all(model, seqs: list, first: np.ndarray, batch_size: int, progress, *, prefix_ids,
                parts: tuple = DEFAULT_FEATURE_PARTS) -> np.ndarray:
    """Features of every (cut) sequence: their common prefix with ``prefix_ids`` runs once, then batches of
    ``batch_size`` rows, longest first.  Each row keeps at least one own token (its last state comes from its
    own pass).  The prefix run once depends only on ``prefix_ids`` and the rows' own tokens, so callers that
    split one set of rows (data-parallel ranks) and pass the whole set's prefix get the same rows bit for bit."""
    n_kept = np.array([len(s) for s in seqs], dtype=np.int64)
    shared = min(common_prefix_length(list(seqs) + [list(prefix_ids)]), int(n_kept.min()) - 1)
    prefix = run_shared_prefix(model, seqs[0][:shared])
    order = np.argsort(-n_kept, kind="stable")
    out = None
    for b0 in range(0, len(seqs), batch_size):
        idx = order[b0 : b0 + batch_size]
        feats = _pooled_batch(model, prefix, [seqs[i] for i in idx], [int(n_kept[i]) for i in idx],
                              [int(first[i]) for i in idx], parts)
        if out is None:
            out = np.empty((len(seqs), feats.shape[1]), dtype=np.float32)
        out[idx] = feats
        if progress is not None:
            progress(len(idx))
    return out


@dataclass(frozen=True)
class FeatureOptions:
    """How :func:`document_features` pools (its keywords).

    ``position``: ``"delimiter"`` (the last ``delimiter`` in the completion) or ``"last"``.
    ``max_length``: kept positions (DESIGN #21).
    ``on_missing``: what to do when the completion holds no delimiter —
    ``"error"`` (ValueError naming the document), ``"last"`` (use the last
    token), ``"prompt"`` (pool the positions before the completion only).
    ``pooling``: ``"all"`` (the paper's mean over every kept position) or
    ``"non-shared"`` (the mean leaves out each document's common prefix with
    ``shared_prefix``, token ids; default: the longest common token prefix of
    these documents — pass it when documents come one at a time).
    ``batch_size``: documents per batch; ``progress(k)`` is called after each batch of ``k``.
    ``parts``: the pooled parts concatenated (:data:`FEATURE_PARTS`; default
    ``("mean", "last")``, DESIGN #21; ``"max,mean,last"`` adds the element-wise max).
    """

    position: str = "delimiter"
    delimiter: str = DEFAULT_DELIMITER
    max_length: int = DEFAULT_MAX_LENGTH
    batch_size: int = 8
    on_missing: str = "error"
    pooling: str = "all"
    shared_prefix: Sequence[int] | None = None
    progress: Callable[[int], None] | None = None
    parts: Sequence[str] | str = DEFAULT_FEATURE_PARTS


def document_features(model, tokenizer, documents: Sequence, completion_spans: Sequence | None = None,
                      **options) -> Features:
    """Features ``concat(mean, state)`` for each document (see the module docstring for the positions).

    ``documents``: strings (encoded with :func:`encode`) or token-id lists.
    ``completion_spans``: per document ``None`` (search the whole document) or
    ``(start, end)`` — character offsets for strings, token offsets for token
    lists, ``end=None`` meaning to the end — delimiting the completion in which
    the last ``delimiter`` is searched (``position="delimiter"``).
    ``options``: the fields of :class:`FeatureOptions` (an unknown one is a ``TypeError``).  The tokens
    every document shares run through the model once (their keys and values are broadcast
    over each batch); documents are sorted by kept length and processed
    ``batch_size`` at a time with right padding.
    """
    o = FeatureOptions(**options)
    position, delimiter, max_length, batch_size = o.position, o.delimiter, o.max_length, o.batch_size
    on_missing, pooling, shared_prefix, progress, parts = o.on_missing, o.pooling, o.shared_prefix, o.progress, o.parts
    n_docs = len(documents)
    spans = _check_feature_options(n_docs, completion_spans, position, on_missing, batch_size)
    if pooling not in POOLINGS:
        raise InputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    parts = check_feature_parts(parts)
    plans = [
        _plan(tokenizer, d, s, position, delimiter, max_length, on_missing=on_missing, idx=i)
        for i, (d, s) in enumerate(zip(documents, spans))
    ]
    n_kept = np.array([p[1] for p in plans], dtype=np.int64)
    seqs = [p[0][: int(n)] for p, n in zip(plans, n_kept)]
    if shared_prefix is None:
        shared_prefix = seqs[0][: common_prefix_length(seqs)] if seqs else []
    shared_prefix = [int(t) for t in shared_prefix]
    first = np.array([pooled_from(s, len(s), pooling, shared_prefix) for s in seqs], dtype=np.int64)
    out = (_pooled_all(model, seqs, first, batch_size, progress, prefix_ids=shared_prefix, parts=parts) if n_docs
           else np.zeros((0, 0), np.float32))
    return Features(
        embeddings=out,
        n_tokens=np.array([len(p[0]) for p in plans], dtype=np.int64),
        n_kept=n_kept,
        delimiter_index=np.array([p[2] for p in plans], dtype=np.int64),
        truncated=np.array([p[3] for p in plans], dtype=bool),
        missing_delimiter=np.array([p[4] for p in plans], dtype=bool),
        pooled_from=first,
        pooling=pooling,
        shared_prefix=shared_prefix,
    )


def prompt_completion_kept_lengths(tokenizer, prompts: Sequence[str], completions: Sequence[str], *,
                                   delimiter: str = DEFAULT_DELIMITER, max_length: int = DEFAULT_MAX_LENGTH,
                                   on_missing: str = "error") -> np.ndarray:
    """Token counts :func:`prompt_completion_features` keeps per (string) pair — its batches' sort key
    (longest first, stable); tokenisation only (data-parallel training splits by whole batches)."""
    return np.array([_plan(tokenizer, p + c, (len(p), None), "delimiter", delimiter, max_length,
                           on_missing=on_missing, idx=i)[1]
                     for i, (p, c) in enumerate(zip(prompts, completions))], dtype=np.int64)


def prompt_completion_features(model, tokenizer, prompts: Sequence, completions: Sequence, **kwargs) -> Features:
    """Features of force-decoded ``prompt + completion`` documents (use (a)).

    ``prompts``: chat-templated strings ending with the generation prompt (see
    :func:`chat_text`) or token-id lists; ``completions``: the matching strings
    or token-id lists.  Text pairs are concatenated and encoded as one string
    (the template's closing tokens are not needed: they follow the delimiter
    and, the model being causal, cannot change the pooled states).  Keyword
    arguments go to :func:`document_features`.
    """
    if len(prompts) != len(completions):
        raise InputError("prompts and completions must have the same length")
    docs, spans = [], []
    for p, c in zip(prompts, completions):
        if isinstance(p, str) != isinstance(c, str):
            raise InputError("prompt and completion must both be strings or both token-id lists")
        docs.append(p + c if isinstance(p, str) else list(p) + list(c))
        spans.append((len(p), None))
    return document_features(model, tokenizer, docs, spans, **kwargs)
