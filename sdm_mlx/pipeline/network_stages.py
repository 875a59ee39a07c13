"""The stages of ``sdm-mlx pipeline`` over Alg. 4 (:mod:`.stages`): ``network`` (``sdm-mlx network-train`` on the
primary verifier's rows and split) and ``network_answers`` (``sdm-mlx generate --head`` with the kept network over
the held-out and shift rows)."""

from __future__ import annotations

import json
import os

from ..errors import InputError
from .answers import count_rows
from .layout import Layout
from .recipe import TEST_SPLITS, Recipe, check_model
from .stage_io import read_json, run_cli, stage_log
from .verifier_stages import verifiers_done
from .verifiers import plans


def _network_fingerprint(recipe: Recipe, layout: Layout) -> dict:
    index = read_json(layout.verifiers_index) or {}
    return {"verifier": (index.get(recipe.primary_verifier()) or {}).get("fingerprint"),
            "settings": recipe.network.settings if recipe.network else None}


def network_done(recipe: Recipe, layout: Layout) -> bool:
    m = read_json(layout.network_metrics) or {}
    marker = read_json(layout.network_marker) or {}
    return (bool(m.get("finished")) and int(m.get("epochs_completed") or 0) >= recipe.network.epochs
            and marker.get("fingerprint") == _network_fingerprint(recipe, layout))


def network_rows(recipe: Recipe, layout: Layout) -> tuple[list[dict], dict]:
    """Alg. 4's verification rows: every row the primary verifier was trained on, with the same id, its task, the
    prompt in the model's chat template and its completion (the own answer, or the forced one); own answers keep
    ``answer_label`` so network-train corrects the wrong ones into W_pos positives.  With them, the base model's
    decodings of those prompts (the own answers: their texts and recorded features, in the verifier's parts), as
    :func:`sdm_mlx.network.base_decodings.save_base_decodings` takes them."""
    from ..llm import embed as _embed
    from .verifiers import RowStore, training_rows

    plan = next(p for p in plans(recipe) if p.name == recipe.primary_verifier())
    store = RowStore(layout)
    ids, X, _, meta = training_rows(plan, store, recipe.verifier.forced_completions, recipe.seed)
    tokenizer = _embed.load_tokenizer(recipe.model)
    docs = {t: {r["id"]: r["document"] for r in store.data(t, "pool")} for t in plan.tasks}
    out, own = [], []
    for k, (i, m) in enumerate(zip(ids, meta)):
        t = recipe.task(m["task"])
        if m["kind"] == "own":
            prompt = _embed.chat_text(tokenizer, docs[t.name][m["id"]], system=recipe.system,
                                      prompt_template=t.template())
            out.append({"id": i, "task": t.name, "prompt": prompt, "completion": m["text"], "label": int(m["label"]),
                        "task_label": int(m["task_label"]), "answer_label": int(m["answer_label"])})
            own.append(k)
        else:
            out.append({"id": i, "task": t.name, "prompt": m["prompt"], "completion": m["completion"],
                        "label": int(m["label"]), "task_label": int(m["task_label"])})
    base = {"prompts": [out[k]["prompt"] for k in own], "texts": [out[k]["completion"] for k in own],
            "features": X[own], "feature_parts": plan.parts,
            "replay": _replay(layout, [meta[k] for k in own], plan.tasks)}
    return out, base


def _replay(layout: Layout, own: list[dict], tasks) -> dict | None:
    """The decision states the answers stage kept for the own rows ``own`` (:mod:`.decisions`), in the form
    :func:`~sdm_mlx.network.base_decodings.save_base_decodings` takes; None when it kept none (or under
    different settings for different tasks)."""
    kept, settings = _kept_decisions(layout, [(t, "pool", {m["id"] for m in own if m["task"] == t}) for t in tasks])
    if not kept:
        return None
    got = [kept.get((m["task"], m["id"])) for m in own]
    return {"token_ids": [g[0] if g else [] for g in got], "stop_reasons": [g[1] if g else "" for g in got],
            "decisions": [g[2] if g else None for g in got], "settings": settings}


def _kept_decisions(layout: Layout, jobs) -> tuple[dict, dict | None]:
    """``({(task, id): (token ids, stop reason, decisions)}, their decode settings)`` that the answers stage kept for
    ``jobs`` (``(task, split, wanted ids or None)``); nothing when none were kept, or when they were kept under
    different settings for different files (they could not be replayed under one)."""
    from .decisions import DecisionStore

    kept, settings = {}, set()
    for task, split, wanted in jobs:
        store = DecisionStore.open(layout.answers(task, split))
        if store is not None:
            settings.add(json.dumps(store.settings, sort_keys=True))
            kept.update({(task, i): v for i, v in store.read(wanted).items()})
    if not kept or len(settings) != 1:
        return {}, None
    return kept, json.loads(settings.pop())


def run_network(recipe: Recipe, layout: Layout) -> dict:
    import yaml

    from ..network.base_decodings import save_base_decodings
    from ..storage.files import make_dirs, write_json, write_jsonl, write_text

    say = stage_log("network")
    check_model(recipe)
    index = read_json(layout.verifiers_index) or {}
    entry = index.get(recipe.primary_verifier())
    if not verifiers_done(recipe, layout) or not entry:
        raise InputError("the primary verifier is missing or out of date: run the verifiers stage first")
    if entry.get("skipped"):
        raise InputError(f"the primary verifier {recipe.primary_verifier()} was not trained ({entry['skipped']}), so "
                         "Alg. 4 has no verification layer: remove the network section or choose another primary")
    make_dirs(os.path.dirname(layout.network_rows))
    fp = _network_fingerprint(recipe, layout)
    marker = read_json(layout.network_marker) or {}
    restart = os.path.isdir(layout.network_run) and marker.get("fingerprint") not in (None, fp)
    if restart or not (os.path.exists(layout.network_rows) and os.path.exists(layout.network_base_decodings)):
        rows, base = network_rows(recipe, layout)
        write_jsonl(layout.network_rows, rows)
        save_base_decodings(layout.network_base_decodings, **base)
        say(f"{len(rows)} verification rows -> {layout.network_rows}; the base model's decodings of their "
            f"{len(base['prompts'])} prompts (the own answers) -> {layout.network_base_decodings}")
    tasks = [{"name": t.name, "completions": t.answer_completions(), "prompt_template": t.template()}
             for t in recipe.tasks if t.name in entry["tasks"]]
    config = {"model": recipe.model, "verification-data": layout.network_rows,
              "verifier": layout.verifier(recipe.primary_verifier()), "tasks": tasks, "system": recipe.system or "",
              "base-decodings": layout.network_base_decodings,
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
    m = read_json(layout.network_metrics) or {}
    return {"rows": count_rows(layout.network_rows),
            "tokens": int(sum(e.get("tokens") or 0 for e in m.get("epochs", [])))}


def _network_state(layout: Layout) -> dict:
    m = read_json(layout.network_metrics) or {}
    return {"selected_epoch": m.get("selected_epoch"), "epochs_completed": m.get("epochs_completed")}


def network_prompts(recipe: Recipe, layout: Layout) -> list[dict]:
    """The held-out and shift rows of every task as ``generate`` prompts: id ``<task>/<id>``, the document the
    task's instruction with the row's text in its slot (``generate --prompt-template '{document}'`` then builds
    exactly the prompt of the task's template, so one process answers every task)."""
    from .answers import read_rows

    return [{"id": f"{t.name}/{r['id']}", "document": t.template().replace("{document}", r["document"]),
             "task": t.name, "split": s}
            for t in recipe.tasks for s in TEST_SPLITS if t.sizes.get(s) for r in read_rows(layout.data(t.name, s))]


def base_head_kept(layout: Layout) -> bool:
    """Whether the network's answers are the base model's: Alg. 4 kept epoch 0, so W_pos is the base head, the
    network decodes exactly as the base model did in the answers stage, and the same primary verifier judges the
    same decode-time features (``network_answers`` then decodes nothing; the table repeats the base verdicts)."""
    marker = read_json(layout.network_answers_marker) or {}
    return bool(marker.get("base_head")) and marker.get("network") == _network_state(layout)


def network_answers_done(recipe: Recipe, layout: Layout) -> bool:
    marker = read_json(layout.network_answers_marker) or {}
    if marker.get("network") != _network_state(layout):
        return False
    want = sum(t.sizes[s] for t in recipe.tasks for s in TEST_SPLITS)
    return bool(marker.get("base_head")) or count_rows(layout.network_answers) + len(replayed_ids(layout)) >= want


def replayed_ids(layout: Layout) -> set:
    """The ``<task>/<id>`` of the held-out and shift prompts whose answer the kept network decodes exactly as the
    base model did (replayed from the answers stage's decision states by ``network_answers``): their network
    verdicts are their base verdicts.  Empty unless written for the current network."""
    saved = read_json(layout.network_replayed) or {}
    return set(saved.get("ids") or []) if saved.get("network") == _network_state(layout) else set()


def _replay_test_prompts(recipe: Recipe, layout: Layout, prompts: list[dict]) -> set:
    """``<task>/<id>`` of the ``prompts`` (:func:`network_prompts`) whose base decoding the kept network makes again
    (:meth:`~sdm_mlx.network.base_decodings.BaseDecodings.replayed` over the decision states the answers stage
    kept; the network is loaded here and released before ``generate`` runs)."""
    import gc

    import mlx.core as mx
    import numpy as np

    from ..llm import embed as _embed
    from ..network.artifact import load_network
    from ..network.base_decodings import BaseDecodings, base_decoding_arrays
    from ..network.decode_journal import prompt_key
    from ..network.generation import DecodeSettings
    from .answers import read_rows

    tests = [(t, s) for t in recipe.tasks for s in TEST_SPLITS if t.sizes.get(s)]
    kept, recorded = _kept_decisions(layout, [(t.name, s, None) for t, s in tests])
    rows = [(t, r) for t, s in tests for r in read_rows(layout.answers(t.name, s)) if (t.name, r["id"]) in kept]
    if not rows:
        return set()
    net = load_network(os.path.join(layout.network_run, "network"), load_verifier=False)
    tok = net.tokenizer
    doc = {p["id"]: p["document"] for p in prompts}
    ids = [f"{t.name}/{r['id']}" for t, r in rows]
    texts = [_embed.chat_text(tok, doc[i], system=recipe.system, prompt_template="{document}") for i in ids]
    base = BaseDecodings.from_arrays(base_decoding_arrays(
        texts, [r["text"] for _, r in rows], np.zeros((len(rows), 1), np.float32), ["last"],
        replay={"token_ids": [kept[(t.name, r["id"])][0] for t, r in rows],
                "stop_reasons": [kept[(t.name, r["id"])][1] for t, r in rows],
                "decisions": [kept[(t.name, r["id"])][2] for t, r in rows], "settings": recorded}), tok,
        "(the answers stage's decisions of the test prompts)")
    decode = DecodeSettings(max_new_tokens=recipe.max_tokens, delimiter=recorded["delimiter"],
                            max_length=recorded["max_length"], feature_parts=("last",))
    same = base.replayed(net.heads, decode)
    by_key = {prompt_key(_embed.encode(tok, x)): i for x, i in zip(texts, ids)}
    out = {by_key[k] for k in same if k in by_key}
    del net, base, tok
    gc.collect()
    mx.clear_cache()
    return out


def run_network_answers(recipe: Recipe, layout: Layout) -> dict:
    from ..storage.files import make_dirs, write_json, write_jsonl
    from .answers import read_rows

    say = stage_log("network_answers")
    if not network_done(recipe, layout):
        raise InputError("the network is missing or out of date: run the network stage first")
    make_dirs(os.path.dirname(layout.network_answers))
    state = _network_state(layout)
    marker = read_json(layout.network_answers_marker) or {}
    out = layout.network_answers
    base_head = state["selected_epoch"] == 0  # the base model: the base verdicts stand for its answers
    if os.path.exists(out) and (base_head or marker.get("network") not in (None, state)):
        os.replace(out, out + ".stale")  # the answers of an earlier network (decoded again unless base_head)
    if base_head:
        write_json(layout.network_answers_marker, {"network": state, "base_head": True})
        say("Alg. 4 kept epoch 0 (no epoch admitted more than the base head): the network is the base model, so "
            "its answers are the answers stage's, judged by the same verifier; nothing to decode")
        return {"rows": 0, "tokens": 0}
    prompts = network_prompts(recipe, layout)
    replayed = replayed_ids(layout)
    if not os.path.exists(layout.network_replayed) or read_json(layout.network_replayed).get("network") != state:
        replayed = _replay_test_prompts(recipe, layout, prompts)
        write_json(layout.network_replayed, {"network": state, "ids": sorted(replayed)})
        say(f"{len(replayed)} of {len(prompts)} prompts: the kept network picks the base model's every answer token "
            "(replayed from the answers stage's decision states), so their verdicts are the base verdicts")
    prompts = [p for p in prompts if p["id"] not in replayed]
    before = count_rows(out)
    total = {"rows": 0, "tokens": 0, "replayed": len(replayed)}
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
