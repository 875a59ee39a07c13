"""Disk and JSONL (layer 1): atomic file and JSONL I/O (:mod:`.files`), strict RFC 8259 JSON
(:mod:`.strict_json`), checksummed pickle-free model artifacts (:mod:`.artifact`) under their update lock
(:mod:`.locks`), chunk journals of long passes (:mod:`.journal`), the labelled-rows ``Dataset`` with its
readers, the resumable output and the embedded factcheck data (:mod:`.datasets`), and what a path given as a model
holds (:mod:`.path_hints`: the hint of a wrong-kind model path).

May import: layer 0 (:mod:`sdm_mlx.errors`, :mod:`sdm_mlx.validation`, :mod:`sdm_mlx.runtime`) only.
Nothing is imported until used (PEP 562).
"""

from .._lazy import lazy_exports

_EXPORTS = {"Dataset": "datasets", "read_jsonl": "datasets", "load_factcheck": "datasets",
            "write_jsonl": "files", "iter_jsonl": "files", "save_artifact": "artifact", "load_artifact": "artifact"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
