"""The base model's own greedy decodings, given to Alg. 4 instead of decoded again (``alg:sdm-network-training``).

Until the first W_pos step, the SDM network's joint decoding is the base model's greedy decoding (W_pos starts as a
copy of the head, and ``argmax(concat(z, z)) mod |V| = argmax z``).  Two of Alg. 4's passes decode with that head:
the calibration count before fine-tuning (step (e), epoch 0) and the q, d of epoch 1 (step (c)); with
``answers: model`` the verification rows' own answers are a third.  A pipeline that already decoded every prompt
with the base model (``sdm-mlx pipeline``'s answers stage: the same prompts, greedy, the same stop rule and
features) gives those decodings here, so a one-epoch run decodes once instead of three times.

A base-decodings file is an ``.npz`` of

* ``prompts``: the prompts as text (the chat-templated strings the rows hold), one per decoding;
* ``texts``: the generated text of each;
* ``features``: float32 ``[N, len(feature_parts) * D]``, the verifier input of each decoding
  (:func:`sdm_mlx.network.generation.greedy_generate`'s, :data:`sdm_mlx.llm.pooling.FEATURE_PARTS` order);
* ``feature_parts``: the pooled parts the features concatenate.

:func:`save_base_decodings` writes one atomically; :class:`BaseDecodings` reads and checks it, and gives each pass
its decodings (:meth:`BaseDecodings.decodings`) in the parts the pass pools.  The trainer decodes one of them
again before using them (:meth:`BaseDecodings.check_against`), so a file of another model, prompt or setting is
refused rather than mixed in.
"""

from __future__ import annotations

import zipfile
from typing import Sequence

import numpy as np

from ..decoding.decode_types import Decoded
from ..errors import InputError
from ..llm import embed as _embed
from ..llm.pooling import check_feature_parts, part_columns
from ..storage.files import atomic_write
from .decode_journal import prompt_key

#: The arrays of a base-decodings file.
ARRAYS = ("prompts", "texts", "features", "feature_parts")
#: How far a decoding made again may be from the given one (relative to its largest feature) and still be the same.
FEATURE_TOLERANCE = 1e-3


def save_base_decodings(path: str, prompts: Sequence[str], texts: Sequence[str], features: np.ndarray,
                        feature_parts: Sequence[str]) -> None:
    """Write a base-decodings file (see the module docstring) atomically."""
    features = np.asarray(features, dtype=np.float32)
    if not (len(prompts) == len(texts) == len(features)):
        raise InputError(f"base decodings: {len(prompts)} prompts, {len(texts)} texts and {len(features)} feature "
                         "rows (one of each per decoding)")
    with atomic_write(path, binary=True) as f:
        np.savez(f, prompts=np.array(list(prompts), dtype=str), texts=np.array(list(texts), dtype=str),
                 features=features.reshape(len(prompts), -1),
                 feature_parts=np.array(list(check_feature_parts(feature_parts)), dtype=str))


class BaseDecodings:
    """The base model's decodings of a base-decodings file, by prompt (see the module docstring).

    Parameters
    ----------
    path : str
        The ``.npz`` file (:func:`save_base_decodings`).
    tokenizer :
        The model's tokenizer: prompts are matched by their token ids (:func:`~.decode_journal.prompt_key`), as a
        pass's decode journal matches them.

    Attributes
    ----------
    feature_parts : tuple of str
        The pooled parts the file's features concatenate.
    """

    def __init__(self, path: str, tokenizer):
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in ARRAYS if k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise InputError(f"base_decodings {path} is not a readable .npz ({type(e).__name__}): write it with "
                             "save_base_decodings, or remove base_decodings to decode every prompt") from None
        missing = [k for k in ARRAYS if k not in arrays]
        if missing:
            raise InputError(f"base_decodings {path} lacks the array(s) {missing}: write it with "
                             "sdm_mlx.network.base_decodings.save_base_decodings (or remove base_decodings)")
        prompts, texts = [str(p) for p in arrays["prompts"]], [str(t) for t in arrays["texts"]]
        features = np.asarray(arrays["features"], dtype=np.float32)
        parts = [str(p) for p in arrays["feature_parts"]]
        if not (len(prompts) == len(texts) == len(features)) or features.ndim != 2:
            raise InputError(f"base_decodings {path}: {len(prompts)} prompts, {len(texts)} texts and features of "
                             f"shape {features.shape}: one text and one feature row per prompt")
        self.feature_parts = check_feature_parts(parts)
        self.path, self._features = path, features
        self._prompt_ids = [_embed.encode(tokenizer, p) for p in prompts]
        self._texts = texts
        self._row = {}
        for i, ids in enumerate(self._prompt_ids):
            self._row.setdefault(prompt_key(ids), i)  # a repeated prompt: its first decoding

    def __len__(self) -> int:
        return len(self._row)

    def decodings(self, feature_parts: Sequence[str]) -> dict[str, Decoded]:
        """``{prompt_key: Decoded}`` with the features pooled as ``feature_parts`` (a pass's verifier's parts)."""
        cols = part_columns(self.feature_parts, check_feature_parts(feature_parts), self._features.shape[1],
                            f"base_decodings {self.path}", "write the file with the features of every part the "
                            "verification layer pools")
        return {k: Decoded(prompt_ids=self._prompt_ids[i], token_ids=[], text=self._texts[i], stop_reason="given",
                           seconds=0.0, features=self._features[i:i + 1, cols])
                for k, i in self._row.items()}

    def check_against(self, decoded: Sequence[Decoded], given: Sequence[Decoded]) -> int:
        """Refuse the file when most of ``decoded`` (prompts decoded again by the base head) differ from their
        ``given`` decodings: another model, prompt template, stop rule or feature construction wrote the file.  (One
        prompt may differ by a near tie between two tokens: BLAS kernels and batch shapes differ.)  Returns how many
        differ."""
        differ = [(a, b) for a, b in zip(decoded, given) if not _same_decoding(a, b)]
        if differ and 2 * len(differ) >= len(given):
            a, b = differ[0]
            raise InputError(
                f"base_decodings {self.path} does not hold this model's greedy decodings of its prompts: decoded "
                f"again, {len(differ)} of {len(given)} differ (one gives {a.text[:60]!r} where the file says "
                f"{b.text[:60]!r}). Write it again from the same model and decode settings, or remove "
                "base_decodings to decode every prompt")
        return len(differ)


def _same_decoding(a: Decoded, b: Decoded) -> bool:
    fa, fb = np.asarray(a.features, np.float32).ravel(), np.asarray(b.features, np.float32).ravel()
    if a.text != b.text or fa.shape != fb.shape:
        return False
    return float(np.abs(fa - fb).max()) <= FEATURE_TOLERANCE * max(float(np.abs(fa).max()), 1.0)
