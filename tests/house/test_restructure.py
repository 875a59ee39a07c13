"""tools/restructure.py rewrites imports written for the flat layout, and leaves the layered one alone."""

import pathlib
import subprocess
import sys

import pytest

import restructure  # tools/ is on pytest's pythonpath

ROOT = pathlib.Path(__file__).resolve().parents[2]
KNOWN = restructure.existing_modules()

CASES = [
    ("sdm_mlx/commands/x.py", "from ..embed import load_model\n", "from ..llm.embed import load_model\n"),
    # a moved file's imports written for its old place
    ("sdm_mlx/llm/embed.py", "from .errors import InputError\n", "from ..errors import InputError\n"),
    ("sdm_mlx/estimator/sdm_estimator.py", "from . import validation\n", "from .. import validation\n"),
    ("sdm_mlx/estimator/training.py", "from .index import _kept, make_index\n",
     "from ..index._arrays import _kept\nfrom ..index import make_index\n"),
    ("tests/t.py", "from sdm_mlx import embed as E  # noqa: E402\n", "from sdm_mlx.llm import embed as E  # noqa: E402\n"),
    ("tests/t.py", "from sdm_mlx import evaluate_output\n", "from sdm_mlx.evaluation import report as evaluate_output\n"),
    ("sdm_mlx/serve/engine.py", "def f():\n    from ..feedback import artifact_lock, summary\n",
     "def f():\n    from ..estimator.updates import artifact_lock\n    from ..estimator.feedback import summary\n"),
    ("tests/t.py", 'monkeypatch.setattr("sdm_mlx.embed.load_model", x)\n',
     'monkeypatch.setattr("sdm_mlx.llm.embed.load_model", x)\n'),
    ("tests/t.py", 'CODE = "from sdm_mlx.feedback import add_support_to_model"\n',
     'CODE = "from sdm_mlx.estimator.updates import add_support_to_model"\n'),
    ("tests/t.py", "from sdm_mlx.estimator import SDMEstimator\n", "from sdm_mlx.estimator import SDMEstimator\n"),
    ("tests/t.py", "from sdm_mlx.index import ExactIndex, _as_float32_matrix\n",
     "from sdm_mlx.index import ExactIndex\nfrom sdm_mlx.index._arrays import _as_float32_matrix\n"),
    ("sdm_mlx/network/trainer.py", "from ..network_config import (\n    NetworkConfig,  # the settings\n)\n",
     "from .config import (\n    NetworkConfig,  # the settings\n)\n"),
]


@pytest.mark.parametrize("path,old,new", CASES, ids=[c[1].strip()[:40] for c in CASES])
def test_python_imports_are_rewritten_once(path, old, new):
    fixed = restructure.fix_python(ROOT / path, old, KNOWN)
    assert fixed == new
    assert restructure.fix_python(ROOT / path, fixed, KNOWN) == fixed  # idempotent


def test_doc_targets_and_entry_points():
    text = "`sdm_mlx.activation:sdm` `sdm_mlx.estimator:SDMEstimator` sdm-mlx = \"sdm_mlx.cli:main\" `sdm_mlx.index:_kept`"
    assert restructure.fix_text(text, KNOWN) == ("`sdm_mlx.core.activation:sdm` `sdm_mlx.estimator:SDMEstimator` "
                                                 "sdm-mlx = \"sdm_mlx.cli:main\" `sdm_mlx.index._arrays:_kept`")


def test_the_tree_has_no_leftovers():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "restructure.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout


def test_file_paths_in_prose():
    text = "(`sdm_mlx/defaults.py`) sdm_mlx/estimator.py sdm_mlx/errors.py sdm_mlx/data/x.zip"
    assert restructure.fix_text(text, KNOWN) == ("(`sdm_mlx/estimator/config.py`) sdm_mlx/estimator/sdm_estimator.py "
                                                 "sdm_mlx/errors.py sdm_mlx/data/x.zip")


def test_an_import_split_over_two_modules_in_a_code_block():
    text = "```python\nfrom sdm_mlx.feedback import add_support_to_model, summary\n```\n"
    assert restructure.fix_text(text, KNOWN) == ("```python\nfrom sdm_mlx.estimator.updates import add_support_to_model\n"
                                                 "from sdm_mlx.estimator.feedback import summary\n```\n")
