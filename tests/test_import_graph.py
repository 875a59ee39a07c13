"""The package's import graph (tools/import_graph.py): acyclic at load time, and the verbs never import
the dispatcher (sdm_mlx/cli.py) or each other — shared CLI pieces live in commands/_common.py."""

import ast
import pathlib
import subprocess
import sys

import import_graph  # tools/ is on pytest's pythonpath

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_load_time_graph_is_acyclic_and_the_tool_prints_it():
    graph = import_graph.import_graph()
    assert import_graph.find_cycle(graph) is None
    assert "calibration.rounds" in graph and "callbacks" in graph["train"]
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py"), "--check"], capture_output=True,
                         text=True)
    assert res.returncode == 0 and res.stdout.strip().endswith("acyclic") and "cli -> " in res.stdout


def test_find_cycle_reports_one():
    assert import_graph.find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every sdm_mlx module a file imports, at load time or inside functions (relative to sdm_mlx)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ["commands"][: max(0, 2 - node.level)]  # files live in sdm_mlx/commands/
            out.add(".".join(base + ([node.module] if node.module else [])))
            if not node.module:
                out |= {".".join(base + [a.name]) for a in node.names}
    return out


def test_verbs_import_neither_the_dispatcher_nor_each_other():
    verbs = {p.stem for p in (ROOT / "sdm_mlx" / "commands").glob("*.py") if not p.stem.startswith("_")}
    for path in (ROOT / "sdm_mlx" / "commands").glob("*.py"):
        mods = _imported_modules(path)
        assert "cli" not in mods, f"{path.name} imports sdm_mlx.cli"
        others = {m for m in mods if m.startswith("commands.") and m.split(".")[1] in verbs - {path.stem}}
        assert not others, f"{path.name} imports other verbs: {others}"
