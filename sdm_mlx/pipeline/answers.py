"""The model's own greedy answers with their verifier features, and force-decoded verification rows: resumable.

Moved here from ``tools/real_llm/real_answers.py`` (now a thin command-line shim over this module); the ``answers`` and
``forced`` stages of ``sdm-mlx pipeline`` call it.

**Own answers** (:func:`decode_answers`).  One output row per task row ``{id, label, document[, split]}``: the
prompt is the task's instruction in the model's chat template (as ``sdm-mlx make-verification-data --model``
and ``sdm-mlx generate --prompt-template`` build it), the answer is the model's greedy answer (batched
decoding, stopped when the JSON answer closes, as ``generate`` stops), and the row's ``embedding`` is the
verifier input pooled from the hidden states of that very decoding (DESIGN #21, the batched engine
:class:`sdm_mlx.decoding.DecodeEngine`): the features ``generate`` computes for the same prompt.  Output rows::

    id, split, task_label, answer_label (-1 = unparsable), form (compact | fenced | other | unparsable),
    label (1 iff answer_label == task_label), text, n_kept, prompt_tokens, generated_tokens,
    embedding_source, feature_parts, embedding

-- a training file for ``sdm-mlx train`` whose label is "the model's answer is correct".

**Forced rows** (:func:`embed_forced`).  Verification rows ``{id, prompt, completion, ...}`` (e.g. from
``sdm-mlx make-verification-data``) get the features of the force-decoded ``prompt + completion``
(``sdm-mlx embed``'s, the file's shared prompt prefix run once per batch).

Both append to their output and flush after every batch; ids already there are skipped and a partial last line
(a killed run) is cut off, so a stopped run loses at most one batch.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ..errors import InputError
from ..llm.pooling import DEFAULT_FEATURE_PARTS


def answer_form(text: str) -> str:
    """``compact`` (one-line JSON), ``fenced`` (a ```json block), ``other`` (JSON in another layout) or
    ``unparsable``."""
    from ..network.training_data import answer_form as form

    return form(text)


def done_ids(path: str) -> set:
    """Ids already written to ``path`` (a trailing partial line, from a killed run, is cut off)."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    ids = set()
    for k, line in enumerate(data.splitlines(), 1):
        if line.strip():
            try:
                ids.add(json.loads(line)["id"])
            except (ValueError, KeyError, TypeError):
                raise InputError(f"{path}: line {k} is not a row with an 'id' (delete the file to start it over)") \
                    from None
    return ids


def read_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def count_rows(path: str) -> int:
    """Non-empty lines of ``path`` (0 when it does not exist)."""
    if not os.path.exists(path):
        return 0
    n = 0
    with open(path, "rb") as f:
        for line in f:
            n += bool(line.strip())
    return n


class AnswerSettings(NamedTuple):
    """How a task's own answers are asked for and kept: the prompt (``system``, the task's ``template`` with a
    ``{document}`` slot), the answer of each label (``completions``, to parse the answers), at most ``max_tokens``
    tokens decoded ``batch_size`` rows at a time, and the pooled ``feature_parts`` of the features (DESIGN #21)."""

    system: str | None
    template: str
    completions: Sequence[str]
    max_tokens: int = 32
    batch_size: int = 16
    feature_parts: Sequence[str] = DEFAULT_FEATURE_PARTS
    #: ``negative_of(output row)``: the row's constructed negative (or None), run after the kept prompt
    #: (:func:`forced_from_kept_prompts`); None: no negatives here
    negative_of: Callable[[dict], str | None] | None = None


def decode_rows(engine, tokenizer, rows: Sequence[dict], settings: AnswerSettings, decisions=None,
                forced=None) -> list[dict]:
    """One batch: output rows with the answer, its parse and the decode-time features.  ``engine`` is the
    package's batched decoder (:class:`sdm_mlx.decoding.DecodeEngine`, plain greedy, the shared prompt prefix
    prefilled once by its prefix cache): the tokens and features ``sdm-mlx generate`` computes.  ``decisions``: a
    :class:`~.decisions.DecisionStore` that keeps the batch's decision states (written before the rows return).
    ``forced``: ``(completion_of, store)``: ``completion_of(output row)`` gives the row's constructed negative (or
    None), whose force-decoded features are computed from the kept prompt and kept in the
    :class:`~.decisions.ForcedFeatures` ``store`` (:func:`forced_from_kept_prompts`)."""
    from ..decoding import DecodeRequest
    from ..llm import embed as _embed
    from ..network.generation import parse_task_prediction

    system, template, completions, max_tokens, _, feature_parts, _ = settings
    prompts = [_embed.chat_text(tokenizer, r["document"], system=system, prompt_template=template) for r in rows]
    ids = [_embed.encode(tokenizer, p) for p in prompts]
    decs = engine.run([DecodeRequest(i, max_tokens, features=True, feature_parts=tuple(feature_parts),
                                     keep_decisions=decisions is not None, keep_prompt=forced is not None)
                       for i in ids])
    if decisions is not None:
        decisions.add([r["id"] for r in rows], decs)
    result = []
    for r, i, dec in zip(rows, ids, decs):
        text = tokenizer.decode(dec.token_ids)
        pred = parse_task_prediction(text, completions)
        result.append({
            "id": r["id"], "split": r.get("split"), "task_label": int(r["label"]), "answer_label": int(pred),
            "form": answer_form(text), "label": int(pred == int(r["label"])), "text": text,
            "n_kept": int(dec.feature_info["n_kept"]), "prompt_tokens": len(i), "generated_tokens": len(dec.token_ids),
            "embedding_source": "llm-hidden-states", "feature_parts": list(feature_parts),
            "embedding": [float(x) for x in np.asarray(dec.features).ravel()],
        })
    if forced is not None:
        completion_of, store = forced
        forced_from_kept_prompts(engine.model, tokenizer, prompts, decs, [completion_of(r) for r in result], store)
    return result


def forced_from_kept_prompts(model, tokenizer, prompts: Sequence[str], decs: Sequence, completions: Sequence,
                             store) -> int:
    """Keep in ``store`` (a :class:`~.decisions.ForcedFeatures`) the force-decoded features of ``prompts[i] +
    completions[i]`` computed from the prompt kept by ``decs[i]`` (only the completion's tokens run; pooled as
    ``embed_forced`` pools them); a row without a completion, or whose ``prompt + completion`` does not encode as the
    prompt's tokens followed by more, is left to the forced stage.  Returns how many were kept."""
    from ..decoding.continuation import continuation_features
    from ..llm import embed as _embed
    from .decisions import pair_key

    keep, conts, kept_n = [], [], []
    for i, (p, d, c) in enumerate(zip(prompts, decs, completions)):
        if c is None or d.prompt_cache is None:
            continue
        try:
            n = int(_embed.prompt_completion_kept_lengths(tokenizer, [p], [c])[0])
        except InputError:  # no closing delimiter: the forced stage says so for its row
            continue
        full, P = _embed.encode(tokenizer, p + c), len(d.prompt_ids)
        if full[:P] == list(d.prompt_ids) and P < n <= len(full):
            keep.append(i)
            conts.append(full[P:])
            kept_n.append(n)
    if keep:
        feats = continuation_features(model, [decs[i].prompt_cache for i in keep], conts, kept_n,
                                      tuple(store.feature_parts))
        store.add([pair_key(prompts[i], completions[i]) for i in keep], feats)
    for d in decs:
        d.prompt_cache = None  # the batch's prompt keys and values are not needed again
    return len(keep)


def shared_prefix_stats(model, tokenizer, prompts) -> dict:
    """Length P of the token prefix every prompt shares and the sum of its final-norm states (float64 [D]).

    The model is causal, so the states of those P positions are the same in every row: the mean over the
    non-shared positions (document + completion) of a row pooled over n positions is
    ``(n * mean_all - state_sum) / (n - P)`` (``tools/real_llm/real_probe.py`` reads it).
    """
    from ..llm import embed as _embed

    ids = [_embed.encode(tokenizer, p) for p in prompts]
    first = ids[0]
    P = min(len(r) for r in ids)
    for r in ids[1:]:
        P = next((k for k in range(P) if r[k] != first[k]), P)
    h = np.array(_embed.hidden_states(model, [first[:P]])[0], dtype=np.float64)
    return {"P": P, "state_sum": h.sum(axis=0), "prefix_text": tokenizer.decode(first[:P])}


def write_prefix_stats(path: str, model, tokenizer, rows, *, system, template) -> dict:
    """``path`` (.npz): the shared prompt prefix's length ``P`` and state sum of ``rows``' prompts."""
    from ..llm import embed as _embed

    prompts = [_embed.chat_text(tokenizer, r["document"], system=system, prompt_template=template) for r in rows]
    st = shared_prefix_stats(model, tokenizer, prompts)
    tmp = path + ".partial.npz"
    np.savez(tmp, P=st["P"], state_sum=st["state_sum"])
    os.replace(tmp, path)
    return st


def _log_default(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def decode_answers(model, tokenizer, rows: Sequence[dict], output: str, settings: AnswerSettings, *,
                   prefix_stats: bool = True, log: Callable[[str], None] = _log_default, label: str = "") -> dict:
    """Append the own-answer row of every row of ``rows`` not yet in ``output``, asked and kept as ``settings`` say;
    returns ``{rows, tokens, generated_tokens, seconds}`` of this call (the rows decoded now, not those found).

    Decoded by a new :class:`~sdm_mlx.decoding.DecodeEngine` with a prefix cache.  ``prefix_stats``: also write
    ``output + ".prefix.npz"`` (:func:`write_prefix_stats`).  The decision states of every decoding are kept in
    ``output + ".decisions/"`` (:mod:`.decisions`: Alg. 4 replays them under a trained head).
    With ``settings.negative_of``, each row's constructed negative is run after its kept prompt, and its features are
    kept in ``output + ".forced/"`` for the forced stage (:mod:`.decisions`)."""
    from ..decoding import DecodeEngine, PrefixCache
    from ..llm.pooling import check_feature_parts
    from .decisions import DecisionStore, ForcedFeatures, decode_settings as decision_settings

    settings = settings._replace(feature_parts=check_feature_parts(settings.feature_parts))
    system, template, batch_size = settings.system, settings.template, settings.batch_size
    have = done_ids(output)
    todo = [r for r in rows if r["id"] not in have]
    name = label or os.path.basename(output)
    log(f"{name}: {len(rows) - len(todo)} rows already in {output}; {len(todo)} to decode")
    stats = {"rows": 0, "tokens": 0, "generated_tokens": 0, "seconds": 0.0}
    if not todo:
        return stats
    if prefix_stats and not os.path.exists(output + ".prefix.npz"):
        write_prefix_stats(output + ".prefix.npz", model, tokenizer, rows, system=system, template=template)
    engine = DecodeEngine(model, tokenizer, max_batch=batch_size, prefix_cache=PrefixCache())
    store = DecisionStore(output, decision_settings(engine, settings.max_tokens))
    forced = (None if settings.negative_of is None
              else (settings.negative_of, ForcedFeatures(output, settings.feature_parts)))
    t0 = time.time()
    with open(output, "a", encoding="utf-8") as f:
        for b0 in range(0, len(todo), batch_size):  # one batch per flush: a stopped run loses at most one batch
            out = decode_rows(engine, tokenizer, todo[b0: b0 + batch_size], settings, store, forced)
            for row in out:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
            stats["rows"] += len(out)
            stats["tokens"] += sum(r["prompt_tokens"] + r["generated_tokens"] for r in out)
            stats["generated_tokens"] += sum(r["generated_tokens"] for r in out)
            dt = max(time.time() - t0, 1e-9)
            forms = {k: sum(r["form"] == k for r in out) for k in ("compact", "fenced", "other", "unparsable")}
            log(f"{name}: {stats['rows']}/{len(todo)} rows, {dt:.0f} s, {stats['rows'] / dt:.3f} rows/s, "
                f"{stats['tokens'] / dt:.1f} tok/s; last batch forms {forms}, right "
                f"{np.mean([r['label'] for r in out]):.2f}")
    stats["seconds"] = time.time() - t0
    return stats


def embed_forced(model, tokenizer, rows: Sequence[dict], output: str, *, batch_size: int = 16,
                 feature_parts: Sequence[str] = DEFAULT_FEATURE_PARTS, log: Callable[[str], None] = _log_default,
                 label: str = "") -> dict:
    """Append the force-decoded features of every verification row (``id, prompt, completion, ...``) not yet in
    ``output`` (the row with ``embedding_source``, ``feature_parts`` and ``embedding`` added); returns
    ``{rows, tokens, seconds}`` of this call.  The whole file's shared prompt prefix (rows do not depend on the
    batch) runs once per batch; rows go longest first; every batch is flushed.  A row that already carries its
    ``embedding`` (computed by the answers stage: :class:`~.decisions.ForcedFeatures`) is written as it is, without
    running the model."""
    from ..llm import embed as _embed
    from ..llm.pooling import check_feature_parts

    feature_parts = check_feature_parts(feature_parts)
    have = done_ids(output)
    todo = [r for r in rows if r["id"] not in have]
    name = label or os.path.basename(output)
    log(f"{name}: {len(rows) - len(todo)} rows already in {output}; {len(todo)} to embed")
    stats = {"rows": 0, "tokens": 0, "seconds": 0.0}
    given = [r for r in todo if r.get("embedding") is not None]
    if given:
        with open(output, "a", encoding="utf-8") as f:
            for r in given:
                f.write(json.dumps({**r, "embedding": [float(x) for x in r["embedding"]]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        todo = [r for r in todo if r.get("embedding") is None]
        log(f"{name}: {len(given)} rows' features were computed by the answers stage (the completion run after "
            f"the kept prompt); {len(todo)} to embed")
    if not todo:
        return stats
    seqs = [_embed.encode(tokenizer, r["prompt"] + r["completion"]) for r in rows]
    shared = seqs[0][: _embed.common_prefix_length(seqs)]
    length = {r["id"]: len(s) for r, s in zip(rows, seqs)}
    todo.sort(key=lambda r: -length[r["id"]])
    t0 = time.time()
    with open(output, "a", encoding="utf-8") as f:
        for b0 in range(0, len(todo), batch_size):
            part = todo[b0: b0 + batch_size]
            feats = _embed.prompt_completion_features(model, tokenizer, [r["prompt"] for r in part],
                                                      [r["completion"] for r in part], batch_size=batch_size,
                                                      shared_prefix=shared, parts=feature_parts).embeddings
            for r, e in zip(part, feats):
                f.write(json.dumps({**r, "embedding_source": "llm-hidden-states", "feature_parts": list(feature_parts),
                                    "embedding": [float(x) for x in e]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            stats["rows"] += len(part)
            stats["tokens"] += sum(length[r["id"]] for r in part)
            dt = max(time.time() - t0, 1e-9)
            log(f"{name}: {stats['rows']}/{len(todo)} rows, {dt:.0f} s, {stats['rows'] / dt:.3f} rows/s, "
                f"{stats['tokens'] / dt:.1f} tok/s")
    stats["seconds"] = time.time() - t0
    return stats
