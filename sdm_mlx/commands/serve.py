"""``sdm-mlx serve``: an OpenAI-compatible HTTP server for verified generation (docs/serving.md).

Loads the model, the verification layer (and optional positive head) once,
then serves ``/v1/chat/completions``, ``/v1/completions`` (streaming and not),
``/v1/models``, ``/v1/verify`` and ``/v1/verdicts/{id}`` on ``--host:--port``
(127.0.0.1 by default).  Every completion carries ``choices[0].verification``
and ``X-SDM-*`` headers; ``--on-reject`` / ``--max-attempts`` set the policy,
which a request overrides with ``"sdm": {"on_reject": ..., "max_attempts": ...}``.
Requests are queued on one model thread.  Access: loopback ``Host`` names only,
no CORS, ``application/json`` POSTs, ``/v1/feedback`` only with ``--api-key``
(``SDM_MLX_API_KEY``), which ``--persist-feedback`` requires; work per request is
bounded (``--max-prompt-tokens``, ``--max-tokens-limit``, ``--max-body-bytes``,
``--body-timeout``; see docs/serving.md, "Threat model").  Ctrl-C / SIGTERM shut down cleanly
(exit 0).  Prints ``sdm-mlx serve: listening on http://HOST:PORT`` on stderr
once ready (``--port 0`` picks a free port).
"""

from __future__ import annotations

import os
import sys

from ..errors import CLIError
from ._common import SETTINGS, add_generation_arguments, add_server_arguments, load_engine

HELP = "OpenAI-compatible server for verified generation (/v1/chat/completions, /v1/completions, /v1/verify)"

__all__ = ["HELP", "SETTINGS", "add_arguments", "run"]


def add_arguments(p) -> None:
    from ..verified.config import add_sampling_arguments

    add_generation_arguments(p, per_request=True)
    add_sampling_arguments(p, per_request=True)
    add_server_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback only by default)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port, printed on stderr)")
    p.add_argument("--served-model-name", default=None,
                   help="model id of /v1/models and the 'model' field (default: the model directory's name)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (413 beyond)")
    p.add_argument("--quiet", action="store_true", help="no access log")
    add_access_arguments(p)


def add_access_arguments(p) -> None:
    """Who may call the server and how much work one request may cause (docs/serving.md, "Threat model")."""
    from ..serve.limits import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_TOKENS_LIMIT

    g = p.add_argument_group("access and limits")
    g.add_argument("--api-key", default=None,
                   help="API key clients send as 'Authorization: Bearer KEY', visible ASCII characters only "
                        "(default: $SDM_MLX_API_KEY); /v1/feedback and --persist-feedback need one")
    g.add_argument("--api-key-routes", choices=["feedback", "all"], default="feedback",
                   help="routes that need the key: feedback (/v1/feedback only) or all (every /v1 route)")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also accept this Host header name, besides the loopback names and --host (repeatable; "
                        "'*' = any)")
    g.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow cross-origin browser requests from ORIGIN (repeatable; '*' = any; none by default)")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens (400 beyond, before any model work); default: the model's context")
    g.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_TOKENS_LIMIT,
                   help="largest max_tokens a request may ask for (400 beyond)")
    g.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                   help="seconds to receive a request body (408 beyond)")
    g.add_argument("--max-verdict-bytes", type=int, default=64 << 20,
                   help="memory budget of the verdicts kept by id (oldest dropped beyond it)")


def api_key(args) -> str | None:
    """``--api-key``, else ``$SDM_MLX_API_KEY``, else None (an empty key is refused)."""
    from ..serve.guard import API_KEY_ENV

    from ..serve.guard import key_problem

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise CLIError(f"--api-key / {API_KEY_ENV} is empty; give a non-empty key")
    problem = None if key is None else key_problem(key)
    if problem is not None:
        raise CLIError(f"{'--api-key' if args.api_key is not None else API_KEY_ENV}: {problem}")
    return key


def check_access_arguments(args) -> None:
    """Refuse inconsistent access and limit options before the model loads."""
    for name in ("max_tokens_limit", "max_verdict_bytes"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise CLIError("--max-prompt-tokens must be >= 1")
    if not args.body_timeout > 0:
        raise CLIError("--body-timeout must be > 0")
    key = api_key(args)  # a key no client could send: exit 2 before the model loads
    if args.persist_feedback and key is None:
        raise CLIError("--persist-feedback writes client feedback to disk: it needs --api-key (or SDM_MLX_API_KEY) "
                       "so that only clients holding the key can change the verifier")


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 1:
        raise CLIError("--max-body-bytes must be >= 1")
    check_access_arguments(args)
    from ..verified.config import sampling_params

    sampling = sampling_params(args)  # bad sampling flags: exit 2 before the model loads
    from ..serve.app import create_app
    from ..serve.guard import AccessPolicy
    from ..serve.limits import RequestLimits
    from ..serve.server import bind, serve

    policy = AccessPolicy.for_listen_address(args.host, args.allowed_host, api_key=api_key(args),
                                             key_routes=args.api_key_routes,
                                             cors_origins=frozenset(args.cors_origin))
    engine = load_engine(args)
    try:
        engine.verdicts.max_bytes = args.max_verdict_bytes
        if engine.settings.max_tokens > args.max_tokens_limit:
            raise CLIError(f"--max-tokens {engine.settings.max_tokens} exceeds --max-tokens-limit {args.max_tokens_limit}")
        context = engine.context_length
        limits = RequestLimits(max_prompt_tokens=min(args.max_prompt_tokens or context, context),
                               max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
                               body_timeout=args.body_timeout)
        try:
            sock = bind(args.host, args.port)
        except OSError as e:
            raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"sdm-mlx serve: {engine.model_id} ({engine.decoding} decoding, on_reject={engine.settings.on_reject}) "
              f"listening on http://{shown}:{port}", file=sys.stderr, flush=True)
        serve(create_app(engine, limits=limits, policy=policy, sampling=sampling), sock, access_log=not args.quiet,
              log_level="warning" if args.quiet else "info", on_exit=engine.closing.set)
    finally:
        engine.close()
    print("sdm-mlx serve: stopped", file=sys.stderr, flush=True)
    return 0
