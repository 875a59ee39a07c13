"""docs/serving.md runs as written on any machine (issue 41, section 2): its examples use the tiny network that one
documented command builds, and with ``--api-key`` set every client example sends that key.  (That the examples run
and that their verdicts are what the page says is tests/docs/test_doc_blocks.py's ``serving.md`` case: the page's
own blocks assert ``verified`` and the rejection reasons.)"""

from __future__ import annotations

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
BUILD = "python tools/builders/make_tiny_model.py runs/tiny && sdm-mlx network-train -c recipes/tiny_sentiment.yaml"


def _blocks(text: str) -> list[str]:
    return re.findall(r"^```(?:bash|python)\n(.*?)^```", text, re.M | re.S)


def test_serving_examples_use_the_network_one_command_builds():
    text = (DOCS / "serving.md").read_text(encoding="utf-8")
    code = _blocks(text)
    assert code[0].strip() == BUILD  # the first block builds what the others serve
    assert "runs/sentiment" not in text and not re.search(r"^\s*MODEL=", text, re.M)
    served = [line for block in code for line in block.replace("\\\n", " ").splitlines()
              if line.strip().startswith("sdm-mlx serve")]
    assert served and all("runs/tiny/" in line for line in served)
    recipe = (DOCS.parent / "recipes" / "tiny_sentiment.yaml").read_text(encoding="utf-8")
    assert "output: runs/tiny/network_train" in recipe and "model: runs/tiny/model" in recipe


def test_with_an_api_key_every_client_example_sends_it():
    text = (DOCS / "serving.md").read_text(encoding="utf-8")
    code = "\n".join(_blocks(text))
    keys = set(re.findall(r"sdm-mlx serve .*?--api-key (\S+)", code.replace("\\\n", " ")))
    assert len(keys) == 1, keys
    key = keys.pop()
    clients = re.findall(r"OpenAI\([^)]*\)", code)
    assert clients and all(f'api_key="{key}"' in c for c in clients), clients
    for call in re.findall(r"curl [^\n]*(?:\\\n[^\n]*)*", code):
        if "/v1/" in call:
            assert f"Authorization: Bearer {key}" in call, call
    feedback = (DOCS / "feedback.md").read_text(encoding="utf-8")
    row = next(line for line in feedback.splitlines() if line.startswith("| `sdm-mlx serve"))
    assert "--api-key KEY" in row and "Authorization: Bearer KEY" in row, row


#: the one figure for the tiny recipe's network-train (issue 41: it had three, "~30 s", "20–40 s", "about a minute")
TINY_TIME = "35–105 s on 2 CPU cores at load average 6–15"


def test_the_tiny_network_train_has_one_wall_time_with_its_load():
    root = DOCS.parent
    places = [root / "recipes" / "tiny_sentiment.yaml", root / "recipes" / "README.md", DOCS / "networks.md",
              DOCS / "serving.md"]
    for path in places:
        assert TINY_TIME in path.read_text(encoding="utf-8"), path
    for path in [root / "README.md", *DOCS.glob("*.md"), *places]:
        text = path.read_text(encoding="utf-8")
        for old in ("~30 s on 2 CPU cores", "~20–40 s", "training ≈ 20–40 s", "in about a minute",
                    "1,000 rows, about a minute"):
            assert old not in text, (path, old)
