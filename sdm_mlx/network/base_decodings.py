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
* ``feature_parts``: the pooled parts the features concatenate;

and, optionally, what replays a decoding under a trained head (:meth:`BaseDecodings.replayed`):

* ``token_ids`` / ``token_offsets``: the generated token ids of each decoding (flat int64, and ``[N + 1]`` offsets);
* ``stop_reasons``: why each stopped (``""`` for a decoding without decisions);
* ``decisions`` / ``decision_offsets``: the final-norm states that picked each token (:attr:`Decoded.decisions
  <sdm_mlx.decoding.decode_types.Decoded>`; flat float32 ``[S, D]`` and ``[N + 1]`` offsets; a decoding may have none);
* ``decode_settings``: JSON ``{max_new_tokens, delimiter, stop_at_delimiter, max_length}`` of the decodings;

and, optionally, ``prompt_token_ids`` / ``prompt_offsets``: the prompts as token ids (flat int64, ``[N + 1]`` offsets),
for decodings made from token ids (matched by these instead of by encoding ``prompts``).

**Replay** (DESIGN #26).  The trunk is frozen (DESIGN #19): W_pos changes which token a state picks, never the states of a given token
sequence.  So if a head's joint picks from a decoding's decision states are that decoding's own tokens (and an
end-of-sequence token where it stopped on one), greedy decoding with that head makes exactly this decoding: the same
text, stop and features.  Alg. 4's passes after a W_pos step take those decodings from the file and decode only the
prompts whose answer the head changes; the check costs one product of the decision states with both heads
(``2 · S · D · 2|V|`` flops, minutes for thousands of prompts, where decoding them takes hours on a CPU).

:func:`save_base_decodings` writes one atomically (:func:`decoded_arrays`: the arrays of the engine's
:class:`~sdm_mlx.decoding.decode_types.Decoded`); :class:`BaseDecodings` reads and checks it (or the same arrays
in memory, :meth:`BaseDecodings.from_arrays`), and gives each pass
its decodings (:meth:`BaseDecodings.decodings`) in the parts the pass pools.  The trainer decodes one of them
again before using them (:meth:`BaseDecodings.check_against`), so a file of another model, prompt or setting is
refused rather than mixed in.
"""

from __future__ import annotations

import json
import zipfile
from typing import Sequence

import numpy as np

from ..decoding.decode_types import Decoded
from ..decoding.kept import pack_decisions, pack_token_ids, unpack_decision, unpack_token_ids
from ..errors import InputError
from ..llm import embed as _embed
from ..llm.pooling import check_feature_parts, part_columns
from ..storage.files import atomic_write
from .decode_journal import prompt_key

#: The arrays of a base-decodings file.
ARRAYS = ("prompts", "texts", "features", "feature_parts")
#: The token ids of the prompts (optional, both or none): decodings made from token ids are matched by these.
PROMPT_ID_ARRAYS = ("prompt_token_ids", "prompt_offsets")
#: The arrays that replay the decodings under a trained head (optional; all or none).
REPLAY_ARRAYS = ("token_ids", "token_offsets", "stop_reasons", "decisions", "decision_offsets", "decode_settings")
#: The decode settings that must be the replaying pass's.
REPLAY_SETTINGS = ("max_new_tokens", "delimiter", "stop_at_delimiter", "max_length")
#: Decision states whose picks are computed in one product (a [rows, 2|V|] float32 block: ~300 MB for Qwen2.5).
REPLAY_ROWS = 256
#: How far a decoding made again may be from the given one (relative to its largest feature) and still be the same.
FEATURE_TOLERANCE = 1e-3


def base_decoding_arrays(prompts: Sequence[str], texts: Sequence[str], features: np.ndarray,
                         feature_parts: Sequence[str], *, replay: dict | None = None,
                         prompt_ids: Sequence[Sequence[int]] | None = None) -> dict:
    """The arrays of a base-decodings file (see the module docstring), checked: what
    :func:`save_base_decodings` writes and :meth:`BaseDecodings.from_arrays` reads without a file.

    ``replay``: what replays the decodings (:meth:`BaseDecodings.replayed`): ``{"token_ids": [ids per decoding],
    "stop_reasons": [...], "decisions": [float32 [n, D] or None per decoding], "settings": {REPLAY_SETTINGS}}``.
    ``prompt_ids``: the token ids of each prompt, when the decodings were made from token ids (they are then
    matched by these, not by encoding ``prompts``)."""
    features = np.asarray(features, dtype=np.float32)
    if not (len(prompts) == len(texts) == len(features)):
        raise InputError(f"base decodings: {len(prompts)} prompts, {len(texts)} texts and {len(features)} feature "
                         "rows (one of each per decoding)")
    extra = {} if replay is None else _replay_arrays(len(prompts), features.shape[-1] if features.size else 0, replay)
    if prompt_ids is not None:
        if len(prompt_ids) != len(prompts):
            raise InputError(f"base decodings: {len(prompt_ids)} token-id prompts for {len(prompts)} decodings")
        extra.update(pack_token_ids(prompt_ids, *PROMPT_ID_ARRAYS))
    return {"prompts": np.array(list(prompts), dtype=str), "texts": np.array(list(texts), dtype=str),
            "features": features.reshape(len(prompts), -1),
            "feature_parts": np.array(list(check_feature_parts(feature_parts)), dtype=str), **extra}


def save_base_decodings(path: str, prompts: Sequence[str], texts: Sequence[str], features: np.ndarray,
                        feature_parts: Sequence[str], *, replay: dict | None = None,
                        prompt_ids: Sequence[Sequence[int]] | None = None) -> None:
    """Write a base-decodings file (see the module docstring) atomically; the arguments as
    :func:`base_decoding_arrays`'s."""
    arrays = base_decoding_arrays(prompts, texts, features, feature_parts, replay=replay, prompt_ids=prompt_ids)
    with atomic_write(path, binary=True) as f:
        np.savez(f, **arrays)


def decoded_arrays(decoded: Sequence[Decoded], feature_parts: Sequence[str], settings: dict, tokenizer) -> dict:
    """:func:`base_decoding_arrays` of the engine's decodings ``decoded`` (each with its features, pooled as
    ``feature_parts``, and its prompt's token ids; ``decisions`` where kept), decoded under the replay ``settings``
    (:data:`REPLAY_SETTINGS`); the prompts' text is their ids decoded by ``tokenizer`` (they are matched by ids)."""
    feats = [np.asarray(d.features, np.float32).reshape(1, -1) for d in decoded]
    return base_decoding_arrays(
        [tokenizer.decode(list(d.prompt_ids)) for d in decoded], [d.text for d in decoded],
        np.concatenate(feats) if feats else np.zeros((0, 0), np.float32), feature_parts,
        prompt_ids=[list(d.prompt_ids) for d in decoded],
        replay={"token_ids": [list(d.token_ids) for d in decoded], "stop_reasons": [d.stop_reason for d in decoded],
                "decisions": [d.decisions for d in decoded], "settings": settings})


def _replay_arrays(n: int, width: int, replay: dict) -> dict:
    tokens, reasons, decisions = replay["token_ids"], replay["stop_reasons"], replay["decisions"]
    if not (len(tokens) == len(reasons) == len(decisions) == n):
        raise InputError(f"base decodings: replay data for {len(tokens)}, {len(reasons)}, {len(decisions)} decodings "
                         f"of {n}")
    settings = {k: replay["settings"][k] for k in REPLAY_SETTINGS}
    return {**pack_token_ids(tokens),
            "stop_reasons": np.array([r if d is not None else "" for r, d in zip(reasons, decisions)], dtype=str),
            **pack_decisions(decisions), "decode_settings": np.array(json.dumps(settings, sort_keys=True))}


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
                arrays = {k: z[k] for k in ARRAYS + REPLAY_ARRAYS + PROMPT_ID_ARRAYS if k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise InputError(f"base_decodings {path} is not a readable .npz ({type(e).__name__}): write it with "
                             "save_base_decodings, or remove base_decodings to decode every prompt") from None
        self._set(arrays, tokenizer, path)

    @classmethod
    def from_arrays(cls, arrays: dict, tokenizer, name: str = "(in memory)") -> "BaseDecodings":
        """The decodings of ``arrays`` (:func:`base_decoding_arrays`) without a file; ``name`` stands for the path
        in messages."""
        out = cls.__new__(cls)
        out._set(arrays, tokenizer, name)
        return out

    def _set(self, arrays: dict, tokenizer, path: str) -> None:
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
        self._replay = {k: arrays[k] for k in REPLAY_ARRAYS if k in arrays} if REPLAY_ARRAYS[0] in arrays else None
        if self._replay is not None and len(self._replay) < len(REPLAY_ARRAYS):
            raise InputError(f"base_decodings {path} has only some of the replay arrays {REPLAY_ARRAYS}: write it "
                             "again with save_base_decodings")
        self._tokenizer = tokenizer
        if all(k in arrays for k in PROMPT_ID_ARRAYS):
            if len(arrays["prompt_offsets"]) != len(prompts) + 1:
                raise InputError(f"base_decodings {path}: prompt_offsets of {len(arrays['prompt_offsets'])} for "
                                 f"{len(prompts)} prompts")
            self._prompt_ids = [unpack_token_ids(arrays, i, *PROMPT_ID_ARRAYS) for i in range(len(prompts))]
        else:
            self._prompt_ids = [_embed.encode(tokenizer, p) for p in prompts]
        self._texts = texts
        self._row = {}
        for i, ids in enumerate(self._prompt_ids):
            self._row.setdefault(prompt_key(ids), i)  # a repeated prompt: its first decoding

    def __len__(self) -> int:
        return len(self._row)

    @property
    def replayable(self) -> int:
        """How many of the decodings carry their decision states (0: the file cannot replay)."""
        if self._replay is None:
            return 0
        return int((np.diff(self._replay["decision_offsets"]) > 0).sum())

    def completion_states(self, prompt: str, completion: str):
        """``(token ids of prompt + answer, position of the first decision, decision states [n, D])`` of the
        base decoding of ``prompt`` when its text is ``completion`` and it kept its decisions (the states that
        predict the answer's tokens: what Alg. 4's token cache would compute for that y = 1 document), else None."""
        if self._replay is None:
            return None
        i = self._row.get(prompt_key(_embed.encode(self._tokenizer, prompt)))
        if i is None or self._texts[i] != completion:
            return None
        r = self._replay
        states = unpack_decision(r, i)
        if states is None:
            return None
        ids = list(self._prompt_ids[i]) + unpack_token_ids(r, i)
        return ids, len(self._prompt_ids[i]) - 1, states

    def replayed(self, heads, settings, keys=None) -> dict[str, Decoded]:
        """``{prompt_key: Decoded}`` of the decodings that greedy joint decoding with ``heads`` (an
        :class:`~sdm_mlx.network.heads.SDMHeads`) under ``settings`` (a
        :class:`~sdm_mlx.network.generation.DecodeSettings`) makes again (see Replay in the module docstring), with
        ``stop_reason`` ``"replayed"`` and the features in ``settings.feature_parts``; ``keys``: only these prompts.
        A file without decision states, or recorded under other decode settings, replays nothing."""
        import mlx.core as mx

        from ..llm.embed import eos_token_ids

        if self._replay is None:
            return {}
        r = self._replay
        recorded = json.loads(str(r["decode_settings"]))
        if any(recorded.get(k) != getattr(settings, k) for k in REPLAY_SETTINGS):
            return {}
        tok_off, dec_off, reasons = r["token_offsets"], r["decision_offsets"], r["stop_reasons"]
        rows = []
        for key, i in self._row.items():
            if keys is not None and key not in keys:
                continue
            n_tok, n_dec, why = int(tok_off[i + 1] - tok_off[i]), int(dec_off[i + 1] - dec_off[i]), str(reasons[i])
            stops_here = {"delimiter": n_tok <= settings.max_new_tokens, "eos": n_tok < settings.max_new_tokens,
                          "max_tokens": n_tok == settings.max_new_tokens}.get(why, False)
            if stops_here and n_dec == n_tok + (why == "eos") and n_dec:
                rows.append(i)
        if not rows:
            return {}
        states = np.concatenate([r["decisions"][dec_off[i]:dec_off[i + 1]] for i in rows])
        picks = np.concatenate([np.array(heads.next_tokens(mx.array(states[a:a + REPLAY_ROWS])))
                                for a in range(0, len(states), REPLAY_ROWS)])
        eos = np.array(sorted(eos_token_ids(self._tokenizer)), dtype=np.int64)
        cols = part_columns(self.feature_parts, check_feature_parts(settings.feature_parts), self._features.shape[1],
                            f"base_decodings {self.path}", "write the file with the features of every part the "
                            "verification layer pools")
        out, at = {}, 0
        for i in rows:
            n_dec = int(dec_off[i + 1] - dec_off[i])
            got, at = picks[at:at + n_dec], at + n_dec
            want = r["token_ids"][tok_off[i]:tok_off[i + 1]]
            same = np.array_equal(got[:len(want)], want) and (len(got) == len(want) or bool(np.isin(got[-1], eos)))
            if same:
                out[prompt_key(self._prompt_ids[i])] = Decoded(
                    prompt_ids=self._prompt_ids[i], token_ids=[int(t) for t in want], text=self._texts[i],
                    stop_reason="replayed", seconds=0.0, features=self._features[i:i + 1, cols])
        return out

    def all_decoded(self) -> list[Decoded]:
        """Every decoding of the file as the engine's :class:`Decoded` (features as recorded, decision states where
        kept), in file order: what :func:`decoded_arrays` takes to write them again."""
        r, out = self._replay, []
        for i, ids in enumerate(self._prompt_ids):
            tokens, why, states = [], "given", None
            if r is not None:
                tokens = unpack_token_ids(r, i)
                why, states = str(r["stop_reasons"][i]) or "given", unpack_decision(r, i)
            out.append(Decoded(prompt_ids=list(ids), token_ids=tokens, text=self._texts[i], stop_reason=why,
                               seconds=0.0, features=self._features[i:i + 1], decisions=states))
        return out

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
