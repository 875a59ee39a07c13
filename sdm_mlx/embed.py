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
runs through the model once, its mlx-lm KV cache is tiled over each batch and
only each document's own tokens run; the prefix's states enter the mean as
they are (:func:`run_shared_prefix`, :func:`tiled_cache`).

Pooling (DESIGN #21): ``pooling="all"`` (default, the paper's) takes the mean
over all ``n`` kept positions; ``pooling="non-shared"`` starts the mean after
the document's common prefix with ``shared_prefix`` (the prompt part every row
shares), i.e. over the document and completion positions.  Every caller pools
with :func:`pool_states`.

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

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .errors import InputError
from .tokens import (  # re-exported: callers find the text/token helpers in sdm_mlx.embed
    DEFAULT_DELIMITER,
    chat_text,
    delimiter_token_index,
    delimiter_token_index_in_text,
    encode,
    eos_token_ids,
    prompt_tail,
)

__all__ = [
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

#: Default number of kept positions (the research code's 500-position cut).
DEFAULT_MAX_LENGTH = 500
POSITIONS = ("delimiter", "last")
#: Mean half of the feature: over all kept positions (the paper's) or without the shared prompt prefix (DESIGN #21).
POOLINGS = ("all", "non-shared")
ON_MISSING = ("error", "last", "prompt")


# --------------------------------------------------------------------------- model access


def load_model(path_or_id: str, *, head: bool = True, **kwargs):
    """``(model, tokenizer)`` from a local mlx-lm directory or a Hugging Face hub id (via mlx-lm).

    A path that looks local (``/``, ``.``, ``~`` prefix) but does not exist raises
    ``FileNotFoundError`` instead of being sent to the hub.  The weights are read
    while the tokenizer loads (``mx.async_eval``).  ``head=False`` (features
    only): an untied LM head is left unread, loaded from its file on first use
    (saves its |V| x D weights of reading and memory when it is never used).
    """
    import mlx.core as mx
    from mlx_lm.utils import _download, load_model as _lm_load_model, load_tokenizer as _lm_load_tokenizer

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    expanded = os.path.expanduser(str(path_or_id))
    if not os.path.exists(expanded) and str(path_or_id).startswith(("/", ".", "~")):
        raise FileNotFoundError(f"model directory not found: {path_or_id}")
    path = _download(expanded if os.path.exists(expanded) else str(path_or_id), revision=kwargs.pop("revision", None))
    model, config = _lm_load_model(path, lazy=True, model_config=kwargs.pop("model_config", None),
                                   trust_remote_code=kwargs.pop("trust_remote_code", False))
    weights = model.parameters() if head else trunk(model).parameters()
    mx.async_eval(weights)  # read on MLX's thread while the tokenizer loads here
    tokenizer = _lm_load_tokenizer(path, kwargs.pop("tokenizer_config", None),
                                   eos_token_ids=config.get("eos_token_id", None))
    if kwargs:
        raise TypeError(f"load_model got unexpected keyword arguments {sorted(kwargs)}")
    mx.eval(weights)
    trunk(model)  # validate early
    return model, tokenizer


def load_tokenizer(path_or_id: str):
    """Only the (mlx-lm wrapped) tokenizer of a local model directory or hub id; no weights are loaded."""
    from pathlib import Path

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    path = Path(os.path.expanduser(str(path_or_id)))
    if not path.exists():
        if str(path_or_id).startswith(("/", ".", "~")):
            raise FileNotFoundError(f"model directory not found: {path_or_id}")
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
        path = Path(snapshot_download(str(path_or_id), allow_patterns=patterns))
    from mlx_lm.utils import load_tokenizer as _load

    return _load(path)


def trunk(model):
    """The transformer trunk whose output is the final-norm hidden states (``model.model`` in mlx-lm)."""
    inner = getattr(model, "model", None)
    if inner is None or not callable(inner) or not hasattr(inner, "embed_tokens"):
        kind = getattr(model, "model_type", type(model).__name__)
        raise InputError(
            f"mlx-lm model of type {kind!r} does not expose its transformer trunk as `model.model` "
            "(with `embed_tokens`); sdm_mlx.embed supports llama-, phi3-, qwen2- and mistral-style models"
        )
    return inner


def hidden_states(model, token_ids_batch, cache=None, pad_id: int = 0):
    """Final-norm hidden states, float32 ``mx.array`` of shape ``[B, T, D]``.

    ``token_ids_batch``: a list of token-id lists (right-padded here with
    ``pad_id`` to the longest; rows past a sequence's length are padding and
    must be ignored by the caller) or an int array ``[B, T]``.  Right padding
    cannot change the states of real positions: the attention mask is causal
    and every pad comes after them.  ``cache``: an mlx-lm prompt cache (list of
    per-layer caches, e.g. ``mlx_lm.models.cache.make_prompt_cache(model)``),
    passed through to the trunk for incremental use during generation (prefill
    the prompt, then feed one token at a time; use one unpadded sequence).
    """
    import mlx.core as mx

    if isinstance(token_ids_batch, mx.array):
        x = token_ids_batch
    else:
        rows = [list(r) for r in token_ids_batch]
        if not rows or min(len(r) for r in rows) == 0:
            raise InputError("hidden_states needs at least one non-empty token sequence")
        width = max(len(r) for r in rows)
        x = mx.array(np.array([r + [pad_id] * (width - len(r)) for r in rows], dtype=np.int32))
    if x.ndim == 1:
        x = x[None]
    return trunk(model)(x, cache=cache).astype(mx.float32)


def logits_from_hidden(model, h):
    """Apply the model's LM head (untied ``lm_head`` or tied ``embed_tokens.as_linear``) to hidden states."""
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head(h)
    return trunk(model).embed_tokens.as_linear(h)


def lm_head_weight(model):
    """The LM head as a float32 ``[V, D]`` ``mx.array`` (tied or untied; quantised weights are dequantised)."""
    import mlx.core as mx

    layer = getattr(model, "lm_head", None)
    if layer is None:
        layer = trunk(model).embed_tokens
    if hasattr(layer, "scales"):  # QuantizedLinear / QuantizedEmbedding
        kw = {"group_size": layer.group_size, "bits": layer.bits}
        if getattr(layer, "mode", "affine") != "affine":
            kw["mode"] = layer.mode
        w = mx.dequantize(layer.weight, layer.scales, getattr(layer, "biases", None), **kw)
    else:
        w = layer.weight
    return w.astype(mx.float32)


# --------------------------------------------------------------------------- positions and pooling


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
    """How many hidden states of *prompt + generated tokens* to pool (use (b)).

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


def pool_states(states, n_kept, first=None):
    """The one pooling of the features (DESIGN #21): per row ``concat(mean(h[first:n]), h[n-1])``, float32 ``mx.array``.

    ``states``: ``[B, T, D]`` hidden states (``mx.array`` or NumPy; positions
    past a row's ``n`` are ignored, so right padding is harmless); ``n_kept``:
    ``[B]`` kept positions ``n``; ``first``: ``[B]`` first pooled position of
    the mean (default 0: the paper's pooling over all kept positions; see
    :func:`pooled_from` for ``pooling="non-shared"``).  The second half is always
    the state at ``n - 1``.
    """
    import mlx.core as mx

    h = states if isinstance(states, mx.array) else mx.array(np.asarray(states, dtype=np.float32))
    h = h.astype(mx.float32)
    n = mx.array(np.asarray(n_kept, dtype=np.int32).reshape(-1))
    f = mx.zeros_like(n) if first is None else mx.array(np.asarray(first, dtype=np.int32).reshape(-1))
    t = mx.arange(h.shape[1])[None, :]
    mask = ((t >= f[:, None]) & (t < n[:, None]))[..., None]
    mean = mx.where(mask, h, 0.0).sum(axis=1) / (n - f).astype(mx.float32)[:, None]
    last = mx.take_along_axis(h, (n - 1)[:, None, None], axis=1)[:, 0, :]
    return mx.concatenate([mean, last], axis=1)


def pool_hidden(hidden, n_kept: int, first: int = 0) -> np.ndarray:
    """:func:`pool_states` of one document's ``[T, D]`` states, as float32 NumPy ``[2D]``."""
    h = np.asarray(hidden, dtype=np.float32)
    if h.ndim != 2 or not 1 <= n_kept <= h.shape[0] or not 0 <= first < n_kept:
        raise InputError(f"need 0 <= first < n_kept <= T for hidden states of shape {h.shape}, "
                         f"got first={first}, n_kept={n_kept}")
    return np.array(pool_states(h[None], [n_kept], [first])[0], dtype=np.float32)


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


# --------------------------------------------------------------------------- batched features


class DocumentError(ValueError):
    """A problem with one document of a batch; ``index`` is its position in the input list."""

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


def _plan(tokenizer, doc, span, position, delimiter, max_length, on_missing, idx):
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


@dataclass
class SharedPrefix:
    """Leading tokens shared by every document of a call, run through the trunk once: per-layer keys and
    values ``[1, H, P, d]`` (mlx-lm ``KVCache`` contents) and final-norm states ``[P, D]``."""

    length: int
    keys: list
    values: list
    states: object


def run_shared_prefix(model, ids: Sequence[int]) -> SharedPrefix | None:
    """Prefill ``ids`` once into an mlx-lm prompt cache; None when ``ids`` is empty or the model's cache is
    not a plain ``KVCache`` per layer (sliding windows, recurrent state: those rows run in full)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    if len(ids) == 0:
        return None
    cache = make_prompt_cache(model)
    if not all(type(c) is KVCache for c in cache):
        return None
    states = hidden_states(model, [list(ids)], cache=cache)[0]
    p = len(ids)
    keys = [c.keys[..., :p, :] for c in cache]
    values = [c.values[..., :p, :] for c in cache]
    mx.eval(states, keys, values)
    return SharedPrefix(p, keys, values, states)


def tiled_cache(prefix: SharedPrefix, batch: int) -> list:
    """One mlx-lm ``KVCache`` per layer holding the prefix's keys/values broadcast over ``batch`` rows."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    caches = []
    for k, v in zip(prefix.keys, prefix.values):
        c = KVCache()
        c.keys = mx.broadcast_to(k, (batch,) + tuple(k.shape[1:]))
        c.values = mx.broadcast_to(v, (batch,) + tuple(v.shape[1:]))
        c.offset = prefix.length
        caches.append(c)
    return caches


def _pooled_batch(model, prefix: SharedPrefix | None, seqs: list, lens: list[int], first: list[int]) -> np.ndarray:
    """Pooled features float32 [B, 2D] of one batch of kept tokens: the shared prefix comes from its cache
    and states, only each row's own tokens (right-padded) run through the trunk."""
    import mlx.core as mx

    p = prefix.length if prefix is not None else 0
    cache = tiled_cache(prefix, len(seqs)) if p else None
    h = hidden_states(model, [s[p:] for s in seqs], cache=cache)
    if p:
        shared = mx.broadcast_to(prefix.states[None], (len(seqs),) + tuple(prefix.states.shape))
        h = mx.concatenate([shared, h], axis=1)
    feats = pool_states(h, lens, first)
    mx.eval(feats)
    return np.array(feats, dtype=np.float32)


def _pooled_all(model, seqs: list, first: np.ndarray, batch_size: int, progress) -> np.ndarray:
    """Features of every (cut) sequence: the longest common prefix runs once, then batches of ``batch_size``
    rows, longest first.  Each row keeps at least one own token (its last state comes from its own pass)."""
    n_kept = np.array([len(s) for s in seqs], dtype=np.int64)
    shared = min(common_prefix_length(seqs), int(n_kept.min()) - 1)
    prefix = run_shared_prefix(model, seqs[0][:shared])
    order = np.argsort(-n_kept, kind="stable")
    out = None
    for b0 in range(0, len(seqs), batch_size):
        idx = order[b0 : b0 + batch_size]
        feats = _pooled_batch(model, prefix, [seqs[i] for i in idx], [int(n_kept[i]) for i in idx],
                              [int(first[i]) for i in idx])
        if out is None:
            out = np.empty((len(seqs), feats.shape[1]), dtype=np.float32)
        out[idx] = feats
        if progress is not None:
            progress(len(idx))
    return out


def document_features(
    model,
    tokenizer,
    documents: Sequence,
    completion_spans: Sequence | None = None,
    *,
    position: str = "delimiter",
    delimiter: str = DEFAULT_DELIMITER,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int = 8,
    on_missing: str = "error",
    pooling: str = "all",
    shared_prefix: Sequence[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Features:
    """Features ``concat(mean, state)`` for each document (see the module docstring for the positions).

    ``documents``: strings (encoded with :func:`encode`) or token-id lists.
    ``completion_spans``: per document ``None`` (search the whole document) or
    ``(start, end)`` — character offsets for strings, token offsets for token
    lists, ``end=None`` meaning to the end — delimiting the completion in which
    the last ``delimiter`` is searched (``position="delimiter"``).
    ``on_missing``: what to do when the completion holds no delimiter —
    ``"error"`` (ValueError naming the document), ``"last"`` (use the last
    token), ``"prompt"`` (pool the positions before the completion only).
    ``pooling``: ``"all"`` (the paper's mean over every kept position) or
    ``"non-shared"`` (the mean leaves out each document's common prefix with
    ``shared_prefix``, token ids; default: the longest common token prefix of
    these documents — pass it when documents come one at a time).  The tokens
    every document shares run through the model once (their KV cache is tiled
    over each batch); documents are sorted by kept length and processed
    ``batch_size`` at a time with right padding; ``progress(k)`` is called after
    each batch of ``k``.
    """
    n_docs = len(documents)
    spans = _check_feature_options(n_docs, completion_spans, position, on_missing, batch_size)
    if pooling not in POOLINGS:
        raise InputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    plans = [
        _plan(tokenizer, d, s, position, delimiter, max_length, on_missing, i)
        for i, (d, s) in enumerate(zip(documents, spans))
    ]
    n_kept = np.array([p[1] for p in plans], dtype=np.int64)
    seqs = [p[0][: int(n)] for p, n in zip(plans, n_kept)]
    if shared_prefix is None:
        shared_prefix = seqs[0][: common_prefix_length(seqs)] if seqs else []
    shared_prefix = [int(t) for t in shared_prefix]
    first = np.array([pooled_from(s, len(s), pooling, shared_prefix) for s in seqs], dtype=np.int64)
    out = _pooled_all(model, seqs, first, batch_size, progress) if n_docs else np.zeros((0, 0), np.float32)
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
    return np.array([_plan(tokenizer, p + c, (len(p), None), "delimiter", delimiter, max_length, on_missing, i)[1]
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
