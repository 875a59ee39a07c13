"""Batched decoding: the one decoding loop of the package (continuous batching of plain and joint neg+pos
decoding with per-request stops, sampling and cancellation; the shared prompt prefix prefilled once).

Modules: :mod:`.batching` (``DecodeEngine``), :mod:`.decode_types` (``DecodeRequest``, ``Decoded``),
:mod:`.sampling` (``SamplingParams``), :mod:`.prompt_cache` (``PrefixCache``), :mod:`.streaming` (stop strings
and streamed text).

May import: layers 0-6 (the language-model features of :mod:`sdm_mlx.llm`, the answer rules of
:mod:`sdm_mlx.llm.answers` and the LM head's dimensions in :mod:`sdm_mlx.llm.model`) and mlx-lm, never
:mod:`sdm_mlx.network`: ``network.generation`` (Alg. 4's decoding) and ``verified`` (verified generation) decode
through it.  Nothing is imported until used (PEP 562).
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "DecodeEngine": "batching", "DecodeRequest": "decode_types", "Decoded": "decode_types",
    "STOP_REASONS": "decode_types", "SamplingParams": "sampling", "PrefixCache": "prompt_cache",
    "decodes_in_batches": "batch_plan",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
