"""``sdm-mlx mcp`` through the MCP SDK's own stdio client (the server is ``python -m sdm_mlx mcp`` as a subprocess).

Uses the tiny model, head and verifier of ``tests/verified/test_generate.py`` (module fixture ``setup``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

pytest.importorskip("mlx_lm")
mcp = pytest.importorskip("mcp")

from sdm_mlx.calibration.reasons import REASONS  # noqa: E402
from verified_lab import OOD_PROMPT  # noqa: E402  (tests/helpers/; the setup fixture: conftest.py)

TIMEOUT = 90


def _structured(result) -> dict:
    assert not result.is_error, result.content
    data = result.structured_content
    assert data == json.loads(result.content[0].text)  # the same verdict as text for plain clients
    return data


async def _session(setup, body):  # noqa: F811
    from mcp import Client, StdioServerParameters

    env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE") if k in os.environ}
    params = StdioServerParameters(command=sys.executable, args=["-m", "sdm_mlx", "mcp", "--head", setup.head_dir],
                                   env=env)
    async with asyncio.timeout(TIMEOUT):
        async with Client(params, read_timeout_seconds=TIMEOUT) as client:
            return await body(client)


def test_mcp_verify_and_explain(setup):  # noqa: F811
    async def body(client):
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == {"verify", "add_feedback", "explain"}
        assert set(tools["verify"].input_schema["properties"]) == {"question", "answer"}
        good = _structured(await client.call_tool("verify", {"question": setup.verified_doc,
                                                             "answer": setup.verified_answer}))
        bad = _structured(await client.call_tool("verify", {"question": OOD_PROMPT,
                                                            "answer": '{"sentiment": "positive"}'}))
        ex = _structured(await client.call_tool("explain", {"verdict_id": good["verdict_id"]}))
        bad_ex = _structured(await client.call_tool("explain", {"verdict_id": bad["verdict_id"]}))
        missing = await client.call_tool("explain", {"verdict_id": "vd-missing"})
        empty = await client.call_tool("verify", {"question": " ", "answer": "x"})
        return good, bad, ex, bad_ex, missing, empty

    good, bad, ex, bad_ex, missing, empty = asyncio.run(_session(setup, body))
    assert good["verified"] and good["admitted"] and 0 < good["p_lower"] <= 1 and good["prediction"] == 1
    assert good["rejection_reason"] is None and good["why"].startswith("verified: admitted")
    assert good["exemplars"] and good["exemplars"][0].startswith("id=") and " label=" in good["exemplars"][0]
    assert not bad["verified"] and bad["rejection_reason"] and bad["why"] and bad["verdict_id"] != good["verdict_id"]
    # why: the condition that failed (sdm_mlx/calibration/reasons.py, the text of the verdict page and the reports),
    # the row's own figures as explain shows them, and what would change the verdict
    words = REASONS[bad["rejection_reason"]]
    assert bad["why"].startswith(words.condition + ": " + words.meaning), bad["why"]
    assert bad["why"].endswith(f"What would change the verdict: {words.change}."), bad["why"]
    if bad["rejection_reason"] in ("ood_similarity", "ood_distance"):
        row = bad_ex["verifier"]
        assert (f"q = {row['q']}" if bad["rejection_reason"] == "ood_similarity" else f"d = {row['d']:.3g}") \
            in bad["why"], (bad["why"], row)
    assert ex["verdict_id"] == good["verdict_id"] and ex["p_lower"] == good["p_lower"] and ex["source"] == "mcp"
    assert {"q", "d0", "d", "p_centroid", "p_upper", "n_kept", "delimiter_index"} <= set(ex["verifier"])
    assert {"logits", "sdm", "q_tilde_lower", "hard_bin_lower", "n_hat", "offset"} <= set(ex["row"])
    assert ex["answer"] == setup.verified_answer and setup.verified_doc in ex["prompt"]
    assert ex["completion_tokens"] == len(ex["answer_token_ids"]) > 0
    assert missing.is_error and "vd-missing" in missing.content[0].text
    assert empty.is_error and "non-empty" in empty.content[0].text
