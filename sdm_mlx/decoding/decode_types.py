"""What the decoding engine is asked (:class:`DecodeRequest`) and what it answers (:class:`Decoded`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import InputError
from ..llm.pooling import DEFAULT_FEATURE_PARTS, FEATURE_PARTS, check_feature_parts
from .sampling import GREEDY, SamplingParams

STOP_REASONS = ("delimiter", "eos", "max_tokens", "stop", "cancelled")


@dataclass
class DecodeRequest:
    """One decoding: prompt token ids and how to pick and stop (``cancel``: polled at every token).

    Streaming: ``on_text(segment)`` gets readable text as it is decoded (mlx-lm's streaming detokenizer);
    ``on_tokens(text, logprobs)`` (used instead when given) gets text released at token boundaries with the
    ``logprobs`` records of exactly the tokens it completes (empty unless ``sampling.logprobs``; see
    :class:`~.streaming.TokenTextEmitter`).
    """

    prompt_ids: list
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop: Sequence[str] = ()
    stop_at_delimiter: bool = True
    features: bool = False
    feature_parts: tuple = DEFAULT_FEATURE_PARTS
    on_text: Callable[[str], None] | None = None
    cancel: Callable[[], bool] | None = None
    on_tokens: Callable[[str, list], None] | None = None
    keep_decisions: bool = False
    keep_prompt: bool = False

    @property
    def keeps_states(self) -> bool:
        """Whether the engine keeps this request's final-norm states (for its features or its decisions)."""
        return self.features or self.keep_decisions or self.keep_prompt


@dataclass
class Decoded:
    """A finished decoding: generated ``token_ids`` (EOS not kept), their ``text``, why it stopped, timings.

    ``features``: with ``features=True``, the verifier input ``[1, len(feature_parts) * D]`` float32 of prompt +
    answer (the request's ``feature_parts``, :data:`sdm_mlx.llm.pooling.FEATURE_PARTS` order) and
    ``feature_info`` = ``{"n_kept", "delimiter_index", "missing_delimiter", "truncated"}``.
    ``logprobs``: with ``sampling.logprobs``, one ``{"token", "id", "logprob"[, "top_logprobs"]}`` per token;
    ``token`` is the text the token adds to ``text`` (:class:`~.streaming.TokenPieces`: the tokens join to it).
    ``decisions``: with ``keep_decisions=True``, float32 ``[n, D]``, the final-norm state that picked each token
    (the last prompt position's, then the state after feeding each token): one per generated token, and one more
    for the end-of-sequence token when the decoding stopped on it (None for a ``stop`` or ``cancelled`` decoding).
    With the trunk frozen, a head whose picks from these states are the same tokens decodes the same answer
    (:mod:`sdm_mlx.network.base_decodings`).
    ``prompt_cache``: with ``keep_prompt=True`` (and the engine's batched prefill), the prompt's keys and values per
    layer (``[1, H, P, d]``) and its final-norm states ``[P, D]``: another completion of the same prompt runs only its
    own tokens (:func:`sdm_mlx.decoding.continuation.continuation_features`).
    """

    prompt_ids: list
    token_ids: list
    text: str
    stop_reason: str
    seconds: float
    features: object = None
    feature_info: dict | None = None
    logprobs: list | None = None
    first_token_seconds: float | None = None
    cached_prompt_tokens: int = 0
    error: BaseException | None = None  # raised by the request's on_text / on_tokens (the row was stopped)
    decisions: object = None
    prompt_cache: object = None  # with keep_prompt=True: ([(keys, values)] per layer, final-norm states [P, D])


def check_request(req: DecodeRequest) -> None:
    """Raise :class:`~sdm_mlx.errors.InputError` naming what is wrong with ``req``."""
    if req.max_tokens < 1:
        raise InputError("max_tokens must be >= 1")
    if not req.prompt_ids:
        raise InputError("empty prompt")
    if any(not isinstance(s, str) or not s for s in req.stop):
        raise InputError("stop strings must be non-empty strings")
    if req.features and tuple(req.feature_parts) != check_feature_parts(req.feature_parts):
        raise InputError(f"feature_parts must be written in the order {FEATURE_PARTS}, got {req.feature_parts!r}")
    req.sampling.validate()
