"""MLX distributed helpers: the process group, rank-0-only work and watched collectives.

Under ``mlx.launch`` (ring backend over TCP / Thunderbolt, or MPI) :func:`group` is the group of
every rank; a plain ``python`` run is a group of one, where every helper below is the identity.
Only MLX's own collectives move data (``mx.distributed.all_gather`` / ``all_sum``); nothing here is
a transport.

Exactness: ``all_gather`` copies bytes, so arrays are sent as their raw 64-bit patterns
(:func:`all_gather_rows` views float64 as int64 and back) — float64 distances arrive bit for bit.
Sums are taken over int64 only.

Watchdog: every collective runs on one worker thread while the calling thread waits at most
``timeout`` seconds (:data:`DEFAULT_TIMEOUT`, or the estimator setting ``shard_timeout``).  A peer
that died makes MLX's ring raise "connection to a peer was lost" within about a second; a peer that
hangs (or never reaches the collective) would block forever — both end in a
:class:`DistributedError` naming this rank, the operation and the timeout.  (``mlx.launch``
also stops every rank with SIGTERM once one exits with an error.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import signal
import threading

import numpy as np

from .errors import SDMError

#: Seconds a collective may wait for the other ranks before :class:`DistributedError` (setting: shard_timeout).
DEFAULT_TIMEOUT = 300.0


class DistributedError(SDMError):
    """A collective that failed or timed out: another rank died, hangs, or holds different data."""


_GROUP = None


def group():
    """The MLX distributed group (``mx.distributed.init()``, initialised once); size 1 outside ``mlx.launch``."""
    global _GROUP
    if _GROUP is None:
        import mlx.core as mx

        _GROUP = mx.distributed.init()
    return _GROUP


def rank(grp=None) -> int:
    """This process's rank in ``grp`` (default: :func:`group`; 0 outside ``mlx.launch``)."""
    return (grp or group()).rank()


def size(grp=None) -> int:
    """Number of ranks in ``grp`` (default: :func:`group`; 1 outside ``mlx.launch``)."""
    return (grp or group()).size()


def is_distributed() -> bool:
    """True under ``mlx.launch`` with more than one rank."""
    return size() > 1


def is_primary() -> bool:
    """True on rank 0 (and in a single process): the rank that writes artifacts and prints results."""
    return rank() == 0


def launched_rank() -> int | None:
    """The rank ``mlx.launch`` gave this process (env ``MLX_RANK``), without initialising MLX; None if not launched."""
    value = os.environ.get("MLX_RANK")
    return int(value) if value is not None and value.isdigit() else None


@contextlib.contextmanager
def quiet_unless_primary():
    """Under ``mlx.launch``, silence stdout and stderr of ranks > 0 inside the block (rank 0 reports);
    exceptions still leave the block, so their messages are printed by the caller on every rank."""
    if not launched_rank():
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


def install_sigterm_message() -> None:
    """Under ``mlx.launch``: SIGTERM (sent by the launcher to every rank once one fails or is killed) raises a
    :class:`DistributedError` naming this rank, so the CLI ends with a message and a non-zero status."""
    r = launched_rank()
    if r is None or threading.current_thread() is not threading.main_thread():
        return

    def stopped(signum, frame):
        raise DistributedError(f"rank {r}: stopped by SIGTERM: mlx.launch stops every rank once one fails or is "
                               "killed (the cause is the other rank's message)")

    signal.signal(signal.SIGTERM, stopped)


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of rank ``rank``'s contiguous shard of ``n`` rows over ``size`` ranks (sizes differ by ≤ 1)."""
    n, rank, size = int(n), int(rank), int(size)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# -- the watched worker thread -------------------------------------------------------------------
class _Worker:
    """One daemon thread that runs every collective (MLX streams are per thread: it keeps its own)."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.busy = False
        threading.Thread(target=self._loop, name="sdm-mlx-collectives", daemon=True).start()

    def _loop(self):
        while True:
            fn, args, out = self.jobs.get()
            try:
                out.put((True, fn(*args)))
            except BaseException as e:  # handed to the waiting thread
                out.put((False, e))

    def run(self, fn, args, what: str, timeout: float, grp):
        r, n = rank(grp), size(grp)
        if self.busy:
            raise DistributedError(f"rank {r}: a timed-out collective is still pending; "
                                   "the distributed run cannot continue")
        out: queue.Queue = queue.Queue()
        self.jobs.put((fn, args, out))
        self.busy = True
        try:
            ok, value = out.get(timeout=timeout)
        except queue.Empty:
            raise DistributedError(
                f"rank {r} of {n}: no answer from the other ranks within {timeout:g} s during {what}: "
                "another rank died, hangs or is far behind (raise the timeout with shard_timeout)") from None
        self.busy = False
        if not ok:
            if isinstance(value, DistributedError):
                raise value
            raise DistributedError(f"rank {r} of {n}: {what} failed: {value} "
                                   "(another rank died or was stopped)") from None
        return value


_WORKER: _Worker | None = None


def _watched(fn, a, what: str, timeout: float | None, grp):
    global _WORKER
    if _WORKER is None:
        _WORKER = _Worker()
    grp = grp or group()
    return _WORKER.run(fn, (a, grp), what, DEFAULT_TIMEOUT if timeout is None else float(timeout), grp)


def _gather_int64(a: np.ndarray, grp) -> np.ndarray:
    import mlx.core as mx

    out = mx.distributed.all_gather(mx.array(a), group=grp, stream=mx.cpu)
    mx.eval(out)
    return np.array(out)


def _sum_int64(a: np.ndarray, grp) -> np.ndarray:
    import mlx.core as mx

    out = mx.distributed.all_sum(mx.array(a), group=grp, stream=mx.cpu)
    mx.eval(out)
    return np.array(out)


# -- collectives -------------------------------------------------------------------------------
def all_gather_rows(a: np.ndarray, what: str = "all_gather", timeout: float | None = None, grp=None) -> np.ndarray:
    """[size, *a.shape]: every rank's ``a`` (same shape and 8-byte dtype on every rank), bit for bit."""
    a = np.ascontiguousarray(a)
    if a.dtype.itemsize != 8:
        raise TypeError(f"all_gather_rows sends 8-byte values, got {a.dtype}")
    if size(grp) == 1:
        return a[None].copy()
    bits = a.view(np.int64).reshape(1, -1)
    out = _watched(_gather_int64, bits, what, timeout, grp)
    return out.view(a.dtype).reshape((size(grp),) + a.shape)


def all_sum_int(a: np.ndarray, what: str = "all_sum", timeout: float | None = None, grp=None) -> np.ndarray:
    """The exact int64 sum of ``a`` over the ranks."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    if size(grp) == 1:
        return a.copy()
    return _watched(_sum_int64, a.reshape(-1), what, timeout, grp).reshape(a.shape)


def smallest_pairs(dist: np.ndarray, index: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the ``m`` smallest (float64 distance, index) pairs of [N, c] arrays, ordered by (distance, index).

    Index −1 marks padding: it sorts after every real index of equal distance and is returned as −1.
    """
    big = np.iinfo(np.int64).max
    idx = np.where(index < 0, big, index)
    order = np.lexsort((idx, dist), axis=-1)[:, :m]
    out_i = np.take_along_axis(idx, order, 1)
    return np.take_along_axis(dist, order, 1), np.where(out_i == big, -1, out_i)


def merge_smallest(dist: np.ndarray, index: np.ndarray, what: str = "merge", timeout: float | None = None,
                   grp=None) -> tuple[np.ndarray, np.ndarray]:
    """The global m smallest (float64 distance, int64 global index) pairs per row, from each rank's local m.

    ``dist`` [N, m] float64 and ``index`` [N, m] int64 hold each rank's own m smallest ((inf, −1): none).
    One all_gather of their bit patterns, then a (distance, index) sort: exact, since the global m smallest
    are among the union of the local m smallest.
    """
    dist = np.asarray(dist, np.float64)
    packed = np.stack([dist.view(np.int64), np.asarray(index, np.int64)])  # [2, N, m]
    every = all_gather_rows(packed, what, timeout, grp)  # [size, 2, N, m]
    d = np.concatenate(list(every[:, 0].view(np.float64)), axis=1)
    i = np.concatenate(list(every[:, 1]), axis=1)
    return smallest_pairs(d, i, dist.shape[1])


def merge_min_pairs(dist: np.ndarray, index: np.ndarray, what: str = "merge", timeout: float | None = None,
                    grp=None) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the smallest (float64 distance, global index) pair over the ranks ([N] arrays; (inf, −1): none)."""
    d, i = merge_smallest(np.asarray(dist)[:, None], np.asarray(index)[:, None], what, timeout, grp)
    return d[:, 0], i[:, 0]


def fingerprint(*arrays) -> int:
    """A 63-bit digest of the arrays' shapes, dtypes and bytes (to check replicated data across ranks)."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(repr((a.shape, a.dtype.str)).encode())
        h.update(a.tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def check_same(what: str, *arrays, timeout: float | None = None, grp=None) -> None:
    """Raise :class:`DistributedError` unless every rank holds the same ``arrays`` (replicated data)."""
    if size(grp) == 1:
        return
    digest = np.array([fingerprint(*arrays)], dtype=np.int64)
    digests = all_gather_rows(digest, f"checking {what}", timeout, grp)[:, 0]
    differ = np.flatnonzero(digests != digests[0]).tolist()
    if differ:
        raise DistributedError(
            f"rank(s) {differ} hold different {what} than rank 0: every rank must run the same command on the "
            "same data (replicated inputs, seeds and settings)")
