"""Shared pytest fixtures: tiny random mlx-lm models built locally (see tools/builders/tiny_models.py)."""

import sdm_mlx  # noqa: F401  (first: loads OpenBLAS for MLX on Linux, see sdm_mlx/runtime/blas.py)
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub from the tests
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@pytest.fixture(scope="session")
def tiny_phi3_path(tmp_path_factory):
    """A tiny Phi-3 model (untied lm_head, SentencePiece-like tokenizer) loadable with mlx_lm.load."""
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_models"), "phi3")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory):
    """A tiny Qwen2 model (tied embeddings, byte-level BPE tokenizer) loadable with mlx_lm.load."""
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_models"), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """A tiny Llama model (untied lm_head, byte-level BPE tokenizer that prepends BOS)."""
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_models"), "llama")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A directory with train/test files and a tiny model trained on the ``embedding`` field (tests/helpers/cli_lab.py)."""
    from cli_lab import build_lab

    return build_lab(tmp_path_factory.mktemp("lab"))


@pytest.fixture(scope="module")
def setup(tiny_phi3_path, tmp_path_factory):
    """The verified-generation lab on the tiny Phi-3: head, verifier, network (tests/helpers/verified_lab.py)."""
    from verified_lab import build_verified_lab

    return build_verified_lab(tiny_phi3_path, tmp_path_factory.mktemp("verified"))


@pytest.fixture(scope="module")
def model_path() -> str:
    """The real test LLM's directory (the ``real_llm`` tier); skips, naming the fetch command, when absent."""
    from real_llm_lab import model_dir

    path = model_dir()
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        pytest.skip(f"real test LLM not found at {path}: run `python tools/fetch_test_llm.py` "
                    "(or set SDM_MLX_TEST_LLM to an mlx-lm model directory)")
    return str(path)


def pytest_addoption(parser):
    parser.addoption("--no-file-lines", action="store_true", default=False,
                     help="no line per finished test file (tests/helpers/file_lines.py)")


def pytest_configure(config):
    from file_lines import register  # tests/helpers/

    register(config)


def pytest_collection_modifyitems(session, config, items):
    from file_order import heaviest_first  # tests/helpers/

    heaviest_first(items)
