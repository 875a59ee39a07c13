"""The CLI sandbox shared by test_hostile and test_io_safety: tiny training settings, labelled rows with two
feature fields, the ``sdm-mlx`` subprocess and a byte-level snapshot of a directory (the ``lab`` fixture of
tests/conftest.py trains a model there once per test module)."""

import hashlib
import json
import os
import stat
import subprocess
import sys

import numpy as np

CLI = [sys.executable, "-m", "sdm_mlx"]
TINY = ["--epochs", "2", "--iterations", "1", "--exemplar-dim", "8", "--rescaler-max-epochs", "20", "--quiet"]


def rows(n=80, seed=0, both=True):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        y = i % 2
        r = {"id": i, "label": y, "embedding": (rng.normal(size=6) + 3 * y).round(4).tolist()}
        if both:
            r["attributes"] = (rng.normal(size=4) - 2 * y).round(4).tolist()
        out.append(r)
    return out


def write_rows(path, rs):
    with open(path, "w", encoding="utf-8") as f:
        for r in rs:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def cli(*args, cwd, stdin=None, prefix=(), timeout=300):
    return subprocess.run([*prefix, *CLI, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          input=stdin, timeout=timeout)


def snapshot(root) -> dict:
    """{relative path: what it is} for everything under root (files by content hash; links not followed)."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                snap[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    snap[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
            elif stat.S_ISDIR(st.st_mode):
                snap[rel] = ("dir",)
            else:
                snap[rel] = ("special", stat.S_IFMT(st.st_mode))
    return snap


def build_lab(root):
    """A directory with train/test files and a tiny model trained on the ``embedding`` field."""
    write_rows(root / "train.jsonl", rows())
    write_rows(root / "test.jsonl", rows(12, seed=1))
    r = cli("train", "--train", "train.jsonl", "--output", "model", "--features", "embedding", "--alpha", "0.6",
            *TINY, cwd=root)
    assert r.returncode == 0, r.stderr
    return root
