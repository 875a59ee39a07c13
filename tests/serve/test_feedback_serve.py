"""Feedback through the servers: ``POST /v1/feedback`` of ``sdm-mlx serve`` and the MCP tool ``add_feedback``.

Uses the tiny model, head and verifier of ``tests/verified/test_generate.py`` (module fixture ``setup``), copied
to a temporary directory so ``--persist-feedback`` can rewrite the verifier in place.  A verdict
labelled ``true`` (right) or ``false`` (wrong) joins the support set at once: re-verifying the same
answer finds that row as its nearest exemplar at distance 0.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import sys

import pytest

pytest.importorskip("mlx_lm")

from server_process import ServerProcess, sdm_mlx  # noqa: E402
from verified_lab import OOD_PROMPT  # noqa: E402  (tests/helpers/; the setup fixture: conftest.py)

from sdm_mlx.estimator import SDMEstimator  # noqa: E402
from sdm_mlx.estimator.feedback import LOG_FILE  # noqa: E402

TIMEOUT = 90
KEY = "feedback-test-key"
ANSWER = '{"sentiment": "positive"}'


@pytest.fixture(scope="module")
def head_copy(setup, tmp_path_factory):  # noqa: F811
    dst = str(tmp_path_factory.mktemp("feedback_serve") / "network")
    shutil.copytree(setup.head_dir, dst)
    return dst


def _request(port, method, path, body=None, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": "application/json"} if data else {})}
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


def test_server_feedback_route(setup, head_copy):  # noqa: F811
    srv = ServerProcess(sdm_mlx("serve", "--head", head_copy, "--port", 0, "--quiet", "--persist-feedback",
                                "--api-key", KEY))
    try:
        port = srv.port
        verifier_dir = os.path.join(head_copy, "verifier")
        n_support = len(SDMEstimator.load(verifier_dir).support_ids_)
        st, first = _request(port, "POST", "/v1/verify", {"prompt": OOD_PROMPT, "completion": ANSWER})
        assert st == 200, first
        v1 = first["verification"]
        assert v1["exemplars"][0]["squared_distance"] > 0
        st, fb = _request(port, "POST", "/v1/feedback", {"verdict_id": v1["verdict_id"], "label": False})
        assert st == 200, fb
        assert fb["object"] == "feedback" and fb["label"] == 0 and fb["persisted"]
        assert fb["support_id"] == f"feedback-{v1['verdict_id']}" and fb["added_rows"] == 1
        # the same answer again: its nearest exemplar is the labelled row, at distance 0
        st, again = _request(port, "POST", "/v1/verify", {"prompt": OOD_PROMPT, "completion": ANSWER})
        v2 = again["verification"]
        assert v2["exemplars"][0]["id"] == fb["support_id"] and v2["exemplars"][0]["squared_distance"] == 0.0
        assert v2["exemplars"][0]["label"] == 0
        row = _request(port, "GET", f"/v1/verdicts/{v2['verdict_id']}")[1]["row"]
        assert row["d0"] == 0.0 and (row["q"] == 0 or row["prediction"] == 0)  # a wrong-labelled row ends q's run
        st, ok = _request(port, "POST", "/v1/feedback", {"verdict_id": v2["verdict_id"], "label": True})
        assert st == 200 and ok["label"] == 1 and ok["added_rows"] == 2
        # errors: a 4xx with an OpenAI error object, and the server keeps serving
        cases = [({"verdict_id": "vd-nope", "label": True}, 404, "vd-nope"),
                 ({"verdict_id": v1["verdict_id"], "label": True}, 400, "already"),  # one label per verdict
                 ({"verdict_id": v2["verdict_id"], "label": 7}, 400, "label"),
                 ({"verdict_id": v2["verdict_id"]}, 400, "label"),
                 ({"verdict_id": v2["verdict_id"], "label": True, "x": 1}, 400, "unknown field")]
        for body, status, message in cases:
            st, err = _request(port, "POST", "/v1/feedback", body)
            assert st == status and message in err["error"]["message"], (body, st, err)
        st, err = _request(port, "POST", "/v1/feedback", {"verdict_id": v1["verdict_id"], "label": False})
        assert st == 400 and err["error"]["code"] == "already_labelled" and err["error"]["param"] == "verdict_id"
        assert "is already labelled" in err["error"]["message"] and "--undo" in err["error"]["message"]
        st, err = _request(port, "POST", "/v1/feedback", raw=b"{not json")
        assert st == 400 and err["error"]
        assert _request(port, "GET", "/health")[0] == 200
        # persisted atomically into the verifier directory, with the update log
        saved = SDMEstimator.load(verifier_dir)
        assert len(saved.support_ids_) == n_support + 2 and saved.support_ids_[-1] == ok["support_id"]
        with open(os.path.join(verifier_dir, LOG_FILE), encoding="utf-8") as f:
            log = [json.loads(line) for line in f]
        assert [(e["op"], e["label"], e["source"]) for e in log] == [("add", 0, "server"), ("add", 1, "server")]
        assert srv.stop(signal.SIGTERM) == 0, "".join(srv.lines)
    finally:
        srv.kill()


def test_mcp_add_feedback(setup):  # noqa: F811
    mcp = pytest.importorskip("mcp")
    from mcp import Client, StdioServerParameters

    env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE") if k in os.environ}
    params = StdioServerParameters(command=sys.executable, args=["-m", "sdm_mlx", "mcp", "--head", setup.head_dir],
                                   env=env)

    async def body(client):
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools["add_feedback"].input_schema["properties"]) == {"verdict_id", "label"}
        first = (await client.call_tool("verify", {"question": OOD_PROMPT, "answer": ANSWER})).structured_content
        fb = await client.call_tool("add_feedback", {"verdict_id": first["verdict_id"], "label": True})
        again = (await client.call_tool("verify", {"question": OOD_PROMPT, "answer": ANSWER})).structured_content
        unknown = await client.call_tool("add_feedback", {"verdict_id": "vd-nope", "label": True})
        twice = await client.call_tool("add_feedback", {"verdict_id": first["verdict_id"], "label": False})
        return first, fb, again, unknown, twice

    async def run():
        async with asyncio.timeout(TIMEOUT):
            async with Client(params, read_timeout_seconds=TIMEOUT) as client:
                return await body(client)

    first, fb, again, unknown, twice = asyncio.run(run())
    assert not fb.is_error, fb.content
    out = fb.structured_content
    assert out["label"] == 1 and out["added_rows"] == 1 and not out["persisted"]
    assert again["exemplars"][0].startswith(f"id={out['support_id']} label=1") and "d²=0" in again["exemplars"][0]
    assert first["exemplars"][0] != again["exemplars"][0]
    assert unknown.is_error and "vd-nope" in unknown.content[0].text
    assert twice.is_error and "already labelled" in twice.content[0].text
    assert not os.path.exists(os.path.join(setup.head_dir, "verifier", LOG_FILE))  # in memory without --persist
