"""Universal verification encoding: sdm_mlx.llm.verification_data and `sdm-mlx make-verification-data`."""

import json
from collections import Counter

import pytest

from sdm_mlx.cli import main
from sdm_mlx.llm.verification_data import PRESETS, assign_negatives, make_verification_rows, phi3_chat_prompt

FACT = PRESETS["factcheck"]["completions"]


def _task(n, n_classes=2):
    return [{"id": f"r{i}", "label": i % n_classes if i % 5 else 0, "document": f"doc {i}", "src": i} for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 7, 10, 41])
def test_balanced_each_row_once(n):
    rows = _task(n)
    out = make_verification_rows(rows, FACT, lambda d: "P:" + d, seed=3)
    assert [r["id"] for r in out] == [r["id"] for r in rows]  # each source row exactly once, in order
    assert sum(r["label"] == 0 for r in out) == n // 2
    for c in (0, 1):  # half of each task label (±1) are negatives
        grp = [r for r in out if r["task_label"] == c]
        assert abs(sum(r["label"] == 0 for r in grp) - len(grp) / 2) <= 1
    for r, src in zip(out, rows):
        assert r["task_label"] == src["label"] and r["document"] == src["document"] and r["src"] == src["src"]
        assert r["prompt"] == "P:" + src["document"]
        want = src["label"] if r["label"] == 1 else 1 - src["label"]
        assert r["completion"] == FACT[want]


def test_seeded_and_multiclass():
    y = [0, 1, 2] * 20
    a, b, c = assign_negatives(y, 1), assign_negatives(y, 1), assign_negatives(y, 2)
    assert (a == b).all() and not (a == c).all()
    comps = ['{"x": "a"}', '{"x": "b"}', '{"x": "c"}']
    rows = [{"id": i, "label": lab, "document": "d"} for i, lab in enumerate(y)]
    out = make_verification_rows(rows, comps, lambda d: d, seed=0)
    neg = [r for r in out if r["label"] == 0]
    assert len(neg) == 30 and all(r["completion"] != comps[r["task_label"]] for r in neg)
    assert len(Counter(r["completion"] for r in neg)) == 3  # negatives drawn among the other labels


def test_errors():
    with pytest.raises(ValueError, match="row 2: label 2 must be an integer"):
        make_verification_rows([{"id": 1, "label": 0, "document": "a"}, {"id": 2, "label": 2, "document": "b"}], FACT, str)
    with pytest.raises(ValueError, match="missing field 'document'"):
        make_verification_rows([{"id": 1, "label": 0}], FACT, str)
    with pytest.raises(ValueError, match="repeats row 1"):
        make_verification_rows([{"id": 1, "label": 0, "document": "a"}, {"id": 1, "label": 1, "document": "b"}], FACT, str)
    with pytest.raises(ValueError, match="label True"):
        make_verification_rows([{"id": 1, "label": True, "document": "a"}], FACT, str)


def test_cli(tmp_path, tiny_phi3_path, capsys):
    inp = tmp_path / "task.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in _task(12)), encoding="utf-8")
    out = tmp_path / "ver.jsonl"
    assert main(["make-verification-data", "--input", str(inp), "--output", str(out), "--preset", "sentiment"]) == 0
    assert "no --model: the prompts use the Phi-3.5-mini-instruct chat format" in capsys.readouterr().err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 12 and sum(r["label"] for r in rows) == 6
    assert rows[0]["prompt"].startswith("<|system|>\nYou are a helpful AI assistant.<|end|>\n<|user|>\nClassify the sentiment")
    assert rows[0]["prompt"].endswith("REVIEW: doc 0<|end|>\n<|assistant|>\n")
    assert {r["completion"] for r in rows} == set(PRESETS["sentiment"]["completions"])

    # the tokenizer's chat template (the tiny model's is Phi-3's) gives the same prompts
    out2 = tmp_path / "ver2.jsonl"
    assert main(["make-verification-data", "--input", str(inp), "--output", str(out2), "--preset", "sentiment",
                 "--model", tiny_phi3_path]) == 0
    assert [json.loads(x) for x in out2.read_text().splitlines()] == rows
    assert "no --model" not in capsys.readouterr().err

    # completions from a YAML list, custom template; default preset is factcheck
    yml = tmp_path / "c.yaml"
    yml.write_text('- \'{"label": "no"}\'\n- \'{"label": "yes"}\'\n', encoding="utf-8")
    assert main(["make-verification-data", "--input", str(inp), "--output", str(out), "--completions", str(yml),
                 "--prompt-template", "Q: {document}", "--system", "", "--seed", "5"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["prompt"] == phi3_chat_prompt("Q: doc 0", None)
    assert {r["completion"] for r in rows} == {'{"label": "no"}', '{"label": "yes"}'}
    assert main(["make-verification-data", "--input", str(inp), "--output", str(out)]) == 0
    assert {json.loads(x)["completion"] for x in out.read_text().splitlines()} == set(FACT)

    capsys.readouterr()
    assert main(["make-verification-data", "--input", str(inp), "--output", str(out), "--completions", "a", "b"]) == 2
    assert "--prompt-template" in capsys.readouterr().err
    inp.write_text('{"id": 1, "label": 0, "document": "x"}\n{"id": 2, "label": 5, "document": "y"}\n')
    assert main(["make-verification-data", "--input", str(inp), "--output", str(out)]) == 2
    assert "line 2: label 5" in capsys.readouterr().err
