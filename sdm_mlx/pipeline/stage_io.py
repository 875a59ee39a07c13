"""What the stages of ``sdm-mlx pipeline`` share (:mod:`.stages`): the stage log on stderr, a tolerant JSON read
of the run directory's markers, and ``sdm-mlx <verb>`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

from ..errors import InputError
from .layout import Layout


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def stage_log(stage: str):
    return lambda message: log(f"[{stage}] {message}")



def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_cli(layout: Layout, name: str, args: list, what: str) -> None:
    """``sdm-mlx <args>`` in a subprocess (stdout to ``logs/<name>.log``, stderr shown); exit 2 becomes an
    :class:`InputError`, any other failure a RuntimeError."""
    from ..storage.files import make_dirs

    make_dirs(layout.logs)
    cmd = [sys.executable, "-m", "sdm_mlx", *map(str, args)]
    with open(layout.log(name), "a", encoding="utf-8") as out:
        out.write(f"$ sdm-mlx {' '.join(map(str, args))}\n")
        out.flush()
        rc = subprocess.call(cmd, stdout=out)
    if rc == 2:
        raise InputError(f"{what}: `sdm-mlx {args[0]}` stopped with the error above (exit 2; its output: "
                         f"{layout.log(name)})")
    if rc != 0:
        raise RuntimeError(f"{what}: `sdm-mlx {args[0]}` failed with exit {rc} (its output: {layout.log(name)})")


