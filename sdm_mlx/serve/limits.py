"""Bounded work per request: prompt tokens, ``max_tokens``, attempts and body reading, checked before any model work.

:class:`RequestLimits` holds the server's caps (``sdm-mlx serve`` flags); :class:`PromptCounter`
counts a request's prompt tokens with its own copy of the tokenizer (the model thread's tokenizer is
never used from another thread), on its own single thread, so a prompt longer than the
limit is refused with 400 ``prompt too long (N tokens, limit L)`` before it reaches the model
thread: no forward pass, no allocation proportional to the prompt.

A prompt whose length alone proves it too long is refused before it is tokenised
(:class:`TokenFloor`, ``prompt too long (at least N tokens by its length alone, limit L)``): tokenising
costs about 1.3 s and hundreds of MB per MB of text, so a 1 MB prompt took 3.2 s to get its 400 and an
8 MB MCP question 50.7 s and 873 MB.  The floor is a proof, never a guess: a prompt it refuses has more
tokens than the limit, and every prompt it lets through is counted exactly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import math
import re
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


#: ASCII whitespace of a prompt (word starts are counted after it), as bytes
_SPACE_BYTES = b" \t\n\r"
#: how a vocabulary spells that whitespace: itself or SentencePiece's ▁ (which a literal ▁ of a text is too)...
_SPACE_SPELLINGS = frozenset(" \t\n\r\u2581")
#: ... or, in a byte-level BPE's vocabulary, Ġ ĉ Ċ č (bytes 0x20 0x09 0x0A 0x0D; every other byte is another
#: character), its added tokens being spelt as text
_BYTE_LEVEL_SPACES = frozenset("\u0120\u0109\u010a\u010d")
#: 1 for a whitespace byte, 0 for any other (bytes.translate): word starts are then the b"\x01\x00" pairs
_SPACE_TABLE = bytes(1 if b in _SPACE_BYTES else 0 for b in range(256))
#: Unicode White_Space: what an added token with lstrip / rstrip swallows next to it
_WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
                + "\u2028\u2029\u202f\u205f\u3000")
#: characters NFC / NFKC can compose into one (a canonical decomposition has at most 4; Hangul L V T: 3)
_COMPOSE = 4


def _start_pattern(spaces) -> re.Pattern:
    """Matches each whitespace-then-not-whitespace pair of a vocabulary entry (whitespace spelt as ``spaces``)."""
    chars = re.escape("".join(sorted(spaces)))
    return re.compile(f"[{chars}](?=[^{chars}])")


_STARTS = {spaces: _start_pattern(spaces) for spaces in (_SPACE_SPELLINGS, _BYTE_LEVEL_SPACES)}


def _word_starts_within(token: str, spaces=_SPACE_SPELLINGS) -> int:
    """Whitespace-then-not-whitespace pairs inside one vocabulary entry (whitespace spelt as ``spaces``)."""
    return len(_STARTS[spaces].findall(token))


def _normalizer_shrink(state) -> tuple[int, bool] | None:
    """``(how many characters may become one, whether word starts are kept)`` of a tokenizer normalizer (its JSON
    state); None for a normalizer that may delete characters (strip, accents, BERT's, a precompiled map...)."""
    if state is None:
        return 1, True
    kind = state.get("type")
    if kind == "Sequence":
        shrink, starts = 1, True
        for sub in state.get("normalizers", []):
            part = _normalizer_shrink(sub)
            if part is None:
                return None
            shrink, starts = shrink * part[0], starts and part[1]
        return shrink, starts
    if kind in ("Prepend", "NFD", "Lowercase"):
        return 1, True
    if kind == "NFC":
        return _COMPOSE, True  # composes marks and jamo, never with whitespace
    if kind in ("NFKC", "NFKD"):  # may turn a no-break space into a space: word starts not kept
        return (_COMPOSE if kind == "NFKC" else 1), False
    if kind == "Replace" and state.get("pattern") == {"String": " "} and state.get("content") == "\u2581":
        return 1, True  # SentencePiece's space marker
    return None


def _pre_tokenizer_keeps_text(state) -> bool:
    """Whether a pre-tokenizer (JSON state) only splits or re-spells the text, never dropping a character."""
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(sub) for sub in state.get("pretokenizers", []))
    if kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts"):
        return True
    if kind in ("Split", "Punctuation"):
        return str(state.get("behavior", "Isolated")).lower() != "removed"
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop characters


class TokenFloor:
    """A lower bound on the tokens of a text from its length alone, for a BPE tokenizer (``floor(text)``).

    Two facts about the tokenizer, read once from its vocabulary, make two bounds:

    * no token stands for more than ``max_chars`` characters (its longest entry: a byte-level entry of n
      characters is n bytes, at most n characters; SentencePiece's ▁ is one space), so a text of C characters
      has at least C / ``max_chars`` tokens (C / 4 ``max_chars`` when NFC may compose characters of a text that
      is not ASCII; added tokens that swallow whitespace: C counts the other characters);
    * no token holds more than ``max_starts`` word starts (a space, tab or newline followed by another
      character), and two neighbouring tokens share at most one, so W word starts need at least
      (W + 1) / (``max_starts`` + 1) tokens: "word " * 52000 needs 26,000 or more wherever the entries are
      long (Qwen2.5's longest has 128 characters, but holds no more than 4 word starts).

    :meth:`of` returns None for a tokenizer where this could be wrong (a normalizer or pre-tokenizer that may
    drop characters, characters without a token of their own: an unknown token that swallows a run of unknown
    characters, a BPE that drops them; a model other than BPE):
    such prompts are only counted exactly.  The chat template and special tokens only add tokens.
    """

    def __init__(self, max_chars: int, max_starts: int | None, compose: int = 1, strip: bool = False,
                 byte_level: bool = False):
        self.max_chars, self.max_starts, self.compose, self.strip = max(1, max_chars), max_starts, compose, strip
        self.byte_level = byte_level

    @classmethod
    def of(cls, tokenizer) -> "TokenFloor | None":
        """The floor of a Hugging Face fast tokenizer (or mlx-lm's wrapper of one); None when no sound one is known."""
        try:
            from tokenizers import pre_tokenizers

            backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
                getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None)
            if backend is None:
                return None
            model = backend.model
            if type(model).__name__ != "BPE":
                return None
            vocab = backend.get_vocab(with_added_tokens=True)
            normalizer, pre = _state(backend.normalizer), _state(backend.pre_tokenizer)
            shrink = _normalizer_shrink(normalizer)
            if shrink is None or not _pre_tokenizer_keeps_text(pre):
                return None
            byte_level = '"ByteLevel"' in json.dumps([normalizer, pre])
            # every character must become at least one token of its own: each byte has a token (byte-level
            # BPE's alphabet, or byte fallback), or an unknown character is one unknown token (not fused with
            # its neighbours; without an unknown token, BPE drops it)
            if not (all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet()) if byte_level else
                    (getattr(model, "byte_fallback", False) and all(f"<0x{b:02X}>" in vocab for b in range(256)))
                    or (getattr(model, "unk_token", None) in vocab and not getattr(model, "fuse_unk", False))):
                return None
            added = list(backend.get_added_tokens_decoder().values())
        except Exception:  # an unusual tokenizer: count exactly
            return None
        texts = {t.content for t in added}
        strip = any(t.lstrip or t.rstrip for t in added)
        spaces = _BYTE_LEVEL_SPACES if byte_level else _SPACE_SPELLINGS
        starts = [_word_starts_within(t, spaces) for t in vocab if not spaces.isdisjoint(t) and t not in texts]
        starts += [_word_starts_within(t.content) + (1 if t.lstrip else 0) for t in added]
        max_chars = max(map(len, vocab), default=1)
        return cls(max_chars, max(starts, default=0) if shrink[1] else None, shrink[0], strip, byte_level)

    def __call__(self, text: str, limit: int | None = None) -> int:
        """At least this many tokens in ``text``; with ``limit``, the word starts are only counted (one pass over
        the bytes) when the characters alone do not already pass it and could."""
        chars = len(text)
        if self.strip:
            chars -= sum(text.count(c) for c in _WHITE_SPACE)
        compose = 1 if text.isascii() else self.compose
        floor = math.ceil(chars / (self.max_chars * compose))
        if self.max_starts is None or (limit is not None and (floor > limit or len(text) <= limit)):
            return floor
        data = text.encode("utf-8", "surrogatepass")
        starts = data.translate(_SPACE_TABLE).count(b"\x01\x00")
        if not self.byte_level:  # a space before a literal ▁ is spelt like two spaces: not a word start
            starts -= sum(data.count(bytes([b]) + "\u2581".encode()) for b in _SPACE_BYTES)
        return max(floor, math.ceil((starts + 1) / (self.max_starts + 1)))


def _state(component):
    """The JSON state of a tokenizer component (None: no component)."""
    return None if component is None else json.loads(component.__getstate__())


class PromptTooLong(ValueError):
    """A prompt refused by its length alone (:class:`TokenFloor`), before it was tokenised."""

    def __init__(self, at_least: int, limit: int):
        self.at_least, self.limit = at_least, limit
        super().__init__(f"prompt too long (at least {at_least} tokens by its length alone, limit {limit})")


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

    def __init__(self, engine, limit: int | None = None):
        self.engine, self.limit = engine, limit
        try:
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # a tokenizer that cannot be copied: count on the model thread instead
            self.tokenizer = None
        # with a limit, a text whose length alone proves it longer is refused before it is tokenised
        own = self.tokenizer if self.tokenizer is not None else engine.tokenizer
        self.floor = TokenFloor.of(own) if limit is not None else None
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdm-prompt-counter")

    async def off_loop(self, fn, *args):
        """Await ``fn(*args)`` (:meth:`prompt_ids` or :meth:`count`) on the counter's own thread: off the event
        loop and off the model thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def prompt_ids(self, messages: list | None = None, prompt: str | None = None,
                   template_kwargs: dict | None = None, extra: str = "") -> list | None:
        """The token ids of the request's generation prompt (+ ``extra``, e.g. a completion to verify), as the
        engine makes them (:meth:`Engine.prompt_ids`), or None without a private tokenizer; a chat template
        that fails on ``template_kwargs`` raises :class:`~sdm_mlx.errors.InputError`, a text whose length
        alone proves it over the limit :class:`PromptTooLong` (before it is tokenised)."""
        if self.tokenizer is None:
            return None
        return self._ids(self.tokenizer, messages, prompt, template_kwargs, extra)

    def _ids(self, tokenizer, messages, prompt, template_kwargs, extra) -> list:
        text = self.engine.prompts.prompt_text(messages, prompt, template_kwargs, tokenizer) + extra
        self.check_length(text)
        return _embed.encode(tokenizer, text)

    def check_length(self, text: str) -> None:
        """Raise :class:`PromptTooLong` when ``text``'s length alone proves it has more tokens than the limit."""
        if self.floor is not None:
            at_least = self.floor(text, self.limit)
            if at_least > self.limit:
                raise PromptTooLong(at_least, self.limit)

    def count(self, messages: list | None = None, prompt: str | None = None, extra: str = "",
              template_kwargs: dict | None = None) -> int:
        """Tokens of :meth:`prompt_ids`; without a private tokenizer, counted the same way with the model's own
        tokenizer on the model thread."""
        ids = self.prompt_ids(messages, prompt, template_kwargs, extra)
        if ids is None:
            ids = self.engine.submit(self._ids, self.engine.tokenizer, messages, prompt, template_kwargs,
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
