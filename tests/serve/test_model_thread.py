"""``ModelThread`` gives the heap's free pages back (``HeapTrimmer``) once it idles after work, not while idle
without work, and keeps running submitted calls in order."""

from __future__ import annotations

import threading
import time

from sdm_mlx.runtime.allocator import HeapTrimmer
from sdm_mlx.serve.engine import ModelThread


def test_an_idle_model_thread_releases_once_after_work_and_not_again():
    released = threading.Event()
    calls = []

    def release():
        calls.append(time.monotonic())
        released.set()
        return True

    thread = ModelThread(name="test-model", trimmer=HeapTrimmer(every_s=0.05, release=release))
    assert [thread.submit(lambda i=i: i * i).result(timeout=10) for i in range(5)] == [0, 1, 4, 9, 16]
    assert released.wait(timeout=10)
    time.sleep(0.3)  # idle, nothing done since the release: no second one
    assert len(calls) == 1
    assert thread.submit(lambda: "again").result(timeout=10) == "again"
    deadline = time.monotonic() + 10
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.05
    assert thread.close(timeout=10)
