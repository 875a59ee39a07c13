"""Greedy joint decoding of an SDM network (paper §"SDM network", test time; reference_spec §8.1).

At every step the next token is ``argmax(concat(z_neg, z_pos)) mod |V|`` — the
argmax of ``sdm(z_neg, z_pos)`` with q = e − 2, d = 1 (an SDM activation never
changes the argmax, so no normalisation is computed).  Prompts are decoded in
batches with left padding and an mlx-lm ``BatchKVCache`` (positions and
attention masks exclude the padding, so a row's tokens do not depend on the
batch).  A row stops at

* ``"delimiter"``: its generated text closes the answer — for the default
  delimiter ``"}"`` the first JSON object is complete (brace depth back to 0,
  braces inside JSON strings ignored); for another delimiter, the text contains
  it;
* ``"eos"``: an end-of-sequence token of the tokenizer (not kept);
* ``"max_tokens"``: ``max_new_tokens`` tokens were generated.

With ``features=True`` each output also carries the verifier input computed
from the hidden states seen during decoding (DESIGN #21, the same construction
as :mod:`sdm_mlx.embed` use (b)): ``concat(mean(h_0..h_{n-1}), h_{n-1})`` with
``n`` = the global index of the generated token holding the last delimiter
(``h_{n-1}`` predicts it), capped at ``max_length``; without a delimiter (parse
failure) only the prompt's states are pooled (the research code's choice).

:func:`parse_task_prediction` maps a generated text back to a task label by
comparing its first JSON object with the JSON of each label's completion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from .. import embed as _embed
from .heads import SDMHeads
from ..errors import InputError

STOP_REASONS = ("delimiter", "eos", "max_tokens")


@dataclass
class GeneratedOutput:
    """One greedy joint decoding.

    ``token_ids``: generated tokens (an EOS that stopped decoding is not kept);
    ``embedding``: the verifier input (float32 ``[2D]``) or None;
    ``n_kept``: pooled positions of ``prompt_ids + token_ids``;
    ``delimiter_index``: global index of the generated delimiter token (−1: none);
    ``missing_delimiter``: no delimiter in the generated text (a parse failure).
    """

    prompt_ids: list
    token_ids: list
    text: str
    stop_reason: str
    embedding: np.ndarray | None = None
    n_kept: int = 0
    delimiter_index: int = -1
    missing_delimiter: bool = True
    truncated: bool = False


def is_closed(text: str, delimiter: str = _embed.DEFAULT_DELIMITER) -> bool:
    """True once ``text`` closes its answer (see the module docstring)."""
    if delimiter != "}":
        return delimiter in text
    depth, in_str, esc, opened = 0, False, False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"' and opened:
            in_str = True
        elif ch == "{":
            depth += 1
            opened = True
        elif ch == "}":
            depth -= 1
            if depth <= 0:
                return True
    return False


def first_json_object(text: str):
    """The first JSON object (dict) in ``text``, or None if there is none / it does not parse."""
    dec = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            obj, _ = dec.raw_decode(text, start)
            if isinstance(obj, dict):
                return obj
        except json.JSONDecodeError:
            pass
        start = text.find("{", start + 1)
    return None


def parse_task_prediction(text: str, completions: Sequence[str]) -> int:
    """Task label predicted by a generated text, or −1 (parse failure / no match).

    If the completions are JSON objects (``{"sentiment": "negative"}``, ...), the
    first JSON object of ``text`` must equal one of them exactly (as parsed
    values: key order and whitespace do not matter).  Otherwise the stripped
    text must equal a stripped completion.
    """
    parsed = [first_json_object(c) for c in completions]
    if all(p is not None for p in parsed):
        obj = first_json_object(text)
        if obj is None:
            return -1
        for c, p in enumerate(parsed):
            if obj == p:
                return c
        return -1
    t = text.strip()
    for c, comp in enumerate(completions):
        if t == comp.strip():
            return c
    return -1


def _encode_prompts(tokenizer, prompts) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        ids = _embed.encode(tokenizer, p) if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise InputError(f"prompt {i} is empty after tokenisation")
        out.append(ids)
    return out


def prompt_lengths(tokenizer, prompts) -> list[int]:
    """Token counts of the encoded prompts: :func:`greedy_generate` decodes them longest first."""
    return [len(ids) for ids in _encode_prompts(tokenizer, prompts)]


def decode_batch_size(heads, batch_size: int) -> int:
    """The batch size :func:`greedy_generate` really uses (1 for models with custom caches)."""
    return 1 if hasattr(heads.model, "make_cache") else batch_size


def _eos_ids(tokenizer) -> set:
    return _embed.eos_token_ids(tokenizer)


def _batch_cache(model, left_padding: list[int]):
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    if hasattr(model, "make_cache"):
        if any(left_padding) or len(left_padding) != 1:
            return None
        return make_prompt_cache(model)
    return [BatchKVCache(list(left_padding)) for _ in _embed.trunk(model).layers]


def _decode_batch(heads, tokenizer, batch_ids, max_new_tokens, delimiter, stop_at_delimiter, eos, want_states):
    """Decode one left-padded batch; returns per-row (tokens, stop_reason, prompt_states, step_states)."""
    model = heads.model
    lens = [len(r) for r in batch_ids]
    width = max(lens)
    pads = [width - n for n in lens]
    cache = _batch_cache(model, pads)
    if cache is None:
        raise RuntimeError("unreachable: models with a custom cache are decoded one prompt at a time")
    x = mx.array(np.array([[0] * p + r for p, r in zip(pads, batch_ids)], dtype=np.int32))
    h = heads.hidden_states(x, cache=cache)  # [B, W, D]
    last = h[:, -1, :]
    B = len(batch_ids)
    tokens = [[] for _ in range(B)]
    reasons = [None] * B
    steps = []
    for step in range(max_new_tokens):
        nxt = heads.next_tokens(last)
        mx.eval(nxt)
        nxt_list = nxt.tolist()
        for i in range(B):
            if reasons[i] is not None:
                continue
            t = int(nxt_list[i])
            if t in eos:
                reasons[i] = "eos"
                continue
            tokens[i].append(t)
            if stop_at_delimiter and is_closed(tokenizer.decode(tokens[i]), delimiter):
                reasons[i] = "delimiter"
            elif len(tokens[i]) >= max_new_tokens:
                reasons[i] = "max_tokens"
        if all(r is not None for r in reasons) or step == max_new_tokens - 1:
            break
        feed = mx.array(np.array([[tokens[i][-1] if tokens[i] else 0] for i in range(B)], dtype=np.int32))
        hs = heads.hidden_states(feed, cache=cache)  # [B, 1, D]
        if want_states:
            steps.append(hs[:, 0, :])
        last = hs[:, -1, :]
        mx.eval(last, *(steps[-1:] if want_states else []))
    for i in range(B):
        if reasons[i] is None:
            reasons[i] = "max_tokens"
    step_states = mx.stack(steps, axis=1) if steps else None
    return tokens, reasons, h, pads, step_states


def _pool(prompt_h, pad, step_h, n_prompt, n_kept):
    """concat(mean(states[:n]), states[n-1]) of one row (float32 NumPy), from on-device states."""
    states = prompt_h[pad:]
    if n_kept > n_prompt:
        states = mx.concatenate([states, step_h[: n_kept - n_prompt]], axis=0)
    return np.array(_embed.pool_states(states[None, :n_kept], [n_kept])[0], dtype=np.float32)


def greedy_generate(
    heads: SDMHeads,
    tokenizer,
    prompts: Sequence,
    *,
    max_new_tokens: int = 32,
    delimiter: str = _embed.DEFAULT_DELIMITER,
    stop_at_delimiter: bool = True,
    batch_size: int = 8,
    features: bool = True,
    max_length: int = _embed.DEFAULT_MAX_LENGTH,
    progress: Callable[[int], None] | None = None,
) -> list[GeneratedOutput]:
    """Greedy joint decoding of each prompt (strings — encoded like mlx-lm's ``generate`` — or token-id lists).

    ``heads``: an :class:`SDMHeads`, or any object with the same ``model``,
    ``hidden_states(token_ids_batch, cache=None)`` and ``next_tokens(h)`` (only
    these are used; :mod:`sdm_mlx.verified.decoding` wraps them to stream).
    Returns one :class:`GeneratedOutput` per prompt, in input order.  With
    ``features=True`` each carries the verifier input (see the module docstring).
    ``progress(k)`` is called after each batch of ``k`` prompts.
    """
    if max_new_tokens < 1:
        raise InputError("max_new_tokens must be >= 1")
    if batch_size < 1:
        raise InputError("batch_size must be >= 1")
    ids = _encode_prompts(tokenizer, prompts)
    eos = _eos_ids(tokenizer)
    batch_size = decode_batch_size(heads, batch_size)  # custom caches (sliding windows, SSMs): one at a time
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out: list = [None] * len(ids)
    for b0 in range(0, len(order), batch_size):
        idx = order[b0 : b0 + batch_size]
        batch = [ids[i] for i in idx]
        toks, reasons, prompt_h, pads, step_h = _decode_batch(
            heads, tokenizer, batch, max_new_tokens, delimiter, stop_at_delimiter, eos, features
        )
        for k, i in enumerate(idx):
            g = GeneratedOutput(prompt_ids=ids[i], token_ids=toks[k], text=tokenizer.decode(toks[k]),
                                stop_reason=reasons[k])
            if features:
                n, info = _embed.generated_n_kept(
                    tokenizer, len(ids[i]), toks[k], delimiter=delimiter, max_length=max_length, on_missing="prompt"
                )
                g.embedding = _pool(prompt_h[k], pads[k], None if step_h is None else step_h[k], len(ids[i]), n)
                g.n_kept = n
                g.delimiter_index = int(info["delimiter_index"])
                g.missing_delimiter = bool(info["missing_delimiter"])
                g.truncated = bool(info["truncated"])
            out[i] = g
        if progress is not None:
            progress(len(idx))
    return out


def generation_features(outputs: Sequence[GeneratedOutput]) -> np.ndarray:
    """Stack the verifier inputs of generated outputs: float32 ``[N, 2D]``."""
    if not outputs:
        return np.zeros((0, 0), dtype=np.float32)
    if any(o.embedding is None for o in outputs):
        raise InputError("outputs were generated with features=False")
    return np.stack([o.embedding for o in outputs]).astype(np.float32)
