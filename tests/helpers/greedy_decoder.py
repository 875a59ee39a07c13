"""A test helper: one prompt at a time through the batched engine, ``GreedyDecoder`` (plain, or joint neg+pos
with a head); the package itself decodes with :class:`sdm_mlx.decoding.batching.DecodeEngine` directly.

``decoder(prompt_ids, max_tokens, on_text=None, *, stop=(), temperature=0.0, sampling=None) -> Decoded``.
Plain decoding picks from the base model's logits (greedy: the tokens of ``mlx_lm.generate``), joint decoding
from ``concat(z_neg, z_pos)`` (token = index mod |V|); stopping, streaming, stop strings and the verifier
features (``features=True``) are the engine's.
"""

from __future__ import annotations

from typing import Callable, Sequence

from sdm_mlx.llm import embed as _embed
from sdm_mlx.decoding.batching import DecodeEngine, DecodeRequest, Decoded
from sdm_mlx.decoding.sampling import SamplingParams


class GreedyDecoder:
    """Decoder of one prompt at a time, plain (``heads=None``) or joint neg+pos (``heads``: ``SDMHeads``).

    ``on_text`` receives readable text segments as tokens arrive.  ``stop_at_delimiter=False`` only stops at
    EOS / max tokens / stop strings.  ``features=True`` also returns the verifier input of prompt + answer
    (``Decoded.features``) pooled from the decoding's own states with at most ``max_length`` positions.
    """

    def __init__(self, model, tokenizer, heads=None, *, delimiter: str = "}", stop_at_delimiter: bool = True,
                 features: bool = False, max_length: int = _embed.DEFAULT_MAX_LENGTH, prefix_cache=False):
        self.engine = DecodeEngine(model, tokenizer, heads=heads, delimiter=delimiter, max_batch=1,
                                   max_length=max_length, prefix_cache=prefix_cache)
        self.model, self.tokenizer, self.heads = model, tokenizer, heads
        self.delimiter, self.stop_at_delimiter = delimiter, stop_at_delimiter
        self.features, self.max_length = bool(features), int(max_length)

    @property
    def mode(self) -> str:
        return self.engine.mode

    def __call__(self, prompt_ids: Sequence[int], max_tokens: int, on_text: Callable[[str], None] | None = None,
                 *, stop: Sequence[str] = (), temperature: float = 0.0,
                 sampling: SamplingParams | None = None) -> Decoded:
        sampling = sampling if sampling is not None else SamplingParams(temperature=float(temperature))
        req = DecodeRequest(list(prompt_ids), int(max_tokens), sampling, tuple(stop or ()),
                            stop_at_delimiter=self.stop_at_delimiter, features=self.features, on_text=on_text)
        return self.engine.run([req])[0]
