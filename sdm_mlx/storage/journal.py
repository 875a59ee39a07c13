"""A long pass's finished parts on disk: a directory of chunk files that belong to one key.

A :class:`ChunkJournal` is the storage under Alg. 4's resumable passes (the decode journals of
:mod:`sdm_mlx.network.decode_journal` and the token cache's build in :mod:`sdm_mlx.network.training_data`): the
pass writes each finished chunk atomically (a stopped write leaves no chunk), and a pass started again reads the
chunks of its own key.  A directory that holds another key (another pass, head, model or rows) is discarded,
never mixed in.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile

import numpy as np

from .files import atomic_write, write_json

#: The file that names a journal's key.
KEY_FILE = "key.json"
_PREFIX, _SUFFIX = "chunk_", ".npz"


class ChunkJournal:
    """Chunk files ``chunk_<name>.npz`` of one ``key`` (a JSON mapping) in the directory ``path``."""

    def __init__(self, path: str, key: dict):
        self.path, self.key = path, json.loads(json.dumps(key, sort_keys=True))
        self._open = False  #: the directory holds this key (checked or written once per journal object)

    def _saved_key(self):
        try:
            with open(os.path.join(self.path, KEY_FILE), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _holds_key(self) -> bool:
        """Whether the directory holds this journal's key (read once per object); another key's is discarded."""
        if not self._open:
            if self._saved_key() != self.key:
                self.discard()
                return False
            self._open = True
        return True

    def chunks(self) -> dict[str, dict]:
        """``{name: arrays}`` of every readable chunk of this key, in name order (a directory of another key is
        discarded; a chunk that cannot be read is left out, so its part is done again)."""
        if not os.path.isdir(self.path) or not self._holds_key():
            return {}
        out = {}
        for file in sorted(n for n in os.listdir(self.path) if n.startswith(_PREFIX) and n.endswith(_SUFFIX)):
            try:
                with np.load(os.path.join(self.path, file), allow_pickle=False) as z:
                    out[file[len(_PREFIX):-len(_SUFFIX)]] = {k: z[k] for k in z.files}
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
                continue
        return out

    def count(self) -> int:
        """How many chunk files the directory holds."""
        if not os.path.isdir(self.path):
            return 0
        return sum(n.startswith(_PREFIX) and n.endswith(_SUFFIX) for n in os.listdir(self.path))

    def write(self, name: str, **arrays) -> None:
        """Write the chunk ``name`` (``np.savez`` of ``arrays``) atomically, under this journal's key."""
        if not self._holds_key():
            write_json(os.path.join(self.path, KEY_FILE), self.key)
            self._open = True
        with atomic_write(os.path.join(self.path, f"{_PREFIX}{name}{_SUFFIX}"), binary=True) as f:
            np.savez(f, **arrays)

    def discard(self) -> None:
        """Delete the journal (its pass is over, or it belongs to another one)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._open = False
