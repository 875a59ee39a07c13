"""Bounded work per request: prompt tokens, ``max_tokens``, attempts and body reading, checked before any model work.

:class:`RequestLimits` holds the server's caps (``sdm-mlx serve`` flags); :class:`PromptCounter`
counts a request's prompt tokens with its own copy of the tokenizer (the model thread's tokenizer is
never used from another thread), on its own single thread, so a prompt longer than the
limit is refused with 400 ``prompt too long (N tokens, limit L)`` before it reaches the model
thread: no forward pass, no allocation proportional to the prompt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
from dataclasses import dataclass

from ..llm import embed as _embed
from .schema import APIError

#: context length assumed when the model does not state one
FALLBACK_CONTEXT = 8192
#: default cap on a request's max_tokens
DEFAULT_MAX_TOKENS_LIMIT = 2048
#: default seconds allowed for receiving a request body
DEFAULT_BODY_TIMEOUT = 30.0


def context_length(model) -> int:
    """The model's context length (``max_position_embeddings`` of its config), else :data:`FALLBACK_CONTEXT`."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_sequence_length", "n_positions", "context_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return FALLBACK_CONTEXT


@dataclass
class RequestLimits:
    """Per-request caps of the server (see ``docs/serving.md``)."""

    max_prompt_tokens: int
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    max_body_bytes: int = 1 << 20
    body_timeout: float = DEFAULT_BODY_TIMEOUT


class PromptCounter:
    """Token counts of request prompts, rendered exactly as the engine renders them, on a private tokenizer copy.

    The event loop awaits them through :meth:`off_loop`, which runs them one after another on the counter's one
    thread, the only user of the tokenizer copy.  One
    thread, not the event loop's pool of workers: what the ``tokenizers`` library keeps of the words it has
    encoded grows with the number of threads that encode.  Measured with ``tokenizers`` 0.23 alone on the
    tiny test model's tokenizer, 80,000 distinct words grew the heap's live bytes by 2.7 MiB from 1 thread
    (flat after 10,000 words, its word cache's capacity) and by 18.6 MiB from 6 threads (flat after
    60,000): in a server under load, part of a slow creep of its memory (docs/serving.md).
    """

    def __init__(self, engine):
        self.engine = engine
        try:
            self.tokenizer = copy.deepcopy(engine.gen.tokenizer)
        except Exception:  # a tokenizer that cannot be copied: count on the model thread instead
            self.tokenizer = None
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdm-prompt-counter")

    async def off_loop(self, fn, *args):
        """Await ``fn(*args)`` (:meth:`prompt_ids` or :meth:`count`) on the counter's own thread: off the event
        loop and off the model thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def prompt_ids(self, messages: list | None = None, prompt: str | None = None,
                   template_kwargs: dict | None = None, extra: str = "") -> list | None:
        """The token ids of the request's generation prompt (+ ``extra``, e.g. a completion to verify), as the
        engine makes them (:meth:`Engine.prompt_ids`), or None without a private tokenizer; a chat template
        that fails on ``template_kwargs`` raises :class:`~sdm_mlx.errors.InputError`."""
        if self.tokenizer is None:
            return None
        return self._ids(self.tokenizer, messages, prompt, template_kwargs, extra)

    def _ids(self, tokenizer, messages, prompt, template_kwargs, extra) -> list:
        text = self.engine.gen.prompts.prompt_text(messages, prompt, template_kwargs, tokenizer) + extra
        return _embed.encode(tokenizer, text)

    def count(self, messages: list | None = None, prompt: str | None = None, extra: str = "",
              template_kwargs: dict | None = None) -> int:
        """Tokens of :meth:`prompt_ids`; without a private tokenizer, counted the same way with the model's own
        tokenizer on the model thread."""
        ids = self.prompt_ids(messages, prompt, template_kwargs, extra)
        if ids is None:
            ids = self.engine.submit(self._ids, self.engine.gen.tokenizer, messages, prompt, template_kwargs,
                                     extra).result()
        return len(ids)


def check_max_tokens(limits: RequestLimits, max_tokens: int | None) -> None:
    if max_tokens is not None and max_tokens > limits.max_tokens_limit:
        raise APIError(400, f"'max_tokens' {max_tokens} exceeds this server's limit of {limits.max_tokens_limit} "
                            "(sdm-mlx serve --max-tokens-limit)", param="max_tokens", code="max_tokens_too_large")


def check_prompt_tokens(limits: RequestLimits, n: int, param: str) -> None:
    if n > limits.max_prompt_tokens:
        raise APIError(400, f"prompt too long ({n} tokens, limit {limits.max_prompt_tokens})", param=param,
                       code="context_length_exceeded")
