"""``sdm-mlx serve``: an OpenAI-compatible HTTP server for verified generation (docs/serving.md).

Loads the model, the verification layer (and optional positive head) once,
then serves ``/v1/chat/completions``, ``/v1/completions`` (streaming and not),
``/v1/models``, ``/v1/verify`` and ``/v1/verdicts/{id}`` on ``--host:--port``
(127.0.0.1 by default).  Every completion carries ``choices[0].verification``
and ``X-SDM-*`` headers; ``--on-reject`` / ``--max-attempts`` set the policy,
which a request overrides with ``"sdm": {"on_reject": ..., "max_attempts": ...}``.
Requests are queued on one model thread.  Ctrl-C / SIGTERM shut down cleanly
(exit 0).  Prints ``sdm-mlx serve: listening on http://HOST:PORT`` on stderr
once ready (``--port 0`` picks a free port).
"""

from __future__ import annotations

import sys

from ..errors import CLIError
from ._common import SETTINGS, add_generation_arguments, add_server_arguments, load_engine

HELP = "OpenAI-compatible server for verified generation (/v1/chat/completions, /v1/completions, /v1/verify)"

__all__ = ["HELP", "SETTINGS", "add_arguments", "run"]


def add_arguments(p) -> None:
    add_generation_arguments(p, per_request=True)
    add_server_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback only by default)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port, printed on stderr)")
    p.add_argument("--served-model-name", default=None,
                   help="model id of /v1/models and the 'model' field (default: the model directory's name)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (413 beyond)")
    p.add_argument("--quiet", action="store_true", help="no access log")


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 1:
        raise CLIError("--max-body-bytes must be >= 1")
    from ..serve.app import create_app
    from ..serve.server import bind, serve

    engine = load_engine(args)
    try:
        try:
            sock = bind(args.host, args.port)
        except OSError as e:
            raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"sdm-mlx serve: {engine.model_id} ({engine.gen.decoding} decoding, on_reject={engine.gen.on_reject}) "
              f"listening on http://{shown}:{port}", file=sys.stderr, flush=True)
        serve(create_app(engine, max_body_bytes=args.max_body_bytes), sock, access_log=not args.quiet,
              log_level="warning" if args.quiet else "info", on_exit=engine.closing.set)
    finally:
        engine.close()
    print("sdm-mlx serve: stopped", file=sys.stderr, flush=True)
    return 0
