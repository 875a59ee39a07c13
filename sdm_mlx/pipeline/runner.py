"""The driver of ``sdm-mlx pipeline``: runs a recipe's stages in order, each in its own process, and measures it.

A stage whose output exists and is current is skipped (:func:`sdm_mlx.pipeline.stages.is_done`); ``table`` always
runs.  Every stage that runs is measured from its process's resource usage (``os.wait4``: the stage and every
command it ran), and ``OUT/stages.json`` gets one entry per run::

    {"<stage>": {"runs": [{"started", "wall_s", "cpu_s", "cpu_share", "peak_rss_gb", "rows", "rows_per_s",
                           "tokens", "tokens_per_s", "load_average", "openblas_thread_timeout", "command", "rc"}]}}

``rows`` and ``tokens`` count the work done in that run (rows decoded, embedded, trained on or judged; prompt +
generated tokens), not the rows found done.  A lock file keeps two drivers out of one run directory.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from ..errors import CLIError, OutputError
from .layout import Layout
from .recipe import Recipe, check_model
from .stages import MODEL_STAGES, STAGES, active_stages, is_done, log


def _rss_gb(ru_maxrss: int) -> float:
    """``ru_maxrss`` in GB: kilobytes on Linux, bytes on macOS."""
    scale = 1 if sys.platform == "darwin" else 1024
    return round(ru_maxrss * scale / 1e9, 3)


def run_measured(cmd: list, keep_fds: tuple = ()) -> tuple[int, dict]:
    """Run ``cmd`` (stdout and stderr shown) and return ``(exit status, usage)`` of it and its waited-for
    children: wall and CPU seconds, peak RSS.

    ``keep_fds``: descriptors the child inherits (the run directory's lock: a stage outliving a killed driver
    still holds it, so a second driver cannot start a second writer of the same files).  SIGTERM to the driver
    is passed on to the child; the driver then exits with 143 once the child has ended.
    """
    import signal
    import threading

    t0 = time.time()
    proc = subprocess.Popen(cmd, pass_fds=tuple(keep_fds))
    terminated = []
    forwarding = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
    if forwarding:
        def forward(signum, frame):
            terminated.append(signum)
            proc.send_signal(signal.SIGTERM)

        previous = signal.signal(signal.SIGTERM, forward)
    try:
        _, status, ru = os.wait4(proc.pid, 0)
    except KeyboardInterrupt:
        proc.wait()
        raise
    finally:
        if forwarding:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if terminated:
        raise SystemExit(128 + signal.SIGTERM)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - t0
    cpu = ru.ru_utime + ru.ru_stime
    return proc.returncode, {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                             "cpu_share": round(cpu / wall, 2) if wall > 0 else None,
                             "peak_rss_gb": _rss_gb(ru.ru_maxrss)}


def check_run_directory(out: str) -> None:
    """The run directory may be new, or one this verb wrote (its recipe.json, data/ or answers/); never a file,
    the working directory or a parent of it, nor someone else's non-empty directory."""
    real = os.path.realpath(out)
    cwd = os.path.realpath(os.getcwd())
    if os.path.lexists(real) and not os.path.isdir(real):
        raise OutputError(f"output {out} exists and is not a directory")
    if cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        raise OutputError(f"output {out} is the working directory or a parent of it; name a run directory such as "
                          "runs/my_run")
    if os.path.isdir(real) and os.listdir(real) and not any(
            os.path.exists(os.path.join(real, n)) for n in ("recipe.json", "data", "answers")):
        raise OutputError(f"output {out} is a non-empty directory that is not a pipeline run; choose a new or empty "
                          "directory")


def _same_model(a: str, b: str) -> bool:
    return a == b or os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def check_same_model(recipe: Recipe, layout: Layout) -> None:
    """A run directory holds one model's answers: another model would mix their rows without a word."""
    try:
        with open(layout.recipe, encoding="utf-8") as f:
            before = json.load(f).get("model")
    except (OSError, ValueError, AttributeError):
        return
    answers = os.path.join(layout.out, "answers")
    if before and not _same_model(before, recipe.model) and os.path.isdir(answers) and os.listdir(answers):
        raise CLIError(f"{layout.out} holds the answers of the model {before}, and this run names {recipe.model}; "
                       "use another output directory (--output) for another model, or name the same model")


class _Lock:
    """An exclusive lock on the run directory (fcntl), released when the driver and the stage it runs have both
    ended (the stage inherits the descriptor: :func:`run_measured`'s ``keep_fds``)."""

    def __init__(self, path: str):
        self.path, self.f = path, None

    def __enter__(self):
        import fcntl

        self.f = open(self.path, "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.f.close()
            raise CLIError(f"another sdm-mlx pipeline is running in {os.path.dirname(self.path)} (it holds "
                           f"{self.path}); wait for it or stop it first") from None
        return self

    def __exit__(self, *exc):
        self.f.close()


def record(layout: Layout, stage: str, entry: dict) -> None:
    from ..storage.files import write_json

    try:
        with open(layout.stages, encoding="utf-8") as f:
            stats = json.load(f)
    except (OSError, ValueError):
        stats = {}
    stats.setdefault(stage, {"runs": []})["runs"].append(entry)
    write_json(layout.stages, stats)


def run_pipeline(recipe: Recipe, only: list[str] | None = None, wrap: str = "") -> int:
    """Run the recipe's stages (``only``: these, in pipeline order); returns the exit status (0, or the failing
    stage's: 2 for a problem with the input, 1 for a bug)."""
    from ..storage.files import make_dirs, write_json

    stages = active_stages(recipe)
    if only:
        unknown = [s for s in only if s not in STAGES]
        if unknown:
            raise CLIError(f"--only: unknown stage(s) {', '.join(unknown)}; the stages are {', '.join(STAGES)}")
        inactive = [s for s in only if s not in stages]
        if inactive:
            raise CLIError(f"--only: {', '.join(inactive)} is not a stage of this recipe (forced needs a row set "
                           "forced or own+forced; network and network_answers need a network section); its stages: "
                           f"{', '.join(stages)}")
        stages = [s for s in stages if s in only]
    layout = Layout(recipe.output)
    check_run_directory(layout.out)
    if any(s in MODEL_STAGES and not is_done(s, recipe, layout) for s in stages):
        check_model(recipe)  # before hours of other stages, not when the first model stage starts
    make_dirs(layout.logs)
    prefix = shlex.split(wrap) if wrap else []
    with _Lock(layout.lock) as lock:
        check_same_model(recipe, layout)
        write_json(layout.recipe, recipe.to_dict())
        log(f"sdm-mlx pipeline: {recipe.path} -> {layout.out} (model {recipe.model}); stages {', '.join(stages)}")
        for stage in stages:
            if stage != "table" and is_done(stage, recipe, layout):
                log(f"[{stage}] done (outputs exist); skipped")
                continue
            cmd = [sys.executable, "-m", "sdm_mlx.pipeline.stages", layout.out, stage]
            full = (prefix if stage in MODEL_STAGES else []) + cmd
            log(f"[{stage}] running")
            result = layout.result(stage)
            if os.path.exists(result):
                os.remove(result)
            started = time.strftime("%Y-%m-%dT%H:%M:%S")
            rc, usage = run_measured(full, keep_fds=(lock.f.fileno(),))
            try:
                with open(result, encoding="utf-8") as f:
                    counts = json.load(f)
            except (OSError, ValueError):
                counts = {}
            rows, tokens = counts.get("rows"), counts.get("tokens")
            wall = usage["wall_s"] or 1e-9
            entry = {"started": started, **usage, "rows": rows,
                     "rows_per_s": round(rows / wall, 4) if rows else None, "tokens": tokens,
                     "tokens_per_s": round(tokens / wall, 2) if tokens else None,
                     "generated_tokens": counts.get("generated_tokens"),
                     "load_average": round(os.getloadavg()[0], 2),
                     "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                     "command": " ".join(map(shlex.quote, full)), "rc": rc}
            record(layout, stage, entry)
            if rc != 0:
                log(f"sdm-mlx pipeline: stage {stage} stopped (exit {rc}); the finished work is kept, the same "
                    "command continues from there (--only table writes the tables of what is done)")
                return 130 if rc in (130, -2) else (2 if rc == 2 else 1)
            log(f"[{stage}] finished in {usage['wall_s']:.1f} s, peak RSS {usage['peak_rss_gb']:.2f} GB"
                + (f", {entry['rows_per_s']} rows/s" if entry["rows_per_s"] else "")
                + (f", {entry['tokens_per_s']} tokens/s" if entry["tokens_per_s"] else ""))
    if "table" in stages and os.path.exists(layout.table_md):
        with open(layout.table_md, encoding="utf-8") as f:
            sys.stdout.write(f.read())
    return 0
