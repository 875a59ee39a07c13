"""The embedded data and the JSONL rows, under the public path ``sdm_mlx.data`` (kept since the first release).

This folder ships the true/false statements of Azaria & Mitchell (2023) with Mixtral features
(``FACTCHECK_README.md``).  The names below live in :mod:`sdm_mlx.storage.datasets` (the layer that reads and
writes rows); this package only makes them importable from here, lazily (PEP 562).  May import: the storage layer.
"""

from .._lazy import lazy_exports

_EXPORTS = {name: ".storage.datasets" for name in (
    "Dataset", "read_jsonl", "parse_rows", "read_objects", "id_key", "load_factcheck", "factcheck_splits",
    "stratified_split", "FEATURE_CHOICES", "FACTCHECK_TOPICS", "FACTCHECK_SHIFTED", "FACTCHECK_CITATION",
    "FACTCHECK_CLASS_NAMES", "FACTCHECK_ZIP",
)}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
