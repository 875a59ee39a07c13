"""Run ``python -m sdm_mlx <verb> ...`` as a real server subprocess for tests and benchmarks (bounded in time).

``ServerProcess(args)`` starts the command with ``--port 0``-style arguments
given by the caller, waits (up to ``timeout`` seconds) for the
``listening on http://HOST:PORT`` line on stderr, and exposes ``url``;
``stop()`` sends SIGTERM and returns the exit code (killing the process if it
does not exit within its timeout).  Stderr is collected in ``lines``.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

LISTENING = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    def __init__(self, argv: list, timeout: float = 60.0, env: dict | None = None):
        self.argv = list(argv)
        self.lines: list = []
        self._lines: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        self.url = self._wait_ready(timeout)

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                self.proc.wait(timeout=10)
                raise RuntimeError(f"server exited ({self.proc.returncode}) before it was ready:\n"
                                   + "".join(self.lines))
            m = LISTENING.search(line)
            if m:
                return m.group(1)
        self.kill()
        raise TimeoutError(f"server not ready after {timeout}s:\n" + "".join(self.lines))

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig``, wait for the exit; return the exit code (the process is killed past ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        self._close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._close()

    def _close(self) -> None:
        self._pump_thread.join(timeout=10)
        if not self._pump_thread.is_alive():
            self.proc.stderr.close()


def sdm_mlx(verb: str, *args) -> list:
    """The argv of ``python -m sdm_mlx <verb> args...`` with this interpreter."""
    return [sys.executable, "-m", "sdm_mlx", verb, *map(str, args)]
