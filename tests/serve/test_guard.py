"""The server's access middleware and verdict store, in process (end to end: serve/test_hostile_server.py).

:class:`~sdm_mlx.serve.guard.AccessGuard` around a minimal ASGI app: Host allow-list, Origin / CORS
(refused by default, answered when configured), API key per route, JSON content type.
:class:`~sdm_mlx.serve.verdicts.VerdictStore`: bounded in bytes as well as in records.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from sdm_mlx.serve.guard import AccessGuard, AccessPolicy, host_name  # noqa: E402
from sdm_mlx.serve.verdicts import MAX_TEXT_CHARS, VerdictStore, record_bytes, verdict_record  # noqa: E402


def _client(policy: AccessPolicy) -> TestClient:
    async def ok(request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in ("/health", "/v1/models", "/v1/feedback")])
    return TestClient(AccessGuard(app, policy), base_url="http://localhost")


JSON = {"Content-Type": "application/json"}


def test_host_names():
    assert host_name("localhost:8080") == "localhost" and host_name("[::1]:80") == "[::1]"
    assert host_name("127.0.0.1") == "127.0.0.1" and host_name("EVIL.example:1") == "evil.example"
    p = AccessPolicy.for_listen_address("10.0.0.5", ["models.lan"])
    assert {"localhost", "10.0.0.5", "models.lan"} <= p.allowed_hosts
    assert AccessPolicy.for_listen_address("0.0.0.0", ["*"]).allowed_hosts is None


def test_defaults_refuse_foreign_hosts_origins_non_json_and_keyless_feedback():
    c = _client(AccessPolicy())
    assert c.get("/health").status_code == 200
    assert c.get("/health", headers={"Host": "rebind.example"}).status_code == 403
    r = c.post("/v1/models", content=b"{}", headers={**JSON, "Origin": "https://evil.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert c.options("/v1/models", headers={"Origin": "https://evil.example"}).status_code == 403
    assert c.post("/v1/models", content=b"{}", headers={"Content-Type": "text/plain"}).status_code == 415
    assert c.post("/v1/models", content=b"{}").status_code == 415  # no content type
    assert c.post("/v1/models", content=b"{}", headers={"Content-Type": "application/json; charset=utf-8"}).is_success
    r = c.post("/v1/feedback", content=b"{}", headers=JSON)
    assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]


def test_api_key_routes_and_cors_when_configured():
    c = _client(AccessPolicy(api_key="k", cors_origins=frozenset({"https://app.example"})))
    assert c.post("/v1/feedback", content=b"{}", headers=JSON).status_code == 401
    r = c.post("/v1/feedback", content=b"{}", headers={**JSON, "Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert c.post("/v1/feedback", content=b"{}", headers={**JSON, "Authorization": "Bearer k"}).is_success
    assert c.get("/v1/models").is_success  # optional elsewhere ...
    assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401  # ... but never wrong
    pre = c.options("/v1/feedback", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in pre.headers["access-control-allow-headers"]
    r = c.get("/v1/models", headers={"Origin": "https://app.example"})
    assert r.is_success and r.headers["access-control-allow-origin"] == "https://app.example"
    strict = _client(AccessPolicy(api_key="k", key_routes="all"))
    assert strict.get("/v1/models").status_code == 401 and strict.get("/health").is_success
    assert strict.get("/v1/models", headers={"Authorization": "Bearer k"}).is_success


MALFORMED_HOSTS = ["[::1]attacker.example", "[::1].evil.example:80", "localhost:80@evil.example", "user@localhost",
                   "localhost:80:80", "localhost:", "localhost:99999", "localhost:8o", "::1", "[::1", "localhost/x",
                   "local host", "127.0.0.1.evil.example", "localhost."]


def test_host_header_is_exactly_an_allowed_host_with_an_optional_port():
    """RFC 3986 host [":" port]: nothing after an IP literal's bracket, no user information, a numeric port."""
    for malformed in MALFORMED_HOSTS[:-2]:  # the last two are well formed, and not allowed
        assert host_name(malformed) is None, malformed
    c = _client(AccessPolicy())
    for bad in MALFORMED_HOSTS:
        r = c.get("/health", headers={"Host": bad})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", bad
    for good in ("localhost", "localhost:8080", "127.0.0.1:1", "[::1]", "[::1]:65535", "LOCALHOST:80"):
        assert c.get("/health", headers={"Host": good}).is_success, good
    lan = _client(AccessPolicy.for_listen_address("127.0.0.1", ["fe80::1", "models.lan"]))
    assert lan.get("/health", headers={"Host": "[fe80::1]:8080"}).is_success
    assert lan.get("/health", headers={"Host": "models.lan:8080"}).is_success
    assert lan.get("/health", headers={"Host": "models.lan.evil.example"}).status_code == 403


def test_api_key_is_compared_as_the_bytes_the_client_sent():
    """A key set through the Python API with non-ASCII characters matches a client that sends its UTF-8 bytes
    (``sdm-mlx serve`` refuses such keys at start: most clients cannot send them)."""
    c = _client(AccessPolicy(api_key="cl\u00e9-\u2603"))
    sent = "Bearer cl\u00e9-\u2603".encode()
    assert c.post("/v1/feedback", content=b"{}", headers={**JSON, "Authorization": sent}).is_success
    assert c.post("/v1/feedback", content=b"{}", headers={**JSON, "Authorization": "Bearer cl\u00e9-\u2603".encode(
        "latin-1", "replace")}).status_code == 401


class _Tok:
    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


def _verdict():
    return types.SimpleNamespace(verified=True, reason=None, p_lower=0.9, parsed={}, exemplars=[], verifier={},
                                 row={})


def test_verdict_records_are_small_and_the_store_bounded_in_bytes():
    big = verdict_record(_Tok(), "verify", list(range(100_000)), [1, 2], text="x" * 1_000_000, verdict=_verdict())
    assert big["prompt_ids"].dtype == np.int32 and big["prompt_ids"].size == 100_000
    assert "tokens not kept" in big["prompt"] and len(big["prompt"]) < 10_000
    assert len(big["answer"]) < MAX_TEXT_CHARS + 100
    size = record_bytes(big)
    assert 400_000 <= size < 600_000  # ids at 4 bytes each + clipped texts
    store = VerdictStore(capacity=1000, max_bytes=3 * size)
    ids = [store.put(big) for _ in range(10)]
    assert len(store) == 3 and store.bytes <= 3 * size
    assert store.get(ids[0]) is None and store.get(ids[-1]) is not None
    one = VerdictStore(capacity=5, max_bytes=1)  # a record above the budget is still kept alone (its id answers)
    vid = one.put(big)
    assert len(one) == 1 and one.get(vid) is not None
