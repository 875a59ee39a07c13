"""The base head's decodings a network-train run keeps for itself, to replay after each W_pos step (DESIGN #26).

A run given no base-decodings file (``base_decodings``, :mod:`.base_decodings`) decodes with the base head itself:
the own answers (``answers: model``), the calibration count before fine-tuning (epoch 0) and the q, d of epoch 1.
Those passes keep the states that picked each token (``keep_decisions``), and each rank writes what its passes
decoded to ``<output>/base_decodings.rank<r>.npz`` (:func:`~.base_decodings.decoded_arrays`).  From then on the run
has base decodings of its own: a later pass at the base head takes them as given, and every pass after a W_pos step
replays the ones the trained head makes again and decodes only the rest, as a run given the pipeline's file does.

The file is keyed by the base model and the decode settings (``source``): decodings of another model or setting
are not used (the file is written again).  Greedy decoding at the base head is a function of the prompt, so the
file stays valid across ``--restart`` and across epochs.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from ..decoding.decode_types import Decoded
from ..storage.files import atomic_write
from .base_decodings import REPLAY_SETTINGS, BaseDecodings, decoded_arrays
from .decode_journal import prompt_key

#: The file of rank ``r`` in the run directory.
FILE = "base_decodings.rank{rank}.npz"


class OwnDecodings:
    """The base-head decodings rank ``rank`` of a run in ``out`` keeps (see the module docstring).

    Parameters
    ----------
    out : str
        The run directory.
    rank : int
        The data-parallel rank (each keeps the decodings of its part of every pass).
    source : dict
        What the decodings depend on: the base model's fingerprint and the decode settings.
    tokenizer :
        The model's tokenizer.
    """

    def __init__(self, out: str, rank: int, source: dict, tokenizer):
        self.path = os.path.join(out, FILE.format(rank=rank))
        self.source = json.loads(json.dumps(source, sort_keys=True, default=str))
        self._tokenizer = tokenizer

    def load(self) -> BaseDecodings | None:
        """The kept decodings, or None when there are none (or they are of another model or setting)."""
        if not os.path.isfile(self.path):
            return None
        try:
            with np.load(self.path, allow_pickle=False) as z:
                saved = json.loads(str(z["source"])) if "source" in z.files else None
        except (OSError, ValueError, EOFError):
            return None
        return BaseDecodings(self.path, self._tokenizer) if saved == self.source else None

    def keep(self, decoded: Sequence[Decoded], feature_parts: Sequence[str], settings) -> BaseDecodings | None:
        """Add the decodings ``decoded`` (of one base-head pass, pooled as ``feature_parts``, decoded under
        ``settings``, a :class:`~.generation.DecodeSettings`) to the file and return all kept ones.  A prompt kept
        before keeps its first decoding; earlier decodings pooled as other parts are replaced."""
        new = [d for d in decoded if d is not None and d.features is not None]
        if not new:
            return self.load()
        parts = tuple(feature_parts)
        before = self.load()
        kept = before.all_decoded() if before is not None and before.feature_parts == parts else []
        seen = {prompt_key(d.prompt_ids) for d in kept}
        for d in new:
            k = prompt_key(d.prompt_ids)
            if k not in seen:
                seen.add(k)
                kept.append(d)
        arrays = decoded_arrays(kept, parts, {k: getattr(settings, k) for k in REPLAY_SETTINGS}, self._tokenizer)
        with atomic_write(self.path, binary=True) as f:
            np.savez(f, source=np.array(json.dumps(self.source, sort_keys=True)), **arrays)
        return BaseDecodings(self.path, self._tokenizer)
