"""Progress reporting on stderr: a bar with rate and ETA, and a quiet switch."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "embed", unit="doc") as p: p.update(n)`` — writes to stderr.

    ``enabled=False`` makes every call a no-op (for ``quiet`` modes and tests).
    """

    def __init__(self, total: int | None, desc: str = "", unit: str = "it", enabled: bool = True, stream=None):
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.stream = stream or sys.stderr
        self.n = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.2 or (self.total and self.n >= self.total)):
            self._last = now
            self._draw(now, postfix)

    def _draw(self, now: float, postfix: dict) -> None:
        elapsed = now - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        extra = " ".join(f"{k}={v}" for k, v in postfix.items())
        if self.total:
            frac = min(1.0, self.n / self.total)
            bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
            eta = (self.total - self.n) / rate if rate > 0 else float("nan")
            line = f"\r{self.desc} [{bar}] {self.n}/{self.total} {rate:.1f} {self.unit}/s ETA {eta:.0f}s {extra}"
        else:
            line = f"\r{self.desc} {self.n} {self.unit} {rate:.1f} {self.unit}/s {extra}"
        self.stream.write(line)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter(), {})
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def log(message: str, enabled: bool = True) -> None:
    """A progress line on stderr."""
    if enabled:
        print(message, file=sys.stderr, flush=True)
