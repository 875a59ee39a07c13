"""What a decoding keeps for later passes, on request: the states that picked its tokens (``keep_decisions``: Alg. 4
replays them under a trained head, :mod:`sdm_mlx.network.base_decodings`) and its prompt's keys, values and states
(``keep_prompt``: another completion of the prompt runs only its own tokens, :mod:`.continuation`)."""

from __future__ import annotations

import numpy as np

#: The stops after which the decisions describe the whole decoding (a ``stop`` string cuts tokens, ``cancelled`` none).
DECIDED = ("delimiter", "eos", "max_tokens")


def prompt_kv(kv_row: list, n_prompt: int) -> list:
    """A copy of the first ``n_prompt`` positions of one row's per-layer ``(keys, values)`` (the batch's buffers move
    on with the decoding)."""
    import mlx.core as mx

    return [(mx.contiguous(k[..., :n_prompt, :]), mx.contiguous(v[..., :n_prompt, :])) for k, v in kv_row]


def attach_kept(dec, req, states, kv, reason: str) -> None:
    """Set ``dec.prompt_cache`` (with ``kv``, the row's :func:`prompt_kv`) and ``dec.decisions`` as ``req`` asks, from
    the row's final-norm ``states`` (``[P + fed tokens, D]``: the prompt's, then one per fed token; the picks came from
    the last prompt state onwards, plus one for an end-of-sequence pick)."""
    P = len(req.prompt_ids)
    if kv is not None:
        dec.prompt_cache = (kv, states[:P])
    if req.keep_decisions and reason in DECIDED:
        n_dec = len(dec.token_ids) + (reason == "eos")
        dec.decisions = np.array(states[P - 1 : P - 1 + n_dec], dtype=np.float32)


def pack_decisions(decisions) -> dict:
    """The decision states of several decodings (float32 ``[n_i, D]`` each, or None where none were kept) as the
    arrays every store of them writes: ``decisions`` (flat ``[sum n_i, D]``) and ``decision_offsets`` (``[len + 1]``
    int64).  States of different widths are refused (:class:`~sdm_mlx.errors.InputError`)."""
    from ..errors import InputError

    dims = {np.asarray(d).shape[-1] for d in decisions if d is not None and len(d)}
    if len(dims) > 1:
        raise InputError(f"decision states of widths {sorted(dims)} cannot be kept together")
    dim = dims.pop() if dims else 0
    kept = [np.zeros((0, dim), np.float32) if d is None else np.asarray(d, np.float32).reshape(-1, dim)
            for d in decisions]
    return {"decisions": np.concatenate(kept) if kept else np.zeros((0, dim), np.float32),
            "decision_offsets": np.cumsum([0] + [len(d) for d in kept]).astype(np.int64)}


def unpack_decision(arrays, i: int):
    """Decoding ``i``'s states of :func:`pack_decisions`' ``arrays`` (a mapping), or None when it kept none (or the
    arrays hold no decisions)."""
    states, offsets = arrays.get("decisions"), arrays.get("decision_offsets")
    if states is None or offsets is None or offsets[i + 1] <= offsets[i]:
        return None
    return states[offsets[i]:offsets[i + 1]]


def pack_token_ids(token_lists, ids: str = "token_ids", offsets: str = "token_offsets") -> dict:
    """Several decodings' (or prompts') token ids as the arrays every store of them writes: ``ids`` (flat int64) and
    ``offsets`` (``[len + 1]`` int64)."""
    return {ids: np.array([t for ts in token_lists for t in ts], dtype=np.int64),
            offsets: np.cumsum([0] + [len(ts) for ts in token_lists]).astype(np.int64)}


def unpack_token_ids(arrays, i: int, ids: str = "token_ids", offsets: str = "token_offsets") -> list[int]:
    """Entry ``i``'s token ids of :func:`pack_token_ids`' ``arrays`` (a mapping)."""
    off = arrays[offsets]
    return [int(t) for t in arrays[ids][off[i]:off[i + 1]]]
