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

import os
import sys

from ..errors import CLIError
from ._common import add_model_arguments, add_policy_arguments

HELP = "OpenAI-compatible server for verified generation (/v1/chat/completions, /v1/completions, /v1/verify)"


def add_generator_arguments(p) -> None:
    """Model, verifier and generation options shared by ``serve`` and ``mcp`` (dests as ``generate``'s)."""
    add_model_arguments(p)
    p.add_argument("--max-verdicts", type=int, default=1000, help="verdicts kept in memory by id (oldest dropped)")
    p.add_argument("--persist-feedback", action="store_true",
                   help="write every feedback label into the verifier directory too (atomically, with its update "
                        "log); default: feedback lives in memory until the server stops")


def add_arguments(p) -> None:
    add_generator_arguments(p)
    add_policy_arguments(p, per_request=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback only by default)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port, printed on stderr)")
    p.add_argument("--served-model-name", default=None,
                   help="model id of /v1/models and the 'model' field (default: the model directory's name)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (413 beyond)")
    p.add_argument("--quiet", action="store_true", help="no access log")


def model_names(args) -> tuple[str, list]:
    """``(served model id, other accepted names)`` from the options."""
    path = args.model
    if path is None and args.head:
        from ..network.artifact import read_network_config

        path = read_network_config(args.head)["base_model"]
    name = args.served_model_name or os.path.basename(os.path.normpath(str(path))) or str(path)
    return name, [str(path)] if path else []


def load_engine(args):
    """Validate the options and load the :class:`~sdm_mlx.serve.engine.Engine` (CLIError on bad ones)."""
    from .generate import build_generator

    if args.max_verdicts < 1:
        raise CLIError("--max-verdicts must be >= 1")
    if args.n_exemplars < 0:
        raise CLIError("--n-exemplars must be >= 0")
    for name in ("verifier", "head"):
        path = getattr(args, name)
        if path and not os.path.isdir(path):
            raise CLIError(f"--{name} {path}: no such directory")
    defaults = {"on_reject": "abstain", "max_attempts": 3, "reask_fallback": "abstain", "reask_template": None,
                "served_model_name": None}  # options of serve that mcp does not have
    for k, v in defaults.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    from ..serve.engine import Engine

    name, aliases = model_names(args)
    return Engine(lambda: build_generator(args), name, aliases=aliases, max_verdicts=args.max_verdicts,
                  persist_feedback=verifier_directory(args) if getattr(args, "persist_feedback", False) else None)


def verifier_directory(args) -> str:
    """The verifier directory in use: ``--verifier``, else the head's ``verifier`` entry."""
    if args.verifier:
        return os.path.abspath(args.verifier)
    if not args.head:
        raise CLIError("--persist-feedback needs --verifier or --head (the directory to write feedback into)")
    from ..network.artifact import read_network_config

    return os.path.join(os.path.abspath(args.head), read_network_config(args.head)["verifier"])


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
