"""The tiny local model + synthetic task of ``recipes/tiny_sentiment.yaml``, at the path older docs and scripts name.

    python tools/make_tiny_model.py runs/tiny          # the same as python tools/builders/make_tiny_model.py runs/tiny

The builder lives in ``tools/builders/make_tiny_model.py`` (with its helpers); this entry point runs it with the same
arguments, exit status and output, and imported it offers the builder's functions (``build``, ``main``).
"""

import importlib.util
import os
import sys

_BUILDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builders", "make_tiny_model.py")
if os.path.dirname(_BUILDER) not in sys.path:
    sys.path.insert(0, os.path.dirname(_BUILDER))  # its helpers (tiny_models, tiny_tasks) sit beside it
_spec = importlib.util.spec_from_file_location("_tiny_model_builder", _BUILDER)
_builder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_builder)
build, main = _builder.build, _builder.main

if __name__ == "__main__":
    sys.exit(main())
