"""MLX distributed helpers: the process group, rank-0-only work, watched collectives — the one layer over
``mlx.core.distributed`` that the sharded index (:mod:`sdm_mlx.index.sharded`) and data-parallel network
training (:mod:`sdm_mlx.network.data_parallel`) build on.

Under ``mlx.launch`` (ring backend over TCP / Thunderbolt, or MPI) :func:`group` is the group of
every rank; a plain ``python`` run is a group of one, where every helper below is the identity.
Only MLX's own collectives move data (``mx.distributed.all_gather`` / ``all_sum`` / ``all_max``);
nothing here is a transport.

Exactness: ``all_gather`` copies bytes; 8-byte arrays are sent as their raw 64-bit patterns
(float64 viewed as int64 and back), so float64 distances arrive bit for bit.  Exact sums are taken
over int64.

Failure bound (one mechanism, :func:`wait`): every wait for a collective — the host-side ones below
and the collectives inside a compiled training step alike — runs on the calling thread under a
deadline kept by one watchdog thread (:class:`Watchdog`).  A peer that died makes MLX's ring raise
"connection to a peer was lost", usually within a second: :func:`wait` turns it into a
:class:`DistributedError`.  A peer that hangs (SIGSTOP, an endless loop), or a collective started
after a peer died, would block forever inside MLX, where no Python exception can reach: after
``timeout`` seconds (:data:`DEFAULT_TIMEOUT`, settings ``shard_timeout`` / ``distributed_timeout``)
the watchdog prints a message naming this rank, the operation and the timeout, and ends the process
with status :data:`WATCHDOG_EXIT`.  SIGTERM (``mlx.launch`` stops every rank once one fails) during
such a wait ends the process the same way at once (:func:`install_sigterm_message`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import select
import signal
import threading
import time

import numpy as np

from ..errors import InputError, SDMError

#: Seconds a rank waits in one collective for the other ranks under ``mlx.launch`` before it stops (a dead or
#: hung rank).  The one default of the ``shard_timeout`` and ``distributed_timeout`` settings.
DISTRIBUTED_TIMEOUT = 900.0
#: The help text of those settings (one concept, one text)
TIMEOUT_HELP = ("seconds a rank waits in one collective for the other ranks before it stops (a dead or hung rank; "
                "docs/distributed.md)")
DEFAULT_TIMEOUT = DISTRIBUTED_TIMEOUT
#: Exit status of a rank that the watchdog stops (timeout, or SIGTERM during a collective).
WATCHDOG_EXIT = 75
#: How MLX's distributed backends prefix their errors ("[ring] connection to a peer was lost").
_BACKEND_ERROR = re.compile(r"\[(ring|mpi|jaccl|nccl)\]")


class DistributedError(SDMError):
    """A collective that failed (another rank died or was stopped) or ranks that hold different replicated data.

    (A collective that times out cannot raise: the watchdog ends the process, see :class:`Watchdog`.)
    """


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
    :class:`DistributedError` naming this rank, so the CLI ends with a message and a non-zero status.

    A rank blocked inside a collective cannot run that handler (MLX holds the main thread), so the signal is
    also written to the watchdog's wake-up pipe: during a watched wait the watchdog ends the process at once.
    """
    r = launched_rank()
    if r is None or threading.current_thread() is not threading.main_thread():
        return
    reason = "mlx.launch stops every rank once one fails or is killed (the cause is the other rank's message)"

    def stopped(signum, frame):
        raise DistributedError(f"rank {r}: stopped by SIGTERM: {reason}")

    signal.signal(signal.SIGTERM, stopped)
    signal.set_wakeup_fd(watchdog().wake_fd, warn_on_full_buffer=False)


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of rank ``rank``'s contiguous shard of ``n`` rows over ``size`` ranks (sizes differ by ≤ 1)."""
    n, rank, size = int(n), int(rank), int(size)
    if size < 1 or not 0 <= rank < size:
        raise InputError(f"rank {rank} is not in 0..{size - 1}")
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# -- the watchdog: a bounded wait for every collective ------------------------------------------
class Watchdog:
    """One daemon thread that ends the process with a message when a guarded wait outlives its deadline.

    MLX offers no way to cancel a collective: a rank blocked in one (a hung peer, or a collective started
    after a peer died) can only stop.  The thread wakes five times a second, or at once when a signal
    arrives on :attr:`wake_fd` (``signal.set_wakeup_fd``; SIGTERM during a guarded wait stops the rank too).
    The message goes to file descriptor 2 itself, so a rank whose ``sys.stderr`` is silenced still says why.
    """

    def __init__(self):
        self._state: tuple[float, str, float, str] | None = None  # (deadline, what, timeout, label), set at once
        self._wake_r, self.wake_fd = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self.wake_fd, False)
        threading.Thread(target=self._watch, name="sdm-mlx-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def guard(self, what: str, timeout: float, label: str):
        """Within the block, stop the process after ``timeout`` seconds (``label``: "rank r of n")."""
        saved = self._state
        self._state = (time.monotonic() + float(timeout), what, float(timeout), label)
        try:
            yield
        finally:
            self._state = saved

    def _watch(self) -> None:
        while True:
            readable, _, _ = select.select([self._wake_r], [], [], 0.2)
            signals = b""
            if readable:
                with contextlib.suppress(BlockingIOError):
                    signals = os.read(self._wake_r, 256)
            state = self._state
            if state is None:
                continue
            deadline, what, timeout, label = state
            if signal.SIGTERM in signals:
                self._stop(label, f"stopped by SIGTERM during {what}: mlx.launch stops every rank once one fails "
                                  "or is killed (the cause is the other rank's message)")
            if time.monotonic() > deadline:
                self._stop(label, f"no answer from the other ranks within {timeout:g} s during {what}: another rank "
                                  "died, hangs or is far behind; stopping (a longer wait: the shard_timeout / "
                                  "distributed_timeout setting, docs/distributed.md)")

    @staticmethod
    def _stop(label: str, message: str) -> None:
        os.write(2, f"sdm-mlx: error: {label}: {message}\n".encode())
        os._exit(WATCHDOG_EXIT)


_WATCHDOG: Watchdog | None = None
_WATCHDOG_LOCK = threading.Lock()


def watchdog() -> Watchdog:
    """The process's one :class:`Watchdog` (its thread starts on first use)."""
    global _WATCHDOG
    with _WATCHDOG_LOCK:
        if _WATCHDOG is None:
            _WATCHDOG = Watchdog()
    return _WATCHDOG


def wait(*arrays, what: str = "a collective", timeout: float | None = None, grp=None) -> None:
    """``mx.eval(*arrays)`` — which runs the collectives in their graph — under the watchdog's deadline.

    A backend error (a peer died) becomes a :class:`DistributedError`; a wait longer than ``timeout``
    seconds (default :data:`DEFAULT_TIMEOUT`) ends the process (:class:`Watchdog`).
    """
    import mlx.core as mx

    grp = grp or group()
    if grp.size() == 1:
        mx.eval(*arrays)
        return
    label = f"rank {grp.rank()} of {grp.size()}"
    try:
        with watchdog().guard(what, DEFAULT_TIMEOUT if timeout is None else timeout, label):
            mx.eval(*arrays)
    except RuntimeError as e:
        if not _BACKEND_ERROR.search(str(e)):
            raise
        raise DistributedError(f"{label}: {what} failed: {e}: another rank died or was stopped (see its own "
                               "message); this rank stops too") from None


def _collective(op: str, a: np.ndarray, what: str, timeout: float | None, grp) -> np.ndarray:
    """``mx.distributed.<op>`` (``all_sum``, ``all_max``, ``all_gather``) of a host array, watched by :func:`wait`."""
    import mlx.core as mx

    out = getattr(mx.distributed, op)(mx.array(a), group=grp, stream=mx.cpu)
    wait(out, what=what, timeout=timeout, grp=grp)
    return np.array(out)


# -- collectives -------------------------------------------------------------------------------
def all_sum(a, what: str = "all_sum", timeout: float | None = None, grp=None) -> np.ndarray:
    """The element-wise sum of ``a`` over the ranks, in ``a``'s dtype (int64: exact)."""
    a = np.ascontiguousarray(a)
    if size(grp) == 1:
        return a.copy()
    return _collective("all_sum", a.reshape(-1), what, timeout, grp).reshape(a.shape)


def all_sum_int(a, what: str = "all_sum", timeout: float | None = None, grp=None) -> np.ndarray:
    """The exact int64 sum of ``a`` over the ranks."""
    return all_sum(np.asarray(a, dtype=np.int64), what, timeout, grp)


def all_max(a, what: str = "all_max", timeout: float | None = None, grp=None) -> np.ndarray:
    """The element-wise maximum of ``a`` over the ranks, in ``a``'s dtype."""
    a = np.ascontiguousarray(a)
    if size(grp) == 1:
        return a.copy()
    return _collective("all_max", a.reshape(-1), what, timeout, grp).reshape(a.shape)


def all_gather_rows(a: np.ndarray, what: str = "all_gather", timeout: float | None = None, grp=None) -> np.ndarray:
    """[size, *a.shape]: every rank's ``a`` (same shape and dtype on every rank), bit for bit."""
    a = np.ascontiguousarray(a)
    if size(grp) == 1:
        return a[None].copy()
    bits = a.view(np.int64) if a.dtype.itemsize == 8 else a  # float64 travels as its 64-bit pattern
    out = _collective("all_gather", bits.reshape(1, -1), what, timeout, grp)
    return out.view(a.dtype).reshape((size(grp),) + a.shape)


def gather_rows(local, what: str = "all_gather", timeout: float | None = None, grp=None) -> np.ndarray:
    """Every rank's rows (axis 0) concatenated in rank order; ranks may hold different row counts.

    A rank with no rows may not know the row shape (e.g. an empty (0, 0) array): the widest is taken.
    """
    local = np.asarray(local)
    if size(grp) == 1:
        return local
    shape = local.shape[1:] if local.shape[0] else (0,) * (local.ndim - 1)
    layout = all_gather_rows(np.array([local.shape[0], *shape], dtype=np.int64), f"{what} (row counts)",
                             timeout, grp)
    counts, width = layout[:, 0], tuple(int(x) for x in layout[:, 1:].max(axis=0))
    padded = np.zeros((int(counts.max()),) + width, dtype=local.dtype)
    if local.shape[0]:
        padded[: local.shape[0]] = local
    every = all_gather_rows(padded, what, timeout, grp)
    return np.concatenate([every[r, : counts[r]] for r in range(size(grp))], axis=0)


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
