"""Per-request sampling settings and their application to one row of a decoding batch.

The fields are those ``mlx_lm.server`` honours, applied in its order: the
repetition penalty on the logits (the last :data:`REPETITION_CONTEXT` tokens),
normalisation to log-probabilities, then the filters ``top_p``, ``min_p``,
``top_k`` (mlx-lm's own ``apply_*`` functions), then a categorical draw at
``temperature``.  ``temperature = 0`` is greedy (argmax; the default).

Joint neg+pos decoding (a positive head) works on the SDM output over the
``2|V|`` joint vocabulary ``concat(z_neg, z_pos)`` — with q = e − 2 and d = 1
the SDM activation is the softmax of these logits, the distribution whose
argmax greedy joint decoding takes.  The repetition penalty applies to both
halves (a token's neg and pos entries), the filters and the draw to the joint
distribution, and the drawn joint index ``i`` emits token ``i mod |V|``.  A
token's reported log-probability is that of emitting it: ``log(p[t] + p[|V|+t])``.

``seed`` makes a request reproducible on its own: its draws use a private
``mx.random.key(seed)`` split once per token, never the global generator, so
the text does not depend on the other requests of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InputError

#: Tokens the repetition penalty looks back over (``mlx_lm.server``'s default ``repetition_context_size``).
REPETITION_CONTEXT = 20
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
    logprobs: bool = False
    top_logprobs: int = 0

    def validate(self) -> "SamplingParams":
        """Raise :class:`~sdm_mlx.errors.InputError` naming the first out-of-range field; return self."""
        checks = (
            ("temperature", self.temperature >= 0 and math.isfinite(self.temperature), "a number >= 0"),
            ("top_p", 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0: off)"),
            ("min_p", 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and self.seed >= 0), "an integer >= 0"),
            ("repetition_penalty", self.repetition_penalty is None or self.repetition_penalty > 0, "a number > 0"),
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
    def plain_argmax(self) -> bool:
        """True when the token is the argmax of the raw logits (no penalty, no draw)."""
        return self.greedy and self.repetition_penalty in (None, 1.0)


GREEDY = SamplingParams()


class RowSampler:
    """Picks the tokens of one request from its row of logits (``[1, W]``, ``W`` = |V| or 2|V| joint)."""

    def __init__(self, params: SamplingParams, vocab: int):
        import mlx.core as mx

        self.params, self.vocab = params, int(vocab)
        self.key = mx.random.key(params.seed) if params.seed is not None else None

    def _penalise(self, logits, context: list):
        import mlx.core as mx

        penalty = self.params.repetition_penalty
        if penalty in (None, 1.0) or not context:
            return logits
        recent = sorted(set(context[-REPETITION_CONTEXT:]))
        idx = recent + ([t + self.vocab for t in recent] if logits.shape[-1] > self.vocab else [])
        idx = mx.array(idx, dtype=mx.int32)
        picked = logits[:, idx]
        logits[:, idx] = mx.where(picked < 0, picked * penalty, picked / penalty)
        return logits

    def _filtered(self, logprobs):
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        p = self.params
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
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
        if self.key is not None:
            self.key, draw = mx.random.split(self.key)
        else:
            draw = None
        scaled = self._filtered(logprobs) * (1.0 / self.params.temperature)
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
