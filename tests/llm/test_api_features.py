"""The paper's 7-dim black-box LLM attribute vector: sdm_mlx.llm.api_features and `sdm-mlx api-features`."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from sdm_mlx.llm.api_features import APIFeatureError, attribute_vector, feature_row, parse_letter, value_spans
from sdm_mlx.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "api_answers_example.jsonl"
e = math.exp


def _tokens(*pairs):
    return [{"token": t, "logprob": lp} for t, lp in pairs]


def _answer(letter_tokens, conf_tokens, expl_tokens=(("ok", -0.1),)):
    toks = ([('{"answer_letter": "', 0.0)] + list(letter_tokens) + [('", "confidence_in_answer_letter": ', 0.0)]
            + list(conf_tokens) + [(', "short_explanation_for_answer_confidence": "', 0.0)] + list(expl_tokens)
            + [('"}', 0.0)])
    return "".join(t for t, _ in toks), _tokens(*toks)


def test_example_file_by_hand(tmp_path):
    out = tmp_path / "f.jsonl"
    assert main(["api-features", "--input", str(EXAMPLE), "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == [1, 0, 2, 3]
    v = [r["attributes"] for r in rows]
    want1 = [e(-0.0202), (e(-0.0001) + 1 + e(-0.3567)) / 3,
             (e(-0.05) + 1 + e(-0.6931) + e(-0.01) + e(-0.002) + 1 + e(-0.001)) / 7, 0, 0.95, 0, 0]
    np.testing.assert_allclose(v[0], want1, rtol=1e-12)
    assert v[1][3:] == [0, 0, 0.6, 0] and rows[1]["predicted_label"] == 2
    assert v[2] == [0.0] * 7 and rows[2]["predicted_label"] == -1  # refusal
    np.testing.assert_allclose(v[3][0], (e(-1.6094) + e(-0.0513) + e(-0.1)) / 3)  # "$D$": letter + "$" tokens
    assert v[3][3:] == [0, 0, 0, 1.0] and rows[3]["verbalized_confidence"] == 1.0
    assert rows[0]["letter_probability"] == v[0][0] and rows[0]["response"].startswith('{"answer_letter"')


def test_spans_and_alignment():
    text = '{ "answer_letter" : "B" ,"confidence_in_answer_letter":0.5, "x": [1, {"y": "}"}]}'
    spans = value_spans(text)
    a, b, val = spans["answer_letter"]
    assert text[a:b] == '"B"' and val == "B"
    assert text[slice(*spans["x"][:2])] == '[1, {"y": "}"}]'
    # a multi-byte character split across byte tokens is aligned through 'bytes'
    resp, toks = _answer([("C", -0.5)], [("0", 0.0), (".", 0.0), ("8", -0.2)], [("caf", -0.1), ("é", -0.3)])
    raw = "é".encode()
    toks[-2:-1] = [{"token": "\\xc3", "bytes": [raw[0]], "logprob": -0.3},
                   {"token": "\\xa9", "bytes": [raw[1]], "logprob": -0.7}]
    vec, info = attribute_vector(resp, {"content": toks})
    np.testing.assert_allclose(vec[:3], [e(-0.5), (2 + e(-0.2)) / 3, (e(-0.1) + e(-0.3) + e(-0.7)) / 3])
    assert vec[3:] == [0, 0, 0.8, 0] and info["predicted_label"] == 2
    assert parse_letter(" (b). ") == 1 and parse_letter("E") is None and parse_letter(3) is None


def test_errors(tmp_path, capsys):
    resp, toks = _answer([("E", 0.0)], [("1", 0.0)])
    with pytest.raises(APIFeatureError, match="answer_letter 'E' is not one of A, B, C, D"):
        attribute_vector(resp, toks)
    vec, info = attribute_vector(resp, toks, on_bad_letter="zero")
    assert vec[3:] == [0, 0, 0, 0] and info["predicted_label"] == -1
    with pytest.raises(APIFeatureError, match="do not concatenate"):
        attribute_vector(resp + " ", toks)
    resp2 = '{"answer_letter": "A"}'
    with pytest.raises(APIFeatureError, match="lacks key"):
        attribute_vector(resp2, _tokens((resp2, 0.0)))
    resp3, toks3 = _answer([("A", 0.0)], [('"high"', 0.0)])
    with pytest.raises(APIFeatureError, match="not a number"):
        attribute_vector(resp3, toks3)
    with pytest.raises(APIFeatureError, match="not valid JSON"):
        attribute_vector('{"answer_letter": "A",', _tokens(('{"answer_letter": "A",', 0.0)))
    with pytest.raises(APIFeatureError, match="label 'F'"):
        feature_row({"id": 1, "label": "F", "response": resp, "logprobs": toks})
    with pytest.raises(APIFeatureError, match="missing field 'logprobs'"):
        feature_row({"id": 1, "label": 0, "response": resp})

    bad = tmp_path / "bad.jsonl"
    good = EXAMPLE.read_text().splitlines()
    bad.write_text(good[0] + "\n" + json.dumps({"id": "z", "label": 1, "response": resp, "logprobs": toks}) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["api-features", "--input", str(bad), "--output", str(out)]) == 2
    assert "line 2 (id 'z'): answer_letter 'E'" in capsys.readouterr().err
    assert main(["api-features", "--input", str(bad), "--output", str(out), "--on-bad-letter", "zero",
                 "--field", "embedding"]) == 0
    assert json.loads(out.read_text().splitlines()[1])["embedding"][3:] == [0, 0, 0, 0]
    bad.write_text(good[0] + "\n{oops\n")
    assert main(["api-features", "--input", str(bad), "--output", str(out)]) == 2
    assert ":2: malformed JSON" in capsys.readouterr().err
