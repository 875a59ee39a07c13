"""A pipeline stage never outlives its driver as a second writer: SIGTERM reaches the stage, and a stage left
running (its driver killed with SIGKILL) still holds the run directory's lock.

Measured before the fix: a driver killed with ``pkill -f 'sdm-mlx pipeline'`` left its ``answers`` stage running;
a new driver took the lock and started a second ``answers`` stage, and the two appended the same 320 rows twice.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time

DRIVER = textwrap.dedent("""
    import sys
    from sdm_mlx.pipeline.runner import _Lock, run_measured
    lock_path, pid_file = sys.argv[1], sys.argv[2]
    child = [sys.executable, "-c",
             "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)", pid_file]
    with _Lock(lock_path) as lock:
        rc, usage = run_measured(child, keep_fds=(lock.f.fileno(),))
    print("driver ended", rc)
""")


def _start_driver(tmp_path):
    lock, pid_file = tmp_path / ".pipeline.lock", tmp_path / "stage.pid"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(lock), str(pid_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert driver.poll() is None, driver.communicate()
        assert time.time() < deadline, "the stage never started"
        time.sleep(0.1)
    return driver, lock, int(pid_file.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped by its parent) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _lock_is_free(lock) -> bool:
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_sigterm_to_the_driver_stops_its_stage(tmp_path):
    driver, lock, stage = _start_driver(tmp_path)
    assert not _lock_is_free(lock)
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=30) == 143
    deadline = time.time() + 10
    while _alive(stage) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(stage), "the stage outlived its driver's SIGTERM"
    assert _lock_is_free(lock)


def test_a_stage_outliving_a_killed_driver_keeps_the_lock(tmp_path):
    driver, lock, stage = _start_driver(tmp_path)
    try:
        driver.kill()  # SIGKILL: no chance to pass it on
        driver.wait(timeout=30)
        assert _alive(stage)
        assert not _lock_is_free(lock), "a second driver could start a second writer beside the orphaned stage"
    finally:
        os.kill(stage, signal.SIGKILL)
    deadline = time.time() + 10
    while not _lock_is_free(lock) and time.time() < deadline:
        time.sleep(0.1)
    assert _lock_is_free(lock)
