"""docs/architecture.md's figures are what its own commands print (issue 41, section 3): the import graph's counts
(``python tools/house/import_graph.py --check | tail -1``, shown on the page and in the table's column "today") and the
two lines of ``python tools/house/trace_predict.py`` (warm and ``--cold``).  A change that adds a module or an import,
or changes the calls of ``predict``, fails here until the page says the new figures."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def _run(*args) -> str:
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_import_graph_figures_are_what_its_command_prints():
    last = _run(ROOT / "tools" / "house" / "import_graph.py", "--check").strip().splitlines()[-1]
    sample = re.search(r"```text\n(# \d+ modules[^\n]*)\n```", DOC)
    assert sample and sample.group(1) == last, (sample and sample.group(1), last)
    m = re.fullmatch(r"# (\d+) modules, (\d+) edges \((\d+) at load time\), 0 cycles, 0 upward imports; acyclic and "
                     r"layered", last)
    modules, edges, load = map(int, m.groups())
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in DOC.splitlines() if line.startswith("| ") and line.count("|") == 5}
    assert rows["modules in `sdm_mlx/`"][2] == str(modules), rows["modules in `sdm_mlx/`"]
    assert rows["edges (load time + in functions)"][2] == f"{edges} ({load} + {edges - load})", \
        rows["edges (load time + in functions)"]


def test_the_trace_figures_are_what_the_tool_prints(tmp_path):
    tool = ROOT / "tools" / "house" / "trace_predict.py"
    warm = _run(tool, "--work", tmp_path / "warm").strip().splitlines()[-1]
    cold = _run(tool, "--work", tmp_path / "cold", "--cold").strip().splitlines()[-1]
    for line in (warm, cold):
        figures = re.fullmatch(r"(\d+ sdm_mlx modules, \d+ cross-module calls) \(rc 0\)", line).group(1)
        assert f"`{figures}`" in DOC, (figures, "docs/architecture.md says otherwise")
