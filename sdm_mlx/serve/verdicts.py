"""Verdicts kept by id for explanations and feedback, bounded in count AND in bytes.

A verdict record keeps the prompt and answer token ids it was computed from (int32 arrays: what a
feedback label needs to recompute the verifier's features), a shortened copy of the prompt text
(the first and last :data:`PROMPT_TEXT_TOKENS` tokens, decoded), the answer text (capped at
:data:`MAX_TEXT_CHARS`), and the verdict's quantities.  The store drops the oldest records beyond
``capacity`` records or ``max_bytes`` estimated bytes, so what clients send cannot grow the
server's memory without bound.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict

import numpy as np

from ..errors import InputError

#: tokens kept at each end of a stored prompt's text (the ids are all kept, as int32)
PROMPT_TEXT_TOKENS = 256
#: characters kept of a stored answer text
MAX_TEXT_CHARS = 16384
#: default byte budget of the verdict store
DEFAULT_MAX_BYTES = 64 << 20


def clip_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}…[{len(text) - 2 * half} characters not kept]…{text[-half:]}"


def prompt_excerpt(tokenizer, prompt_ids) -> str:
    """The prompt's text, or for a long prompt its first and last :data:`PROMPT_TEXT_TOKENS` tokens."""
    ids = [int(t) for t in prompt_ids]
    k = PROMPT_TEXT_TOKENS
    if len(ids) <= 2 * k:
        return tokenizer.decode(ids)
    return f"{tokenizer.decode(ids[:k])}…[{len(ids) - 2 * k} tokens not kept]…{tokenizer.decode(ids[-k:])}"


def verdict_record(tokenizer, source: str, prompt_ids, answer_ids, *, text: str, verdict) -> dict:
    """The stored record of one ``verdict`` (a Verdict, with its full per-row output ``row``); run on the model
    thread."""
    v = verdict
    return {
        "source": source, "created": time.time(),
        "prompt_ids": np.asarray(list(prompt_ids), dtype=np.int32),
        "answer_ids": np.asarray(list(answer_ids), dtype=np.int32),
        "prompt": prompt_excerpt(tokenizer, prompt_ids), "answer": clip_text(text),
        "verified": v.verified, "reason": v.reason, "p_lower": v.p_lower, "parsed": v.parsed,
        "exemplars": v.exemplars, "verifier": v.verifier, "row": v.row,
    }


def record_bytes(record: dict) -> int:
    """An estimate of a record's memory: its id arrays, texts (4 bytes a character at most) and JSON fields."""
    n = 512
    for key, value in record.items():
        if isinstance(value, np.ndarray):
            n += value.nbytes
        elif isinstance(value, str):
            n += 4 * len(value)
        else:
            try:
                n += 2 * len(json.dumps(value, default=str))
            except (TypeError, ValueError, RecursionError):
                n += 4096
    return n


class VerdictStore:
    """Verdict records by id; the oldest dropped beyond ``capacity`` records or ``max_bytes`` (thread-safe)."""

    def __init__(self, capacity: int = 1000, max_bytes: int = DEFAULT_MAX_BYTES):
        if capacity < 1:
            raise InputError("the verdict store capacity must be >= 1")
        if max_bytes < 1:
            raise InputError("the verdict store byte limit must be >= 1")
        self.capacity, self.max_bytes = int(capacity), int(max_bytes)
        self._items: OrderedDict = OrderedDict()
        self._sizes: dict = {}
        self.bytes = 0
        self._lock = threading.Lock()

    def put(self, record: dict) -> str:
        vid = "vd-" + uuid.uuid4().hex[:16]
        size = record_bytes(record)
        with self._lock:
            self._items[vid] = dict(record, verdict_id=vid)
            self._sizes[vid] = size
            self.bytes += size
            while len(self._items) > 1 and (len(self._items) > self.capacity or self.bytes > self.max_bytes):
                old, _ = self._items.popitem(last=False)
                self.bytes -= self._sizes.pop(old)
        return vid

    def get(self, verdict_id: str) -> dict | None:
        with self._lock:
            return self._items.get(verdict_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
