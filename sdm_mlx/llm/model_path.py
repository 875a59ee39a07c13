"""Where an LLM ``--model`` argument points: an existing mlx-lm directory, or a Hugging Face hub id.

Every verb that loads an LLM (``embed``, ``generate``, ``chat``, ``serve``, ``mcp``, ``network-train``,
``make-verification-data``) goes through :func:`sdm_mlx.llm.embed.load_model` / ``load_tokenizer``, which call
:func:`check_model_reference` first and run the hub download under :func:`hub_errors_as_not_found`.  A
reference that is neither an existing directory nor a hub id that can be reached raises
:class:`~sdm_mlx.errors.ModelNotFoundError` ("model not found: PATH (...)", exit 2) instead of the hub
client's validation or connection error.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from ..errors import ModelNotFoundError

HUB_HINT = "no such directory; hub ids need network access"


def _is_hub_id(text: str) -> bool:
    """True if ``text`` is spelled as a hub repository id (``name`` or ``namespace/name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def check_model_reference(path_or_id) -> str:
    """The local directory (user-expanded) or the hub id to load; :class:`ModelNotFoundError` when it is a
    file, or a path that does not exist and cannot be a hub id (``runs/tiny/model``, ``./m``, ``~/m``)."""
    from ..storage.path_hints import wrong_kind_hint

    text = str(path_or_id)
    expanded = os.path.expanduser(text)
    hint = wrong_kind_hint(expanded, "llm")
    if os.path.isdir(expanded):
        missing = [name for name in ("config.json",) if not os.path.isfile(os.path.join(expanded, name))]
        if not missing and not any(n.endswith(".safetensors") for n in os.listdir(expanded)):
            missing = ["the weights (*.safetensors)"]
        if missing:  # never let mlx-lm's "cannot open config.json" suggest a write
            raise ModelNotFoundError(f"{text} is not an mlx-lm model directory: {', '.join(missing)} is missing "
                                     "(an mlx-lm model directory holds config.json, the weights *.safetensors and "
                                     "the tokenizer files)" + (f"; {hint}" if hint else ""))
        return expanded
    if os.path.exists(expanded):
        raise ModelNotFoundError(f"model not found: {text} (a file, not a model directory)" + (f"; {hint}" if hint else ""))
    if text.startswith(("/", ".", "~")) or not _is_hub_id(text):
        raise ModelNotFoundError(f"model not found: {text} ({HUB_HINT})" + (f"; {hint}" if hint else ""))
    return text


@contextmanager
def hub_errors_as_not_found(reference: str):
    """Turn the hub client's "no such repository / not cached and offline" errors for ``reference`` into
    :class:`ModelNotFoundError`; every other error passes through."""
    from huggingface_hub import errors as hub

    try:
        yield
    except (hub.HFValidationError, hub.RepositoryNotFoundError, hub.LocalEntryNotFoundError,
            hub.RevisionNotFoundError, hub.GatedRepoError) as e:
        from ..storage.path_hints import wrong_kind_hint

        hint = wrong_kind_hint(reference, "llm")  # a typo of a local directory: its close names
        raise ModelNotFoundError(f"model not found: {reference} ({HUB_HINT}; the hub client said "
                                 f"{type(e).__name__})" + (f"; {hint}" if hint else "")) from None
