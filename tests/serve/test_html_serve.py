"""Verdict pages of ``sdm-mlx serve`` (``GET /v1/verdicts/{id}`` as HTML) and of MCP ``explain(html=...)``, end to end:
the real server as a subprocess (tiny model, head and verifier of ``tests/verified/test_generate.py``) and the MCP SDK client."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal

import pytest

pytest.importorskip("mlx_lm")

from server_process import ServerProcess, sdm_mlx  # noqa: E402

TIMEOUT = 90


def _get(srv, path, accept=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    try:
        conn.request("GET", path, headers={"Accept": accept} if accept else {})
        r = conn.getresponse()
        return r.status, r.headers, r.read().decode()
    finally:
        conn.close()


def _post(srv, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return json.loads(r.read())
    finally:
        conn.close()


def test_server_verdict_page(setup):  # noqa: F811
    srv = ServerProcess(sdm_mlx("serve", "--head", setup.head_dir, "--port", 0, "--quiet"))
    try:
        answer = '<script>alert("x")</script> "q" مرحبا'
        out = _post(srv, "/v1/verify", {"messages": [{"role": "user", "content": setup.verified_doc}],
                                        "completion": answer})
        vid = out["verification"]["verdict_id"]
        status, headers, body = _get(srv, f"/v1/verdicts/{vid}")
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        record = json.loads(body)
        assert {"alpha_region_lower", "alpha_region_centroid", "decision"} <= set(record["verifier"])
        for path, accept in ((f"/v1/verdicts/{vid}.html", None), (f"/v1/verdicts/{vid}", "text/html,*/*;q=0.8")):
            status, headers, page = _get(srv, path, accept)
            assert status == 200 and headers["Content-Type"].startswith("text/html"), (path, page[:300])
            assert "default-src 'none'" in headers["Content-Security-Policy"]
            assert "<script" not in page and "&lt;script&gt;" in page and "مرحبا" in page
            assert f'id="decision">{record["verifier"]["decision"].upper()}' in page
            assert "Prompt" in page and "Answer" in page and "Nearest training exemplars" in page
        status, _, missing = _get(srv, "/v1/verdicts/vd-nope.html")
        assert status == 404 and "vd-nope" in missing and "/" + "tmp" not in missing
        assert srv.stop(signal.SIGTERM) == 0
    finally:
        srv.kill()


def test_mcp_explain_returns_the_page(setup):  # noqa: F811
    pytest.importorskip("mcp")
    from mcp import Client, StdioServerParameters

    async def run():
        env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE") if k in os.environ}
        params = StdioServerParameters(command=os.sys.executable,
                                       args=["-m", "sdm_mlx", "mcp", "--head", setup.head_dir], env=env)
        async with asyncio.timeout(TIMEOUT):
            async with Client(params, read_timeout_seconds=TIMEOUT) as client:
                tools = {t.name: t for t in (await client.list_tools()).tools}
                good = (await client.call_tool("verify", {"question": setup.verified_doc,
                                                          "answer": setup.verified_answer})).structured_content
                vid = good["verdict_id"]
                plain = (await client.call_tool("explain", {"verdict_id": vid})).structured_content
                content = (await client.call_tool("explain", {"verdict_id": vid, "html": "content"})).structured_content
                path = (await client.call_tool("explain", {"verdict_id": vid, "html": "path"})).structured_content
                with open(path["html_path"], encoding="utf-8") as f:  # valid while the server runs
                    page = f.read()
                bad = await client.call_tool("explain", {"verdict_id": vid, "html": "pdf"})
                return tools, plain, content, path, page, bad

    tools, plain, content, path, page, bad = asyncio.run(run())
    assert "html" in tools["explain"].input_schema["properties"]
    assert "html_content" not in plain and "html_path" not in plain
    assert content["html_content"].startswith("<!DOCTYPE html>") and "Verdict for" in content["html_content"]
    assert content["p_lower"] == plain["p_lower"]
    assert page == content["html_content"]
    assert not os.path.exists(os.path.dirname(path["html_path"]))  # the server removed its pages when it exited
    assert bad.is_error and "html must be" in bad.content[0].text
