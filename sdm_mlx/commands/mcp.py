"""``sdm-mlx mcp``: an MCP server on stdio with the tools ``verify(question, answer)``,
``add_feedback(verdict_id, label)`` and ``explain(verdict_id)``.

Loads the model and verification layer once (same options as ``sdm-mlx serve``),
then speaks MCP on stdin/stdout until the client closes stdin (exit 0).  Logs
go to stderr; stdout carries only the protocol.  See :mod:`sdm_mlx.mcp_server`
and docs/serving.md for a client configuration.
"""

from __future__ import annotations

import sys

HELP = ("MCP server (stdio) exposing SDM verification to assistants: verify(question, answer), "
        "add_feedback(verdict_id, label), explain(verdict_id)")


def add_arguments(p) -> None:
    from .serve import add_generator_arguments

    add_generator_arguments(p)


def run(args) -> int:
    from ..mcp_server import create_server
    from .serve import load_engine

    engine = load_engine(args)
    try:
        print(f"sdm-mlx mcp: {engine.model_id} ready on stdio", file=sys.stderr, flush=True)
        create_server(engine).run("stdio")
    finally:
        engine.close()
    return 0
