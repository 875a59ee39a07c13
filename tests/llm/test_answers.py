"""answer_in_layout: a constructed negative keeps the model's own answer layout, only the answer changes."""

import pytest

from sdm_mlx.llm.answers import answer_in_layout, first_json_object
from sdm_mlx.llm.verification_data import PRESETS

SENT = PRESETS["sentiment"]["completions"]
FACT = PRESETS["factcheck"]["completions"]


@pytest.mark.parametrize("text, label, want", [
    ('```json\n{\n  "sentiment": "negative"\n}\n', 1, '```json\n{\n  "sentiment": "positive"\n}\n'),
    ('{"sentiment": "positive"}', 0, '{"sentiment": "negative"}'),
    ('{"sentiment":"positive"}', 1, '{"sentiment":"positive"}'),
    ('Sure: {"sentiment": "neutral"} because', 0, 'Sure: {"sentiment": "negative"} because'),
    ('text {oops {"sentiment": "positive"}', 0, 'text {oops {"sentiment": "negative"}'),
])
def test_sentiment_answers_inverted_in_place(text, label, want):
    assert answer_in_layout(text, SENT, label) == want


def test_boolean_answers_and_no_answer():
    out = answer_in_layout('```json\n{"correctness":true}\n```', FACT, 0)
    assert out == '```json\n{"correctness":false}\n```' and first_json_object(out) == {"correctness": False}
    assert answer_in_layout("no json here", SENT, 0) is None
    assert answer_in_layout('{"other": 1}', SENT, 0) is None
    assert answer_in_layout('{"sentiment": "x", "why": 2}', SENT, 0) is None  # not one key: not the answer form
    assert answer_in_layout('{"sentiment": "negative"}', ["yes", "no"], 0) is None  # plain-text completions
