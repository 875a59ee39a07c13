"""Greedy decoding for verified generation: plain mlx-lm greedy, or joint neg+pos with a positive head.

* **plain** (no positive head): the tokens of mlx-lm's own ``generate_step``
  with its default greedy sampler, i.e. exactly what ``mlx_lm.generate`` /
  ``stream_generate`` produce for the same prompt tokens (same prefill split,
  same ``KVCache``), cut by the stopping rule below.
* **joint** (a positive head attached): :func:`sdm_mlx.network.generation.greedy_generate`,
  the codebase's one implementation of joint decoding — token
  ``argmax(concat(z_neg, z_pos)) mod |V|`` — run on one prompt.  Tokens are
  streamed through a thin wrapper around the :class:`~sdm_mlx.network.heads.SDMHeads`
  whose ``next_tokens`` reports each chosen token (``greedy_generate`` calls
  it once per step).

Stopping (both paths, the rule of ``network.generation``): the verification
unit is closed — for the delimiter ``"}"`` the ``}`` that balances the first
``{`` of the text (:func:`~sdm_mlx.network.generation.is_closed`; braces inside
JSON strings ignored), for another delimiter its first occurrence —; an
end-of-sequence token (not kept); or ``max_tokens`` generated tokens.

Verifier features while decoding (``features=True``): the final-norm hidden
states that decoding computes anyway (prefill of the prompt, then one per fed
token) are pooled exactly as :mod:`sdm_mlx.llm.embed` pools a force-decoded prompt
+ completion (``concat(mean(h_0 .. h_{n-1}), h_{n-1})``, ``n`` from
:func:`~sdm_mlx.llm.embed.generated_n_kept`), so verifying the answer needs no second
forward pass.  Plain decoding records them by wrapping the trunk's final norm
while mlx-lm's ``generate_step`` runs; joint decoding gets them from
``greedy_generate(features=True)``.  They equal the force-decoded features up to
KV-cache rounding (float32: ~1e-6 relative).

Two request-level options (used by ``sdm-mlx serve``): ``stop`` strings end
decoding as soon as the decoded text contains one (OpenAI semantics: the text is
cut before it; the streamed text never shows it — the last ``len(stop) - 1``
characters are held back until they cannot start one), and ``temperature > 0``
samples with mlx-lm's sampler instead of greedy argmax (plain decoding only;
joint decoding is greedy by construction).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..llm import embed as _embed
from ..network.generation import is_closed
from ..errors import InputError

STOP_REASONS = ("delimiter", "eos", "max_tokens", "stop")


class _StopHit(Exception):
    """Raised by the joint-decoding token hook when a stop string appears."""


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index of the earliest occurrence in ``text`` of any string of ``stop`` (None: none occurs)."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


class _Emitter:
    """Forwards streamed text to ``on_text``, holding back a possible stop-string prefix and cutting at a stop."""

    def __init__(self, on_text: Callable[[str], None], stop: Sequence[str]):
        self.on_text, self.stop = on_text, list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text, self.sent = "", 0

    def push(self, segment: str) -> None:
        self.text += segment
        self._send(len(self.text) - self.hold)

    def close(self) -> None:
        self._send(len(self.text))

    def _send(self, upto: int) -> None:
        cut = first_stop(self.text, self.stop)
        if cut is not None:
            upto = min(upto, cut)
        if upto > self.sent:
            self.on_text(self.text[self.sent:upto])
            self.sent = upto


@dataclass
class Decoded:
    """One greedy decoding: generated ``token_ids`` (EOS not kept), their ``text``, why it stopped, wall time."""

    prompt_ids: list
    token_ids: list
    text: str
    stop_reason: str
    seconds: float
    #: with ``GreedyDecoder(features=True)``: the verifier input ``[1, 2D]`` float32 of prompt + answer and
    #: ``{"n_kept", "delimiter_index", "missing_delimiter", "truncated"}`` (see the module docstring)
    features: object = None
    feature_info: dict | None = None


class _NormRecorder:
    """Stands in for the trunk's final norm while decoding and keeps every output (``[1, T_i, D]`` each)."""

    def __init__(self, norm):
        self.norm, self.outputs = norm, []

    def __call__(self, x):
        y = self.norm(x)
        self.outputs.append(y)
        return y

    def states(self):
        """The recorded final-norm states of positions 0, 1, ... as one ``[T, D]`` array."""
        import mlx.core as mx

        return mx.concatenate([o.reshape(-1, o.shape[-1]) for o in self.outputs], axis=0)


def eos_ids(tokenizer) -> set:
    """End-of-sequence token ids of an (mlx-lm wrapped) tokenizer."""
    from ..llm.embed import eos_token_ids

    return eos_token_ids(tokenizer)


class _StreamingHeads:
    """Forwards to :class:`SDMHeads`; ``next_tokens`` also hands each chosen token to ``hook`` (batch of one)."""

    def __init__(self, heads, hook: Callable[[int], None]):
        self._heads, self._hook = heads, hook

    @property
    def model(self):
        return self._heads.model

    def hidden_states(self, token_ids_batch, cache=None):
        return self._heads.hidden_states(token_ids_batch, cache=cache)

    def next_tokens(self, h):
        import mlx.core as mx

        nxt = self._heads.next_tokens(h)
        mx.eval(nxt)
        self._hook(int(nxt.reshape(-1)[0].item()))
        return nxt


class GreedyDecoder:
    """Greedy decoder of one prompt at a time, plain (``heads=None``) or joint neg+pos (``heads``: ``SDMHeads``).

    ``decoder(prompt_ids, max_tokens, on_text=None) -> Decoded``; ``on_text``
    receives readable text segments as tokens arrive (mlx-lm's streaming
    detokenizer).  ``stop_at_delimiter=False`` only stops at EOS / max tokens.
    ``features=True`` also returns the verifier input of prompt + answer (``Decoded.features``), pooled from
    the states of the decoding itself with at most ``max_length`` positions.
    """

    def __init__(self, model, tokenizer, heads=None, delimiter: str = "}", stop_at_delimiter: bool = True,
                 features: bool = False, *, max_length: int = _embed.DEFAULT_MAX_LENGTH):
        if not delimiter:
            raise InputError("delimiter must be a non-empty string")
        self.model, self.tokenizer, self.heads = model, tokenizer, heads
        self.delimiter, self.stop_at_delimiter = delimiter, stop_at_delimiter
        self.features, self.max_length = bool(features), int(max_length)
        self.eos = eos_ids(tokenizer)

    @property
    def mode(self) -> str:
        return "plain" if self.heads is None else "joint"

    def __call__(self, prompt_ids: Sequence[int], max_tokens: int, on_text: Callable[[str], None] | None = None,
                 *, stop: Sequence[str] = (), temperature: float = 0.0):
        if max_tokens < 1:
            raise InputError("max_tokens must be >= 1")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise InputError("empty prompt")
        stop = list(stop or ())
        if any(not isinstance(x, str) or not x for x in stop):
            raise InputError("stop strings must be non-empty strings")
        if not temperature >= 0:
            raise InputError("temperature must be >= 0")
        if temperature > 0 and self.heads is not None:
            raise InputError("joint neg+pos decoding is greedy: temperature must be 0")
        det = out = None
        if on_text is not None:
            det, out = self.tokenizer.detokenizer, _Emitter(on_text, stop)

        def emit(t: int) -> None:
            if det is not None and t not in self.eos:
                det.add_token(t)
                seg = det.last_segment
                if seg:
                    out.push(seg)

        t0 = time.perf_counter()
        states = pooled = None
        if self.heads is None:
            tokens, reason, states = self._plain(prompt_ids, max_tokens, emit, stop, temperature)
        else:
            tokens, reason, pooled = self._joint(prompt_ids, max_tokens, emit, stop)
        if det is not None:
            det.finalize()
            seg = det.last_segment
            if seg:
                out.push(seg)
            out.close()
        text = self.tokenizer.decode(tokens)
        if reason == "stop":
            text, tokens = self._cut_at_stop(text, tokens, stop)
            pooled = None  # the joint path pooled the uncut answer
        feats = info = None
        if self.features:
            feats, info = self._pool(prompt_ids, tokens, states, pooled)
        return Decoded(prompt_ids, tokens, text, reason, time.perf_counter() - t0, feats, info)

    def _pool(self, prompt_ids, tokens, states, pooled):
        """``(features [1, 2D] float32, info)`` of prompt + answer from the decoding's states (or None)."""
        import numpy as np

        n, info = _embed.generated_n_kept(self.tokenizer, len(prompt_ids), tokens, delimiter=self.delimiter,
                                          max_length=self.max_length, on_missing="prompt")
        info = {"n_kept": int(n), **info}
        if pooled is not None and pooled[1] == n:
            return np.asarray(pooled[0], dtype=np.float32).reshape(1, -1), info
        if states is None or states.shape[0] < n:
            return None, None  # not all states were computed (e.g. the joint answer was cut at a stop string)
        return _embed.pool_hidden(np.array(states[:n], dtype=np.float32), n).reshape(1, -1), info

    def _cut_at_stop(self, text: str, tokens: list, stop: Sequence[str]) -> tuple[str, list]:
        """Text cut before the stop string; the longest token prefix whose text is a prefix of it."""
        text = text[: first_stop(text, stop)]
        tokens = list(tokens)
        while tokens and not text.startswith(self.tokenizer.decode(tokens)):
            tokens.pop()
        return text, tokens

    # -- plain greedy: mlx-lm's own generate_step ----------------------------------------------------------
    def _closes(self, tokens: list, t: int) -> bool:
        last = self.delimiter[-1]
        if last.isascii() and last not in self.tokenizer.decode([t]):
            return False  # an ASCII delimiter character cannot be split across tokens
        return is_closed(self.tokenizer.decode(tokens), self.delimiter)

    def _plain(self, prompt_ids, max_tokens, emit, stop=(), temperature=0.0):
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        sampler = None
        if temperature > 0:
            from mlx_lm.sample_utils import make_sampler

            sampler = make_sampler(temp=float(temperature))
        tokens, reason = [], "max_tokens"
        recorder = None
        body = _embed.trunk(self.model) if self.features else None
        if body is not None and callable(getattr(body, "norm", None)):  # else: no states, the verifier's own pass
            recorder = _NormRecorder(body.norm)
            body.norm = recorder
        steps = generate_step(mx.array(prompt_ids), self.model, max_tokens=max_tokens, sampler=sampler)
        try:
            for tok, _ in steps:
                t = int(tok)
                emit(t)
                if t in self.eos:
                    reason = "eos"
                    break
                tokens.append(t)
                if self.stop_at_delimiter and self._closes(tokens, t):
                    reason = "delimiter"
                    break
                if stop and first_stop(self.tokenizer.decode(tokens), stop) is not None:
                    reason = "stop"
                    break
                if len(tokens) >= max_tokens:
                    break
        finally:
            steps.close()
            if recorder is not None:
                body.norm = recorder.norm
        return tokens, reason, (recorder.states() if recorder is not None and recorder.outputs else None)

    # -- joint neg+pos: network.generation.greedy_generate ---------------------------------------------------
    def _joint(self, prompt_ids, max_tokens, emit, stop=()):
        from ..network.generation import greedy_generate

        seen = []

        def hook(t: int) -> None:
            emit(t)
            if t in self.eos:
                return
            seen.append(t)
            if stop and first_stop(self.tokenizer.decode(seen), stop) is not None:
                raise _StopHit

        try:
            out = greedy_generate(
                _StreamingHeads(self.heads, hook), self.tokenizer, [prompt_ids], max_new_tokens=max_tokens,
                delimiter=self.delimiter, stop_at_delimiter=self.stop_at_delimiter, batch_size=1,
                features=self.features, max_length=self.max_length,
            )[0]
        except _StopHit:
            return seen, "stop", None
        pooled = (out.embedding, out.n_kept) if self.features else None
        return list(out.token_ids), out.stop_reason, pooled
