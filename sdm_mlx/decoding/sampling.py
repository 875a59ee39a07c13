"""Per-request sampling settings and their application to one row of a decoding batch.

The fields are those ``mlx_lm.server`` honours, applied in its order: the
logit bias, then the repetition (multiplicative), presence and frequency
(additive) penalties over each one's window of recent tokens, normalisation to
log-probabilities, then the filters ``top_p``, ``min_p``, XTC, ``top_k``
(mlx-lm's own ``apply_*`` functions for three of them), then a categorical draw
at ``temperature``.  ``temperature = 0`` is greedy (argmax of the penalised
logits; the default), and the filters and XTC act only on draws, as in mlx-lm.

Joint neg+pos decoding (a positive head) works on the SDM output over the
``2|V|`` joint vocabulary ``concat(z_neg, z_pos)`` — with q = e − 2 and d = 1
the SDM activation is the softmax of these logits, the distribution whose
argmax greedy joint decoding takes.  The logit bias and the penalties apply to
both halves (a token's neg and pos entries), the filters and the draw to the
joint distribution, and the drawn joint index ``i`` emits token ``i mod |V|``.
A token's reported log-probability is that of emitting it: ``log(p[t] + p[|V|+t])``.

``seed`` makes a request reproducible on its own: its draws (and XTC's coin)
use a private ``mx.random.key(seed)`` split once per token, never the global
generator, so the text does not depend on the other requests of the batch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..errors import InputError

#: Tokens each penalty looks back over by default (``mlx_lm.server``'s ``*_context_size``; 0: all of them).
REPETITION_CONTEXT = 20
#: Largest logit bias (the OpenAI API's range is [-100, 100]).
MAX_LOGIT_BIAS = 100.0
#: Largest seed (``mx.random.key`` takes an unsigned 64-bit integer).
MAX_SEED = 2**64 - 1
#: Most alternatives reported per token with ``top_logprobs`` (the OpenAI limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (see the module docstring); the defaults are greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = REPETITION_CONTEXT
    presence_penalty: float = 0.0
    presence_context_size: int = REPETITION_CONTEXT
    frequency_penalty: float = 0.0
    frequency_context_size: int = REPETITION_CONTEXT
    #: ``((token id, bias), ...)`` added to the logits (a ``{token id: bias}`` dict is taken too)
    logit_bias: tuple = ()
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))

    def validate(self) -> "SamplingParams":
        """Raise :class:`~sdm_mlx.errors.InputError` naming the first out-of-range field; return self."""
        checks = (
            ("temperature", self.temperature >= 0 and math.isfinite(self.temperature), "a number >= 0"),
            ("top_p", 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0: off)"),
            ("min_p", 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED),
             "an integer in [0, 2**64 - 1]"),
            ("repetition_penalty", self.repetition_penalty is None or self.repetition_penalty > 0, "a number > 0"),
            *((f"{name}_context_size", _count(getattr(self, f"{name}_context_size")), "an integer >= 0 (0: all)")
              for name in ("repetition", "presence", "frequency")),
            ("presence_penalty", _finite(self.presence_penalty), "a finite number"),
            ("frequency_penalty", _finite(self.frequency_penalty), "a finite number"),
            ("logit_bias", all(_count(t) and _finite(b) and abs(b) <= MAX_LOGIT_BIAS for t, b in self.logit_bias),
             f"token ids (integers >= 0) with biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            ("xtc_probability", 0 <= self.xtc_probability <= 1, "a number in [0, 1]"),
            ("xtc_threshold", 0 <= self.xtc_threshold <= 0.5, "a number in [0, 0.5]"),
            ("top_logprobs", 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"an integer in [0, {MAX_TOP_LOGPROBS}]"),
        )
        for name, ok, what in checks:
            if not ok:
                raise InputError(f"{name} must be {what}, got {getattr(self, name)!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def changes_logits(self) -> bool:
        """True when a logit bias or a penalty changes the logits before the pick."""
        return (self.repetition_penalty not in (None, 1.0) or self.presence_penalty != 0
                or self.frequency_penalty != 0 or bool(self.logit_bias))

    @property
    def plain_argmax(self) -> bool:
        """True when the token is the argmax of the raw logits (no bias, no penalty, no draw)."""
        return self.greedy and not self.changes_logits


GREEDY = SamplingParams()


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _window(context: list, size: int) -> list:
    """The last ``size`` tokens of ``context`` (all of them for 0, as mlx-lm's ``tokens[-0:]``)."""
    return context[-size:] if size else context


class RowSampler:
    """Picks the tokens of one request from its row of logits (``[1, W]``, ``W`` = |V| or 2|V| joint).

    ``xtc_special``: token ids XTC never removes (mlx-lm's: the encoding of ``"\\n"`` and the EOS ids)."""

    def __init__(self, params: SamplingParams, vocab: int, xtc_special: tuple = ()):
        import mlx.core as mx

        self.params, self.vocab = params, int(vocab)
        self.key = mx.random.key(params.seed) if params.seed is not None else None
        self.xtc_special = tuple(int(t) for t in xtc_special if 0 <= int(t) < self.vocab)

    def _both_halves(self, ids, width: int) -> list:
        """``ids`` and, on a joint 2|V| row, the same tokens' pos entries."""
        ids = list(ids)
        return ids + [t + self.vocab for t in ids] if width > self.vocab else ids

    def _columns(self, ids, logits):
        """The columns of ``ids`` in both halves of a joint row, as an index array."""
        import mlx.core as mx

        return mx.array(self._both_halves(ids, logits.shape[-1]), dtype=mx.int32)

    def _at(self, logits, ids):
        """``logits.at`` the columns of ``ids`` (:meth:`_columns`)."""
        return logits.at[:, self._columns(ids, logits)]

    def _per_column(self, values, logits):
        """``values`` (one per id given to :meth:`_at`) repeated for the pos half of a joint row."""
        import mlx.core as mx

        return mx.array(list(values) * (2 if logits.shape[-1] > self.vocab else 1), dtype=logits.dtype)

    def _penalise(self, logits, context: list):
        """The logit bias, then the repetition, presence and frequency penalties (mlx-lm's order)."""
        import mlx.core as mx

        p = self.params
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            logits = self._at(logits, ids).add(self._per_column(bias, logits))
        if not context:
            return logits
        if p.repetition_penalty not in (None, 1.0):
            idx = self._columns(sorted(set(_window(context, p.repetition_context_size))), logits)
            picked = logits[:, idx]
            logits[:, idx] = mx.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
        if p.presence_penalty:
            logits = self._at(logits, sorted(set(_window(context, p.presence_context_size)))).subtract(
                p.presence_penalty)
        if p.frequency_penalty:
            ids, counts = zip(*sorted(Counter(_window(context, p.frequency_context_size)).items()))
            logits = self._at(logits, ids).subtract(self._per_column([p.frequency_penalty * c for c in counts],
                                                                    logits))
        return logits

    def _xtc(self, logprobs, coin_key):
        """XTC (mlx-lm's ``apply_xtc``): with probability ``xtc_probability``, every token above the threshold
        except the least likely of them is removed; the coin comes from the request's key when it has one."""
        import mlx.core as mx

        p = self.params
        probs = mx.exp(logprobs)
        keep_least = mx.where(probs > p.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
        mask = probs > keep_least
        if self.xtc_special:
            mask[..., mx.array(self._both_halves(list(self.xtc_special), logprobs.shape[-1]), dtype=mx.int32)] = False
        coin = mx.random.uniform(key=coin_key) if coin_key is not None else mx.random.uniform()
        return mx.where(coin > p.xtc_probability, logprobs, mx.where(mask, -mx.inf, logprobs))

    def _filtered(self, logprobs, coin_key):
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        p = self.params
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.xtc_probability > 0:
            logprobs = self._xtc(logprobs, coin_key)
        if 0 < p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        return logprobs

    def choose(self, logits, context: list):
        """``(index [1] int32 over the row's width, logprobs [1, W])`` — lazy arrays."""
        import mlx.core as mx

        logits = self._penalise(logits.astype(mx.float32), context)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1), logprobs
        draw = coin = None
        if self.key is not None:
            if self.params.xtc_probability > 0:
                self.key, draw, coin = mx.random.split(self.key, 3)
            else:  # the same stream as before XTC existed: a seed keeps its text
                self.key, draw = mx.random.split(self.key)
        scaled = self._filtered(logprobs, coin) * (1.0 / self.params.temperature)
        return mx.random.categorical(scaled, key=draw), logprobs


def token_logprobs(logprobs_row, token: int, vocab: int, top: int, tokenizer) -> dict:
    """``{"token", "logprob", "top_logprobs"}`` of an emitted token from its row's log-probabilities (``[W]``).

    Over a joint ``2|V|`` row a token's probability is the sum of its neg and pos entries.
    """
    import mlx.core as mx
    import numpy as np

    lp = logprobs_row
    if lp.shape[-1] > vocab:
        lp = mx.logaddexp(lp[:vocab], lp[vocab:])
    lp = np.asarray(lp, dtype=np.float64)
    out = {"token": tokenizer.decode([int(token)]), "id": int(token), "logprob": float(lp[int(token)])}
    if top > 0:
        best = np.argsort(-lp, kind="stable")[:top]
        out["top_logprobs"] = [{"token": tokenizer.decode([int(i)]), "id": int(i), "logprob": float(lp[i])}
                               for i in best]
    return out
