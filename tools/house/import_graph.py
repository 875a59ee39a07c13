"""Print the module-level import graph of ``sdm_mlx`` as text, and check it against the declared layers.

Usage::

    python tools/house/import_graph.py            # one line per module: "module -> dep, dep (deferred: dep)"
    python tools/house/import_graph.py --check    # also fail (exit 1) on a cycle or an import that points up a layer
    python tools/house/import_graph.py --stats    # one line: modules, edges, cycles, upward imports

Both kinds of import count: those run when the module is loaded (module body, including ``if``/``try`` at
module level, except ``if TYPE_CHECKING:``) and those deferred inside functions -- a deferred import is still a
dependency, and a cycle through one is still a cycle.  Names are relative to ``sdm_mlx``; packages print as
``pkg/``.  An import of a module's own package (``from . import x`` resolving to the ``__init__``) is not an
edge: the package ``__init__``s are lazy.  Only edges inside ``sdm_mlx`` are shown.  The source is parsed with
:mod:`ast`, so nothing is imported.

:data:`LAYERS` is the declared order (docs/architecture.md draws it): a module may import its own layer and
the layers below it, never a layer above.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "sdm_mlx"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

#: The layers, bottom first: (name, module prefixes relative to sdm_mlx).  "" is the root ``__init__``.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("_lazy", "errors", "results", "settings", "validation", "runtime")),
    ("storage", ("storage", "data")),
    ("primitives", ("core", "index", "llm")),
    ("calibration", ("calibration",)),
    ("estimator", ("estimator",)),
    ("evaluation", ("evaluation",)),
    ("network", ("network", "decoding")),
    ("verified", ("verified",)),
    ("serve", ("serve",)),
    ("pipeline", ("pipeline",)),
    ("cli", ("commands", "cli", "__main__", "")),
]


def module_name(path: Path, root: Path = ROOT) -> str:
    """Dotted name of a source file relative to the package root ("" for the root)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(tree: ast.Module):
    """(import node, deferred?) for every import: the module body (descending into if/try/with) runs at load
    time; anything inside a function or class body's function runs later."""
    stack = [(node, False) for node in tree.body]
    while stack:
        node, deferred = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, deferred
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend((n, deferred) for n in node.orelse)  # type-only imports never run
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend((n, True) for n in ast.iter_child_nodes(node))
        else:
            stack.extend((n, deferred) for n in ast.iter_child_nodes(node))


def lazy_exports(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """``{package: {name: defining module}}`` read from the ``_EXPORTS`` table of each lazy ``__init__``."""
    out = {}
    for init in root.rglob("__init__.py"):
        pkg = module_name(init, root)
        for node in ast.parse(init.read_text(encoding="utf-8")).body:
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets)
                    and isinstance(node.value, ast.Dict)):
                table = {k.value: v.value for k, v in zip(node.value.keys, node.value.values)
                         if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
                out[pkg] = {k: ".".join(p for p in (pkg, v) if p) for k, v in table.items()}
    return out


def _resolve(node: ast.AST, here: str, is_pkg: bool, known: set[str], lazy: dict | None = None) -> set[str]:
    """Internal modules named by one import statement (not ``here`` and not its own packages).  A name that a
    lazy package ``__init__`` exports (:func:`lazy_exports`) resolves to the module that defines it."""
    targets: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                targets.add(alias.name[len(PACKAGE) + 1:])
        return {_known_prefix(t, known) for t in targets} - {None, here} - _ancestors(here)
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
        if sub not in known and alias.name in (lazy or {}).get(base, {}):
            sub = lazy[base][alias.name]
        targets.add(_known_prefix(sub, known))
    return targets - {None, here} - _ancestors(here)


def _known_prefix(name: str, known: set[str]) -> str | None:
    while name not in known:
        if "." not in name:
            return None
        name = name.rpartition(".")[0]
    return name


def _ancestors(name: str) -> set[str]:
    parts = name.split(".") if name else []
    return {".".join(parts[:i]) for i in range(len(parts))}


def import_edges(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """``{module: {dep: "load" | "deferred"}}`` (``"load"`` when any import of ``dep`` runs at load time)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    lazy = lazy_exports(root)
    out: dict[str, dict[str, str]] = {}
    for name, path in files.items():
        deps: dict[str, str] = {}
        for node, deferred in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            for dep in _resolve(node, name, path.name == "__init__.py", known, lazy):
                if not deferred or dep not in deps:
                    deps[dep] = "deferred" if deferred else "load"
        out[name] = dict(sorted(deps.items()))
    return out


def import_graph(root: Path = ROOT, deferred: bool = True) -> dict[str, list[str]]:
    """``{module: sorted internal modules it imports}``; ``deferred=False`` keeps load-time imports only."""
    return {m: [d for d, kind in deps.items() if deferred or kind == "load"] for m, deps in import_edges(root).items()}


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


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, []):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            connect(v)
    return out


def layer_of(module: str) -> int | None:
    """Index into :data:`LAYERS` of a module (None: undeclared)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            hit = module == prefix or (prefix and module.startswith(prefix + "."))
            if hit and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def upward_imports(graph: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(module, dep) pairs where ``dep`` sits in a higher layer than ``module``."""
    return [(m, d) for m, deps in graph.items() for d in deps
            if layer_of(m) is not None and layer_of(d) is not None and layer_of(d) > layer_of(m)]


def undeclared(graph: dict[str, list[str]]) -> list[str]:
    return [m for m in graph if layer_of(m) is None]


def _label(name: str, graph: dict) -> str:
    is_pkg = any(other.startswith(name + ".") for other in graph) if name else True
    return (name or "(sdm_mlx)") + ("/" if is_pkg and name else "")


def stats(root: Path = ROOT) -> dict[str, int]:
    edges = import_edges(root)
    graph = import_graph(root)
    return {"modules": len(graph), "edges": sum(len(d) for d in graph.values()),
            "load_time_edges": sum(k == "load" for d in edges.values() for k in d.values()),
            "cycles": len(cycles(graph)), "upward_imports": len(upward_imports(graph))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on a cycle or an upward import")
    parser.add_argument("--stats", action="store_true", help="print only the counts")
    parser.add_argument("--root", type=Path, default=ROOT, help="the sdm_mlx source directory (default: this repo's)")
    args = parser.parse_args(argv)
    edges = import_edges(args.root)
    graph = import_graph(args.root)
    if not args.stats:
        for name, deps in edges.items():
            now = [d or "(sdm_mlx)" for d, k in deps.items() if k == "load"]
            later = [d or "(sdm_mlx)" for d, k in deps.items() if k == "deferred"]
            print(f"{_label(name, graph)} -> {', '.join(now) if now else '-'}"
                  + (f" (deferred: {', '.join(later)})" if later else ""))
    found, up, loose = cycles(graph), upward_imports(graph), undeclared(graph)
    for comp in found:
        print("CYCLE: " + " <-> ".join(comp))
    for m, d in up:
        print(f"UPWARD: {m} ({LAYERS[layer_of(m)][0]}) -> {d} ({LAYERS[layer_of(d)][0]})")
    for m in loose:
        print(f"UNDECLARED: {m} is in no layer of tools/house/import_graph.py LAYERS")
    s = stats(args.root)
    print(f"# {s['modules']} modules, {s['edges']} edges ({s['load_time_edges']} at load time), "
          f"{s['cycles']} cycles, {s['upward_imports']} upward imports"
          + ("; acyclic and layered" if not (found or up or loose) else ""))
    return 1 if (args.check and (found or up or loose)) else 0


if __name__ == "__main__":
    sys.exit(main())
