"""``sdm-mlx pipeline -c RECIPE`` end to end on a tiny model, through the CLI: a two-task recipe (sentiment from a
small movie-review CSV and tweet folder, arithmetic), every stage (data, own answers, constructed negatives, the
universal verifiers of three row sets and two encodings, per-task verifiers, evaluate, Alg. 4, the network's
answers, the table); then a second run that skips every finished stage, an answers file cut mid-row that the
answers stage completes row by row, and recipes that exit 2 naming the key and the fix.  Nothing is downloaded
(tests/helpers/pipeline_lab.py builds the model and the data)."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

import pipeline_lab as L

STAGES = ("data", "answers", "forced", "verifiers", "evaluate", "network", "network_answers", "table")
VERDICT_FIELDS = ["task", "split", "id", "label", "answer", "correct", "verified", "p_lower", "reason", "stage"]


def _cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "sdm_mlx", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=900)


def _rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline")
    model = L.build_model(str(folder / "models"))
    csv_path, tweets = L.write_sentiment_sources(str(folder / "sources"))
    recipe = L.write_recipe(str(folder / "recipe.yaml"), L.recipe(str(folder), model, csv_path, tweets))
    t0 = time.time()
    first = _cli("pipeline", "-c", recipe)
    return {"folder": folder, "model": model, "csv": csv_path, "tweets": tweets, "recipe": recipe,
            "out": folder / "run", "first": first, "seconds": time.time() - t0}


def test_every_stage_runs_and_writes_its_outputs(lab):
    r, out = lab["first"], lab["out"]
    assert r.returncode == 0, r.stderr[-3000:]
    for stage in STAGES:
        assert f"[{stage}] running" in r.stderr
    for task in ("sentiment", "arithmetic"):
        for split, n in (("pool", L.POOL), ("heldout", L.HELDOUT), ("shift", L.SHIFT)):
            data = _rows(out / "data" / f"{task}_{split}.jsonl")
            assert len(data) == n and all(set(d) == {"id", "label", "document", "split"} and d["split"] == split
                                          for d in data)
            answers = _rows(out / "answers" / f"{task}_{split}.jsonl")
            assert [a["id"] for a in answers] == [d["id"] for d in data]
            a = answers[0]
            for key in ("id", "split", "task_label", "answer_label", "form", "label", "text", "n_kept", "prompt_tokens",
                        "generated_tokens", "feature_parts", "embedding"):
                assert key in a
            assert a["feature_parts"] == ["max", "mean", "last"] and len(a["embedding"]) == 3 * 64  # hidden 64
            assert all(x["label"] == int(x["answer_label"] == x["task_label"]) for x in answers)
        forced = _rows(out / "forced" / f"{task}_pool.jsonl")
        assert len(forced) == L.POOL and sum(f["label"] == 0 for f in forced) == L.POOL // 2  # half negatives
        comps = json.loads((out / "forced" / f"{task}_completions.json").read_text())["completions"]
        assert {f["completion"] for f in forced} == set(comps)
    index = json.loads((out / "verifiers" / "index.json").read_text())
    assert set(index) == {f"universal-{s}-{f}" for s in ("own", "forced", "own+forced")
                          for f in ("mean-last", "max-mean-last")} | {"sentiment-own-mean-last",
                                                                       "arithmetic-own-mean-last"}
    assert index["universal-own-mean-last"]["width"] == 128 and index["universal-own-max-mean-last"]["width"] == 192
    assert index["universal-own+forced-mean-last"]["rows"] == 2 * L.POOL + L.POOL  # own + the negatives (half)
    assert index["sentiment-own-mean-last"]["tasks"] == ["sentiment"]
    for name, e in index.items():
        assert (out / "verifiers" / name).is_dir() and (out / "evaluate" / f"{name}.jsonl").is_file()
    metrics = json.loads((out / "network" / "run" / "metrics.json").read_text())
    assert metrics["finished"] and metrics["epochs_completed"] == 1
    # the base head's count took the answers stage's own answers (a few decoded again to check them)
    with np.load(out / "network" / "base_decodings.npz") as base:
        assert len(base["prompts"]) == 2 * L.POOL and list(base["feature_parts"]) == ["mean", "last"]
        # with the decision states the answers stage kept for every pool answer (a trained head replays them)
        assert (np.diff(base["decision_offsets"]) > 0).all() and base["decisions"].shape[1] == 64
    assert metrics["initial"]["given"] == metrics["initial"]["documents"] > 0
    cal = metrics["epochs"][0]["calibration"]
    table = json.loads((out / "table.json").read_text())
    assert {k: table["network"]["selection"]["epochs"][0][k] for k in ("replayed", "documents")} == \
        {k: cal[k] for k in ("replayed", "documents")}
    # the answers the trained W_pos decodes as the base model did are replayed (28 of 40 when written), not decoded
    assert cal["given"] == 0 and 0 < cal["replayed"] <= cal["documents"]
    done = json.loads((out / "network" / "answers.done.json").read_text())
    if metrics["selected_epoch"] == 0:  # the base head kept: nothing decoded (see the next test)
        assert done["base_head"] and not (out / "network" / "answers.jsonl").exists()
    else:
        assert len(_rows(out / "network" / "answers.jsonl")) == 2 * (L.HELDOUT + L.SHIFT)
    for name in ("table.json", "table.md", "verdicts.jsonl", "recipe.json"):
        assert (out / name).is_file()
    assert "| sentiment | heldout | 10 |" in r.stdout  # the markdown table on stdout
    stages = json.loads((out / "stages.json").read_text())
    assert list(stages) == list(STAGES)
    for stage, entry in stages.items():
        run = entry["runs"][-1]
        assert run["rc"] == 0 and run["wall_s"] > 0 and run["peak_rss_gb"] > 0 and run["cpu_s"] >= 0
    assert stages["answers"]["runs"][-1]["rows"] == 2 * (L.POOL + L.HELDOUT + L.SHIFT)
    assert stages["answers"]["runs"][-1]["tokens_per_s"] > 0 and stages["forced"]["runs"][-1]["rows_per_s"] > 0
    print(f"first run: {lab['seconds']:.1f} s")


def test_verdicts_hold_the_checked_fields_and_agree_with_the_table(lab):
    out = lab["out"]
    rows = _rows(out / "verdicts.jsonl")
    assert len(rows) == 2 * 2 * (L.HELDOUT + L.SHIFT)  # (base, network) x two tasks x (heldout + shift)
    data = {(t, s): {d["id"]: d for d in _rows(out / "data" / f"{t}_{s}.jsonl")}
            for t in ("sentiment", "arithmetic") for s in ("heldout", "shift")}
    for r in rows:
        assert list(r) == VERDICT_FIELDS
        assert r["stage"] in ("base", "network") and r["split"] in ("heldout", "shift")
        assert r["label"] == data[(r["task"], r["split"])][r["id"]]["label"]
        assert isinstance(r["verified"], bool) and isinstance(r["correct"], bool)
        assert r["correct"] == (r["answer"] == r["label"])
        assert r["answer"] in (0, 1, None)
        assert (r["reason"] is None) == r["verified"]
        if r["verified"]:
            assert r["answer"] is not None
        assert r["p_lower"] is None or 0.0 <= r["p_lower"] <= 1.0
    table = json.loads((out / "table.json").read_text())
    for stage, part in (("base", table["base"]), ("network", table["network"]["results"])):
        for task, splits in part.items():
            for split, s in splits.items():
                group = [r for r in rows if (r["stage"], r["task"], r["split"]) == (stage, task, split)]
                assert s["n"] == len(group) and s["verified"] == sum(r["verified"] for r in group)
                assert s["no_reject_accuracy"] == pytest.approx(sum(r["correct"] for r in group) / len(group), abs=1e-4)
    # the base verdicts are the primary verifier's judgement of the own answers
    ev = {(r["task"], r["id"]): r for r in _rows(out / "evaluate" / "universal-own-mean-last.jsonl")}
    for r in rows:
        if r["stage"] == "base":
            assert ev[(r["task"], r["id"])]["verified"] == r["verified"]
    # a network that kept epoch 0 is the base model: its rows are the base rows, and generate --head (which the
    # stage then skips) answers as the answers stage did, judged alike by the verifier on decode-time features
    if table["network"]["selection"]["selected_epoch"] == 0:
        base = {(r["task"], r["id"]): r for r in rows if r["stage"] == "base"}
        assert len(base) == sum(r["stage"] == "network" for r in rows)
        for r in rows:
            if r["stage"] == "network":
                assert r == {**base[(r["task"], r["id"])], "stage": "network"}
        _generate_with_the_base_head_answers_as_the_answers_stage(out, base)


def _generate_with_the_base_head_answers_as_the_answers_stage(out, base):
    from sdm_mlx.pipeline.layout import Layout
    from sdm_mlx.pipeline.network_stages import network_prompts
    from sdm_mlx.pipeline.stages import load_run_recipe
    from sdm_mlx.pipeline.table import network_verdicts

    recipe, layout = load_run_recipe(str(out)), Layout(str(out / "check"))
    prompts = [p for p in network_prompts(recipe, Layout(str(out))) if p["split"] == "heldout"][::3]
    (out / "check" / "network").mkdir(parents=True)
    (out / "check" / "network" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (out / "check" / "data").symlink_to(out / "data")
    r = _cli("generate", "--head", out / "network" / "run" / "network", "--verifier",
             out / "verifiers" / recipe.primary_verifier(), "--system", recipe.system or "", "--prompt-template",
             "{document}", "--max-tokens", recipe.max_tokens, "--input", out / "check" / "network" / "prompts.jsonl",
             "--output", layout.network_answers, "--on-reject", "return", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    decoded = network_verdicts(recipe, layout)
    assert len(decoded) == len(prompts) >= 4
    for d in decoded:
        b = base[(d["task"], d["id"])]
        assert d["answer"] == b["answer"] and d["verified"] == b["verified"]
        assert d["p_lower"] == pytest.approx(b["p_lower"], abs=1e-3)


def test_network_answers_replay_the_answers_a_network_keeps_and_decode_the_rest(lab):
    """A kept network whose W_pos changes some of the test answers (the lab's head plus noise): network_answers
    replays the others from the answers stage's decision states (their verdicts are the base verdicts) and decodes
    only the changed ones; every verdict is the one ``generate --head`` gives when it decodes every prompt."""
    import mlx.core as mx

    from sdm_mlx.network.artifact import load_network, save_network
    from sdm_mlx.pipeline.layout import Layout
    from sdm_mlx.pipeline.network_stages import _replay_test_prompts, network_prompts, replayed_ids, run_network_answers
    from sdm_mlx.pipeline.stages import load_run_recipe
    from sdm_mlx.pipeline.table import network_verdicts

    out = lab["out"]
    recipe = load_run_recipe(str(out))
    check = out / "replaycheck"
    (check / "network" / "run").mkdir(parents=True)
    for d in ("data", "answers", "verifiers"):
        (check / d).symlink_to(out / d)
    (check / "network" / "done.json").write_text((out / "network" / "done.json").read_text())
    (check / "network" / "run" / "metrics.json").write_text(json.dumps(
        {"finished": True, "epochs_completed": recipe.network.epochs, "selected_epoch": 1}))
    layout = Layout(str(check))
    prompts = network_prompts(recipe, layout)
    net = load_network(out / "network" / "run" / "network", load_verifier=False)
    w0 = np.array(net.heads.pos.weight)
    noise = np.random.default_rng(1).standard_normal(w0.shape).astype(np.float32) * float(np.abs(w0).mean())
    for scale in 2.0 ** np.arange(-3, 7):
        net.heads.pos.weight = mx.array(w0 + scale * noise)
        save_network(check / "network" / "run" / "network", net.heads, net.config["base_model"],
                     out / "verifiers" / recipe.primary_verifier(), net.settings, overwrite=True)
        n_same = len(_replay_test_prompts(recipe, layout, prompts))
        if 0 < n_same < len(prompts):
            break
    assert 0 < n_same < len(prompts)  # some answers changed, some not
    base = [{**r, "stage": "base"} for r in _rows(out / "verdicts.jsonl") if r["stage"] == "base"]
    done = run_network_answers(recipe, layout)
    assert done["replayed"] == n_same == len(replayed_ids(layout))
    assert len(_rows(layout.network_answers)) == len(prompts) - n_same  # only the changed answers were decoded
    got = {(r["task"], r["id"]): r for r in network_verdicts(recipe, layout, base)}
    assert len(got) == len(prompts)
    # the reference: generate --head decodes every prompt with the same network
    ref = out / "replayref"
    (ref / "network").mkdir(parents=True)
    (ref / "data").symlink_to(out / "data")
    (ref / "network" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    r = _cli("generate", "--head", check / "network" / "run" / "network", "--verifier",
             out / "verifiers" / recipe.primary_verifier(), "--system", recipe.system or "", "--prompt-template",
             "{document}", "--max-tokens", recipe.max_tokens, "--input", ref / "network" / "prompts.jsonl",
             "--output", ref / "network" / "answers.jsonl", "--on-reject", "return", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    want = {(x["task"], x["id"]): x for x in network_verdicts(recipe, Layout(str(ref)))}
    assert set(want) == set(got)
    for k, w in want.items():
        g = got[k]
        assert (g["answer"], g["correct"], g["verified"]) == (w["answer"], w["correct"], w["verified"]), k
        assert (g["p_lower"] is None) == (w["p_lower"] is None)
        if w["p_lower"] is not None:
            assert g["p_lower"] == pytest.approx(w["p_lower"], abs=1e-3)


def _bench(script, lab, tmp_path) -> dict:
    """The JSON report of ``tools/bench/<script>`` on 6 of the lab run's arithmetic rows, one repeat."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "bench", script), str(lab["out"]), "--task",
                        "arithmetic", "--n", "6", "--repeats", "1", "--json", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((tmp_path / "r.json").read_text())


def test_bench_replay_measures_both_modes_on_a_run(lab, tmp_path):
    """tools/bench/bench_replay.py on the lab's run: both modes measured with the CPU shares; the base head decodes
    the answers stage's texts again and replays every prompt."""
    rep = _bench("bench_replay.py", lab, tmp_path)
    assert {x["mode"] for x in rep["rows"]} == {"decode", "replay"} and rep["decode_over_replay"] > 0
    assert all({"load_average", "cpu_steal", "rss_mb"} <= set(x) for x in rep["rows"])
    assert rep["agreement"] == {"decoded_texts_equal": 6, "replayed": 6, "of": 6}


def test_bench_forced_measures_both_ways_on_a_run(lab, tmp_path):
    """tools/bench/bench_forced.py on the lab's run: both ways measured with the CPU shares, the same features."""
    rep = _bench("bench_forced.py", lab, tmp_path)
    assert {x["mode"] for x in rep["measurements"]} == {"scratch", "continuation"} and rep["rows"] == 6
    assert all({"load_average", "cpu_steal", "rss_mb"} <= set(x) for x in rep["measurements"])
    assert rep["max_relative_difference"] < 1e-4 and rep["tokens_continuation"] < rep["tokens_scratch"]


def test_flip_negatives_are_run_after_the_kept_prompt_in_the_answers_stage(lab, tmp_path):
    """``forced_completions: flip``: the answers stage runs each pool answer's constructed negative from the prompt it
    kept (only the completion's tokens), and the forced stage takes those features instead of embedding the rows:
    they are the force-decoded features ``prompt_completion_features`` computes from scratch."""
    import re

    from sdm_mlx.llm.embed import load_model, prompt_completion_features

    mapping = L.recipe(str(tmp_path), lab["model"], lab["csv"], lab["tweets"], network=False)
    mapping["verifier"] = {**mapping["verifier"], "forced_completions": "flip", "row_sets": ["own+forced"],
                           "primary": "own+forced", "features": ["mean,last"], "per_task": "none"}
    recipe = L.write_recipe(str(tmp_path / "flip.yaml"), mapping)
    for stage in ("data,answers", "forced"):
        r = _cli("pipeline", "-c", recipe, "--only", stage)
        assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    took = {}
    for task in ("sentiment", "arithmetic"):
        m = re.search(rf"{task}/forced: (\d+) rows' features were computed by the answers stage", r.stderr)
        assert m, r.stderr[-3000:]
        took[task] = int(m.group(1))
        answers = _rows(out / "answers" / f"{task}_pool.jsonl")
        parsable = sum(a["answer_label"] in (0, 1) for a in answers)
        assert 0 < took[task] <= parsable
        forced = _rows(out / "forced" / f"{task}_pool.jsonl")
        assert len(forced) == L.POOL
        model, tok = load_model(lab["model"])
        sample = forced[:: max(1, len(forced) // 8)]
        want = prompt_completion_features(model, tok, [f["prompt"] for f in sample], [f["completion"] for f in sample],
                                          parts=("max", "mean", "last"), batch_size=4).embeddings
        np.testing.assert_allclose(np.array([f["embedding"] for f in sample]), want, rtol=1e-4, atol=1e-4)


def test_a_second_run_skips_every_finished_stage(lab):
    out = lab["out"]
    before = json.loads((out / "stages.json").read_text())
    t0 = time.time()
    r = _cli("pipeline", "-c", lab["recipe"])
    assert r.returncode == 0, r.stderr[-2000:]
    for stage in STAGES[:-1]:
        assert f"[{stage}] done (outputs exist); skipped" in r.stderr
        assert f"[{stage}] running" not in r.stderr
    assert "[table] running" in r.stderr
    after = json.loads((out / "stages.json").read_text())
    assert {s: len(e["runs"]) for s, e in after.items()} == {s: len(e["runs"]) + (s == "table")
                                                             for s, e in before.items()}
    listed = _cli("pipeline", "-c", lab["recipe"], "--list")
    assert listed.returncode == 0 and "answers\tdone" in listed.stdout and "table\tto run" in listed.stdout
    print(f"second run: {time.time() - t0:.1f} s")


def test_the_answers_stage_resumes_row_by_row(lab):
    """An answers file cut mid-row (a killed run): the stage decodes only the missing rows; the kept rows stay
    byte for byte, and the rows decoded again equal the first run's (same greedy answer and parse)."""
    out = lab["out"]
    path = out / "answers" / "arithmetic_pool.jsonl"
    full = path.read_text().splitlines(keepends=True)
    kept = "".join(full[:-3])
    path.write_text(kept + full[-3][: len(full[-3]) // 2])  # two rows gone, a third cut in the middle
    r = _cli("pipeline", "-c", lab["recipe"], "--only", "answers")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "arithmetic/pool: 37 rows already" in r.stderr and "3 to decode" in r.stderr
    now = path.read_text()
    assert now.startswith(kept)
    again = [json.loads(x) for x in now.splitlines()[-3:]]
    first = [json.loads(x) for x in full[-3:]]
    assert [(a["id"], a["text"], a["answer_label"]) for a in again] == [(a["id"], a["text"], a["answer_label"])
                                                                       for a in first]
    stages = json.loads((out / "stages.json").read_text())
    assert stages["answers"]["runs"][-1]["rows"] == 3


def _main(*args):
    """The CLI in this process (no model is loaded on these paths): exit status."""
    from sdm_mlx.cli import main

    return main([*map(str, args)])


@pytest.mark.parametrize("change, key, fix", [
    ({"tasks": [{"name": "sentiment", "preset": "sentimnt", "sizes": {"pool": 2}}]}, "tasks[0].preset",
     "is not one of sentiment, factcheck, arithmetic"),
    ({"verifer": {}}, "verifer", "did you mean 'verifier'"),
    ({"record_features": "mean,last", "verifier": {"features": ["max,mean,last"]}}, "verifier.features",
     "add them to record_features"),
])
def test_a_bad_recipe_exits_2_naming_the_key_and_the_fix(lab, tmp_path, capsys, change, key, fix):
    mapping = L.recipe(str(tmp_path), lab["model"], lab["csv"], lab["tweets"], network=False)
    mapping.update(change)
    path = L.write_recipe(str(tmp_path / "bad.yaml"), mapping)
    assert _main("pipeline", "-c", path) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdm-mlx pipeline: error: ") and key in err and fix in err
    assert not (tmp_path / "run").exists()  # nothing ran


def test_a_missing_model_stops_before_any_stage(lab, tmp_path, capsys):
    mapping = L.recipe(str(tmp_path), str(tmp_path / "no_model"), lab["csv"], lab["tweets"], network=False)
    path = L.write_recipe(str(tmp_path / "r.yaml"), mapping)
    assert _main("pipeline", "-c", path) == 2
    err = capsys.readouterr().err
    assert "model directory not found" in err and "SDM_MLX_MODEL" in err and "[data] running" not in err
    assert not (tmp_path / "run" / "data").exists()
    assert _main("pipeline", "-c", path, "--only", "answers,nonsense") == 2
    assert "unknown stage(s) nonsense" in capsys.readouterr().err
    assert _main("pipeline", "-c", path, "--only", "network") == 2  # no network section in this recipe
    assert "not a stage of this recipe" in capsys.readouterr().err


def test_model_from_the_environment_when_the_recipe_names_none(lab, tmp_path, capsys, monkeypatch):
    """No model in the recipe: $SDM_MLX_MODEL names it (a missing one here, so the error shows which was used);
    --model overrides both."""
    mapping = L.recipe(str(tmp_path), lab["model"], lab["csv"], lab["tweets"], network=False)
    del mapping["model"]
    path = L.write_recipe(str(tmp_path / "r.yaml"), mapping)
    monkeypatch.setenv("SDM_MLX_MODEL", str(tmp_path / "env_model"))
    assert _main("pipeline", "-c", path) == 2
    assert str(tmp_path / "env_model") in capsys.readouterr().err
    assert _main("pipeline", "-c", path, "--model", str(tmp_path / "cli_model")) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "cli_model") in err and "env_model" not in err


def test_another_model_in_the_same_run_directory_is_refused(lab, capsys):
    """A run directory holds one model's answers: naming another model stops the verb before any stage."""
    assert _main("pipeline", "-c", lab["recipe"], "--model", str(lab["folder"] / "models")) == 2
    err = capsys.readouterr().err
    assert "holds the answers of the model" in err and "--output" in err


@pytest.mark.slow
def test_forced_primary_own_task_files_larger_pool_and_wrap(lab, tmp_path):
    """The other paths: a task from the recipe's own JSONL files (preset sentiment) beside factcheck's embedded
    split; the forced row set (the preset's compact answers) as the primary, so Alg. 4 trains on force-decoded
    rows; every per-task verifier; a --wrap prefix; then a larger pool: the data grows (old rows kept), only the
    new rows are decoded and embedded, and the verifiers train again on the new rows."""
    from tiny_tasks import synthetic_sentiment_rows

    files = {}
    rows = synthetic_sentiment_rows(60, seed=11)
    for split, part in (("pool", rows[:40]), ("heldout", rows[40:50]), ("shift", rows[50:])):
        files[split] = str(tmp_path / f"{split}.jsonl")
        with open(files[split], "w", encoding="utf-8") as f:
            f.writelines(json.dumps({**r, "id": f"mine-{r['id']}"}) + "\n" for r in part)

    def mapping(pool):
        return {"model": lab["model"], "output": str(tmp_path / "run"), "max_tokens": 16, "generation_batch_size": 32,
                "embed_batch_size": 32, "record_features": "mean,last",
                "tasks": [{"name": "mine", "preset": "sentiment", "data": files,
                           "sizes": {"pool": pool, "heldout": 10, "shift": 10}},
                          {"name": "facts", "preset": "factcheck", "sizes": {"pool": pool, "heldout": 6, "shift": 4}}],
                "verifier": {"row_sets": ["forced", "own"], "features": "last", "per_task": "all",
                             "forced_completions": "preset",
                             "train": {"alpha": 0.6, "iterations": 2, "epochs": 8, "exemplar_dim": 16,
                                       "batch_size": 16, "learning_rate": 0.003, "rescaler_max_epochs": 20}},
                "network": {"epochs": 1, "learning_rate": 0.01, "compile_step": False, "require_admission": False}}

    recipe = L.write_recipe(str(tmp_path / "r.yaml"), mapping(24))
    r = _cli("pipeline", "-c", recipe, "--wrap", "nice -n 1")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    index = json.loads((out / "verifiers" / "index.json").read_text())
    # a verifier on `last` alone: Alg. 4's decodings pool as it was trained (its count and its q, d)
    assert set(index) == {f"{s}-{k}-last" for s in ("universal", "mine", "facts") for k in ("forced", "own")}
    assert json.loads((out / "forced" / "mine_completions.json").read_text())["source"] == "preset"
    net_rows = _rows(out / "network" / "rows.jsonl")
    assert len(net_rows) == 48 and all(x["id"].endswith("/forced") and "answer_label" not in x for x in net_rows)
    assert {x["task"] for x in net_rows} == {"mine", "facts"}
    stages = json.loads((out / "stages.json").read_text())
    assert stages["answers"]["runs"][-1]["command"].startswith("nice -n 1 ")
    assert not stages["verifiers"]["runs"][-1]["command"].startswith("nice")  # only the model's stages
    verdicts = _rows(out / "verdicts.jsonl")
    assert {(v["stage"], v["task"]) for v in verdicts} == {(s, t) for s in ("base", "network")
                                                           for t in ("mine", "facts")}
    first_pool = (out / "data" / "facts_pool.jsonl").read_text()
    first_answers = (out / "answers" / "facts_pool.jsonl").read_text()

    r = _cli("pipeline", "-c", L.write_recipe(str(tmp_path / "r.yaml"), mapping(32)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "facts/pool: 24 rows already" in r.stderr and "8 to decode" in r.stderr
    import re

    # the negatives are assigned over the whole pool again: rows whose shown answer stayed are kept, not embedded
    kept, again = map(int, re.search(r"mine/forced: (\d+) rows already .*?; (\d+) to embed", r.stderr).groups())
    assert kept + again == 32 and 8 <= again < 32
    embedded = _rows(out / "forced" / "mine_pool.jsonl")
    assert {x["id"] for x in embedded} == {x["id"] for x in _rows(out / "forced" / "mine_pool.rows.jsonl")}
    rows_now = {x["id"]: x["completion"] for x in _rows(out / "forced" / "mine_pool.rows.jsonl")}
    assert all(rows_now[x["id"]] == x["completion"] for x in embedded)
    assert (out / "answers" / "facts_pool.jsonl").read_text().startswith(first_answers)
    new_pool = _rows(out / "data" / "facts_pool.jsonl")
    assert len(new_pool) == 32 and {x["id"] for x in _rows(out / "data" / "facts_pool.jsonl")} >= {
        json.loads(x)["id"] for x in first_pool.splitlines()}
    index = json.loads((out / "verifiers" / "index.json").read_text())
    assert index["universal-forced-last"]["rows"] == 64  # retrained on the larger pool
    assert "[network] running" in r.stderr  # its verifier changed: Alg. 4 starts over


def test_verifier_anatomy_recomputes_the_calibration_rows_and_the_twins(lab, tmp_path):
    """tools/real_llm/verifier_anatomy.py, from the run directory alone: one row per calibration row of the
    verifier, the per-task q~ table, and (row sets with constructed negatives) how often a row's nearest neighbour
    is its twin (the same prompt, the other answer): the mean over every position barely sees the answer."""
    import verifier_anatomy  # tools/real_llm is on pytest's pythonpath

    name = "universal-own+forced-mean-last"
    rows, table = tmp_path / "cal.jsonl", tmp_path / "anatomy.json"
    assert verifier_anatomy.main([str(lab["out"]), "--verifier", name, "--rows", str(rows), "--json",
                                  str(table)]) == 0
    index = json.loads((lab["out"] / "verifiers" / "index.json").read_text())[name]
    cal = _rows(rows)
    assert len(cal) == index["calibration_size"] and {r["task"] for r in cal} == {"sentiment", "arithmetic"}
    assert {r["kind"] for r in cal} == {"own", "forced"}
    assert all(set(r) == {"id", "task", "kind", "label", "prediction", "q_tilde_lower"} for r in cal)
    t = json.loads(table.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert t["calibration"]["robust_min_valid"] is None  # this tiny verifier finds no threshold
    assert sum(d["n"] for d in t["calibration"]["per_task"].values()) == len(cal)
    assert all(sum(b["n"] for b in d["bins"]) == d["n"] for d in t["calibration"]["per_task"].values())
    twins = {(r["encoding"], r["task"]): r for r in t["twins"]}
    assert sum(twins[("mean", task)]["rows"] for task in ("sentiment", "arithmetic")) == index["rows"]
    assert twins[("mean", "sentiment")]["nn_is_twin"] > 0.5 and twins[("mean", "arithmetic")]["nn_is_twin"] > 0.5
    assert verifier_anatomy.main([str(lab["out"]), "--verifier", "nope"]) == 2


def test_pool_curve_retrains_the_primary_on_a_prefix_of_one_pool(lab, tmp_path, capsys):
    """tools/real_llm/pool_curve.py: the primary verifier again on the first k pool prompts of one task (the other
    tasks' rows unchanged), judging the same answers; the run's own size reuses the run's verifier; a second call
    trains nothing."""
    import pool_curve  # tools/real_llm is on pytest's pythonpath

    out = tmp_path / "curve"
    half = L.POOL // 2
    argv = [str(lab["out"]), "--task", "sentiment", "--sizes", f"{half},{L.POOL}", "--out", str(out)]
    assert pool_curve.main(argv) == 0
    first = capsys.readouterr()
    curve = json.loads((out / "pool_curve.json").read_text(),
                       parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))["curve"]
    index = json.loads((lab["out"] / "verifiers" / "index.json").read_text())
    primary = index["universal-own-mean-last"]
    assert [c["pool_size"] for c in curve] == [half, L.POOL] and [c["run_verifier"] for c in curve] == [False, True]
    assert curve[1]["rows"] == primary["rows"] == 2 * L.POOL  # own answers of both tasks' pools
    assert curve[0]["rows"] == half + L.POOL
    verdicts = _rows(out / "pool_curve.jsonl")
    run_verdicts = _rows(lab["out"] / "evaluate" / "universal-own-mean-last.jsonl")
    for k in (half, L.POOL):
        mine = [v for v in verdicts if v["pool_size"] == k]
        assert sorted((v["task"], v["split"], v["id"]) for v in mine) == sorted(
            (v["task"], v["split"], v["id"]) for v in run_verdicts)
        c = next(c for c in curve if c["pool_size"] == k)
        summaries = [r for splits in c["results"].values() for r in splits.values()]
        assert sum(r["n"] for r in summaries) == len(mine)
        assert sum(r["verified"] for r in summaries) == sum(v["verified"] for v in mine)
    assert "training on" in first.err and f"| {half} | {half + L.POOL} |" in first.out
    assert pool_curve.main(argv) == 0
    assert "training on" not in capsys.readouterr().err  # resumed: nothing trained again
    assert pool_curve.main(argv[:4] + [f"{L.POOL + 2}", "--out", str(out)]) == 2
    assert pool_curve.main([str(lab["out"]), "--task", "nope", "--sizes", "2", "--out", str(out)]) == 2
    assert "nope" in capsys.readouterr().err
