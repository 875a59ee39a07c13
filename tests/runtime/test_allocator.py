"""``sdm_mlx.runtime.allocator``: glibc's mmap and trim thresholds are set once on Linux, only for processes that
ask (the batch commands); a server's arenas, heap trims, frozen objects and MLX buffer cache; each opt-out is
honoured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sdm_mlx.runtime import allocator


def _run(code: str, *args: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env}, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux only")
def test_thresholds_are_set_once_and_buffers_still_work():
    code = ("import numpy as np; from sdm_mlx.runtime.allocator import keep_freed_buffers as k;"
            "a = k(); b = k(); x = np.ones((4096, 1024), np.float32); del x; y = np.ones((4096, 1024), np.float32);"
            "print(a, b, float(y.sum()))")
    first, second, total = _run(code, SDM_MLX_KEEP_FREED_BUFFERS="1").split()
    if first == "False":  # not glibc (e.g. musl): nothing is set, nothing breaks
        assert second == "False"
    else:
        assert first == second == "True"
    assert float(total) == 4096 * 1024


def test_opt_out_leaves_the_allocator_alone():
    code = "from sdm_mlx.runtime.allocator import keep_freed_buffers as k; print(k())"
    assert _run(code, SDM_MLX_KEEP_FREED_BUFFERS="0") == "False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux only")
def test_load_model_applies_it_only_when_the_process_asked(tiny_phi3_path):
    """A server (nothing asked) keeps glibc's defaults after load_model; a batch command's process sets them."""
    code = ("import sys; from sdm_mlx.runtime import allocator as a; from sdm_mlx.llm.model import load_model;"
            "ask = sys.argv[1] == 'ask'; ask and a.keep_freed_buffers_after_load();"
            "load_model(sys.argv[2]); print(a._done)")
    env = {**os.environ, "SDM_MLX_KEEP_FREED_BUFFERS": "1"}
    run = lambda mode: subprocess.run([sys.executable, "-c", code, mode, tiny_phi3_path], capture_output=True,  # noqa: E731
                                      text=True, timeout=300, env=env, check=True).stdout.strip().splitlines()[-1]
    assert run("serve") == "False"
    if _run("from sdm_mlx.runtime.allocator import keep_freed_buffers as k; print(k())") == "True":
        assert run("ask") == "True"


def test_the_batch_commands_ask_and_serve_does_not():
    root = os.path.join(os.path.dirname(allocator.__file__), "..", "commands")
    text = {name: open(os.path.join(root, f"{name}.py"), encoding="utf-8").read()
            for name in ("embed", "network_train", "generate", "serve")}
    assert all("keep_freed_buffers_after_load()" in text[n] for n in ("embed", "network_train", "generate"))
    assert "keep_freed_buffers" not in text["serve"]


def test_thresholds_fit_in_a_c_int():
    assert 0 < allocator.MMAP_THRESHOLD_BYTES < 2**31 and 0 < allocator.TRIM_THRESHOLD_BYTES < 2**31


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_heap_trimmer_releases_only_after_work_and_at_most_every_period():
    clock, calls = _Clock(), []
    trimmer = allocator.HeapTrimmer(every_s=10.0, release=lambda: calls.append(clock.now) or True, clock=clock)
    assert trimmer.due_in() is None and not trimmer.maybe_release()  # no work yet: nothing to give back
    trimmer.worked()
    clock.now += 4.0
    assert trimmer.due_in() == pytest.approx(6.0) and not trimmer.maybe_release()
    clock.now += 6.0
    assert trimmer.due_in() == 0.0 and trimmer.maybe_release()
    assert calls == [110.0] and trimmer.releases == 1
    clock.now += 60.0  # idle for a minute: no work since the release, so no release
    assert trimmer.due_in() is None and not trimmer.maybe_release()
    trimmer.worked()
    assert trimmer.due_in() == 0.0 and trimmer.maybe_release() and calls == [110.0, 170.0]


@pytest.mark.parametrize("every_s", [0, -1.0, float("nan")])
def test_heap_trimmer_refuses_a_period_that_is_not_positive(every_s):
    with pytest.raises(ValueError, match="every_s must be > 0"):
        allocator.HeapTrimmer(every_s=every_s)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_release_free_memory_gives_freed_heap_pages_back():
    """Small blocks freed in the middle of the heap stay resident until malloc_trim; the opt-out is honoured."""
    code = ("import ctypes, sys; from sdm_mlx.runtime.allocator import release_free_memory as r\n"
            "def rss():\n"
            "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')) / 1024\n"
            "libc = ctypes.CDLL('libc.so.6'); libc.malloc.restype = ctypes.c_void_p\n"
            "libc.free.argtypes = (ctypes.c_void_p,); libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)\n"
            "blocks = [libc.malloc(60000) for _ in range(4000)]\n"
            "[libc.memset(b, 1, 60000) for b in blocks]\n"
            "[libc.free(b) for b in blocks[:-1]]\n"  # the last block pins the heap's top
            "before = rss(); done = r(); after = rss(); print(done, before - after)")
    done, freed = _run(code, SDM_MLX_TRIM_HEAP="1").split()
    if done == "True":  # glibc: about 229 MiB were freed below the pinned top block
        assert float(freed) > 100, freed
    off, freed_off = _run(code, SDM_MLX_TRIM_HEAP="0").split()
    assert off == "False" and abs(float(freed_off)) < 20


_ARENAS = """
import ctypes, os, sys, tempfile, threading
from sdm_mlx.runtime.allocator import limit_arenas
done = limit_arenas(2) if sys.argv[1] == "limit" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
barrier = threading.Barrier(8)
def work():
    barrier.wait()
    blocks = [libc.malloc(256) for _ in range(20000)]
    for b in blocks:
        libc.free(b)
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
path = os.path.join(tempfile.mkdtemp(), "info.xml")
fp = libc.fopen(path.encode(), b"w"); libc.malloc_info(0, fp); libc.fclose(fp)
print(done, open(path).read().count("<heap nr="))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="M_ARENA_MAX is glibc's")
def test_limit_arenas_caps_the_arenas_of_threads_started_after_it():
    done, arenas = _run(_ARENAS, "limit", SDM_MLX_TRIM_HEAP="1").split()
    if done == "False":  # not glibc: nothing is set
        return
    assert done == "True" and int(arenas) <= 2
    _, control = _run(_ARENAS, "none").split()  # glibc gives each new allocating thread an arena of its own
    assert int(control) > 2
    off, arenas_off = _run(_ARENAS, "limit", SDM_MLX_TRIM_HEAP="0").split()
    assert off == "False" and int(arenas_off) > 2


def test_freeze_loaded_objects_leaves_full_collections_only_the_new_objects():
    """After the freeze, a cycle made later is still collected, and a full collection walks only new objects."""
    code = ("import gc; from sdm_mlx.runtime.allocator import freeze_loaded_objects as f\n"
            "loaded = [[i] for i in range(200000)]\n"
            "n = f()\n"
            "class Node: pass\n"
            "a, b = Node(), Node(); a.other, b.other = b, a; del a, b\n"
            "found = gc.collect()\n"
            "print(n >= 200000, found >= 2, len(gc.get_objects()) < 100000)")  # the walked objects: not the frozen
    assert _run(code) == "True True True"


def test_a_release_that_raises_is_counted_and_does_not_reach_the_owner():
    clock = _Clock()

    def broken():
        raise OSError("no")

    trimmer = allocator.HeapTrimmer(every_s=1.0, release=broken, clock=clock)
    trimmer.worked()
    clock.now += 1.0
    assert not trimmer.maybe_release() and (trimmer.failures, trimmer.releases) == (1, 0)
    assert trimmer.due_in() is None  # the next try waits for new work and the period


_BUFFER_CACHE = """
import mlx.core as mx
from sdm_mlx.runtime.allocator import limit_buffer_cache
done = limit_buffer_cache()
for n in (1000, 3000, 7000):  # freed buffers of three sizes: kept by MLX's cache, or handed to glibc
    x = mx.ones((n, 64)) * 2.0
    mx.eval(x)
    del x
print(done, mx.get_cache_memory())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the server's setting is for glibc's heap")
def test_a_server_hands_freed_buffers_to_glibc_and_the_limit_can_be_set_or_opted_out():
    done, cached = _run(_BUFFER_CACHE, SDM_MLX_TRIM_HEAP="1").split()
    if done == "None":
        pytest.skip("not glibc, or not computing on the CPU: MLX's default is left alone")
    assert (done, cached) == ("0", "0")
    done, cached = _run(_BUFFER_CACHE, SDM_MLX_TRIM_HEAP="1", SDM_MLX_BUFFER_CACHE_BYTES="33554432").split()
    assert done == "33554432" and int(cached) > 0
    done, cached = _run(_BUFFER_CACHE, SDM_MLX_TRIM_HEAP="0").split()
    assert done == "None" and int(cached) > 0  # the opt-out keeps MLX's own 32 MiB cache


@pytest.mark.parametrize("raw", ["lots", "-1", "1.5", "\u00b2"])
def test_a_bad_buffer_cache_setting_names_the_variable_and_the_fix(raw, monkeypatch):
    import mlx.core as mx

    if allocator._mallopt is None or mx.metal.is_available():
        pytest.skip("not glibc, or not computing on the CPU: the setting is not read")
    monkeypatch.setenv("SDM_MLX_BUFFER_CACHE_BYTES", raw)
    monkeypatch.setenv("SDM_MLX_TRIM_HEAP", "1")
    with pytest.raises(allocator.InputError, match="SDM_MLX_BUFFER_CACHE_BYTES.*unset it"):
        allocator.limit_buffer_cache()
    with pytest.raises(allocator.InputError, match="n must be.*pass 0 or more"):
        allocator.limit_buffer_cache(-1)
