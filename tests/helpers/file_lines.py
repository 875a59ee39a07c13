"""One line per finished test file in the default ``pytest -q`` run (registered by tests/conftest.py).

``-q`` prints a dot per test; in the slow end of a run (a minute or more per file) that is all there is. This
plugin, in the process that reports (pytest-xdist's controller, or the only process with ``-n 0``), adds a line
when every test of a file has run::

    tests/network/test_network_train.py: 7 passed in 98 s, cpu 61 s (gw1) [84/131 files, 6:12 elapsed]

and, while a file runs longer than :data:`STILL_RUNNING` seconds, one line per such interval naming it, so a slow
tail is visibly alive.  ``cpu``: the CPU time of the process that ran the file (all its threads) and of the
subprocesses it waited for, which depends much less than the wall time on what else runs on the machine.
``--no-file-lines`` turns it off; ``-v`` (a line per test already) does too.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, defaultdict

import pytest

#: seconds after which a file still running is named again (and again after as many more)
STILL_RUNNING = 60


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuTime:
    """In the process that runs the tests: each report carries ``cpu_seconds`` spent since the previous one."""

    def __init__(self):
        self.last = _cpu_seconds()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        self.last = _cpu_seconds()  # the imports of collection are not a test's

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        now = _cpu_seconds()
        outcome.get_result().cpu_seconds = now - self.last  # travels to xdist's controller with the report
        self.last = now


class FileLines:
    def __init__(self, config):
        self.config = config
        self.total: dict = {}                 # file -> number of tests
        self.finished: Counter = Counter()    # file -> tests finished
        self.outcomes: dict = defaultdict(Counter)
        self.cpu: Counter = Counter()        # file -> CPU seconds
        self.started: dict = {}               # file -> (monotonic start, worker)
        self.files_done = 0
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ticker = None

    # -- how many tests each file has -----------------------------------------------------------
    def _count(self, nodeids) -> None:
        if not self.total:
            self.total = dict(Counter(_file(n) for n in nodeids))

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        if session.items:  # -n 0 (the xdist controller collects nothing)
            self._count([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self._count(ids)

    # -- progress -------------------------------------------------------------------------------
    def pytest_runtest_logstart(self, nodeid, location):
        with self.lock:
            self.started.setdefault(_file(nodeid), [time.monotonic(), None, 1])

    def pytest_runtest_logreport(self, report):
        path = _file(report.nodeid)
        gateway = getattr(getattr(report, "node", None), "gateway", None)  # the xdist worker that ran it
        word = self._outcome(report)
        with self.lock:
            if gateway is not None and path in self.started:
                self.started[path][1] = gateway.id
            if word:
                self.outcomes[path][word] += 1
            self.cpu[path] += getattr(report, "cpu_seconds", 0.0)
            if report.when != "teardown":
                return
            self.finished[path] += 1
            if self.finished[path] != self.total.get(path):
                return
            self.files_done += 1
            start, wid, _ = self.started.pop(path, (time.monotonic(), None, 1))
            parts = ", ".join(f"{n} {w}" for w, n in self.outcomes[path].items()) or "nothing run"
            line = (f"{path}: {parts} in {time.monotonic() - start:.0f} s, cpu {self.cpu[path]:.0f} s"
                    f"{f' ({wid})' if wid else ''} "
                    f"[{self.files_done}/{len(self.total)} files, {self._elapsed()} elapsed]")
        self._write(line)

    @staticmethod
    def _outcome(report) -> str | None:
        """The word this report adds to its file's line (None: nothing, e.g. a setup or teardown that passed)."""
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if xfail:
                return "xfailed" if report.outcome == "skipped" else "xpassed"
            return report.outcome
        if report.outcome == "failed":
            return "error"
        if report.when == "setup" and report.outcome == "skipped":
            return "xfailed" if xfail else "skipped"
        return None

    def _elapsed(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60}:{s % 60:02d}"

    def _write(self, line: str) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            if getattr(tr._tw, "width_of_current_line", 0):  # after -q's dots: a line of its own
                tr._tw.line()
            tr.write_line(line)
            tr._tw.flush()  # seen at once also when the output goes to a pipe or a file (a CI log)

    # -- still running ----------------------------------------------------------------------------
    def pytest_sessionstart(self, session):
        self.ticker = threading.Thread(target=self._tick, name="file-lines", daemon=True)
        self.ticker.start()

    def _tick(self) -> None:
        while not self.stop.wait(5):
            now, lines = time.monotonic(), []
            with self.lock:
                for path, entry in self.started.items():
                    start, wid, shown = entry
                    if now - start >= STILL_RUNNING * shown:
                        entry[2] = shown + 1
                        lines.append(f"{path}: still running after {now - start:.0f} s"
                                     f"{f' ({wid})' if wid else ''} [{self._elapsed()} elapsed]")
            for line in lines:
                self._write(line)

    def pytest_sessionfinish(self, session):
        self.stop.set()


def register(config) -> None:
    """Register :class:`CpuTime` where tests run and :class:`FileLines` in the reporting process, unless
    ``--no-file-lines`` or ``-v``."""
    if config.getoption("no_file_lines") or config.option.verbose > 0:
        return
    config.pluginmanager.register(CpuTime(), "sdm-cpu-time")  # (idle in xdist's controller, which runs no test)
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(FileLines(config), "sdm-file-lines")
