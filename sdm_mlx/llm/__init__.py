"""What sdm_mlx reads from a language model (layer 2): chat templating, tokens and the positions the
features are taken at (:mod:`.tokens`), the kept positions and the DESIGN #21 pooling (:mod:`.pooling`),
hidden-state features of documents and generations (:mod:`.embed`), verification training data built from a
model's own answers (:mod:`.verification_data`), and features from an OpenAI-compatible API
(:mod:`.api_features`).

May import: layers 0-1 (:mod:`sdm_mlx.errors`, :mod:`sdm_mlx.validation`, :mod:`sdm_mlx.runtime`,
:mod:`sdm_mlx.storage`) and mlx-lm.  Nothing is imported until used (PEP 562), so reading its constants does
not load MLX.
"""

from .._lazy import lazy_exports

_EXPORTS = {"load_model": "embed", "encode": "tokens", "chat_text": "tokens"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
