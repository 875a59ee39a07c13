"""What the server writes to its log for one failed request, in process (end to end: serve/test_hostile_server.py).

Starlette re-raises an exception after its 500 handler answered it, for the ASGI server to log it a second
time: one internal error was two tracebacks.  ``LoggedOnce`` ends an exception the handler logged, and a client
that hangs up mid-body (``ClientDisconnect``) is one warning line without a traceback.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import ClientDisconnect  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from sdm_mlx.serve import app as served  # noqa: E402


def _client(error: Exception) -> TestClient:
    async def fail(request):
        raise error

    app = Starlette(routes=[Route("/v1/{name}", fail, methods=["POST"])], exception_handlers={
        ClientDisconnect: served._client_gone, Exception: served._server_error})
    return TestClient(served.LoggedOnce(app))  # raise_server_exceptions: what escapes reaches the test


def test_an_internal_error_is_one_traceback(caplog):
    with caplog.at_level(logging.WARNING, logger="sdm_mlx.serve"):
        r = _client(KeyError("boom")).post("/v1/x%1B[2Jforged")  # a terminal escape in the path
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal server error: KeyError"
    records = [x for x in caplog.records if x.name == "sdm_mlx.serve"]
    assert len(records) == 1 and records[0].exc_info is not None
    assert "\x1b" not in records[0].getMessage() and "\\x1b[2Jforged" in records[0].getMessage()  # shown escaped


def test_a_client_gone_mid_body_is_one_line_without_traceback(caplog):
    with caplog.at_level(logging.WARNING, logger="sdm_mlx.serve"):
        r = _client(ClientDisconnect()).post("/v1/x")
    assert r.status_code == 499
    (record,) = [x for x in caplog.records if x.name == "sdm_mlx.serve"]
    assert record.exc_info is None and "closed the connection before its request body" in record.getMessage()
