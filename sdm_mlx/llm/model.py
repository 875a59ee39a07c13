"""Access to an mlx-lm language model: loading (model, tokenizer), its trunk, the final-norm hidden states
``h_t`` (the input of the LM head), logits from them, and the (tied or untied, possibly quantised) LM head's
weight.  :mod:`sdm_mlx.llm.embed` builds the DESIGN #21 features on these and re-exports them."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InputError

def load_model(path_or_id: str, *, head: bool = True, **kwargs):
    """``(model, tokenizer)`` from a local mlx-lm directory or a Hugging Face hub id (via mlx-lm).

    A reference that is neither an existing directory nor a reachable hub id raises
    :class:`~sdm_mlx.errors.ModelNotFoundError` (a ``FileNotFoundError``; see :mod:`sdm_mlx.llm.model_path`).
    The weights are read while the tokenizer loads on a helper thread.  ``head=False`` (features
    only): an untied LM head is left unread, loaded from its file on first use
    (saves its |V| x D weights of reading and memory when it is never used).  On the CPU the MLP layers
    compute their activation with :func:`~sdm_mlx.llm.cpu_swiglu.swiglu` (3.5x faster than MLX's there), and a
    decoding step's RMSNorm and RoPE are compiled (:mod:`sdm_mlx.llm.cpu_decode_ops`; the same values).
    """
    import mlx.core as mx
    from mlx_lm.utils import _download, load_model as _lm_load_model, load_tokenizer as _lm_load_tokenizer

    from ..runtime.allocator import apply_after_load
    from .cpu_decode_ops import use_cpu_decode_ops
    from .cpu_swiglu import use_cpu_swiglu
    from .model_path import check_model_reference, hub_errors_as_not_found

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    reference = check_model_reference(path_or_id)
    with hub_errors_as_not_found(str(path_or_id)):
        path = _download(reference, revision=kwargs.pop("revision", None))
        model, config = _lm_load_model(path, lazy=True, model_config=kwargs.pop("model_config", None),
                                       trust_remote_code=kwargs.pop("trust_remote_code", False))
        weights = model.parameters() if head else trunk(model).parameters()
        # The tokenizer loads on a helper thread while this one reads the weights (mx.eval releases the GIL).
        # mx.async_eval would not overlap them: it blocks until most of the reads are done.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdm-tokenizer") as pool:
            tokenizer = pool.submit(_lm_load_tokenizer, path, kwargs.pop("tokenizer_config", None),
                                    eos_token_ids=config.get("eos_token_id", None))
            mx.eval(weights)
            tokenizer = tokenizer.result()
    if kwargs:
        raise TypeError(f"load_model got unexpected keyword arguments {sorted(kwargs)}")
    trunk(model)  # validate early
    use_cpu_swiglu(model)
    use_cpu_decode_ops(model)
    apply_after_load()  # batch commands: activations reuse freed heap memory (sdm_mlx.runtime.allocator)
    return model, tokenizer


def load_tokenizer(path_or_id: str):
    """Only the (mlx-lm wrapped) tokenizer of a local model directory or hub id; no weights are loaded."""
    from pathlib import Path

    from .model_path import check_model_reference, hub_errors_as_not_found

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    path = Path(check_model_reference(path_or_id))
    if not path.exists():
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
        with hub_errors_as_not_found(str(path_or_id)):
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
            "(with `embed_tokens`); sdm_mlx.llm.embed supports llama-, phi3-, qwen2- and mistral-style models"
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


def model_dims(model) -> tuple[int, int]:
    """``(|V|, D)`` of the model's LM head (rows = output vocabulary incl. padding rows, e.g. 32064 for Phi-3.5)."""
    layer = getattr(model, "lm_head", None)
    if layer is None:
        layer = trunk(model).embed_tokens
    w = layer.weight
    rows = int(w.shape[0])
    if hasattr(layer, "scales"):  # packed quantised weights: columns are packed, use the scales' group count
        cols = int(layer.scales.shape[1]) * int(layer.group_size)
    else:
        cols = int(w.shape[1])
    return rows, cols


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


class PrefixKV:
    """One layer's KV cache for a single forward pass of rows that all continue the same shared prefix.

    mlx-lm's attention reads ``offset`` (the RoPE position of the rows' first token), calls
    ``update_and_fetch(keys, values)`` with the rows' own keys and values and builds its mask with ``make_mask``.
    Here the prefix's ``[1, H, P, d]`` keys and values are broadcast over the batch and the rows' own appended in one
    concatenation, instead of the preallocated 256-position buffer and the copies of a ``KVCache`` (on an AVX2 box
    the own-token passes of 32 factcheck rows took 20.5 s instead of 24.8 s, the features equal bit for bit).  The
    cache is not for incremental decoding: each call appends to the prefix alone.
    """

    def __init__(self, keys, values, offset: int):
        self.prefix_keys, self.prefix_values, self.offset = keys, values, int(offset)

    def update_and_fetch(self, keys, values):
        import mlx.core as mx

        b = keys.shape[0]
        k = mx.concatenate([mx.broadcast_to(self.prefix_keys, (b,) + tuple(self.prefix_keys.shape[1:])), keys], axis=2)
        v = mx.concatenate([mx.broadcast_to(self.prefix_values, (b,) + tuple(self.prefix_values.shape[1:])), values],
                           axis=2)
        self.offset += keys.shape[2]
        return k, v

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(n, self.offset, return_array, window_size)


def prefix_caches(prefix: SharedPrefix) -> list:
    """One :class:`PrefixKV` per layer: the prefix's keys and values for a single forward pass of any number of
    rows that continue it."""
    return [PrefixKV(k, v, prefix.length) for k, v in zip(prefix.keys, prefix.values)]
