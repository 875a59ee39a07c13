"""Where a verified generator's model comes from, resolved once: :class:`ModelSources`.

``sdm-mlx generate``, ``chat``, ``serve`` and ``mcp`` build one :class:`ModelSources` from their settings
(:meth:`ModelSources.resolve`: the :class:`~.config.GenerationConfig` validated once, the head's
``network_config.json`` read once) and hand it down: the served model's names, the verifier directory that
feedback is written into, and :class:`~.generator.VerifiedGenerator` all read it instead of the files.
No MLX import here, so ``--help`` stays fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import InputError
from .config import GenerationConfig


@dataclass(frozen=True)
class ModelSources:
    """The settings (validated) and what the head directory says (read once).

    Attributes
    ----------
    config : GenerationConfig
        The generation settings, validated.
    head_config : dict or None
        The head's parsed ``network_config.json`` (``base_model`` resolved to the model to load); None without
        a head.
    """

    config: GenerationConfig
    head_config: dict | None = None

    @classmethod
    def resolve(cls, config: GenerationConfig) -> "ModelSources":
        """Validate ``config`` and read its head's ``network_config.json`` (if it names a head)."""
        config.validate()
        return cls.read(config)

    @classmethod
    def read(cls, config: GenerationConfig) -> "ModelSources":
        """Read the head's ``network_config.json`` of an already validated ``config`` (precondition: the caller
        validated it, as ``sdm-mlx``'s option parsing does)."""
        head_config = None
        if config.head is not None:
            from ..network.artifact import read_network_config

            head_config = read_network_config(config.head)
        return cls(config, head_config)

    @property
    def model(self) -> str | None:
        """The model reference to load: ``config.model``, else the head's base model (None: neither)."""
        if self.config.model is not None:
            return self.config.model
        return (self.head_config or {}).get("base_model")

    @property
    def verifier(self) -> str | None:
        """The verifier directory: ``config.verifier``, else the head directory's ``verifier`` entry (absolute)."""
        if self.config.verifier is not None:
            return self.config.verifier
        if self.head_config is None:
            return None
        return os.path.join(os.path.abspath(os.fspath(self.config.head)), self.head_config["verifier"])

    @property
    def head_settings(self) -> dict | None:
        """The head's stored templating settings (the defaults of :meth:`GenerationConfig.templating`)."""
        return (self.head_config or {}).get("settings")

    def names(self, served_model_name: str | None = None) -> tuple[str, list]:
        """``(served model id, other accepted names)`` of the model."""
        path = self.model
        name = served_model_name or os.path.basename(os.path.normpath(str(path))) or str(path)
        return name, [str(path)] if path else []

    def require_model(self) -> str:
        """:attr:`model`, or an ``InputError`` saying what to give."""
        if self.model is None:
            raise InputError("give model_path (or a head whose config names its base model)")
        return self.model

    def require_verifier(self) -> str:
        """:attr:`verifier`, or an ``InputError`` saying what to give."""
        if self.verifier is None:
            raise InputError("give verifier_path (a saved SDMEstimator) or a head directory holding one")
        return self.verifier
