"""Where the real test LLM lives (the ``real_llm`` tier; the ``model_path`` fixture of tests/conftest.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: batch invariance of real-model features, relative (measured ~1e-6; docs/real_llm.md)
BATCH_RTOL = 1e-4


def model_dir() -> Path:
    """``$SDM_MLX_TEST_LLM``, else the directory ``tools/fetch_test_llm.py`` writes (float32)."""
    env = os.environ.get("SDM_MLX_TEST_LLM")
    if env:
        return Path(env).expanduser()
    sys.path.insert(0, str(ROOT / "tools"))
    from fetch_test_llm import default_cache, default_output

    return default_output(default_cache(), "float32")
