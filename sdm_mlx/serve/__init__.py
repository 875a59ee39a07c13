"""``sdm-mlx serve``: an OpenAI-compatible HTTP server for verified generation (and the pieces ``sdm-mlx mcp`` shares).

Modules: :mod:`.schema` (request validation, OpenAI error objects),
:mod:`.engine` (the loaded :class:`~sdm_mlx.verified.VerifiedGenerator` on one
worker thread, prompt building), :mod:`.verdicts` (the verdict store, bounded in
records and bytes), :mod:`.guard` (Host, Origin, API key and content-type checks),
:mod:`.limits` (prompt tokens, ``max_tokens`` and body caps), :mod:`.responses` (wire
format of completions, stream chunks and ``X-SDM-*`` headers), :mod:`.app`
(the Starlette routes), :mod:`.server` (uvicorn with clean SIGINT/SIGTERM
shutdown).  Usage and examples: ``docs/serving.md``.
"""
