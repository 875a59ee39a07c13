"""The docs resolve: every paper-map row names a real function that cites its label, and every
``DESIGN #n`` cited in the package exists in docs/design.md."""

import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAPER_MAP = ROOT / "docs" / "paper-map.md"
DESIGN = ROOT / "docs" / "design.md"
ROW = re.compile(r"^\| `(?P<label>[A-Za-z:-]+)` \| [^|]+ \| `(?P<target>[\w.]+:[\w.]+)` \|$")


def _paper_map_rows():
    rows = [m.groupdict() for line in PAPER_MAP.read_text(encoding="utf-8").splitlines() if (m := ROW.match(line))]
    assert len(rows) >= 20, "docs/paper-map.md lost its table"
    return rows


def _resolve(target: str):
    module, qualname = target.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("row", _paper_map_rows(), ids=lambda r: r["label"])
def test_paper_map_row_resolves_and_is_cited(row):
    obj = _resolve(row["target"])
    assert row["label"] in (inspect.getdoc(obj) or ""), f"{row['target']}'s docstring does not cite {row['label']}"


#: a paper label as the package cites it (``equation:q``, ``eq:sdm-loss``, ``alg:...``, ``defn:...``, ``tab:...``)
CITED = re.compile(r"\b(?:eq|equation|alg|defn|tab):[A-Za-z][A-Za-z-]*")


def test_every_cited_paper_label_has_a_row():
    """The repository's own check (no paper needed, so it runs in CI): a label a docstring or comment cites is one
    the map holds, so a reader finds the equation's row and its function."""
    mapped = {r["label"] for r in _paper_map_rows()}
    cited = {}
    for path in (ROOT / "sdm_mlx").rglob("*.py"):
        for label in CITED.findall(path.read_text(encoding="utf-8")):
            cited.setdefault(label, str(path.relative_to(ROOT)))
    assert cited, "no paper labels found: the pattern is stale"
    missing = {label: where for label, where in cited.items() if label not in mapped}
    assert not missing, f"cited but not in docs/paper-map.md: {missing}"


def test_paper_labels_exist_in_the_paper():
    paper = ROOT.parent / "shared" / "paper" / "sdm_paper.tex"
    if not paper.exists():
        pytest.skip("the paper is not beside this checkout")
    labels = set(re.findall(r"\\label\{([^}]+)\}", paper.read_text(encoding="utf-8")))
    missing = [r["label"] for r in _paper_map_rows() if r["label"] not in labels]
    assert not missing


def test_every_cited_design_decision_exists():
    defined = set(re.findall(r"^\| (\d+) \|", DESIGN.read_text(encoding="utf-8"), flags=re.M))
    cited = set()
    for path in (ROOT / "sdm_mlx").rglob("*.py"):
        cited |= set(re.findall(r"DESIGN #(\d+)", path.read_text(encoding="utf-8")))
    assert cited, "no DESIGN citations found: the pattern is stale"
    assert cited <= defined, f"cited but not in docs/design.md: {sorted(cited - defined, key=int)}"
