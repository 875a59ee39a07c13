"""The tiny local model + synthetic task of ``recipes/tiny_sentiment.yaml``, at the path older docs and scripts name.

    python tools/make_tiny_model.py runs/tiny          # the same as python tools/builders/make_tiny_model.py runs/tiny

The builder lives in ``tools/builders/make_tiny_model.py`` (with its helpers); this entry point runs it unchanged,
with the same arguments, exit status and output.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    builder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builders", "make_tiny_model.py")
    sys.path.insert(0, os.path.dirname(builder))
    sys.argv[0] = builder
    runpy.run_path(builder, run_name="__main__")
