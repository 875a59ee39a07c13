"""Print the module-level import graph of ``sdm_mlx`` as text.

Usage::

    python tools/import_graph.py            # one line per module: "module -> dep, dep"
    python tools/import_graph.py --check    # also fail (exit 1) if the graph has a cycle

Only imports executed when the module is loaded count (top-level ``import``/``from``
statements, including those under ``if``/``try`` at module level, except ``if TYPE_CHECKING:``);
imports inside functions are deferred and do not create a load-time edge. Names are relative to ``sdm_mlx`` and
packages print as ``pkg/``. Only edges inside ``sdm_mlx`` are shown. The source is parsed
with :mod:`ast`, so nothing is imported.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "sdm_mlx"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def module_name(path: Path) -> str:
    """Dotted name of a source file relative to the package root ("" for the root)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _top_level_imports(tree: ast.Module):
    """Import nodes run at load time: module body, descending into if/try/with, not defs."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)  # type-only imports never run
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)


def _resolve(node: ast.AST, here: str, is_pkg: bool, known: set[str]) -> set[str]:
    """Internal modules named by one import statement."""
    targets: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                targets.add(alias.name[len(PACKAGE) + 1:])
        return {t for t in targets if t in known}
    if node.level == 0:
        if not (node.module or "").startswith(PACKAGE):
            return set()
        base = (node.module or "")[len(PACKAGE) + 1:]
    else:
        parts = here.split(".") if here else []
        if not is_pkg:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        targets.add(sub if sub in known else base)
    return {t for t in targets if t in known and t != here}


def import_graph() -> dict[str, list[str]]:
    """``{module: sorted internal modules it imports at load time}``."""
    files = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    known = set(files)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        deps: set[str] = set()
        for node in _top_level_imports(tree):
            deps |= _resolve(node, name, path.name == "__init__.py", known)
        graph[name] = sorted(deps)
    return graph


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None when the graph is acyclic."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in graph.get(node, []):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in graph:
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _label(name: str, graph: dict[str, list[str]]) -> str:
    is_pkg = any(other.startswith(name + ".") for other in graph) if name else True
    return (name or "(sdm_mlx)") + ("/" if is_pkg and name else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if there is a cycle")
    args = parser.parse_args(argv)
    graph = import_graph()
    for name, deps in graph.items():
        shown = [d or "(sdm_mlx)" for d in deps]
        print(f"{_label(name, graph)} -> {', '.join(shown) if shown else '-'}")
    edges = sum(len(d) for d in graph.values())
    cycle = find_cycle(graph)
    print(f"# {len(graph)} modules, {edges} load-time edges, "
          + ("acyclic" if cycle is None else "CYCLE: " + " -> ".join(cycle)))
    return 1 if (args.check and cycle) else 0


if __name__ == "__main__":
    sys.exit(main())
