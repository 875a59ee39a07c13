"""Who may call the server: Host allow-list, origin (CORS), JSON content type, API key (ASGI middleware).

Checked on every HTTP request, before routing, in this order (the threat model is in ``docs/serving.md``):

1. **Host**: the ``Host`` header must be one of the allowed names (loopback names and the address the
   server listens on, by default; ``--allowed-host``, ``*`` for any): a DNS-rebinding page whose name
   resolves to this server sends its own name and gets 403.
2. **Origin**: a request carrying an ``Origin`` header (a browser's cross-site request) is refused
   with 403 unless that origin was allowed with ``--cors-origin``; allowed origins get CORS headers and
   answered preflights (``OPTIONS``).
3. **API key**: with ``--api-key`` (or ``SDM_MLX_API_KEY``), ``Authorization: Bearer <key>`` as the
   OpenAI API takes it.  ``/v1/feedback`` (which changes verdicts) always needs it — without a key
   configured the route is refused — and, with ``--api-key-routes all``, every ``/v1`` route needs it.
   A wrong key is refused on every route (401).
4. **Content type**: a ``POST`` must be ``Content-Type: application/json`` (415 otherwise), which a
   browser cannot send cross-site without a CORS preflight.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field

#: host names a loopback server answers to by default
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
#: routes that change state: they always need the API key
KEY_ALWAYS = ("/v1/feedback",)
#: environment variable holding the API key (same as ``--api-key``)
API_KEY_ENV = "SDM_MLX_API_KEY"


@dataclass
class AccessPolicy:
    """The server's access rules (``sdm-mlx serve`` flags)."""

    api_key: str | None = None
    key_routes: str = "feedback"                    # "feedback" | "all"
    allowed_hosts: frozenset | None = frozenset(LOOPBACK_HOSTS)  # None: any Host
    cors_origins: frozenset = field(default_factory=frozenset)  # "*" allows every origin

    @classmethod
    def for_listen_address(cls, host: str, extra_hosts=(), **kw) -> "AccessPolicy":
        """Loopback names, the listening address (unless a wildcard) and ``extra_hosts`` (``*``: any Host)."""
        extra = {h.strip().lower() for h in extra_hosts if h and h.strip()}
        if "*" in extra:
            return cls(allowed_hosts=None, **kw)
        names = set(LOOPBACK_HOSTS) | extra
        if host not in ("0.0.0.0", "::", ""):
            names |= {host.lower(), f"[{host.lower()}]" if ":" in host else host.lower()}
        return cls(allowed_hosts=frozenset(names), **kw)


def host_name(header: str) -> str:
    """The host part of a ``Host`` header (port removed; IPv6 kept in brackets), lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[: end + 1] if end > 0 else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _error(status: int, message: str, code: str, headers=()) -> tuple[int, bytes, list]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status != 401
                                 else "authentication_error", "param": None, "code": code}}).encode()
    return status, body, [(b"content-type", b"application/json"), *headers]


class AccessGuard:
    """ASGI middleware applying an :class:`AccessPolicy` (see the module docstring)."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        origin = headers.get("origin")
        refusal = self._refusal(scope, headers, origin)
        if refusal is None and scope["method"] == "OPTIONS":
            refusal = (204, b"", self._cors_headers(origin) + [(b"access-control-allow-methods", b"GET, POST"),
                       (b"access-control-allow-headers", b"authorization, content-type"),
                       (b"access-control-max-age", b"600")])
        if refusal is not None:
            status, body, extra = refusal
            await send({"type": "http.response.start", "status": status,
                        "headers": extra + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        cors = self._cors_headers(origin)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + cors)
            await send(message)

        return await self.app(scope, receive, send_with_cors)

    def _cors_headers(self, origin: str | None) -> list:
        if origin is None or not self._origin_allowed(origin):
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    def _origin_allowed(self, origin: str) -> bool:
        return "*" in self.policy.cors_origins or origin in self.policy.cors_origins

    def _refusal(self, scope, headers: dict, origin: str | None):
        """``(status, body, headers)`` of the refusal of this request, or None when it may proceed."""
        p = self.policy
        host = headers.get("host")
        if host is not None and p.allowed_hosts is not None and host_name(host) not in p.allowed_hosts:
            return _error(403, f"Host {host[:80]!r} is not allowed; this server answers to "
                               f"{', '.join(sorted(p.allowed_hosts))} (sdm-mlx serve --allowed-host NAME)",
                          "host_not_allowed")
        if origin is not None and not self._origin_allowed(origin):
            return _error(403, f"cross-origin requests are refused (Origin {origin[:80]!r}); allow an origin with "
                               "sdm-mlx serve --cors-origin ORIGIN", "origin_not_allowed")
        if scope["method"] == "OPTIONS":
            return None
        refused = self._key_refusal(scope["path"], headers.get("authorization"))
        if refused is not None:
            return refused
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return _error(415, f"Content-Type must be application/json, got {media[:60] or 'none'!r}",
                              "unsupported_media_type")
        return None

    def _key_refusal(self, path: str, authorization: str | None):
        p = self.policy
        needs = path in KEY_ALWAYS or (p.key_routes == "all" and path.startswith("/v1/"))
        if p.api_key is None:
            if path in KEY_ALWAYS:
                return _error(403, f"{path} is disabled: this server has no API key (start it with --api-key or "
                                   f"{API_KEY_ENV} to accept feedback from clients holding the key)",
                              "feedback_disabled")
            return None
        given = None
        if authorization is not None:
            scheme, _, token = authorization.partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else ""
        if given is None and not needs:
            return None
        if given is None or not hmac.compare_digest(given.encode("utf-8", "replace"), p.api_key.encode("utf-8")):
            what = "a valid API key" if given else "an API key"
            return _error(401, f"{path} needs {what}: send 'Authorization: Bearer <key>'", "invalid_api_key",
                          [(b"www-authenticate", b"Bearer")])
        return None
