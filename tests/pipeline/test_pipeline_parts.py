"""The pipeline's pieces on files alone (no model): verdict rows and their summary (index-conditional accuracy),
the network's answers parsed per task (unparsable = wrong), feature slicing, the model's own answer form for the
constructed negatives, resumable row files, and network-train's per-task completions beside verification rows."""

import json

import numpy as np
import pytest

from sdm_mlx.errors import InputError
from sdm_mlx.pipeline import recipe as R
from sdm_mlx.pipeline.answers import done_ids
from sdm_mlx.pipeline.layout import Layout
from sdm_mlx.pipeline.network_stages import base_head_kept, network_answers_done, network_done, run_network_answers
from sdm_mlx.pipeline.row_stages import model_completions
from sdm_mlx.pipeline.table import index_conditional, network_verdicts, risk_coverage, summarize
from sdm_mlx.pipeline.verifiers import slice_columns, verdict

TRUE = '{"correctness": true}'
FALSE = '```json\n{\n  "correctness": false\n}\n```'


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _v(label, answer, verified, **kw):
    return {"task": "t", "split": "heldout", "id": kw.pop("id", "x"), "label": label, "answer": answer,
            "correct": answer == label, "verified": verified, "p_lower": 0.9, "reason": None if verified else "r", **kw}


def test_summary_and_index_conditional_accuracy():
    rows = [_v(1, 1, True), _v(1, 1, True), _v(0, 1, True), _v(0, 0, True), _v(0, 0, False), _v(1, None, False)]
    m, per = index_conditional(rows)
    # true class 1: 2/2, true class 0: 1/2; predicted 1: 2/3, predicted 0: 1/1 -> min 0.5
    assert per == {"true": {"0": 0.5, "1": 1.0}, "predicted": {"0": 1.0, "1": round(2 / 3, 4)}}
    assert m == pytest.approx(0.5)
    s = summarize(rows)
    assert (s["n"], s["verified"], s["unparsable"]) == (6, 4, 1)
    assert s["no_reject_accuracy"] == pytest.approx(4 / 6, abs=1e-4)
    assert s["verified_accuracy"] == pytest.approx(3 / 4, abs=1e-4) and s["verified_fraction"] == pytest.approx(4 / 6,
                                                                                                              abs=1e-4)
    assert s["not_verified_reasons"] == {"r": 2}
    assert index_conditional([_v(1, 1, False)]) == (None, {})
    assert summarize([_v(1, 1, False)])["index_conditional_accuracy"] is None


def test_verdict_of_an_own_answer():
    pred = {"admitted": True, "prediction": 1, "rejection_reason": "", "p_lower": 0.97}
    assert verdict({"answer_label": 1, "task_label": 1}, pred)["verified"]
    v = verdict({"answer_label": -1, "task_label": 1}, pred)  # unparsable: never verified, wrong
    assert (v["verified"], v["reason"], v["answer"], v["correct"]) == (False, "parse_failure", None, False)
    v = verdict({"answer_label": 0, "task_label": 1}, dict(pred, prediction=0))
    assert (v["verified"], v["reason"], v["correct"]) == (False, "predicted_unverified", False)
    v = verdict({"answer_label": 1, "task_label": 1}, dict(pred, admitted=False, rejection_reason="ood_distance"))
    assert (v["verified"], v["reason"]) == (False, "ood_distance")


def test_network_verdicts_parse_each_task_and_count_unparsable_as_wrong(tmp_path):
    r = R.parse_recipe({"output": str(tmp_path), "tasks": [
        {"name": "arith", "preset": "arithmetic", "sizes": {"heldout": 3, "shift": 1}},
        {"name": "sent", "preset": "factcheck", "sizes": {"heldout": 1}}]})
    lay = Layout(str(tmp_path))
    _write(tmp_path / "data" / "arith_heldout.jsonl", [{"id": "h1", "label": 1, "document": "a"},
                                                       {"id": "h2", "label": 0, "document": "b"},
                                                       {"id": "h3", "label": 0, "document": "c"}])
    _write(tmp_path / "data" / "arith_shift.jsonl", [{"id": "g1", "label": 1, "document": "d"}])
    _write(tmp_path / "data" / "sent_heldout.jsonl", [{"id": "h1", "label": 1, "document": "e"}])
    verifier = {"prediction": 1, "admitted": True}
    _write(tmp_path / "network" / "answers.jsonl", [
        {"id": "arith/h1", "answer": TRUE, "verified": True, "p_lower": 0.99, "reason": None,
         "attempts": [{"verifier": verifier}]},                                        # right, verified
        {"id": "arith/h2", "answer": FALSE, "verified": False, "p_lower": 0.5, "reason": "ood_distance"},  # right
        {"id": "arith/h3", "answer": "I think so", "verified": True, "p_lower": 0.9, "reason": None},  # unparsable
        {"id": "arith/g1", "answer": FALSE, "verified": False, "p_lower": 0.4, "reason": "below_threshold_psi"},
        {"id": "sent/h1", "answer": TRUE, "verified": False, "p_lower": None, "reason": "parse_failure"}])
    rows = {(x["task"], x["id"]): x for x in network_verdicts(r, lay)}
    assert len(rows) == 5 and all(x["stage"] == "network" for x in rows.values())
    h1 = rows[("arith", "h1")]
    assert h1["verified"] and h1["correct"] and h1["prediction"] == 1
    assert rows[("arith", "h2")]["answer"] == 0 and rows[("arith", "h2")]["correct"]  # the fenced form parses
    h3 = rows[("arith", "h3")]
    assert (h3["answer"], h3["correct"], h3["verified"], h3["reason"]) == (None, False, False, "parse_failure")
    assert rows[("arith", "g1")]["split"] == "shift" and not rows[("arith", "g1")]["correct"]
    assert rows[("sent", "h1")]["correct"] and rows[("sent", "h1")]["split"] == "heldout"


def test_network_stage_done_reads_the_metrics_and_the_marker(tmp_path):
    r = R.parse_recipe({"output": str(tmp_path), "network": {"epochs": 2},
                        "tasks": [{"name": "a", "preset": "arithmetic", "sizes": {"pool": 2, "heldout": 2}}]})
    lay = Layout(str(tmp_path))
    assert not network_done(r, lay)
    _write(tmp_path / "network" / "run" / "metrics.json", [])
    (tmp_path / "network" / "run" / "metrics.json").write_text(json.dumps(
        {"finished": True, "epochs_completed": 1, "selected_epoch": 1}))
    (tmp_path / "network" / "done.json").write_text(json.dumps({"fingerprint": {"verifier": None,
                                                                                 "settings": {}}}))
    assert not network_done(r, lay)  # the recipe asks for 2 epochs: the stage continues
    (tmp_path / "network" / "run" / "metrics.json").write_text(json.dumps(
        {"finished": True, "epochs_completed": 2, "selected_epoch": 2}))
    assert network_done(r, lay)
    # the network's answers belong to the network that wrote them
    (tmp_path / "data").mkdir()
    _write(tmp_path / "network" / "answers.jsonl", [{"id": "a/1"}, {"id": "a/2"}])
    (tmp_path / "network" / "answers.done.json").write_text(json.dumps(
        {"network": {"selected_epoch": 1, "epochs_completed": 1}}))
    assert not network_answers_done(r, lay)
    (tmp_path / "network" / "answers.done.json").write_text(json.dumps(
        {"network": {"selected_epoch": 2, "epochs_completed": 2}}))
    assert network_answers_done(r, lay)


def test_a_network_that_kept_epoch_0_answers_as_the_base_model_without_decoding(tmp_path):
    """Alg. 4 kept epoch 0 (the base head): network_answers decodes nothing, and the table's network rows are the
    base verdicts; a later network that kept an epoch of its own needs its answers decoded."""
    r = R.parse_recipe({"output": str(tmp_path), "network": {"epochs": 1},
                        "tasks": [{"name": "a", "preset": "arithmetic", "sizes": {"pool": 2, "heldout": 2}}]})
    lay = Layout(str(tmp_path))
    (tmp_path / "network" / "run").mkdir(parents=True)
    (tmp_path / "network" / "run" / "metrics.json").write_text(json.dumps(
        {"finished": True, "epochs_completed": 1, "selected_epoch": 0}))
    (tmp_path / "network" / "done.json").write_text(json.dumps({"fingerprint": {"verifier": None, "settings": {}}}))
    _write(tmp_path / "network" / "answers.jsonl", [{"id": "a/1"}])  # an earlier network's answers
    (tmp_path / "network" / "answers.done.json").write_text(json.dumps(
        {"network": {"selected_epoch": 2, "epochs_completed": 2}}))
    assert network_done(r, lay) and not network_answers_done(r, lay) and not base_head_kept(lay)
    assert run_network_answers(r, lay) == {"rows": 0, "tokens": 0}
    assert network_answers_done(r, lay) and base_head_kept(lay)
    assert not (tmp_path / "network" / "answers.jsonl").exists()  # set aside, not mixed in
    assert (tmp_path / "network" / "answers.jsonl.stale").exists()
    base = [_v(1, 1, True, id="1"), _v(0, 1, False, id="2")]
    net = network_verdicts(r, lay, base)
    assert [x["stage"] for x in net] == ["network", "network"]
    assert [{k: v for k, v in x.items() if k != "stage"} for x in net] == base
    (tmp_path / "network" / "run" / "metrics.json").write_text(json.dumps(
        {"finished": True, "epochs_completed": 1, "selected_epoch": 1}))
    assert not base_head_kept(lay) and not network_answers_done(r, lay)
    assert network_verdicts(r, lay, base) == []


def test_slice_columns_picks_the_parts_of_one_decoding():
    X = np.arange(12, dtype=np.float32).reshape(1, 12)  # max | mean | last, D = 4
    cols = slice_columns(("max", "mean", "last"), ("mean", "last"), 12, "x")
    assert X[0, cols].tolist() == list(range(4, 12))
    assert X[0, slice_columns(("max", "mean", "last"), ("max", "last"), 12, "x")].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    with pytest.raises(InputError, match="record_features"):
        slice_columns(("mean", "last"), ("max", "mean", "last"), 8, "x")


def test_constructed_negatives_take_the_models_own_answer_form():
    task = R.parse_recipe({"output": "o", "tasks": [{"name": "f", "preset": "factcheck",
                                                     "sizes": {"pool": 2}}]}).task("f")
    fenced_true = '```json\n{\n  "correctness": true\n}'
    rows = [{"text": fenced_true, "answer_label": 1}] * 3 + [{"text": TRUE, "answer_label": 1},
                                                            {"text": "no", "answer_label": -1}]
    comps, how = model_completions(task, rows)  # "false" never written: the true answer's form, value changed
    assert comps == ['```json\n{\n  "correctness": false\n}', fenced_true] and "value changed" in how
    rows.append({"text": '{"correctness": false}', "answer_label": 0})
    assert model_completions(task, rows)[0] == ['{"correctness": false}', fenced_true]
    assert model_completions(task, [{"text": "x", "answer_label": -1}])[0] == task.answer_completions()


def test_done_ids_cuts_a_partial_last_line(tmp_path):
    p = tmp_path / "a.jsonl"
    assert done_ids(str(p)) == set()
    p.write_text('{"id": "a", "x": 1}\n{"id": "b", "x": 2}\n{"id": "c", "x"')
    assert done_ids(str(p)) == {"a", "b"}
    assert p.read_text() == '{"id": "a", "x": 1}\n{"id": "b", "x": 2}\n'
    p.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(InputError, match="line 2"):
        done_ids(str(p))


def test_risk_coverage_ranks_trusted_answers_first():
    rows = [_v(1, 1, True, prediction=1, id="a"), _v(1, 0, False, prediction=0, id="b"),
            _v(0, 0, False, prediction=1, id="c"), _v(1, None, False, id="d")]
    rows[2]["p_lower"] = 0.6
    cov, risk = risk_coverage(rows)
    assert cov == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert risk == pytest.approx([0.0, 0.0, 1 / 3, 0.5])  # a, c (right), b (judged wrong), d (unparsable) last


def test_network_train_takes_per_task_completions_beside_verification_rows():
    from sdm_mlx.network.config import NetworkConfig

    tasks = [{"name": "s", "preset": "sentiment"}, {"name": "f", "completions": ["no", "yes"],
                                                    "prompt_template": "{document}"}]
    c = NetworkConfig(model="m", output_dir="o", verification_data="rows.jsonl", tasks=tasks)
    c.validate()
    assert c.resolved_completions() == {"s": ['{"sentiment": "negative"}', '{"sentiment": "positive"}'],
                                        "f": ["no", "yes"]}
    with pytest.raises(InputError, match="remove 'data'"):
        NetworkConfig(model="m", output_dir="o", verification_data="rows.jsonl",
                      tasks=[{"name": "s", "data": "x", "preset": "sentiment"}]).validate()
    with pytest.raises(InputError, match="'name' and 'data'"):
        NetworkConfig(model="m", output_dir="o", tasks=[{"name": "s", "preset": "sentiment"}]).validate()


def test_linear_probe_and_auc():
    from sdm_mlx.pipeline.verifiers import auc, fit_probe

    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([0.5, 0.5], [0, 1]) == pytest.approx(0.5) and auc([0.1, 0.2], [1, 1]) is None
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 6)).astype(np.float32)
    y = (X[:, 2] - 0.5 * X[:, 4] > 0).astype(int)
    probe = fit_probe(X[:200], y[:200])
    assert auc(probe(X[200:]), y[200:]) > 0.95  # a linear rule is found
    assert auc(fit_probe(X[:200], rng.integers(0, 2, 200))(X[200:]), y[200:]) < 0.8  # noise labels: no rule


class _FlipStore:
    """A RowStore stand-in: 6 own pool answers (2 wrong) and their inverted rows, features = [row number, kind]."""

    def __init__(self):
        labels = [0, 1, 0, 1, 0, 1]
        right = [1, 1, 0, 1, 1, 0]
        self.own_rows = [{"id": f"r{i}", "task_label": y, "label": ok, "answer_label": y if ok else 1 - y}
                         for i, (y, ok) in enumerate(zip(labels, right))]
        self.flip_rows = [{"id": r["id"], "task_label": r["task_label"], "label": 1 - r["label"],
                           "answer_label": 1 - r["answer_label"]} for r in self.own_rows]

    def own(self, task, split):
        return self.own_rows, np.array([[i, 0, 0] for i in range(6)], np.float32), ("max", "mean", "last")

    def forced(self, task):
        return self.flip_rows, np.array([[i, 1, 0] for i in range(6)], np.float32), ("max", "mean", "last")


def test_flip_row_sets_pair_each_own_answer_with_its_inversion():
    """forced_completions: flip. (c) = every own answer + every inverted one (labels balanced by construction);
    (a) = one row per prompt, shown its right answer or its wrong one (half each), taken from the own row or the
    inverted row so that the label is what the assignment asked for."""
    from sdm_mlx.llm.verification_data import assign_negatives
    from sdm_mlx.pipeline.verifiers import VerifierPlan, training_rows

    store = _FlipStore()
    c = VerifierPlan("u", "universal", ("t",), "own+forced", ("max",))
    ids, X, y, rows = training_rows(c, store, "flip", 0)
    assert len(ids) == 12 and y.sum() == 6 and ids[6] == "t/r0/forced"
    assert X[:, 0].tolist() == list(range(6)) * 2  # the max column of each own row, then of each inverted row
    a = VerifierPlan("u", "universal", ("t",), "forced", ("max",))
    ids, X, y, rows = training_rows(a, store, "flip", 0)
    wrong = assign_negatives([r["task_label"] for r in store.own_rows], seed=0)
    assert len(ids) == 6 and y.tolist() == [int(not w) for w in wrong]
    for i, r in enumerate(rows):  # the own row where it already shows what was asked, else the inverted one
        assert r["kind"] == ("own" if store.own_rows[i]["label"] == int(not wrong[i]) else "forced")
