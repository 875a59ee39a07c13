"""``tools/make_tiny_model.py`` loaded as a module (tools/ is not a package): its ``build`` makes the tiny random
model and task that the network tests train on."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_tiny_model_tool():
    spec = importlib.util.spec_from_file_location("make_tiny_model_tool", os.path.join(ROOT, "tools", "make_tiny_model.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool
