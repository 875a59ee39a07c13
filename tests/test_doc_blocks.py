"""Every code block in README.md and docs/*.md runs.

Conventions (docs/README.md's "Writing docs" section says the same):
- ```bash and ```python blocks are executed, in order, one sandbox directory per document, so a
  later block sees the files an earlier one wrote (a tutorial reads top to bottom).
- A block whose first line is ``# file: NAME`` (any language: yaml, jsonl, python) is written to
  NAME in the sandbox instead of being executed.
- ```text / ```json / ```console blocks are output samples and are not executed.
- Set-up lines that CI performs itself (``git clone``, ``cd sdm_mlx``, ``python3 -m venv``,
  ``pip install``, activating the venv) are checked against ``.ci/run`` rather than re-run.
- The sandbox holds small labelled JSONL files cut from the embedded factcheck data:
  ``train.jsonl``, ``calibration.jsonl`` and ``test.jsonl`` (fields id, label, attributes,
  document), so "your own data" examples run in seconds.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: the documents whose code blocks run here (the docs/*.md pages that need an mlx-lm model are not yet in
#: this list: their blocks name hub models that the tests cannot download)
DOCS = [ROOT / "README.md"]
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
EXECUTED = {"bash", "sh", "python"}
SAMPLES = {"text", "json", "console", ""}
SETUP = re.compile(r"^\s*(git clone |cd sdm_mlx\b|python3? -m venv |(python -m )?pip install |python -m pytest\b|"
                   r"source \S*activate|\. \S*activate)")


def blocks(path: pathlib.Path) -> list[tuple[str, str]]:
    return [(m.group(1).lower(), m.group(2)) for m in FENCE.finditer(path.read_text(encoding="utf-8"))]


def _sandbox_data(tmp: pathlib.Path) -> None:
    import json

    from sdm_mlx.data import factcheck_splits

    pool, heldout, _ = factcheck_splits()
    rng_rows = {"train.jsonl": pool.subset(range(0, len(pool), 8)), "calibration.jsonl": pool.subset(range(1, len(pool), 8)),
                "test.jsonl": heldout.subset(range(0, len(heldout), 4))}
    for name, ds in rng_rows.items():
        with open(tmp / name, "w", encoding="utf-8") as f:
            for i, x, y, doc in zip(ds.ids, ds.X.tolist(), ds.y.tolist(), ds.documents):
                f.write(json.dumps({"id": i, "label": y, "attributes": x, "document": doc}) + "\n")


def _run(lang: str, code: str, cwd: pathlib.Path, where: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["PATH"] = str(pathlib.Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{where} failed (exit {r.returncode}):\n{code}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"


def _strip_setup(code: str, ci_text: str, where: str) -> str:
    """The block without the set-up steps CI performs (``.venv/bin/`` prefixes dropped: the venv is on PATH)."""
    kept = []
    for part in (p for line in code.splitlines() for p in line.replace(".venv/bin/", "").split(" && ")):
        line = part
        if SETUP.match(line):
            if line.strip().startswith(("pip install", "python -m pip install")):
                extras = re.findall(r'"\.\[([\w,-]+)\]"|\.\[([\w,-]+)\]', line)
                for group in extras:
                    for extra in filter(None, ",".join(group).split(",")):
                        assert extra in ci_text or extra in (ROOT / "pyproject.toml").read_text(), \
                            f"{where}: pip extra {extra!r} is unknown"
            continue
        kept.append(line)
    return "\n".join(kept)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_code_blocks_run(doc, tmp_path):
    found = blocks(doc)
    runnable = [(lang, code) for lang, code in found if lang in EXECUTED or code.startswith("# file: ")]
    if not runnable:
        pytest.skip(f"{doc.name} has no code blocks to run")
    unknown = {lang for lang, _ in found} - EXECUTED - SAMPLES
    assert not unknown, f"{doc.name}: code blocks in languages the runner does not know: {unknown}"
    _sandbox_data(tmp_path)
    ci_text = (ROOT / ".ci" / "run").read_text()
    for n, (lang, code) in enumerate(found, 1):
        where = f"{doc.name} block {n} ({lang})"
        if code.startswith("# file: "):
            first, _, body = code.partition("\n")
            (tmp_path / first[len("# file: "):].strip()).write_text(body, encoding="utf-8")
        elif lang in EXECUTED:
            code = _strip_setup(code, ci_text, where) if lang != "python" else code
            if code.strip():
                _run("python" if lang == "python" else "bash", code, tmp_path, where)
