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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..network.generation import is_closed

STOP_REASONS = ("delimiter", "eos", "max_tokens")


@dataclass
class Decoded:
    """One greedy decoding: generated ``token_ids`` (EOS not kept), their ``text``, why it stopped, wall time."""

    prompt_ids: list
    token_ids: list
    text: str
    stop_reason: str
    seconds: float


def eos_ids(tokenizer) -> set:
    """End-of-sequence token ids of an (mlx-lm wrapped) tokenizer."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    eid = getattr(tokenizer, "eos_token_id", None)
    if eid is not None:
        ids.add(int(eid))
    return ids


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
    """

    def __init__(self, model, tokenizer, heads=None, delimiter: str = "}", stop_at_delimiter: bool = True):
        if not delimiter:
            raise ValueError("delimiter must be a non-empty string")
        self.model, self.tokenizer, self.heads = model, tokenizer, heads
        self.delimiter, self.stop_at_delimiter = delimiter, stop_at_delimiter
        self.eos = eos_ids(tokenizer)

    @property
    def mode(self) -> str:
        return "plain" if self.heads is None else "joint"

    def __call__(self, prompt_ids: Sequence[int], max_tokens: int, on_text: Callable[[str], None] | None = None):
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt")
        det = None
        if on_text is not None:
            det = self.tokenizer.detokenizer

        def emit(t: int) -> None:
            if det is not None and t not in self.eos:
                det.add_token(t)
                seg = det.last_segment
                if seg:
                    on_text(seg)

        t0 = time.perf_counter()
        if self.heads is None:
            tokens, reason = self._plain(prompt_ids, max_tokens, emit)
        else:
            tokens, reason = self._joint(prompt_ids, max_tokens, emit)
        if det is not None:
            det.finalize()
            seg = det.last_segment
            if seg:
                on_text(seg)
        return Decoded(prompt_ids, tokens, self.tokenizer.decode(tokens), reason, time.perf_counter() - t0)

    # -- plain greedy: mlx-lm's own generate_step ----------------------------------------------------------
    def _closes(self, tokens: list, t: int) -> bool:
        last = self.delimiter[-1]
        if last.isascii() and last not in self.tokenizer.decode([t]):
            return False  # an ASCII delimiter character cannot be split across tokens
        return is_closed(self.tokenizer.decode(tokens), self.delimiter)

    def _plain(self, prompt_ids, max_tokens, emit):
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        tokens, reason = [], "max_tokens"
        steps = generate_step(mx.array(prompt_ids), self.model, max_tokens=max_tokens)
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
                if len(tokens) >= max_tokens:
                    break
        finally:
            steps.close()
        return tokens, reason

    # -- joint neg+pos: network.generation.greedy_generate ---------------------------------------------------
    def _joint(self, prompt_ids, max_tokens, emit):
        from ..network.generation import greedy_generate

        out = greedy_generate(
            _StreamingHeads(self.heads, emit), self.tokenizer, [prompt_ids], max_new_tokens=max_tokens,
            delimiter=self.delimiter, stop_at_delimiter=self.stop_at_delimiter, batch_size=1, features=False,
        )[0]
        return list(out.token_ids), out.stop_reason
