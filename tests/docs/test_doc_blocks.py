"""Every code block in README.md and docs/*.md runs (docs/writing-docs.md says the same for authors).

Conventions:
- ```bash and ```python blocks are executed, in order, one sandbox directory per document, so a
  later block sees the files an earlier one wrote (a page reads top to bottom).  Every ``docs/*.md``
  page is collected, so a new page is covered as soon as it exists.
- A block whose first line is ``# file: NAME`` (any language: yaml, jsonl, python) is written to
  NAME in the sandbox instead of being executed.
- ```text / ```json / ```console / ```yaml blocks are output or file samples and are not executed.
- Set-up lines that CI performs itself (``git clone``, ``cd sdm_mlx``, ``python3 -m venv``,
  ``pip install``, activating the venv, ``python -m pytest``) are checked against ``.ci/run`` rather
  than re-run.
- The sandbox holds small labelled JSONL files cut from the embedded factcheck data:
  ``train.jsonl``, ``calibration.jsonl``, ``test.jsonl`` and ``shifted.jsonl`` (the generated,
  shifted statements) with fields id, label, attributes, document, so "your own data" examples
  run in seconds.
- LLM pages name their model once, in a ``MODEL=...`` line (bash) or ``MODEL = "..."`` (python), and
  use ``$MODEL`` / ``MODEL`` after it.  Here the value is replaced by a tiny random mlx-lm model built
  locally (tools/builders/make_tiny_model.py), and such a page's sandbox also holds ``runs/sentiment/``: an
  SDM network trained on that model (``runs/sentiment/network``, ``runs/sentiment/verifier``), as
  ``sdm-mlx network-train --output runs/sentiment`` writes it.
- The sandbox links ``tools/`` and ``recipes/`` of the checkout (pages run from a checkout).
- ``sdm-mlx serve`` lines start a server in the background (on a free port: the ports 8080/8081 of
  the page are replaced everywhere on it) that later blocks talk to; it is stopped after the page.
- ``<!-- doc-test: not-run: REASON -->`` on the line before a block: the block is not executed.  Only
  for what truly cannot run here; every such block is named in :data:`NOT_RUN` below, with the reason
  shown in the page.
- ``<!-- doc-test: slow: REASON -->`` anywhere in a page: the page runs only with ``-m slow``.
- :data:`QUICK_RUNS`: a page whose long command has a quick mode runs it in that mode in the default run
  (``sdm-mlx demo`` of README.md as ``sdm-mlx demo --quick``: the same files, in ~10 s instead of ~1 min; its
  trainings with 1 round of 3 epochs, in its commands and in ``SDMEstimator(...)`` of its Python blocks; the same for
  python-api.md); the page also runs exactly as written under ``-m slow`` (the ``README.md-as-written`` case).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*doc-test:\s*([\w-]+)\s*:?\s*(.*?)\s*-->", re.S)
EXECUTED = {"bash", "sh", "python"}
SAMPLES = {"text", "json", "console", "yaml", ""}
SETUP = re.compile(r"^\s*(git clone |cd sdm_mlx\b|python3? -m venv |(python -m )?pip install |python -m pytest\b|"
                   r"source \S*activate|\. \S*activate)")
LLM = re.compile(r"\$\{?MODEL\b|^\s*MODEL\s*=|runs/sentiment/", re.M)
#: The blocks that are not run, by page: (the first line of the block, why).  Keep this list short.
NOT_RUN = {
    "real_llm.md": [("pip install -e '.[tools]'", "downloads a 1.5B model (about 3 GB)"),
                    ("python -m pytest -m real_llm", "the real-LLM test tier: a 1.5B model, minutes, 8+ GB")],
    "verified-generation-real.md": [("MODEL=", "the real 1.5B model (7.5 GB per process)"),
                                    ("MODEL=", "the real 1.5B model (7.5 GB per process) and hours of CPU"),
                                    ("python -m pytest -m real_llm -n 0 tests/test_real_llm.py",
                                     "the real-LLM test tier: a 1.5B model, minutes, 8+ GB")],
}


#: Fewer rounds and epochs for a training in the default run: the same commands, files and code paths as written,
#: in seconds (a model of 3 epochs is as good an input to the page's later commands as one of 50).
_QUICK_TRAIN = (re.compile(r"^(\s*sdm-mlx train\b(?![^\n]*--epochs)[^\n]*)$", re.M), r"\1 --iterations 1 --epochs 3")
_QUICK_FIT = (re.compile(r"\biterations=\d+(?:, epochs=\d+)?"), "iterations=1, epochs=3")  # SDMEstimator(...)
#: page -> [(pattern, replacement)] applied to its commands and Python blocks in the default run (see the module
#: docstring); ``sdm-mlx demo`` writes the same runs/demo/data/ files in every mode, which the page's later blocks
#: read.  Measured (CPU seconds, load 10-12): README.md's train on the 5,173-row pool 26 s, demo 14 s.
QUICK_RUNS = {
    "README.md": [(re.compile(r"^(\s*sdm-mlx demo)(?![^\n]*--(?:quick|paper))([^\n]*)$", re.M), r"\1 --quick\2"),
                  _QUICK_TRAIN, _QUICK_FIT],
    "python-api.md": [_QUICK_FIT],
}


def _docs() -> list:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    out = []
    for doc in docs:
        slow = [m for line in doc.read_text(encoding="utf-8").splitlines()  # a marker on a line of its own
                if (m := MARKER.fullmatch(line.strip())) and m.group(1) == "slow"]
        out.append(pytest.param(doc, False, id=doc.name, marks=[pytest.mark.slow] if slow else []))
        if doc.name in QUICK_RUNS and not slow:
            out.append(pytest.param(doc, True, id=f"{doc.name}-as-written", marks=[pytest.mark.slow]))
    return out


def _quick(doc: pathlib.Path, code: str, as_written: bool) -> str:
    """``code`` with :data:`QUICK_RUNS`' substitutions of ``doc`` (none when running it as written)."""
    if as_written:
        return code
    for pattern, replacement in QUICK_RUNS.get(doc.name, []):
        code = pattern.sub(replacement, code)
    return code


def blocks(path: pathlib.Path) -> list[tuple[str, str, str | None]]:
    """``(language, code, not-run reason or None)`` of every fenced block of ``path``."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().rsplit("\n", 1)[-1]
        mark = MARKER.fullmatch(before.strip())
        reason = mark.group(2) if mark and mark.group(1) == "not-run" else None
        out.append((m.group(1).lower(), m.group(2), reason))
    return out


def _sandbox_data(tmp: pathlib.Path) -> None:
    import json

    from sdm_mlx.storage.datasets import factcheck_splits

    pool, heldout, generated = factcheck_splits()
    parts = {"train.jsonl": pool.subset(range(0, len(pool), 8)), "calibration.jsonl": pool.subset(range(1, len(pool), 8)),
             "test.jsonl": heldout.subset(range(0, len(heldout), 4)), "shifted.jsonl": generated}
    for name, ds in parts.items():
        with open(tmp / name, "w", encoding="utf-8") as f:
            for i, x, y, doc in zip(ds.ids, ds.X.tolist(), ds.y.tolist(), ds.documents):
                f.write(json.dumps({"id": i, "label": y, "attributes": x, "document": doc}) + "\n")


@pytest.fixture(scope="session")
def llm_runs(tmp_path_factory):
    """A tiny local base model and an SDM network trained on it (``runs/sentiment``), built once."""
    import warnings

    import make_tiny_model

    from sdm_mlx.network import NetworkConfig, train_network

    root = tmp_path_factory.mktemp("doc_llm")
    built = make_tiny_model.build(str(root / "tiny"), rows=300, tune_steps=150, quiet=True)
    cfg = NetworkConfig(model=built["model"], data=built["task"], output_dir=str(root / "runs" / "sentiment"),
                        answers="preset",
                        # the pages show the commands, not admission: this tiny random model's verifier admits no
                        # calibration row, so run Alg. 4's epoch anyway (as --no-require-admission does)
                        require_admission=False,
                        preset="sentiment", epochs=1, learning_rate=1e-2, batch_size=50, max_new_tokens=12,
                        generation_batch_size=64, embed_batch_size=32, alpha=0.8, verifier_iterations=1,
                        verifier_epochs=20, verifier_exemplar_dim=32, verifier_learning_rate=3e-3,
                        verifier_rescaler_max_epochs=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a small verification set: the estimator may warn about its size
        train_network(cfg)
    return built["model"], root / "runs"


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["PATH"] = str(pathlib.Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return env


def _run(lang: str, code: str, cwd: pathlib.Path, where: str, env: dict, timeout: int = 600) -> None:
    cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{where} failed (exit {r.returncode}):\n{code}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"


def _strip_setup(code: str, ci_text: str, where: str) -> str:
    """The block without the set-up steps CI performs (``.venv/bin/`` prefixes dropped: the venv is on PATH)."""
    kept = []
    for part in (p for line in code.splitlines() for p in line.replace(".venv/bin/", "").split(" && ")):
        line = part
        if SETUP.match(line):
            if line.strip().startswith(("pip install", "python -m pip install")):
                extras = re.findall(r'"\.\[([\w,-]+)\]"|\.\[([\w,-]+)\]|sdm_mlx\[([\w,-]+)\]', line)
                for group in extras:
                    for extra in filter(None, ",".join(group).split(",")):
                        assert extra in ci_text or f"\n{extra} = [" in (ROOT / "pyproject.toml").read_text(), \
                            f"{where}: pip extra {extra!r} is unknown"
            continue
        kept.append(line)
    return "\n".join(kept)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Servers:
    """``sdm-mlx serve`` lines of a page, started in the background on free ports and stopped at the end."""

    LINE = re.compile(r"^\s*sdm-mlx serve\b.*$", re.M)

    def __init__(self):
        self.ports = {"8080": str(_free_port()), "8081": str(_free_port())}
        self.procs = []

    def ported(self, code: str) -> str:
        return re.sub(r"\b(8080|8081)\b", lambda m: self.ports[m.group(1)], code)

    def start(self, code: str, cwd, env, where: str) -> str:
        """``code`` without its serve lines, each started (and waited for) in the background."""
        code = code.replace("\\\n", " ")
        for line in self.LINE.findall(code):
            cmd = line.split("#")[0].strip() if " #" in line else line.strip()
            if "--port" not in cmd:
                cmd += f" --port {self.ports['8080']}"
            proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            self.procs.append(proc)
            deadline, seen = time.time() + 180, []
            while time.time() < deadline:
                out = proc.stderr.readline()
                seen.append(out)
                if "listening on" in out or (not out and proc.poll() is not None):
                    break
            assert proc.poll() is None, f"{where}: `{cmd}` did not start:\n{''.join(seen)[-3000:]}"
        return self.LINE.sub("", code)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _with_model(lang: str, code: str, model: str) -> str:
    if lang == "python":
        return re.sub(r"^(\s*MODEL\s*=\s*).*$", lambda m: m.group(1) + repr(model), code, flags=re.M)
    return re.sub(r"^(\s*(?:export\s+)?MODEL=).*$", lambda m: m.group(1) + f"'{model}'", code, flags=re.M)


def _check_not_run(doc: pathlib.Path, found) -> None:
    skipped = [(code.splitlines()[0] if code.strip() else "", reason) for _, code, reason in found
               if reason is not None]
    named = NOT_RUN.get(doc.name, [])
    assert all(reason for _, reason in skipped), f"{doc.name}: a not-run block without a reason"
    assert len(skipped) == len(named) and all(first.startswith(start) for (first, _), (start, _) in
                                              zip(skipped, named)), \
        f"{doc.name}: not-run blocks {skipped} differ from the ones named in NOT_RUN ({named})"


@pytest.mark.parametrize("doc, as_written", _docs())
def test_code_blocks_run(doc, as_written, tmp_path, request):
    found = blocks(doc)
    _check_not_run(doc, found)
    runnable = [(lang, code) for lang, code, reason in found
                if reason is None and (lang in EXECUTED or code.startswith("# file: "))]
    if not runnable:
        pytest.skip(f"{doc.name} has no code blocks to run")
    unknown = {lang for lang, _, _ in found} - EXECUTED - SAMPLES
    assert not unknown, f"{doc.name}: code blocks in languages the runner does not know: {unknown}"
    _sandbox_data(tmp_path)
    for name in ("tools", "recipes"):  # pages run their commands from a checkout
        (tmp_path / name).symlink_to(ROOT / name)
    env, model = _env(), None
    if any(LLM.search(code) for _, code in runnable):
        model, runs = request.getfixturevalue("llm_runs")
        shutil.copytree(runs, tmp_path / "runs")
        env["MODEL"] = model
    ci_text = (ROOT / ".ci" / "run").read_text()
    servers = _Servers()
    try:
        for n, (lang, code, reason) in enumerate(found, 1):
            where = f"{doc.name} block {n} ({lang})"
            if reason is not None:
                continue
            if code.startswith("# file: "):
                first, _, body = code.partition("\n")
                (tmp_path / first[len("# file: "):].strip()).write_text(body, encoding="utf-8")
            elif lang in EXECUTED:
                code = _quick(doc, _strip_setup(code, ci_text, where) if lang != "python" else code, as_written)
                code = servers.ported(_with_model(lang, code, model) if model else code)
                if lang != "python":
                    code = servers.start(code, tmp_path, env, where)
                if code.strip():
                    _run("python" if lang == "python" else "bash", code, tmp_path, where, env,
                         timeout=3600 if request.node.get_closest_marker("slow") else 600)
    finally:
        servers.stop()
