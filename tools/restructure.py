"""Rewrite imports from the flat ``sdm_mlx`` layout to the layered packages (docs/architecture.md).

The table :data:`MOVES` maps every old module to its new home, and :data:`NAMES` maps single names that left
a module when it was split (``index.py`` into ``index/``, ``feedback.update_model`` into ``estimator/updates.py``).
The rewrite is idempotent: a path that already names the new layout is left alone, so it can be re-run after a
branch written against the old layout is merged::

    python tools/restructure.py --fix-imports     # rewrite sdm_mlx/, tests/, tools/, docs/*.md, README.md, pyproject.toml
    python tools/restructure.py --check           # list leftovers (old paths, misplaced top-level modules); exit 1 if any
    python tools/restructure.py --move            # git mv old top-level modules that still exist, then --fix-imports

What is rewritten:

* ``from .x import a`` / ``from ..x import a`` / ``from sdm_mlx.x import a`` / ``from . import x`` /
  ``import sdm_mlx.x`` in Python files, including imports inside functions.  Relative imports stay relative,
  computed from the file's current place; an import written for the file's old place (a module that was moved)
  is resolved against that old place first.
* ``sdm_mlx.x`` and ``sdm_mlx.x:name`` / ``sdm_mlx.x.name`` anywhere else in the text (strings such as
  ``monkeypatch.setattr("sdm_mlx.embed.load_model", ...)``, docs, pyproject entry points).

The codemod only reads and writes text; it imports nothing from sdm_mlx.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = "sdm_mlx"

#: old module -> new module (full dotted names).  A module not listed stays where it is.
MOVES: dict[str, str] = {
    # the batched decoding engine: one loop under network/ and verified/ (network layer)
    "sdm_mlx.verified.batching": "sdm_mlx.decoding.batching",
    "sdm_mlx.verified.sampling": "sdm_mlx.decoding.sampling",
    "sdm_mlx.verified.prompt_cache": "sdm_mlx.decoding.prompt_cache",
    "sdm_mlx.verified.streaming": "sdm_mlx.decoding.streaming",
    "sdm_mlx.verified.decode_types": "sdm_mlx.decoding.decode_types",
    # L0 runtime: process concerns
    "sdm_mlx.blas": "sdm_mlx.runtime.blas",
    "sdm_mlx.distributed": "sdm_mlx.runtime.distributed",
    "sdm_mlx.callbacks": "sdm_mlx.runtime.callbacks",
    # L1 storage: disk and JSONL
    "sdm_mlx.io": "sdm_mlx.storage.files",
    "sdm_mlx.artifact": "sdm_mlx.storage.artifact",
    # "sdm_mlx.data" stays a public path: a lazy package over sdm_mlx.storage.datasets (sdm_mlx/data/__init__.py)
    # L2 core: paper primitives
    "sdm_mlx.activation": "sdm_mlx.core.activation",
    "sdm_mlx.adaptor": "sdm_mlx.core.adaptor",
    "sdm_mlx.exact_product": "sdm_mlx.core.exact_product",
    "sdm_mlx.distance": "sdm_mlx.core.distance",
    # L2 index: the support index
    "sdm_mlx.hnsw_index": "sdm_mlx.index.hnsw",
    "sdm_mlx.sharded_index": "sdm_mlx.index.sharded",
    # L2 llm: features of a language model
    "sdm_mlx.embed": "sdm_mlx.llm.embed",
    "sdm_mlx.tokens": "sdm_mlx.llm.tokens",
    "sdm_mlx.verification_data": "sdm_mlx.llm.verification_data",
    "sdm_mlx.api_features": "sdm_mlx.llm.api_features",
    # L3 calibration
    "sdm_mlx.rescaler": "sdm_mlx.calibration.rescaler",
    "sdm_mlx.diagnosis": "sdm_mlx.calibration.diagnosis",
    # L4 estimator
    "sdm_mlx.estimator": "sdm_mlx.estimator.sdm_estimator",
    "sdm_mlx.estimator_io": "sdm_mlx.estimator.persistence",
    "sdm_mlx.train": "sdm_mlx.estimator.training",
    "sdm_mlx.checkpoint": "sdm_mlx.estimator.checkpoint",
    "sdm_mlx.defaults": "sdm_mlx.estimator.config",
    "sdm_mlx.chunked": "sdm_mlx.estimator.chunking",
    "sdm_mlx.feedback": "sdm_mlx.estimator.feedback",
    # L5 evaluation
    "sdm_mlx.metrics": "sdm_mlx.evaluation.metrics",
    "sdm_mlx.evaluate": "sdm_mlx.evaluation.evaluate",
    "sdm_mlx.evaluate_output": "sdm_mlx.evaluation.report",
    "sdm_mlx.plots": "sdm_mlx.evaluation.plots",
    "sdm_mlx.baselines": "sdm_mlx.evaluation.baselines",
    "sdm_mlx.baseline_core": "sdm_mlx.evaluation.baseline_core",
    "sdm_mlx.conformal": "sdm_mlx.evaluation.conformal",
    # L6-L8: configs beside their consumers, the MCP server beside the HTTP server
    "sdm_mlx.network_config": "sdm_mlx.network.config",
    "sdm_mlx.generation_config": "sdm_mlx.verified.config",
    "sdm_mlx.mcp_server": "sdm_mlx.serve.mcp",
}

#: Old modules that are now packages: the names their lazy ``__init__`` re-exports stay valid at the old path.
PUBLIC: dict[str, set[str]] = {
    "sdm_mlx.estimator": {"SDMEstimator", "FittedState"},
    "sdm_mlx.index": {"ExactIndex", "HnswIndex", "ShardedExactIndex", "make_index", "default_k",
                      "good_neighbours_by_class", "similarity_from_neighbours", "SupportIndex"},
}

#: (old module, name) -> new module, for names that left a module when it was split.
NAMES: dict[tuple[str, str], str] = {
    **{("sdm_mlx.index", n): "sdm_mlx.index._arrays"
       for n in ("_as_float32_matrix", "_kept", "_exclusion", "check_predictions")},
    **{("sdm_mlx.index", n): "sdm_mlx.index.exact" for n in ("DISTANCE_BLOCK_BYTES", "_Grouping")},
    **{(m, n): "sdm_mlx.index.screening"
       for m in ("sdm_mlx.index", "sdm_mlx.index.exact")
       for n in ("HOST_SCREEN_ELEMENTS", "HOST_MATMUL_MULTIPLY_ADDS", "screening_tolerance", "_squared_distances",
                 "_screen_top", "_count_before_first_bad", "_host_view", "_hard_positions", "_excluded_inf", "_xp",
                 "_evaluate")},
    **{(m, "sdm_numpy"): "sdm_mlx.core.activation" for m in ("sdm_mlx.train", "sdm_mlx.estimator.training")},
    **{(m, n): "sdm_mlx.estimator.updates"
       for m in ("sdm_mlx.feedback", "sdm_mlx.estimator.feedback")
       for n in ("update_model", "artifact_lock", "add_support_to_model", "remove_support_from_model")},
}

#: Where a new top-level module that another branch created belongs (``--move`` places it; then it is a move
#: like the others).  Add a row when ``--check`` reports "a top-level module outside the layout".
PLACE_NEW: dict[str, str] = {
    "sdm_mlx.model_path": "sdm_mlx.llm.model_path",  # where an LLM --model points (imported by llm.embed)
    "sdm_mlx.selective": "sdm_mlx.evaluation.selective",  # a selective score for model selection
    "sdm_mlx.writer": "sdm_mlx.storage.writer",  # the writer protocol of artifact directories
    "sdm_mlx.artifact_load": "sdm_mlx.storage.artifact_load",  # reading artifact directories
    "sdm_mlx.verdict_html": "sdm_mlx.evaluation.verdict_html",  # verdict pages
}
MOVES.update(PLACE_NEW)

#: Top-level modules that belong at the top (``--check`` flags any other).
TOP_LEVEL = {"__init__", "__main__", "_lazy", "errors", "settings", "validation", "results", "cli"}

SEARCH = ("sdm_mlx", "tests", "tools")
TEXT_FILES = ("README.md", "pyproject.toml")


# --------------------------------------------------------------------------------------------- the module tree

def existing_modules(root: Path = REPO) -> set[str]:
    """Dotted names of every module and package under sdm_mlx/ as the tree stands."""
    out = set()
    for p in (root / PKG).rglob("*.py"):
        parts = p.relative_to(root).with_suffix("").parts
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def module_of(path: Path, root: Path = REPO) -> tuple[str, bool] | None:
    """(dotted module name, is a package __init__) of a file under sdm_mlx/, else None."""
    try:
        parts = path.resolve().relative_to(root.resolve()).with_suffix("").parts
    except ValueError:
        return None
    if not parts or parts[0] != PKG:
        return None
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def old_name_of(module: str) -> str | None:
    """The module's name before the move (None if it did not move)."""
    for old, new in MOVES.items():
        if new == module:
            return old
    return None


def active(old: str, known: set[str]) -> bool:
    """A move is active once its destination exists."""
    return old in MOVES and MOVES[old] in known


def map_module(name: str, known: set[str]) -> str:
    """The new name of a dotted module path (the longest moved prefix wins; a current module is left alone)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in PUBLIC:
            return name
        if active(prefix, known):
            return ".".join([MOVES[prefix]] + parts[i:])
        if prefix in known:
            return name
    return name


def map_name(module: str, name: str, known: set[str]) -> str:
    """The module that now defines ``name`` that was imported from ``module``."""
    if NAMES.get((module, name)) in known:
        return NAMES[(module, name)]
    if module in PUBLIC:
        home = MOVES.get(module, module)
        if home in known and name not in PUBLIC[module] and f"{module}.{name}" not in known:
            return home
        return module
    return map_module(module, known)


# --------------------------------------------------------------------------------------------- Python imports

def _absolute(here: str, is_pkg: bool, level: int, module: str | None) -> str:
    parts = here.split(".")
    if not is_pkg:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(parts + ([module] if module else []))


def _relative(here: str, is_pkg: bool, target: str) -> tuple[int, str]:
    """(level, module) of a relative import of ``target`` from module ``here``."""
    base = here.split(".") if is_pkg else here.split(".")[:-1]
    tparts = target.split(".")
    common = 0
    while common < min(len(base), len(tparts)) and base[common] == tparts[common]:
        common += 1
    level = len(base) - common + 1
    return level, ".".join(tparts[common:])


def _resolves(target: str, module: str | None, names: list[str], known: set[str]) -> bool:
    """Does a relative import resolved to ``target`` name something that exists (or existed)?"""
    if module is None:  # from . import a, b: modules of the package, or names its __init__ defines
        return target in known
    return target in known or target in MOVES


def _all_modules(target: str, names: list[str], known: set[str]) -> bool:
    return all(f"{target}.{n}" in known or f"{target}.{n}" in MOVES for n in names)


def _target(node: ast.ImportFrom, ctx: dict) -> str | None:
    """The absolute module a ``from`` import names, resolved against the file's place (or its old place)."""
    if node.level == 0:
        ok = node.module == PKG or (node.module or "").startswith(PKG + ".")
        return node.module if ok else None
    if ctx["here"] is None:
        return None
    known, names = ctx["known"], [a.name for a in node.names]
    target = _absolute(ctx["here"], ctx["is_pkg"], node.level, node.module)
    if not ctx["old_here"]:
        return target
    old = _absolute(ctx["old_here"], False, node.level, node.module)
    if not _resolves(target, node.module, names, known):
        return old
    if node.module is None and _all_modules(old, names, known) and not _all_modules(target, names, known):
        return old  # "from . import validation" written at the old place
    return target


def _rewrite_from(node: ast.ImportFrom, ctx: dict) -> tuple[str, list[str]] | None:
    """("spec", [spec]) when only the module spec changes, ("stmts", [...]) to replace it; None: unchanged."""
    known, target = ctx["known"], _target(node, ctx)
    if target is None:
        return None
    groups: dict[str, list[ast.alias]] = {}
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if (sub in MOVES or sub in known) and sub not in PUBLIC:
            new_sub = map_module(sub, known)
            dest, _, leaf = new_sub.rpartition(".")
            keep = alias.asname or (alias.name if leaf != alias.name else None)
            groups.setdefault(dest, []).append(ast.alias(leaf, keep))
        else:
            groups.setdefault(map_name(target, alias.name, known), []).append(alias)

    def spec(dest: str) -> str:
        if node.level == 0:
            return dest
        level, mod = _relative(ctx["here"], ctx["is_pkg"], dest)
        return "." * level + mod

    old_spec = "." * node.level + (node.module or "")
    same_names = [(a.name, a.asname) for a in node.names]
    if len(groups) == 1:
        dest, aliases = next(iter(groups.items()))
        if [(a.name, a.asname) for a in aliases] == same_names:
            new_spec = spec(dest)
            return None if new_spec == old_spec else ("spec", [new_spec])
    return "stmts", [f"from {spec(d)} import " + ", ".join(a.name + (f" as {a.asname}" if a.asname else "")
                                                          for a in al) for d, al in groups.items()]


def _rewrite_import(node: ast.Import, known: set[str]) -> list[str] | None:
    changed = False
    parts = []
    for alias in node.names:
        new = map_module(alias.name, known) if alias.name.startswith(PKG + ".") else alias.name
        changed |= new != alias.name
        parts.append(new + (f" as {alias.asname}" if alias.asname else ""))
    return [f"import {', '.join(parts)}"] if changed else None


def fix_python(path: Path, text: str, known: set[str]) -> str:
    """Rewrite the imports of one Python file, then its dotted ``sdm_mlx.x`` text."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    mod = module_of(path)
    here, is_pkg = mod if mod else (None, False)
    ctx = {"here": here, "is_pkg": is_pkg, "known": known, "old_here": old_name_of(here) if here else None}
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            new = _rewrite_from(node, ctx)
        elif isinstance(node, ast.Import):
            new = _rewrite_import(node, known)
            new = ("stmts", new) if new else None
        else:
            continue
        if new is not None:
            edits.append((node, new))
    for node, (kind, new) in sorted(edits, key=lambda e: -e[0].lineno):
        start, end = node.lineno - 1, node.end_lineno - 1
        if kind == "spec":
            line = lines[start]
            head = re.compile(r"from\s+[.\w]+\s+import")
            m = head.search(line, node.col_offset)
            lines[start] = line[: m.start()] + f"from {new[0]} import" + line[m.end():]
            continue
        indent = lines[start][: node.col_offset]
        tail = lines[end][node.end_col_offset:]
        comment = tail.rstrip("\n") if tail.strip().startswith("#") else ""
        lines[start: end + 1] = [indent + (comment + "\n" + indent).join(new) + tail]
    return fix_text("".join(lines), known)


# --------------------------------------------------------------------------------------------- dotted text

DOTTED = re.compile(r"(?<![\w.])sdm_mlx((?:\.[A-Za-z_]\w*)+)(:[A-Za-z_]\w*)?")


def _fix_dotted(match: re.Match, known: set[str]) -> str:
    parts = (PKG + match.group(1)).split(".")
    colon = match.group(2) or ""
    # the longest prefix that is (or was) a module; the rest are attributes
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in known or prefix in MOVES:
            rest = parts[i:]
            break
    else:
        return match.group(0)
    first = rest[0] if rest else (colon[1:] if colon else None)
    new = map_name(prefix, first, known) if first else map_module(prefix, known)
    return ".".join([new] + rest) + colon


IMPORT_TEXT = re.compile(r"from (sdm_mlx(?:\.\w+)*) import (\w+(?:, \w+)*)")


def _fix_import_text(match: re.Match, known: set[str]) -> str:
    """``from sdm_mlx.x import a, b`` inside a string (code run in a subprocess): the names' new module, when
    they all went to one place."""
    module, names = match.group(1), match.group(2).split(", ")
    dests: dict = {}
    for n in names:
        if f"{module}.{n}" in known or f"{module}.{n}" in MOVES:
            dest, _, leaf = map_module(f"{module}.{n}", known).rpartition(".")
            dests.setdefault(dest if leaf == n else None, []).append(n)
        else:
            dests.setdefault(map_name(module, n, known), []).append(n)
    if None in dests:
        return match.group(0)
    if len(dests) == 1:
        return f"from {next(iter(dests))} import {match.group(2)}"
    line_start = match.string.rfind("\n", 0, match.start()) + 1
    indent = match.string[line_start:match.start()]
    if indent.strip():
        return match.group(0)  # inside a string: cannot split into two statements
    return ("\n" + indent).join(f"from {d} import {', '.join(ns)}" for d, ns in dests.items())


PATH = re.compile(r"(?<![\w/.])sdm_mlx/([\w/]+)\.py\b")


def _fix_path(match: re.Match, known: set[str]) -> str:
    """``sdm_mlx/x.py`` in prose: the file's new path (an old module that became a package: its __init__)."""
    dotted = f"{PKG}.{match.group(1).replace('/', '.')}"
    if dotted.endswith(".__init__") or (dotted in known and dotted not in PUBLIC):
        return match.group(0)
    if active(dotted, known):
        return MOVES[dotted].replace(".", "/") + ".py"
    return f"sdm_mlx/{match.group(1)}/__init__.py" if dotted in known else match.group(0)


def fix_text(text: str, known: set[str]) -> str:
    text = PATH.sub(lambda m: _fix_path(m, known), text)
    text = IMPORT_TEXT.sub(lambda m: _fix_import_text(m, known), text)
    return DOTTED.sub(lambda m: _fix_dotted(m, known), text)


# --------------------------------------------------------------------------------------------- driver

def files_to_fix(root: Path = REPO) -> list[Path]:
    out = []
    for d in SEARCH:
        out += [p for p in sorted((root / d).rglob("*.py")) if ".venv" not in p.parts]
    out += sorted((root / "docs").glob("*.md")) + [root / f for f in TEXT_FILES if (root / f).exists()]
    skip = {Path(__file__).resolve()} | {(root / "tests" / t).resolve()  # they quote old or dangling paths
                                         for t in ("house/test_restructure.py", "docs/test_doc_references.py")}
    return [p for p in out if p.resolve() not in skip]


def rewrites(root: Path = REPO):
    """``(path, text, new text)`` of every file the table changes."""
    known = existing_modules(root)
    for path in files_to_fix(root):
        text = path.read_text(encoding="utf-8")
        new = fix_python(path, text, known) if path.suffix == ".py" else fix_text(text, known)
        if new != text:
            yield path, text, new


def fix_all(root: Path = REPO) -> list[Path]:
    """Rewrite every file; return the changed ones."""
    changed = []
    for path, _, new in rewrites(root):
        path.write_text(new, encoding="utf-8")
        changed.append(path)
    return changed


def leftovers(root: Path = REPO) -> list[str]:
    """Old paths still in the text, and top-level modules outside :data:`TOP_LEVEL`."""
    out = []
    for path, text, new in rewrites(root):
        old_lines = text.splitlines()
        matcher = difflib.SequenceMatcher(None, old_lines, new.splitlines(), autojunk=False)
        for tag, i1, i2, _, _ in matcher.get_opcodes():
            out += [f"{path.relative_to(root)}:{i + 1}: {old_lines[i].strip()}" for i in range(i1, i2) if tag != "equal"]
    for p in sorted((root / PKG).glob("*.py")):
        if p.stem not in TOP_LEVEL:
            where = MOVES.get(f"{PKG}.{p.stem}")
            out.append(f"sdm_mlx/{p.name}: a top-level module outside the layout"
                       + (f" (belongs at {where})" if where else " (add it to PLACE_NEW)"))
    return out


def move_all(root: Path = REPO) -> list[str]:
    """``git mv`` every old top-level module that still exists to its new home."""
    moved = []
    for old, new in MOVES.items():
        src = root / Path(*old.split(".")).with_suffix(".py")
        dst = root / Path(*new.split(".")).with_suffix(".py")
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "mv", str(src), str(dst)], cwd=root, check=True)
            moved.append(f"{old} -> {new}")
    return moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--fix-imports", action="store_true", help="rewrite old import paths in place")
    mode.add_argument("--check", action="store_true", help="list leftovers; exit 1 if there are any")
    mode.add_argument("--move", action="store_true", help="git mv old modules that still exist, then fix imports")
    args = parser.parse_args(argv)
    if args.check:
        found = leftovers()
        print("\n".join(found) if found else "restructure: no leftovers")
        return 1 if found else 0
    if args.move:
        for line in move_all():
            print("moved", line)
    for path in fix_all():
        print("rewrote", path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
