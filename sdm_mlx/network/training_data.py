"""What SDM-network training learns from: verification rows (step (a)) and the token cache (step (b)).

See :mod:`sdm_mlx.network.trainer` for Alg. 4 (``alg:sdm-network-training``).  Verification rows
``(id, prompt, completion, label, task_label[, task])`` come from a verification file or are built
from task rows (:mod:`sdm_mlx.llm.verification_data`); the token cache holds the frozen hidden states
that predict each y = 1 training completion token, with joint targets ``token + |V|`` (DESIGN #19).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..llm import embed as _embed
from ..runtime.callbacks import log, progress_bar as Progress
from ..storage.artifact import save_artifact
from ..storage.artifact_load import has_kind, load_artifact
from ..storage.datasets import read_objects
from ..errors import ArtifactError, InputError
from .config import NetworkConfig
from ..llm.verification_data import PRESETS, make_verification_rows
from .heads import SDMHeads, token_hidden_states


def answer_form(text: str) -> str:
    """How a generated answer is written: ``compact`` (one-line JSON), ``fenced`` (a ``` block), ``other``
    (JSON in another layout) or ``unparsable`` (no JSON object)."""
    from .generation import first_json_object

    if first_json_object(text) is None:
        return "unparsable"
    stripped = text.strip()
    if stripped.startswith("```"):
        return "fenced"
    return "compact" if stripped.startswith("{") and "\n" not in stripped else "other"


def corrected_answer(text: str, shown: str, right: str) -> str | None:
    """``text`` (the model's answer, which parses to completion ``shown``) with its JSON values changed to those
    of completion ``right``, keeping the model's own layout; None when a value cannot be found in the text."""
    import json
    import re

    from .generation import first_json_object

    a, b = first_json_object(shown), first_json_object(right)
    if a is None or b is None or set(a) != set(b):
        return None
    out = text
    for key in a:
        if a[key] == b[key]:
            continue
        pattern = re.compile(r'("' + re.escape(key) + r'"\s*:\s*)' + re.escape(json.dumps(a[key])))
        out, n = pattern.subn(lambda m: m.group(1) + json.dumps(b[key]), out, count=1)
        if n != 1:
            return None
    return out


def model_answer_rows(rows: Sequence[dict], texts: Sequence[str], completions) -> list[dict]:
    """Verification rows from the model's own answers: ``completion`` = the generated text, ``answer_label`` =
    the task label it parses to (−1: unparsable), ``label`` = 1 iff that is the row's ``task_label``, ``form``
    (:func:`answer_form`).  ``completions``: one list, or ``{task name: list}`` by each row's ``task``."""
    from .generation import parse_task_prediction

    out = []
    for r, text in zip(rows, texts):
        comps = completions.get(r.get("task")) if isinstance(completions, dict) else completions
        pred = parse_task_prediction(text, comps)
        out.append({**r, "completion": text, "answer_label": int(pred), "form": answer_form(text),
                    "label": int(pred == int(r["task_label"]))})
    return out


def corrected_rows(rows: Sequence[dict], completions) -> list[dict]:
    """For the label-0 own-answer rows that parse: the right answer in the model's own layout (W_pos positives)."""
    out = []
    for r in rows:
        if int(r["label"]) == 1 or r.get("answer_label", -1) < 0:
            continue
        comps = completions.get(r.get("task")) if isinstance(completions, dict) else completions
        fixed = corrected_answer(r["completion"], comps[r["answer_label"]], comps[int(r["task_label"])])
        if fixed is not None:
            out.append({**r, "completion": fixed, "label": 1, "corrected": True})
    return out


def _read_jsonl(path: str) -> list[dict]:
    return [row for _, row in read_objects(path)]


def _task_rows(path: str, completions, template, config: NetworkConfig, tokenizer) -> list[dict]:
    if not completions:
        raise InputError("give completions (one per task label) or a preset")
    if template is None:
        raise InputError("give a prompt_template with a {document} slot (or a preset)")
    if "{document}" not in template:
        raise InputError("prompt_template must contain a {document} slot")
    task_rows = _read_jsonl(path)
    system = config.system or None

    def prompt_fn(doc):
        return _embed.chat_text(tokenizer, doc, system=system, prompt_template=template,
                                use_chat_template=config.use_chat_template)

    return make_verification_rows(task_rows, completions, prompt_fn, seed=config.negatives_seed,
                                  where=lambda i: f"{path}: row {i + 1}")


def build_verification_rows(config: NetworkConfig, tokenizer) -> list[dict]:
    """Verification rows (id, prompt, completion, label, task_label[, task]) from the configured data."""
    if config.verification_data:
        rows = _read_jsonl(config.verification_data)
        for i, r in enumerate(rows):
            for fld in ("id", "prompt", "completion", "label"):
                if fld not in r:
                    raise InputError(f"{config.verification_data}: row {i + 1} lacks field {fld!r}")
            if r["label"] not in (0, 1) or isinstance(r["label"], bool):
                raise InputError(f"{config.verification_data}: row {i + 1}: label must be 0 or 1")
            if "answer_label" in r and "task_label" not in r:  # an own-answer row: corrected when wrong
                raise InputError(f"{config.verification_data}: row {i + 1} has answer_label (the model's own "
                                 "answer) but no task_label (the right one): add task_label")
        return rows
    if config.tasks:
        out = []
        for t in config.tasks:
            preset = PRESETS.get(t.get("preset")) if t.get("preset") else None
            comps = t.get("completions") or (preset or {}).get("completions")
            template = t.get("prompt_template") or (preset or {}).get("prompt_template")
            for r in _task_rows(t["data"], comps, template, config, tokenizer):
                out.append({**r, "id": f"{t['name']}/{r['id']}", "source_id": r["id"], "task": t["name"]})
        return out
    return _task_rows(config.data, config.resolved_completions(), config.resolved_template(), config, tokenizer)


@dataclass
class TokenCache:
    """Frozen hidden states of the y = 1 training completion tokens (DESIGN #19).

    ``hidden`` [N_tok, D] float32 (states predicting each target), ``targets``
    [N_tok] joint indices (token + |V|), ``doc`` [N_tok] index of the document
    (into the list of cached documents) each token belongs to.
    """

    hidden: np.ndarray
    targets: np.ndarray
    doc: np.ndarray
    skipped: list = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.targets.shape[0])


def completion_token_positions(tokenizer, prompt: str, completion: str, delimiter: str, max_length: int):
    """``(ids, positions, target_ids)`` of the force-decoded ``prompt + completion``.

    Targets are the completion tokens up to and including the token holding the
    completion's last ``delimiter``; ``positions[k] = index(target_k) − 1`` (the
    state that predicts it), restricted to positions < ``max_length``.
    """
    text = prompt + completion
    ids = _embed.encode(tokenizer, text)
    p_ids = _embed.encode(tokenizer, prompt)
    c = 0
    while c < min(len(ids), len(p_ids)) and ids[c] == p_ids[c]:
        c += 1
    j = _embed.delimiter_token_index_in_text(tokenizer, text, ids, (len(prompt), None), delimiter)
    if j is None:
        raise InputError(f"completion {completion!r} holds no closing delimiter {delimiter!r}")
    c = max(c, 1)
    targets = list(range(c, j + 1))
    positions = [t - 1 for t in targets if t - 1 < max_length]
    return ids, positions, [ids[p + 1] for p in positions]


def shared_prefix(seqs: Sequence[Sequence[int]], poss: Sequence[Sequence[int]]) -> list | None:
    """The token prefix the sequences share, each cut after its last chosen position (what
    :func:`~sdm_mlx.network.heads.token_hidden_states` runs once); None when no position is chosen."""
    cut = [list(s[: max(p) + 1]) for s, p in zip(seqs, poss) if len(p)]
    return cut[0][: _embed.common_prefix_length(cut)] if cut else None


#: y = 1 documents whose states are computed (and, with a journal, written) together: a few minutes of a real model.
TOKEN_CACHE_CHUNK_DOCS = 256


def build_token_cache(heads: SDMHeads, tokenizer, rows: Sequence[dict], config: NetworkConfig, *, prefix_ids=None,
                      journal=None, given: Sequence | None = None) -> TokenCache:
    """The :class:`TokenCache` of y = 1 rows (``prompt`` + ``completion``), the completion tokens picked by the
    ``config``'s ``delimiter`` and ``max_length``, ``embed_batch_size`` rows per forward pass (``verbose``: a
    progress bar); their shared token prefix runs once (``prefix_ids``: see
    :func:`~sdm_mlx.network.heads.token_hidden_states`).

    ``journal``: a :class:`~sdm_mlx.storage.journal.ChunkJournal` keyed by these rows
    (:func:`token_cache_key`): the states are computed :data:`TOKEN_CACHE_CHUNK_DOCS` documents at a time, each
    part written to it as it finishes and read from it when a stopped build is started again.

    ``given``: per row None or ``(token ids, first position, states)``, the decision states of the base model's own
    decoding of that very prompt + completion (:meth:`~.base_decodings.BaseDecodings.completion_states`): a row whose
    token ids and positions they cover takes its states from them instead of running the model (DESIGN #26)."""
    delimiter, max_length, batch_size, verbose = (config.delimiter, config.max_length, config.embed_batch_size,
                                                  config.verbose)
    seqs, poss, tgts, docs, skipped = [], [], [], [], []
    for i, r in enumerate(rows):
        ids, pos, tg = completion_token_positions(tokenizer, r["prompt"], r["completion"], delimiter, max_length)
        if not pos:
            skipped.append(r["id"])
        seqs.append(ids)
        poss.append(pos)
        tgts.extend(tg)
        docs.extend([i] * len(pos))
    known = _given_states(seqs, poss, given)
    run = [i for i in range(len(rows)) if i not in known]
    # each task's rows run after their own shared prefix (the tasks' templates differ after the system prompt),
    # computed over the whole set so that every part runs the prefix one pass would; a given prefix_ids (the
    # data-parallel ranks') stands for every row
    groups = [None] * len(run) if prefix_ids is not None else [rows[i].get("task") for i in run]
    prefixes = {None: prefix_ids} if prefix_ids is not None else {
        g: shared_prefix([seqs[i] for i, k in zip(run, groups) if k == g], [poss[i] for i, k in zip(run, groups) if k == g])
        for g in dict.fromkeys(groups)}
    with Progress(len(rows), "cache completion states", unit="doc", enabled=verbose) as bar:
        bar.update(len(known))
        args = ([seqs[i] for i in run], [poss[i] for i in run], groups, prefixes)
        if journal is None:
            ran = _grouped_states(heads, *args, batch_size=batch_size, progress=bar.update) if run else None
        else:
            ran = _journaled_states(heads, *args, journal, batch_size=batch_size, progress=bar.update)
    hidden = _in_row_order(len(rows), poss, known, run, ran, heads.hidden_size)
    targets = np.asarray(tgts, dtype=np.int64) + heads.vocab_size
    if skipped and verbose:
        log(f"{len(skipped)} y=1 training document(s) have their completion beyond max_length {max_length} "
            f"and give no training tokens (e.g. ids {skipped[:5]})")
    return TokenCache(hidden=hidden, targets=targets, doc=np.asarray(docs, dtype=np.int64), skipped=skipped)


def _given_states(seqs, poss, given) -> dict:
    """``{row: states [len(positions), D]}`` of the rows whose ``given`` decision states cover their token ids and
    positions (the decision at ``first + k`` is the state at that position)."""
    out = {}
    for i, g in enumerate(given or ()):
        if g is None or not poss[i]:
            continue
        ids, first, states = g
        n = len(poss[i])
        if (list(poss[i]) == list(range(first, first + n)) and n <= len(states)
                and list(seqs[i][:poss[i][-1] + 2]) == list(ids[:poss[i][-1] + 2])):
            out[i] = np.asarray(states[:n], dtype=np.float32)
    return out


def _in_row_order(n: int, poss, known: dict, run: list, ran, width: int) -> np.ndarray:
    """The states of every row in row order: the given ones and those of ``run`` (concatenated in ``ran``)."""
    parts, at, computed = [], 0, {}
    for i in run:
        computed[i] = (at, at + len(poss[i]))
        at += len(poss[i])
    for i in range(n):
        if i in known:
            parts.append(known[i])
        elif poss[i]:
            a, b = computed[i]
            parts.append(ran[a:b])
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros((0, width), dtype=np.float32)


def _grouped_states(heads: SDMHeads, seqs, poss, groups, prefixes: dict, *, batch_size: int, progress) -> np.ndarray:
    """:func:`token_hidden_states` of ``seqs`` (concatenated in their order), the rows of each group run after that
    group's prefix (``prefixes[group]``)."""
    parts: list = [None] * len(seqs)
    for g in dict.fromkeys(groups):
        idx = [i for i, k in enumerate(groups) if k == g]
        h = token_hidden_states(heads.model, [seqs[i] for i in idx], [poss[i] for i in idx], batch_size=batch_size,
                                progress=progress, prefix_ids=prefixes.get(g))
        at = 0
        for i in idx:
            parts[i], at = h[at:at + len(poss[i])], at + len(poss[i])
    kept = [p for p in parts if p is not None and len(p)]
    return np.concatenate(kept).astype(np.float32) if kept else np.zeros((0, heads.hidden_size), dtype=np.float32)


def _journaled_states(heads: SDMHeads, seqs, poss, groups, prefixes: dict, journal, *, batch_size: int,
                      progress) -> np.ndarray:
    """:func:`_grouped_states` of ``seqs`` in parts of :data:`TOKEN_CACHE_CHUNK_DOCS` documents, each kept in
    (and, when a stopped build is started again, read from) ``journal``."""
    have = journal.chunks()
    parts = []
    for lo in range(0, len(seqs), TOKEN_CACHE_CHUNK_DOCS):
        hi = min(lo + TOKEN_CACHE_CHUNK_DOCS, len(seqs))
        n_tok = sum(len(p) for p in poss[lo:hi])
        saved = have.get(f"docs{lo:07d}-{hi:07d}", {}).get("hidden")
        if saved is not None and saved.shape == (n_tok, heads.hidden_size):
            progress(hi - lo)
            parts.append(saved)
            continue
        h = _grouped_states(heads, seqs[lo:hi], poss[lo:hi], groups[lo:hi], prefixes, batch_size=batch_size,
                            progress=progress)
        h = h if n_tok else np.zeros((0, heads.hidden_size), dtype=np.float32)
        journal.write(f"docs{lo:07d}-{hi:07d}", hidden=np.asarray(h, dtype=np.float32))
        parts.append(h)
    return np.concatenate(parts) if parts else np.zeros((0, heads.hidden_size), dtype=np.float32)


#: The token cache's directory in a network-train run (:func:`save_token_cache`); kept across runs.
TOKEN_CACHE_DIR = "token_cache"
_CACHE_KIND, _CACHE_VERSION = "sdm_network_token_cache", 1


def token_cache_key(model_fingerprint: dict, rows: Sequence[dict], delimiter: str, max_length: int) -> dict:
    """What a token cache depends on: the frozen base model (its fingerprint), the y = 1 rows in order (SHA-256 of
    their ids, prompts and completions), the delimiter and ``max_length``."""
    text = json.dumps([[r["id"], r["prompt"], r["completion"]] for r in rows], ensure_ascii=False)
    return {"model": model_fingerprint, "rows": len(rows),
            "rows_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "delimiter": delimiter, "max_length": int(max_length)}


def save_token_cache(path: str, cache: TokenCache, key: dict) -> None:
    """Write ``cache`` and its :func:`token_cache_key` to the directory ``path`` (atomically replaced)."""
    hidden = cache.hidden if cache.hidden is not None else np.zeros((0, 0), dtype=np.float32)
    save_artifact(path, _CACHE_KIND, _CACHE_VERSION,
                  {"cache": {"hidden": np.asarray(hidden, dtype=np.float32),
                             "targets": np.asarray(cache.targets, dtype=np.int64),
                             "doc": np.asarray(cache.doc, dtype=np.int64)}},
                  {"key": key, "skipped": list(cache.skipped)}, overwrite=True)


def load_token_cache(path: str, key: dict) -> TokenCache | None:
    """The cache saved at ``path`` when it was built with ``key``; None when there is none, it is unreadable or it
    was built from other rows, another model or other settings (then it is built again and replaced)."""
    if not os.path.isdir(path):
        return None
    try:
        if not has_kind(path, _CACHE_KIND, _CACHE_VERSION, "token cache"):
            return None
        groups, meta = load_artifact(path, _CACHE_KIND, _CACHE_VERSION)
    except (ArtifactError, OSError, ValueError) as e:
        log(f"network-train: the saved token cache is unreadable ({e}); building it again")
        return None
    if meta.get("key") != key:
        log("network-train: the saved token cache was built from other rows, model or settings; building it again")
        return None
    g = groups["cache"]
    return TokenCache(hidden=g["hidden"], targets=g["targets"], doc=g["doc"], skipped=list(meta.get("skipped") or []))
