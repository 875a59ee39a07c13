"""The order in which the default run hands test files to pytest-xdist's workers: the dearest first.

``--dist loadfile`` sends each file whole to one worker, in the order of the collection when
``--no-loadscope-reorder`` is given (pyproject.toml), and a worker that finishes a file takes the next one.  With the
few long files (a trained network, ``mlx.launch`` runs, the documentation pages) handed out first and the many short
ones after, the two workers finish within a short file of each other instead of one of them running a long file
alone at the end (longest-first scheduling).  :data:`COST` holds the measured CPU seconds of the long files (the
``cpu`` of the per-file lines, tests/helpers/file_lines.py); a file not listed counts as short.  The figures only
order the files: stale ones cost some balance, never a test.
"""

from __future__ import annotations

#: CPU seconds of a file in the default run (tests/helpers/file_lines.py's ``cpu``), the long ones only: measured in a
#: full run at load 12-16 (2 cores), less the tests since moved to ``-m slow`` and the quicker documentation pages
COST = {
    "tests/docs/test_doc_blocks.py": 80,
    "tests/cli/test_hostile.py": 58,
    "tests/network/test_network_resume.py": 42,
    "tests/index/test_sharded.py": 37,
    "tests/estimator/test_estimator.py": 38,
    "tests/core/test_adaptor_normalization.py": 37,
    "tests/estimator/test_defaults.py": 36,
    "tests/network/test_network_train.py": 36,
    "tests/estimator/test_feedback.py": 34,
    "tests/serve/test_hostile_server.py": 28,
    "tests/calibration/test_nested.py": 26,
    "tests/cli/test_user_errors.py": 24,
    "tests/storage/test_io_safety.py": 21,
    "tests/verified/test_generate.py": 20,
    "tests/house/test_import_graph.py": 20,
    "tests/estimator/test_scale.py": 19,
    "tests/network/test_host_step.py": 17,
    "tests/network/test_data_parallel.py": 15,
    "tests/serve/test_html_serve.py": 15,
    "tests/serve/test_serve.py": 15,
}


def heaviest_first(items: list) -> None:
    """Reorder ``items`` in place: files by :data:`COST`, dearest first (a stable sort: the collection order
    otherwise, and the tests of a file stay in their order)."""
    items.sort(key=lambda item: -COST.get(item.nodeid.split("::", 1)[0], 0))
