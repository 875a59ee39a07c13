"""What the answers stage keeps beside its rows for later stages: the decision states of its decodings (Alg. 4's
replay) and the features of its constructed negatives (the forced stage).

The answers stage decodes every prompt greedily with the base model.  With each batch it keeps, in
``<answers file>.decisions/``, the final-norm states that picked each answer token
(:attr:`sdm_mlx.decoding.decode_types.Decoded.decisions`), the tokens and why the decoding stopped.  The network
stage hands them to ``network-train`` in its base-decodings file, so that Alg. 4's calibration count after a W_pos
step decodes only the prompts whose answer the new head changes (:meth:`sdm_mlx.network.base_decodings.BaseDecodings.
replayed`).  A row without decisions (decoded before they were kept) is decoded as before.

The store is a :class:`~sdm_mlx.storage.journal.ChunkJournal` keyed by the decode settings: a chunk is written
atomically before its batch's rows are appended to the answers file, so every row in the file whose chunk was written
has its decisions; rows of a stopped batch are decoded again and their later chunk wins.

With ``forced_completions: flip`` the answers stage also runs each pool answer's constructed negative (the own answer
inverted in its own layout) right after the answer, from the prompt's kept keys and values
(:func:`sdm_mlx.decoding.continuation.continuation_features`): only its dozen tokens run, not the prompt again.  The
features go to a :class:`ForcedFeatures` store (``<answers file>.forced/``), keyed by the SHA-1 of ``prompt +
completion``; the forced stage takes a row's features from it when its prompt and completion are those, and embeds
the others as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

import numpy as np

from ..decoding.kept import pack_decisions, pack_token_ids, unpack_decision, unpack_token_ids
from ..storage.journal import KEY_FILE, ChunkJournal

#: The decision store's directory beside an answers file.
SUFFIX = ".decisions"


class DecisionStore:
    """The decisions of the decodings written to the answers file ``output`` under ``settings`` (the
    :data:`sdm_mlx.network.base_decodings.REPLAY_SETTINGS` of the decoding; a store of other settings is discarded
    when this one first writes)."""

    def __init__(self, output: str, settings: dict):
        self.settings = dict(settings)
        self._journal = ChunkJournal(output + SUFFIX, {"answers": os.path.basename(output), **self.settings})

    @classmethod
    def open(cls, output: str) -> "DecisionStore | None":
        """The store beside the answers file ``output`` under the settings it was written with (None: none kept)."""
        try:
            with open(os.path.join(output + SUFFIX, KEY_FILE), encoding="utf-8") as f:
                key = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(key, dict) or key.get("answers") != os.path.basename(output):
            return None
        return cls(output, {k: v for k, v in key.items() if k != "answers"})

    def add(self, ids: Sequence[str], decoded: Sequence) -> None:
        """Keep the decisions of one batch (``decoded``: the engine's :class:`Decoded` of each id)."""
        keep = [(i, d) for i, d in zip(ids, decoded) if d.decisions is not None]
        if not keep:
            return
        self._journal.write(
            f"{self._journal.count():06d}", ids=np.array(json.dumps([i for i, _ in keep])),
            **pack_token_ids([d.token_ids for _, d in keep]),
            stop_reasons=np.array([d.stop_reason for _, d in keep], dtype=str),
            **pack_decisions([d.decisions for _, d in keep]))

    def read(self, wanted=None) -> dict[str, tuple[list, str, np.ndarray]]:
        """``{id: (token_ids, stop_reason, decisions [n, D])}`` of the kept decodings (``wanted``: only these ids;
        a later chunk's decoding of an id replaces an earlier one)."""
        out = {}
        for arrays in self._journal.chunks().values():
            ids = json.loads(str(arrays["ids"]))
            for k, i in enumerate(ids):
                if wanted is None or i in wanted:
                    out[i] = (unpack_token_ids(arrays, k), str(arrays["stop_reasons"][k]), unpack_decision(arrays, k))
        return out


def decode_settings(engine, max_tokens: int) -> dict:
    """The replay settings of the answers stage's greedy decoding by ``engine`` (a
    :class:`~sdm_mlx.decoding.DecodeEngine`) with at most ``max_tokens`` tokens, stopped at the delimiter."""
    return {"max_new_tokens": int(max_tokens), "delimiter": engine.delimiter, "stop_at_delimiter": True,
            "max_length": int(engine.max_length)}


#: The forced-features store's directory beside an answers file.
FORCED_SUFFIX = ".forced"


def pair_key(prompt: str, completion: str) -> str:
    """A force-decoded row's identity in a :class:`ForcedFeatures` store: SHA-1 of ``prompt + completion``."""
    return hashlib.sha1((prompt + "\x00" + completion).encode("utf-8")).hexdigest()


class ForcedFeatures:
    """Features of force-decoded ``prompt + completion`` pairs computed by the answers stage beside the answers file
    ``output``, pooled as ``feature_parts`` (a store of other parts is discarded when this one first writes)."""

    def __init__(self, output: str, feature_parts: Sequence[str]):
        self.feature_parts = list(feature_parts)
        self._journal = ChunkJournal(output + FORCED_SUFFIX, {"answers": os.path.basename(output),
                                                             "feature_parts": self.feature_parts})

    def add(self, keys: Sequence[str], features: np.ndarray) -> None:
        if len(keys):
            self._journal.write(f"{self._journal.count():06d}", keys=np.array(json.dumps(list(keys))),
                                features=np.asarray(features, dtype=np.float32))

    def read(self) -> dict[str, np.ndarray]:
        """``{pair_key: features}`` (a later chunk's row replaces an earlier one)."""
        out = {}
        for arrays in self._journal.chunks().values():
            for k, key in enumerate(json.loads(str(arrays["keys"]))):
                out[key] = arrays["features"][k]
        return out
