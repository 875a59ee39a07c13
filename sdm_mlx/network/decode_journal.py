"""Alg. 4's long decodings, kept as they finish (``alg:sdm-network-training``, steps (c) and (e)).

On a real model one decoding pass of ``network-train`` (the calibration count of a head over D_ca*, or the q, d
decoding of the y = 1 training prompts) takes about an hour on a 2-core CPU, and the run's saved state
(:mod:`.resume`) is written only between such passes.  A :class:`DecodeJournal` keeps the decodings of one pass
in a directory of chunk files as they finish, each written atomically, so a run that is stopped in the middle of
a pass and started again decodes only the prompts it had not finished.

A journal holds the decodings of one ``key`` (what the pass is, the head's checksum, the decode settings and the
prompts); a journal of another key is discarded, never mixed in.  :func:`~.generation.greedy_generate` reads and
writes it; the trainer names one per pass and rank (:meth:`~.rank_work.RankWork.journal`) and deletes them once
the state that makes them unneeded is saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Sequence

import numpy as np

from ..decoding.decode_types import Decoded
from ..decoding.kept import pack_decisions, unpack_decision
from ..storage.journal import ChunkJournal

#: The journals' directory in a network-train run.
JOURNAL_DIR = "decode_journal"
#: Prompts decoded (and written) per chunk: 4 decode batches of 64 on a CPU, a few minutes of a real model.
CHUNK_PROMPTS = 256


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A prompt's identity in a journal: SHA-1 of its token ids."""
    return hashlib.sha1(np.asarray(list(prompt_ids), dtype=np.int64).tobytes()).hexdigest()


class DecodeJournal(ChunkJournal):
    """The finished decodings of one decoding pass, in ``path`` (see the module docstring).

    ``key``: a JSON mapping that names the pass; ``chunk``: prompts decoded before each write (default
    :data:`CHUNK_PROMPTS`)."""

    def __init__(self, path: str, key: dict, chunk: int | None = None):
        super().__init__(path, key)
        self.chunk = int(chunk or CHUNK_PROMPTS)

    def done(self) -> dict[str, Decoded]:
        """``{prompt_key: Decoded}`` of the prompts already decoded in this pass (a journal of another key, or a
        damaged one, is discarded: its prompts are decoded again), with their decision states where kept."""
        out = {}
        for arrays in self.chunks().values():
            try:
                rows, feats = json.loads(str(arrays["rows"])), arrays["features"]
            except (KeyError, ValueError):
                continue  # a chunk that cannot be read is decoded again
            for i, r in enumerate(rows):
                out[r["key"]] = Decoded(prompt_ids=r["prompt_ids"], token_ids=r["token_ids"], text=r["text"],
                                        stop_reason=r["stop_reason"], seconds=r["seconds"],
                                        features=feats[i:i + 1] if feats.size else None,
                                        feature_info=r["feature_info"], decisions=unpack_decision(arrays, i))
        return out

    def add(self, keys: Sequence[str], decoded: Sequence[Decoded]) -> None:
        """Write one chunk of finished decodings (atomically: a stopped write leaves no chunk), with the decision
        states of those that kept them."""
        if not keys:
            return
        rows = [{"key": k, "prompt_ids": [int(t) for t in d.prompt_ids], "token_ids": [int(t) for t in d.token_ids],
                 "text": d.text, "stop_reason": d.stop_reason, "seconds": float(d.seconds),
                 "feature_info": d.feature_info} for k, d in zip(keys, decoded)]
        has = all(d.features is not None for d in decoded)
        feats = (np.concatenate([np.asarray(d.features, dtype=np.float32).reshape(1, -1) for d in decoded])
                 if has else np.zeros((0, 0), dtype=np.float32))
        extra = pack_decisions([d.decisions for d in decoded]) if any(d.decisions is not None for d in decoded) else {}
        self.write(f"{self.count():06d}", rows=np.array(json.dumps(rows)), features=feats, **extra)


class GivenDecodings:
    """A pass's decodings known before it (``given``: ``{prompt_key: Decoded}``, the base head's of
    :mod:`.base_decodings`) in front of its ``journal`` (or none): :func:`~.generation.greedy_generate` reads it as
    a journal, takes the given decodings as they are and writes only what it decodes to ``journal``."""

    def __init__(self, given: dict, journal: DecodeJournal | None = None):
        self.given, self.journal = given, journal
        self.chunk = journal.chunk if journal is not None else None

    def done(self) -> dict:
        return {**self.given, **(self.journal.done() if self.journal is not None else {})}

    def add(self, keys: Sequence[str], decoded: Sequence[Decoded]) -> None:
        if self.journal is not None:
            self.journal.add(keys, decoded)


def discard_journals(root: str, rank: int) -> None:
    """Delete rank ``rank``'s journals under ``root`` (and ``root`` once no rank's are left)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.endswith(f".rank{rank}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    try:
        os.rmdir(root)  # the last rank to finish removes the empty directory
    except OSError:
        pass
