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
from ..storage.files import atomic_write, write_json

#: The journals' directory in a network-train run.
JOURNAL_DIR = "decode_journal"
KEY_FILE = "key.json"
#: Prompts decoded (and written) per chunk: 4 decode batches of 64 on a CPU, a few minutes of a real model.
CHUNK_PROMPTS = 256


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A prompt's identity in a journal: SHA-1 of its token ids."""
    return hashlib.sha1(np.asarray(list(prompt_ids), dtype=np.int64).tobytes()).hexdigest()


class DecodeJournal:
    """The finished decodings of one decoding pass, in ``path`` (see the module docstring).

    ``key``: a JSON mapping that names the pass; ``chunk``: prompts decoded before each write (default
    :data:`CHUNK_PROMPTS`)."""

    def __init__(self, path: str, key: dict, chunk: int | None = None):
        self.path, self.key = path, json.loads(json.dumps(key, sort_keys=True))
        self.chunk = int(chunk or CHUNK_PROMPTS)
        self._open = False  #: the directory holds this key (checked or written once per journal object)

    def _saved_key(self):
        try:
            with open(os.path.join(self.path, KEY_FILE), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def done(self) -> dict[str, Decoded]:
        """``{prompt_key: Decoded}`` of the prompts already decoded in this pass (a journal of another key, or a
        damaged one, is discarded: its prompts are decoded again)."""
        if not os.path.isdir(self.path):
            return {}
        if self._saved_key() != self.key:
            self.discard()
            return {}
        self._open = True
        out = {}
        for name in sorted(n for n in os.listdir(self.path) if n.startswith("chunk_") and n.endswith(".npz")):
            try:
                with np.load(os.path.join(self.path, name), allow_pickle=False) as z:
                    rows, feats = json.loads(str(z["rows"])), z["features"]
            except (OSError, ValueError, KeyError):
                continue  # a chunk that cannot be read is decoded again
            for i, r in enumerate(rows):
                out[r["key"]] = Decoded(prompt_ids=r["prompt_ids"], token_ids=r["token_ids"], text=r["text"],
                                        stop_reason=r["stop_reason"], seconds=r["seconds"],
                                        features=feats[i:i + 1] if feats.size else None,
                                        feature_info=r["feature_info"])
        return out

    def add(self, keys: Sequence[str], decoded: Sequence[Decoded]) -> None:
        """Write one chunk of finished decodings (atomically: a stopped write leaves no chunk)."""
        if not keys:
            return
        if not self._open and self._saved_key() != self.key:
            self.discard()
            write_json(os.path.join(self.path, KEY_FILE), self.key)
        self._open = True
        rows = [{"key": k, "prompt_ids": [int(t) for t in d.prompt_ids], "token_ids": [int(t) for t in d.token_ids],
                 "text": d.text, "stop_reason": d.stop_reason, "seconds": float(d.seconds),
                 "feature_info": d.feature_info} for k, d in zip(keys, decoded)]
        has = all(d.features is not None for d in decoded)
        feats = (np.concatenate([np.asarray(d.features, dtype=np.float32).reshape(1, -1) for d in decoded])
                 if has else np.zeros((0, 0), dtype=np.float32))
        n = len([x for x in os.listdir(self.path) if x.startswith("chunk_") and x.endswith(".npz")])
        with atomic_write(os.path.join(self.path, f"chunk_{n:06d}.npz"), binary=True) as f:
            np.savez(f, rows=np.array(json.dumps(rows)), features=feats)

    def discard(self) -> None:
        """Delete the journal (its pass is over, or it belongs to another one)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._open = False


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
