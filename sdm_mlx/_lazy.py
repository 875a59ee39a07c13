"""Lazy package exports (PEP 562), shared by ``sdm_mlx`` and its subpackages.

A package ``__init__`` declares ``{public name: submodule}`` and calls :func:`lazy_exports`; the submodule is
imported on first attribute access, so importing a package (for example to read a configuration at
``sdm-mlx --help``) does not import MLX.  This module imports nothing from sdm_mlx.
"""

from __future__ import annotations

import importlib
import importlib.util


def lazy_exports(package: str, exports: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package`` that import ``exports[name]`` (a submodule) on first use."""

    def __getattr__(name: str):
        if name not in exports:
            if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")  # a submodule: pkg.sub works without import
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__():
        return sorted(set(vars(importlib.import_module(package))) | set(exports))

    return __getattr__, __dir__
