"""``sdm-mlx serve``: an OpenAI-compatible HTTP server for verified generation (and the pieces ``sdm-mlx mcp`` shares).

Modules: :mod:`.schema` (request validation, OpenAI error objects),
:mod:`.engine` (the loaded :class:`~sdm_mlx.verified.VerifiedGenerator` on one
worker thread, prompt building), :mod:`.verdicts` (the verdict store, bounded in
records and bytes), :mod:`.guard` (Host, Origin, API key and content-type checks),
:mod:`.limits` (prompt tokens, ``max_tokens`` and body caps), :mod:`.responses` (wire
format of completions, stream chunks and ``X-SDM-*`` headers), :mod:`.app`
(the Starlette routes), :mod:`.server` (uvicorn with clean SIGINT/SIGTERM
shutdown), and :mod:`.mcp` (the same engine as MCP tools over stdio for ``sdm-mlx mcp``).  Usage and
examples: ``docs/serving.md``.

May import: layers 0-7 (up to :mod:`sdm_mlx.verified`); only :mod:`sdm_mlx.commands` imports it.  This
``__init__`` imports nothing.
"""
