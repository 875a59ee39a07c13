"""tools/real_factcheck_pipeline.py's network stages on files alone: the rows Alg. 4 trains on, and the table
row of the SDM network (task accuracy from the parsed answers, unparsable = wrong; verified = p̂_lower's)."""

import json

import real_factcheck_pipeline as P  # tools/ is on pytest's pythonpath (pyproject.toml)

TRUE = '{"correctness": true}'
FALSE = '```json\n{\n  "correctness": false\n}\n```'


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_network_table_scores_parsed_answers_and_verdicts(tmp_path):
    task = [{"id": "h1", "label": 1, "document": "1 plus 1 equals 2.", "split": "heldout_topics"},
            {"id": "h2", "label": 0, "document": "1 plus 2 equals 4.", "split": "heldout_topics"},
            {"id": "h3", "label": 0, "document": "2 plus 2 equals 5.", "split": "heldout_topics"},
            {"id": "g1", "label": 1, "document": "100 plus 100 equals 200.", "split": "generated"},
            {"id": "p1", "label": 1, "document": "3 plus 3 equals 6.", "split": "pool"}]
    _write(tmp_path / "task.jsonl", task)
    (tmp_path / "network_run").mkdir()
    (tmp_path / "network_run" / "metrics.json").write_text(json.dumps(
        {"initial": {"count": 31}, "selected_epoch": 1, "finished": True,
         "epochs": [{"epoch": 1, "count": 35, "loss": 2.5, "tokens": 100}]}))
    assert P.network_table(str(tmp_path))["selection"]["initial_count"] == 31  # no answers yet: selection only
    assert "heldout_topics" not in P.network_table(str(tmp_path))
    _write(tmp_path / "network_answers.jsonl", [
        {"id": "h1", "answer": TRUE, "verified": True, "status": "verified"},    # right, verified
        {"id": "h2", "answer": FALSE, "verified": False, "status": "unverified"},  # right (fenced form)
        {"id": "h3", "answer": "I think so", "verified": False, "status": "rejected"},  # unparsable: wrong
        {"id": "g1", "answer": FALSE, "verified": False, "status": "rejected"}])  # wrong
    t = P.network_table(str(tmp_path))
    assert t["selection"]["epochs"][0]["count"] == 35 and t["selection"]["selected_epoch"] == 1
    held = t["heldout_topics"]
    assert held["statements"] == 3
    assert held["no_reject"]["task_accuracy"] == round(2 / 3, 4)
    assert held["p_lower"] == {"task_accuracy": 1.0, "admitted": 1, "admitted_fraction": round(1 / 3, 4)}
    assert held["statuses"] == {"rejected": 1, "unverified": 1, "verified": 1}
    gen = t["generated"]
    assert gen["no_reject"]["task_accuracy"] == 0.0 and gen["p_lower"]["task_accuracy"] is None


def test_network_finished_reads_the_metrics(tmp_path):
    assert not P.network_finished(str(tmp_path))
    (tmp_path / "network_run").mkdir()
    (tmp_path / "network_run" / "metrics.json").write_text(json.dumps({"finished": False, "epochs": []}))
    assert not P.network_finished(str(tmp_path))
    (tmp_path / "network_run" / "metrics.json").write_text(
        json.dumps({"finished": True, "epochs_completed": 1, "epochs": []}))
    assert P.network_finished(str(tmp_path)) and P.network_finished(str(tmp_path), 1)
    assert not P.network_finished(str(tmp_path), 3)  # the recipe asks for more epochs: the stage continues
    (tmp_path / "network_run" / "metrics.json").write_text(
        json.dumps({"finished": True, "epochs_completed": 3, "epochs": []}))
    assert P.network_finished(str(tmp_path), 3)


def test_answer_splits_decode_only_the_named_splits(tmp_path):
    """A recipe with ``answer_splits`` (a verifier trained on force-decoded rows) decodes only those splits' statements;
    without it, the answers stage decodes the whole sample."""
    task = [{"id": "p1", "label": 1, "document": "a", "split": "pool"},
            {"id": "h1", "label": 0, "document": "b", "split": "heldout_topics"},
            {"id": "g1", "label": 1, "document": "c", "split": "generated"}]
    _write(tmp_path / "task.jsonl", task)
    assert P.answer_source({}) == "task.jsonl"
    cfg = {"answer_splits": ["heldout_topics", "generated"]}
    assert P.answer_source(cfg) == "task_answers.jsonl"
    P.write_answer_tasks(cfg, str(tmp_path))
    kept = [json.loads(x)["id"] for x in (tmp_path / "task_answers.jsonl").read_text().splitlines()]
    assert kept == ["h1", "g1"]
    assert not P.answers_done(str(tmp_path), source="task_answers.jsonl")
    _write(tmp_path / "answers.jsonl", [{"id": "h1"}, {"id": "g1"}])
    assert P.answers_done(str(tmp_path), source="task_answers.jsonl")  # 2 of the 2 asked for, not 2 of 3
    assert not P.answers_done(str(tmp_path))
    # the split stage is done once the first named split's file exists (there are no pool answers to write)
    sizes = {"model": "m", "pool": 1, "heldout": 1, "generated": 1}
    assert P.stage_commands({**cfg, **sizes}, str(tmp_path))["split"][0].endswith("answers.heldout_topics.jsonl")
    assert P.stage_commands(sizes, "o")["split"][0].endswith("answers.pool.jsonl")
