"""``sdm-mlx mcp``: an MCP server on stdio with the tools ``verify(question, answer)``,
``add_feedback(verdict_id, label)`` and ``explain(verdict_id)``.

Loads the model and verification layer once (same options as ``sdm-mlx serve``),
then speaks MCP on stdin/stdout until the client closes stdin (exit 0).  Logs
go to stderr; stdout carries only the protocol.  See :mod:`sdm_mlx.serve.mcp`
and docs/serving.md for a client configuration.
"""

from __future__ import annotations

import sys

from ._common import SETTINGS, add_generation_arguments, add_server_arguments, load_engine

HELP = ("MCP server (stdio) exposing SDM verification to assistants: verify(question, answer), "
        "add_feedback(verdict_id, label), explain(verdict_id)")

__all__ = ["HELP", "SETTINGS", "add_arguments", "run"]


def add_arguments(p) -> None:
    """The generator's model/verifier/prompt options (MCP's verify tool does not generate: no reject policy)."""
    add_generation_arguments(p, policy=False)
    add_server_arguments(p)


def run(args) -> int:
    from ..serve.mcp import create_server, run_stdio

    engine = load_engine(args)
    try:
        print(f"sdm-mlx mcp: {engine.model_id} ready on stdio", file=sys.stderr, flush=True)
        run_stdio(create_server(engine))
    finally:
        engine.close()
    return 0
