"""Greedy joint decoding of an SDM network (paper §"SDM network", test time; DESIGN #19).

At every step the next token is ``argmax(concat(z_neg, z_pos)) mod |V|`` — the
argmax of ``sdm(z_neg, z_pos)`` with q = e − 2, d = 1 (an SDM activation never
changes the argmax, so no normalisation is computed).  Prompts are decoded by
the one batched engine, :class:`sdm_mlx.decoding.batching.DecodeEngine`
(each prompt prefilled alone from the shared-prefix cache, decode steps
batched over an mlx-lm ``BatchKVCache`` whose positions and attention masks
exclude the padding, so a row's tokens do not depend on the batch).  A row stops at

* ``"delimiter"``: its generated text closes the answer — for the default
  delimiter ``"}"`` the first JSON object is complete (brace depth back to 0,
  braces inside JSON strings ignored); for another delimiter, the text contains
  it;
* ``"eos"``: an end-of-sequence token of the tokenizer (not kept);
* ``"max_tokens"``: ``max_new_tokens`` tokens were generated.

With ``features=True`` each output also carries the verifier input computed
from the hidden states seen during decoding (DESIGN #21, the same construction
as :mod:`sdm_mlx.llm.embed` use (b)): ``concat(mean(h_0..h_{n-1}), h_{n-1})`` with
``n`` = the global index of the generated token holding the last delimiter
(``h_{n-1}`` predicts it), capped at ``max_length``; without a delimiter (parse
failure) only the prompt's states are pooled (the research code's choice).

:func:`parse_task_prediction` maps a generated text back to a task label by
comparing its first JSON object with the JSON of each label's completion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..llm import embed as _embed
from ..llm.answers import first_json_object, is_closed  # noqa: F401  (re-exported: the answer rules)
from .heads import SDMHeads
from ..errors import InputError


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
    """The batch size :func:`greedy_generate` really uses (1 for models whose caches do not merge into batches)."""
    from ..decoding.batch_plan import decodes_in_batches

    return batch_size if decodes_in_batches(heads.model) else 1


@dataclass(frozen=True)
class DecodeSettings:
    """How :func:`greedy_generate` decodes: at most ``max_new_tokens`` tokens per prompt, stopping when the answer
    closes (``delimiter``; never with ``stop_at_delimiter=False``), the verifier's features over at most
    ``max_length`` positions, ``batch_size`` rows decoded together.  Alg. 4's per-epoch decoding and its calibration
    count (:func:`sdm_mlx.network.selection.count_verified`) pass one."""

    max_new_tokens: int = 32
    delimiter: str = _embed.DEFAULT_DELIMITER
    stop_at_delimiter: bool = True
    max_length: int = _embed.DEFAULT_MAX_LENGTH
    batch_size: int = 8
    #: the pooled parts of the features (the verification layer's ``feature_parts_``; DESIGN #21's by default)
    feature_parts: tuple = _embed.DEFAULT_FEATURE_PARTS
    #: each decoding keeps the states that picked its tokens (``Decoded.decisions``), to replay it (DESIGN #26)
    keep_decisions: bool = False


def greedy_generate(heads: SDMHeads, tokenizer, prompts: Sequence, settings: DecodeSettings | None = None, *,
                    features: bool = True, progress: Callable[[int], None] | None = None, prefix_cache=None,
                    journal=None) -> list:
    """Greedy joint decoding of each prompt (strings — encoded like mlx-lm's ``generate`` — or token-id lists).

    ``settings``: a :class:`DecodeSettings` (None: its defaults).  Decoded by
    :class:`sdm_mlx.decoding.batching.DecodeEngine` (continuous batching of ``settings.batch_size``
    rows, the shared prompt prefix prefilled once: ``prefix_cache`` a
    :class:`~sdm_mlx.decoding.prompt_cache.PrefixCache`, default a fresh one, ``False`` off).  Returns the
    engine's :class:`~sdm_mlx.decoding.decode_types.Decoded` per prompt, in input order (``stop_reason``:
    "delimiter", "eos" or "max_tokens" of :data:`sdm_mlx.decoding.STOP_REASONS`).  With ``features=True`` each
    carries the verifier input ``features`` [1, len(settings.feature_parts)·D] and its ``feature_info`` (see the module docstring).
    ``progress(k)`` is called as ``k`` more prompts finish.

    A prompt that occurs more than once is decoded once: greedy decoding is a function of the prompt, and Alg. 4's
    rows repeat prompts (own answers plus their constructed negatives: the calibration split holds both rows of
    many prompts).  Its repeats share that prompt's :class:`Decoded` (read it, do not change it).

    ``journal``: a :class:`~sdm_mlx.network.decode_journal.DecodeJournal` of this pass: the prompts it holds are
    not decoded again, and the others are decoded ``journal.chunk`` at a time, each chunk written to it.
    A :class:`~sdm_mlx.network.decode_journal.GivenDecodings` journal adds decodings known before the pass (the
    base head's): taken as they are, neither decoded nor written.

    With ``settings.keep_decisions`` each decoding keeps the states that picked its tokens (``Decoded.decisions``; a
    journal keeps them too), which replay it under a later W_pos (:mod:`sdm_mlx.network.base_decodings`).
    """
    from ..decoding.batching import DecodeEngine, DecodeRequest

    s = DecodeSettings() if settings is None else settings
    if s.max_new_tokens < 1:
        raise InputError("max_new_tokens must be >= 1")
    if s.batch_size < 1:
        raise InputError("batch_size must be >= 1")
    ids = _encode_prompts(tokenizer, prompts)
    first = {}  # token ids -> index of the prompt's first occurrence among the unique ones
    slot = [first.setdefault(tuple(p), len(first)) for p in ids]
    unique = [None] * len(first)
    for p, k in zip(ids, slot):
        if unique[k] is None:
            unique[k] = p
    engine = DecodeEngine(heads.model, tokenizer, heads=heads, delimiter=s.delimiter, max_batch=s.batch_size,
                          max_length=s.max_length, prefix_cache=prefix_cache)
    reqs = [DecodeRequest(p, s.max_new_tokens, stop_at_delimiter=s.stop_at_delimiter, features=features,
                          feature_parts=tuple(s.feature_parts), keep_decisions=s.keep_decisions)
            for p in unique]
    decoded = engine.run(reqs, progress=progress) if journal is None else _journaled(engine, reqs, journal, progress)
    if progress is not None and len(unique) < len(ids):
        progress(len(ids) - len(unique))  # the repeats finish with their first occurrence
    return [decoded[k] for k in slot]


def _journaled(engine, reqs: list, journal, progress) -> list:
    """``engine.run(reqs)`` with the journal's finished prompts taken from it and the rest written to it
    (``journal.chunk`` at a time; all at once for a journal without a chunk size)."""
    from .decode_journal import prompt_key

    have = journal.done()
    keys = [prompt_key(r.prompt_ids) for r in reqs]
    out = [have.get(k) for k in keys]
    todo = [i for i, d in enumerate(out) if d is None]
    if progress is not None and len(todo) < len(reqs):
        progress(len(reqs) - len(todo))
    step = journal.chunk or max(len(todo), 1)
    for lo in range(0, len(todo), step):
        part = todo[lo:lo + step]
        done = engine.run([reqs[i] for i in part], progress=progress)
        journal.add([keys[i] for i in part], done)
        for i, d in zip(part, done):
            out[i] = d
    return out


def generation_features(outputs: Sequence) -> np.ndarray:
    """Stack the verifier inputs of :func:`greedy_generate`'s outputs: float32 ``[N, 2D]``."""
    if not outputs:
        return np.zeros((0, 0), dtype=np.float32)
    if any(o.features is None for o in outputs):
        raise InputError("outputs were generated with features=False")
    return np.stack([o.features.reshape(-1) for o in outputs]).astype(np.float32)
