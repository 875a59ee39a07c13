"""Who may call the server: Host allow-list, origin (CORS), JSON content type, API key (ASGI middleware).

Checked on every HTTP request, before routing, in this order (the threat model is in ``docs/serving.md``):

1. **Host**: the ``Host`` header must be exactly one of the allowed names (loopback names and the address
   the server listens on, by default; ``--allowed-host``, ``*`` for any) with an optional port, as RFC 3986
   writes an authority without user information (:func:`host_name`): a DNS-rebinding page whose name
   resolves to this server sends its own name and gets 403, and so does ``[::1]attacker.example``,
   ``[::1].evil.example:80`` or ``localhost:80@evil.example``.
2. **Origin**: a request carrying an ``Origin`` header (a browser's cross-site request) is refused
   with 403 unless that origin was allowed with ``--cors-origin``; allowed origins get CORS headers and
   answered preflights (``OPTIONS``).
3. **API key**: with ``--api-key`` (or ``SDM_MLX_API_KEY``), ``Authorization: Bearer <key>`` as the
   OpenAI API takes it (compared as bytes: the header's bytes with the key's UTF-8; ``sdm-mlx serve`` only
   takes keys of visible ASCII characters, :func:`key_problem`, as HTTP clients send headers in ASCII).
   ``/v1/feedback`` (which changes verdicts) always needs it — without a key
   configured the route is refused — and, with ``--api-key-routes all``, every ``/v1`` route needs it.
   A wrong key is refused on every route (401).
4. **Content type**: a ``POST`` must be ``Content-Type: application/json`` (415 otherwise), which a
   browser cannot send cross-site without a CORS preflight.
"""

from __future__ import annotations

import hmac
import json
import re
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
        if host not in ("0.0.0.0", "::", ""):
            extra.add(host.lower())
        names = set(LOOPBACK_HOSTS) | {f"[{h}]" if ":" in h and not h.startswith("[") else h for h in extra}
        return cls(allowed_hosts=frozenset(names), **kw)


#: a ``Host`` header: RFC 3986's host (an IP literal in brackets, or an IPv4 address / registered name: unreserved
#: characters, percent escapes and sub-delimiters) and an optional port of digits, nothing else (no user
#: information, no text after the closing bracket)
_HOST = re.compile(r"(?P<host>\[[0-9a-f:.]+\]|\[v[0-9a-f]+\.[a-z0-9._~!$&'()*+,;=:-]+\]|[a-z0-9._~!$&'()*+,;=%-]+)"
                   r"(?::(?P<port>[0-9]{1,5}))?")


def host_name(header: str) -> str | None:
    """The host part of a ``Host`` header, lower case (port removed; IPv6 kept in brackets), or None when the
    header is not a host with an optional port (RFC 3986): ``[::1]attacker.example``, ``localhost:80@evil``,
    an unbracketed IPv6 address, a port that is not a number up to 65535."""
    m = _HOST.fullmatch(header.strip().lower())
    if m is None or (m["port"] is not None and int(m["port"]) > 65535):
        return None
    return m["host"]


def key_problem(key: str) -> str | None:
    """Why ``key`` cannot be an API key clients send (None: it can): an HTTP header carries ASCII, and
    ``Authorization: Bearer <key>`` ends at whitespace, so only visible ASCII characters can arrive intact."""
    bad = sorted({c for c in key if not "\x21" <= c <= "\x7e"})
    if not bad:
        return None
    shown = ", ".join(repr(c) for c in bad[:5])
    return (f"the API key holds {shown}: clients send it in an HTTP header, which carries visible ASCII "
            "characters only (letters, digits, punctuation; no spaces or accents); choose such a key")


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
        if host is not None and p.allowed_hosts is not None and (host_name(host) or "") not in p.allowed_hosts:
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
        # the header's own bytes (latin-1 undoes the decoding above) against the key's UTF-8 bytes
        if given is None or not hmac.compare_digest(given.encode("latin-1"), p.api_key.encode("utf-8")):
            what = "a valid API key" if given else "an API key"
            return _error(401, f"{path} needs {what}: send 'Authorization: Bearer <key>'", "invalid_api_key",
                          [(b"www-authenticate", b"Bearer")])
        return None
