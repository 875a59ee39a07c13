"""Every ``sdm_mlx`` path the docs and docstrings name resolves: ``module:name`` targets and dotted
``sdm_mlx.x.y`` references in docs/*.md, README.md and the package's docstrings and comments."""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"(?<![\w./-])(sdm_mlx(?:\.[A-Za-z_]\w*)*)(?::([A-Za-z_][\w.]*))?")


def _sources():
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield ROOT / "README.md"
    yield from sorted((ROOT / "sdm_mlx").rglob("*.py"))


def _references() -> dict[str, list[str]]:
    """{reference: [where]} over every source file."""
    found: dict[str, list[str]] = {}
    for path in _sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in REFERENCE.finditer(line):
                if line[m.end():m.end() + 1] in ("/", "*") or line[:m.start()].endswith(("-m ", "import ")):
                    continue  # a path (sdm_mlx/data), a glob, or code that the import itself checks
                ref = m.group(1) + (f":{m.group(2)}" if m.group(2) else "")
                found.setdefault(ref.rstrip("."), []).append(f"{path.relative_to(ROOT)}:{n}")
    return found


def resolve(ref: str):
    """The object a reference names: ``pkg.mod:Class.attr`` or ``pkg.mod.Class.attr``."""
    dotted, _, qualname = ref.partition(":")
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not ".".join(parts[:i]).startswith(e.name):
                raise  # a third-party import failed, not the path
            continue
        for attr in parts[i:] + (qualname.split(".") if qualname else []):
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(ref)


REFS = _references()


def test_the_docs_name_some_paths():
    assert len(REFS) > 50 and "sdm_mlx.estimator:SDMEstimator" in REFS or "sdm_mlx.estimator.SDMEstimator" in REFS


@pytest.mark.parametrize("ref", sorted(REFS))
def test_reference_resolves(ref):
    try:
        resolve(ref)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{ref} (named in {', '.join(REFS[ref][:3])}) does not resolve: {e}")


def test_a_dangling_reference_fails():
    with pytest.raises((ImportError, AttributeError)):
        resolve("sdm_mlx.estimator:NoSuchThing")
    with pytest.raises((ImportError, AttributeError)):
        resolve("sdm_mlx.no_such_module.x")
