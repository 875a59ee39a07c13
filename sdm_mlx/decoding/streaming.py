"""Streamed answer text: stop strings cut the text, a possible stop-string prefix is held back until decided,
and (:class:`TokenTextEmitter`) text released at token boundaries with the records of the tokens it completes."""

from __future__ import annotations

import os
from typing import Callable, Sequence


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index of the earliest occurrence in ``text`` of any string of ``stop`` (None: none occurs)."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def cut_at_stop(tokenizer, text: str, tokens: Sequence[int], stop: Sequence[str]) -> tuple[str, list]:
    """``text`` cut before its first stop string, and the longest prefix of ``tokens`` whose text is a prefix
    of the cut text."""
    text = text[: first_stop(text, stop)]
    tokens = list(tokens)
    while tokens and not text.startswith(tokenizer.decode(tokens)):
        tokens.pop()
    return text, tokens


class TextEmitter:
    """Forwards streamed text to ``on_text``, holding back a possible stop-string prefix and cutting at a stop.

    OpenAI semantics: the text is cut before the stop string; the streamed text never shows it — the
    last ``len(stop) - 1`` characters are held back until they cannot start one.
    """

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


class TokenPieces:
    """The text each generated token adds to the decoded answer (``Decoded.logprobs``' ``token``).

    A token's piece is the growth of ``tokenizer.decode(tokens)`` when it is appended, so the pieces join to
    the decoded text (a SentencePiece ``▁word`` adds ``" word"``, not the ``"word"`` it decodes to alone).
    Text is attributed once it is final: a token that ends inside a multi-byte character adds nothing and
    the token that completes the character carries all of its bytes; a run of SentencePiece byte-fallback
    tokens (``<0xE2>``) adds nothing until a token that is not one follows, since the tokenizer decodes the
    run as a whole (an invalid run becomes one U+FFFD per byte, rewriting what its valid start decoded to).
    :meth:`finalize` returns what the pieces left out at the end.  A decoder that rewrites earlier text
    (``clean_up_tokenization_spaces``: ``"a ,"`` becomes ``"a,"``) gets the new text from where the two
    decodings differ: the pieces then join to the text as streamed, not to the final decoding.

    Each token costs a decoding of the last ``2 * CONTEXT`` or so tokens, not of the whole answer: the text of
    the tokens older than ``CONTEXT`` is taken as streamed, and the newer ones are decoded after ``CONTEXT``
    tokens of left context (which gives a SentencePiece word its leading space and the clean-up its
    neighbours).  Both cuts are moved back to a token after which the text was whole (not inside a byte run
    or a character).  When the decoded context is not the start of the decoded window, or holds an invalid
    byte sequence, the whole answer is decoded, as before.
    """

    #: tokens of left context decoded before the ones whose text may still change
    CONTEXT = 8

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.text = tokenizer, [], ""
        self.ends: list = []  # per token: len(self.text) after its piece
        self.settled: list = []  # per token: the text then held all tokens' text (not in a byte run or a character)

    def add(self, token: int) -> str:
        self.tokens.append(int(token))
        if _is_byte_token(self.tokenizer, token):
            piece, settled = "", False
        else:
            decoded = self._decoded()
            piece, settled = self._grow(decoded.rstrip("\ufffd")), not decoded.endswith("\ufffd")
        self.ends.append(len(self.text))
        self.settled.append(settled)
        return piece

    def finalize(self) -> str:
        return self._grow(self._decoded()) if self.tokens else ""

    def _boundary(self, i: int) -> int:
        """The largest ``j <= i`` after whose tokens the streamed text holds all of their text (0: none)."""
        while i > 0 and not self.settled[i - 1]:
            i -= 1
        return i

    def _decoded(self) -> str:
        """``tokenizer.decode(self.tokens)``, from the streamed text and a decoding of the last tokens only."""
        decode = self.tokenizer.decode
        stable = self._boundary(len(self.tokens) - self.CONTEXT - 1)  # tokens [0, stable) are taken as streamed
        start = self._boundary(stable - self.CONTEXT)
        if start <= 0:
            return decode(self.tokens)
        head, window = decode(self.tokens[start:stable]), decode(self.tokens[start:])
        if not window.startswith(head) or "\ufffd" in head:
            return decode(self.tokens)
        return self.text[: self.ends[stable - 1]] + window[len(head):]

    def _grow(self, decoded: str) -> str:
        if decoded.startswith(self.text):
            same = len(self.text)
        else:  # earlier text rewritten: no token's text ends past the rewrite any more
            same = len(os.path.commonprefix([self.text, decoded]))
            self.ends = [min(e, same) for e in self.ends]
        piece, self.text = decoded[same:], decoded
        return piece


def _is_byte_token(tokenizer, token: int) -> bool:
    """True for a SentencePiece byte-fallback token (``<0x0A>``)."""
    try:
        name = tokenizer.convert_ids_to_tokens(int(token))
    except Exception:  # a tokenizer without token names: no byte-fallback tokens to tell apart
        return False
    return isinstance(name, str) and len(name) == 6 and name.startswith("<0x") and name.endswith(">")


class TokenTextEmitter:
    """Streams text at token boundaries: ``on_tokens(text, records)`` gets the text and the records (e.g. the
    logprobs) of exactly the tokens that text completes.

    As :class:`TextEmitter`, the last ``len(stop) - 1`` characters are held back until they cannot start a
    stop string, and nothing from a stop string on is sent; a release is moved back to the end of the last
    token that lies wholly before it.  A token whose piece is empty (it ends inside a character) goes with
    the token that completes its text.  Only :meth:`close` may cut a token (before a stop string that
    starts inside it): it sends the text up to the stop and the records of the first ``n_kept`` tokens.
    """

    def __init__(self, on_tokens: Callable[[str, list], None], stop: Sequence[str]):
        self.on_tokens, self.stop = on_tokens, list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text, self.sent, self.released = "", 0, 0
        self.ends: list = []      # per token: offset in text where its piece ends
        self.records: list = []   # per token: its record (None: nothing to report)
        self.filled: list = []    # per token: its piece is not empty

    def push(self, piece: str, record=None) -> None:
        """One more token: its piece of text and its record."""
        self.text += piece
        self.ends.append(len(self.text))
        self.records.append(record)
        self.filled.append(bool(piece))
        self._send(len(self.text) - self.hold)

    def extend(self, text: str) -> None:
        """Text that belongs to the last token (:meth:`TokenPieces.finalize`)."""
        self.text += text
        if self.ends:
            self.ends[-1] = len(self.text)
            self.filled[-1] = self.filled[-1] or bool(text)

    def close(self, n_kept: int) -> None:
        """Send the rest: the text up to the first stop string (or all of it), the records of tokens < ``n_kept``."""
        cut = first_stop(self.text, self.stop)
        self._release(len(self.text) if cut is None else cut, n_kept)

    def _send(self, upto: int) -> None:
        cut = first_stop(self.text, self.stop)
        if cut is not None:
            upto = min(upto, cut)
        n = self.released
        for i in range(self.released, len(self.ends)):
            if self.ends[i] > upto:
                break
            if self.filled[i]:
                n = i + 1
        if n > self.released:
            self._release(self.ends[n - 1], n)

    def _release(self, upto: int, n: int) -> None:
        text = self.text[self.sent:upto] if upto > self.sent else ""
        records = [r for r in self.records[self.released:n] if r is not None]
        self.sent, self.released = max(self.sent, upto), max(self.released, n)
        if text or records:
            self.on_tokens(text, records)


class AnswerStream:
    """One decoding row's streamed text and token pieces (:class:`~.decode_types.DecodeRequest`'s ``on_text`` /
    ``on_tokens``; pieces with ``pieces=True`` or ``on_tokens``).

    :meth:`add` takes each generated token (with its logprobs record, which gets the token's piece as its
    ``token``), :meth:`end` sends the rest.  A consumer that raises (a client that went away) stops the
    stream: ``error`` holds the exception and nothing more is sent.
    """

    def __init__(self, tokenizer, *, stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None,
                 on_tokens: Callable[[str, list], None] | None = None, pieces: bool = False):
        self.error: BaseException | None = None
        self.pieces = TokenPieces(tokenizer) if (pieces or on_tokens is not None) else None
        self.detok, self.out = None, None
        if on_tokens is not None:
            self.out = TokenTextEmitter(on_tokens, stop)
        elif on_text is not None:
            self.detok, self.out = tokenizer.detokenizer, TextEmitter(on_text, stop)

    def add(self, token: int, record: dict | None = None) -> bool:
        """Take one generated token; False when the consumer raised (the row should stop)."""
        piece = None if self.pieces is None else self.pieces.add(token)
        if record is not None and piece is not None:
            record["token"] = piece
        if self.out is None:
            return True
        try:
            if self.detok is None:
                self.out.push(piece, record)
            else:
                self.detok.add_token(token)
                if seg := self.detok.last_segment:
                    self.out.push(seg)
        except Exception as e:  # a consumer that went away must not stop the other rows
            self.error = e
            return False
        return True

    def end(self, n_kept: int, last_record: dict | None = None) -> None:
        """Send the rest (``n_kept``: the tokens left after a stop-string cut; ``last_record``: the last token's
        record, which gets an incomplete final character's text)."""
        rest = "" if self.pieces is None else self.pieces.finalize()
        if rest and last_record is not None:
            last_record["token"] += rest
        if self.out is None or self.error is not None:
            return
        try:
            if self.detok is None:
                self.out.extend(rest)
                self.out.close(n_kept)
                return
            self.detok.finalize()
            if seg := self.detok.last_segment:
                self.out.push(seg)
            self.out.close()
        except Exception as e:
            self.error = e
