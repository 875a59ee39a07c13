"""The tests mirror the package (docs/architecture.md, "Tests"): the test of ``sdm_mlx/x/y.py`` lives in
``tests/x/``, no test file is added at the top of ``tests/`` (only the real-model tier stays there), every
test folder is an ``sdm_mlx`` package or a named cross-cutting folder listed in the map, and no two test files
share a basename (pytest imports them by basename: there is no ``__init__.py`` in ``tests/``)."""

import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: The real-model tier (``-m real_llm``) stays at the top of tests/: the docs run it by these paths.
TOP_LEVEL = {"test_real_llm.py", "test_batch_engine_real.py"}
#: Folders of tests/ that hold no tests.
NOT_TESTS = {"helpers", "data", "__pycache__"}
#: Test folders that cover something other than one ``sdm_mlx/<name>/`` package.
CROSS_CUTTING = {
    "foundation": "the top-level modules sdm_mlx/*.py (results, settings, errors, validation)",
    "cli": "sdm_mlx/cli.py and sdm_mlx/commands/, through the CLI",
    "docs": "README.md and docs/*.md",
    "house": "the house rules: layers and lazy __init__s, this layout",
    "tools": "the scripts in tools/",
}


def _test_files(folder: pathlib.Path, pattern: str = "") -> list[pathlib.Path]:
    """pytest's default ``python_files``: ``test_*.py`` and ``*_test.py``."""
    return sorted({*folder.glob(f"{pattern}test_*.py"), *folder.glob(f"{pattern}*_test.py")})


def _test_folders() -> list[str]:
    return sorted(d.name for d in TESTS.iterdir()
                  if d.is_dir() and d.name not in NOT_TESTS and not d.name.startswith("."))


def test_no_new_test_file_at_the_top_of_tests():
    extra = sorted(p.name for p in _test_files(TESTS) if p.name not in TOP_LEVEL)
    assert not extra, (f"tests/{extra[0]} is at the top of tests/: move it into the folder of the sdm_mlx package "
                       "it tests, tests/<package>/ (the map: docs/architecture.md, section 'Tests')")


def test_every_test_folder_mirrors_a_package_and_is_in_the_map():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]
    folders = _test_folders()
    assert "core" in folders and "serve" in folders, folders
    for name in folders:
        assert (ROOT / "sdm_mlx" / name).is_dir() or name in CROSS_CUTTING, (
            f"tests/{name}/ is neither an sdm_mlx package nor a cross-cutting folder: name it after the package "
            "it tests, or add it to CROSS_CUTTING here")
        assert f"`tests/{name}/`" in section, f"tests/{name}/ is missing from the map in docs/architecture.md ('Tests')"
        assert _test_files(TESTS / name, "**/"), f"tests/{name}/ holds no test file"


def test_test_basenames_are_unique():
    names = collections.Counter(p.name for p in _test_files(TESTS, "**/"))
    dupes = sorted(n for n, count in names.items() if count > 1)
    assert not dupes, (f"{dupes} exist in more than one folder of tests/: pytest imports test files by basename, "
                       "so give each a name that says which module it covers")
