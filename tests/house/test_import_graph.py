"""The package's import graph (tools/house/import_graph.py): no cycle and no import up a layer, counting imports made
inside functions as well as at load time; the verbs never import the dispatcher (sdm_mlx/cli.py) or each other --
shared CLI pieces live in commands/_common.py; and the subpackages stay lazy."""

import ast
import pathlib
import subprocess
import sys

import import_graph  # tools/house/ is on pytest's pythonpath

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_graph_has_no_cycle_and_no_upward_import_counting_deferred_imports():
    graph = import_graph.import_graph()
    assert import_graph.cycles(graph) == []
    assert import_graph.find_cycle(graph) is None
    assert import_graph.upward_imports(graph) == []
    assert import_graph.undeclared(graph) == [], "add the module's package to LAYERS in tools/house/import_graph.py"
    assert "calibration.rounds" in graph and "runtime.callbacks" in graph["estimator.training"]
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "house" / "import_graph.py"), "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:]
    assert res.stdout.strip().endswith("acyclic and layered") and "cli -> " in res.stdout


def _graph_of(tmp_path, files: dict[str, str]) -> dict[str, list[str]]:
    for name, text in files.items():
        path = tmp_path / "sdm_mlx" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph.import_graph(tmp_path / "sdm_mlx")


def test_a_deferred_import_makes_a_cycle_and_a_lazy_export_resolves_to_its_module(tmp_path):
    graph = _graph_of(tmp_path, {
        "__init__.py": "",
        "estimator/__init__.py": '_EXPORTS = {"SDMEstimator": "model"}\n',
        "estimator/model.py": "from .feedback import parse_log\n",
        "estimator/feedback.py": "def update():\n    from . import SDMEstimator\n",
    })
    assert graph["estimator.feedback"] == ["estimator.model"]
    assert import_graph.cycles(graph) == [["estimator.feedback", "estimator.model"]]
    assert import_graph.import_graph(tmp_path / "sdm_mlx", deferred=False)["estimator.feedback"] == []


def test_an_upward_import_is_reported(tmp_path):
    graph = _graph_of(tmp_path, {
        "__init__.py": "", "errors.py": "", "runtime/__init__.py": "",
        "runtime/distributed.py": "def timeout():\n    from ..estimator.config import T\n",
        "estimator/__init__.py": "", "estimator/config.py": "from ..errors import E\n",
    })
    assert import_graph.upward_imports(graph) == [("runtime.distributed", "estimator.config")]
    assert import_graph.cycles(graph) == []


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


def test_every_package_init_says_what_it_may_import_and_imports_no_submodule_at_load():
    for init in sorted((ROOT / "sdm_mlx").glob("*/__init__.py")):
        pkg = init.parent.name
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "May import" in doc or pkg == "commands" and "may import" in doc, f"{pkg}/__init__ lacks 'May import'"
        loaded = import_graph.import_graph(deferred=False).get(pkg, [])
        assert all(d == "_lazy" or d == "errors" for d in loaded), f"{pkg}/__init__ imports {loaded} at load time"


def test_help_and_configs_do_not_import_mlx():
    code = ("import sys\nfrom sdm_mlx.estimator.config import EstimatorConfig\nfrom sdm_mlx.network.config import "
            "NetworkConfig\nfrom sdm_mlx.verified.config import GenerationConfig\nfrom sdm_mlx import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\nprint('mlx.core' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "False"


def test_no_test_imports_another_test_module():
    """Shared fixtures live in tests/conftest.py and shared helpers in tests/helpers/, never in a test file."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # every dotted part counts, and so does each imported name: tests live in folders now, so a test
            # module may be reached as ``core.test_activation`` or ``from core import test_activation``
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [".".join(filter(None, (node.module, a.name))) for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if any(part.startswith("test_") for part in n.split("."))]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}: move what it shares to conftest.py or tests/helpers/"


def test_public_paths_users_know_keep_working():
    """The paths the README, the docs and users' scripts import from resolve after the move into packages."""
    import sdm_mlx
    from sdm_mlx import calibration, index  # noqa: F401
    from sdm_mlx.data import Dataset, factcheck_splits, load_factcheck, read_jsonl
    from sdm_mlx.estimator import SDMEstimator
    from sdm_mlx.network import load_network  # noqa: F401

    assert sdm_mlx.SDMEstimator is SDMEstimator and sdm_mlx.read_jsonl is read_jsonl
    assert callable(factcheck_splits) and len(load_factcheck("generated").y) == 245 and Dataset is not None
    assert callable(calibration.estimate) and callable(index.make_index)
