"""``tools/builders/make_tiny_model.py`` loaded as a module (tools/ is not a package): its ``build`` makes the
tiny random model and task that the network tests train on."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_tiny_model_tool():
    path = os.path.join(ROOT, "tools", "builders", "make_tiny_model.py")
    spec = importlib.util.spec_from_file_location("make_tiny_model_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool
