"""Streamed answer text: stop strings cut the text, and a possible stop-string prefix is held back until decided."""

from __future__ import annotations

from typing import Callable, Sequence


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index of the earliest occurrence in ``text`` of any string of ``stop`` (None: none occurs)."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


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
