"""Data-parallel SDM-network training over ``mlx.core.distributed`` (docs/network-data-parallel.md).

Under ``mlx.launch -n N`` every rank runs the same Alg. 4 (:mod:`.trainer`) on the same
inputs; without a launcher ``mx.distributed.init()`` gives a group of size 1 and nothing
here communicates.  What is split and what is replicated:

* **Split by whole batches**: the verifier's force-decoded features of the verification rows,
  the token-cache forward pass over the y = 1 training documents,
  the per-epoch greedy generations whose q, d feed the loss, and the calibration generations
  of Alg. 4's selection count.  These functions sort their rows by length and pad per batch,
  so a row's float result depends on its batch: rank r of N takes the batches
  ``[r·nb/N, (r+1)·nb/N)`` of the single-process batch order (:meth:`DataParallel.aligned_parts`)
  and gets bit-identical force-decoded features.  Generations batch continuously (a prompt joins a running
  batch when a row stops), so where a rank's running batch differs from the one-process run's, a row's decode
  states differ by float rounding on CPUs whose BLAS rounds by row count (measured: up to 8e-7 relative).
  The token cache and per-document q, d are
  all-gathered back into row order; the selection count and its parts are ``all_sum``-med, so
  every rank keeps the same epoch.
* **Split per mini-batch**: the global token permutation (same seed on every rank) is cut
  into global mini-batches of ``batch_size`` tokens exactly as in one process; rank r
  takes the contiguous slice ``[r·B/N, (r+1)·B/N)`` of each.
* **Replicated**: the verification estimator (trained identically on every rank on the
  gathered, bit-identical features; its SGD turns feature differences of 1e-6 — what another
  batch composition gives — into different q, hence the whole-batch split), the token cache
  after the gather, W_pos and the Adam state (identical because every rank applies the
  same summed gradient).

The loss of ``eq:sdm-network-next-token-training-loss`` is not a plain per-token mean:
R' = sqrt(max(R, 1)^s) rescales the batch mean R with s = ln L / ln R from the batch means.
Its gradient is ``(Σ ∇nll_n + β c Σ ∇‖·‖_n) / B`` with ``c = ∂R'/∂R`` at the *global* L and
R, so a step first ``all_sum``-s the two local sums (two floats), then differentiates the
local part ``(S_L + β c S_R) / B`` and ``all_sum``-s the W_pos gradient: the sum over ranks
is the single-process gradient up to float summation order.

The group, the generic collectives, and what happens when a rank dies or hangs (one bounded wait for
every collective, the ``distributed_timeout`` setting) are :mod:`sdm_mlx.runtime.distributed`'s.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from ..runtime import distributed as dist
from .loss import network_loss_terms, rescaled_regularizer
from ..errors import InputError


class DataParallel:
    """This rank of the ``mx.distributed`` group, with the group and the timeout bound to the few collectives
    Alg. 4 needs (:mod:`sdm_mlx.runtime.distributed` does the work and bounds every wait: ``timeout`` seconds,
    default the ``distributed_timeout`` setting's), and the whole-batch splits of the network trainer.
    """

    def __init__(self, group=None, timeout: float | None = None):
        self.group = group if group is not None else dist.group()
        self.rank = int(self.group.rank())
        self.size = int(self.group.size())
        self.timeout = dist.DEFAULT_TIMEOUT if timeout is None else float(timeout)

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def writer(self) -> bool:
        """Rank 0 alone writes the run directory, prints and shows progress."""
        return self.rank == 0

    def wait(self, *arrays, what: str = "a collective") -> None:
        """``mx.eval(*arrays)`` (which runs the pending collectives) with a bounded wait (:func:`distributed.wait`)."""
        dist.wait(*arrays, what=what, timeout=self.timeout, grp=self.group)

    def all_sum(self, values) -> np.ndarray:
        """Element-wise sum over ranks of a small NumPy array (int64 or float32 kept as given)."""
        return dist.all_sum(values, "all_sum", self.timeout, self.group)

    def all_max(self, values) -> np.ndarray:
        return dist.all_max(values, "all_max", self.timeout, self.group)

    def gather_rows(self, local: np.ndarray) -> np.ndarray:
        """Concatenate every rank's rows (axis 0) in rank order; ranks may hold different row counts."""
        return dist.gather_rows(local, "all_gather", self.timeout, self.group)

    def check_same(self, value: float, what: str) -> None:
        """Raise :class:`~sdm_mlx.runtime.distributed.DistributedError` if a scalar differs between ranks (the
        replicated state has diverged)."""
        dist.check_same(what, np.array([value], dtype=np.float64), timeout=self.timeout, grp=self.group)

    def shard(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """``[lo, hi)`` of rank ``rank`` (default: this one) in a contiguous split of ``n`` rows."""
        return dist.shard_bounds(n, self.rank if rank is None else rank, self.size)

    def minibatch_slice(self, n_batch: int) -> tuple[int, int]:
        """``[lo, hi)`` of this rank inside a global mini-batch of ``n_batch`` tokens."""
        return self.shard(n_batch)

    def aligned_parts(self, keys, batch_size: int) -> list[np.ndarray]:
        """Every rank's rows (ascending indices) for a function that processes rows sorted by descending
        ``keys`` (stable) ``batch_size`` at a time: rank r gets the whole batches ``[r·nb/N, (r+1)·nb/N)``
        of that order, so it forms exactly the single-process batches and its rows' results are
        bit-identical to the single-process ones (padding depends on the batch)."""
        keys = np.asarray(keys, dtype=np.int64)
        order = np.argsort(-keys, kind="stable")
        nb = -(-len(keys) // batch_size)
        return [np.sort(order[self.shard(nb, r)[0] * batch_size : self.shard(nb, r)[1] * batch_size])
                for r in range(self.size)]

    def gather_parts(self, local: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
        """Rows computed by each rank for its ``parts[rank]``, gathered back into the original row order."""
        every = self.gather_rows(local)
        if not self.active:
            return every
        out = np.empty_like(every)
        out[np.concatenate(parts)] = every
        return out

    def sum_gradients(self, grads):
        """``all_sum`` every gradient array (lazy: evaluated with the step)."""
        if not self.active:
            return grads
        return tree_map(lambda g: mx.distributed.all_sum(g, group=self.group), grads)


def weight_checksum(heads) -> float:
    """Σ w + Σ w² of W_pos (float32; for :meth:`DataParallel.check_same`, no host copy of the head)."""
    w = heads.pos.weight
    return float((mx.sum(w) + mx.sum(w * w)).item())


def global_losses(sums: mx.array, n_global: mx.array, beta: mx.array):
    """``(total, L, R, R', c)`` from the all-summed ``[S_L, S_R]``; ``c = ∂R'/∂R`` (s held fixed)."""
    nll, reg = sums[0] / n_global, sums[1] / n_global
    reg_rescaled = rescaled_regularizer(nll, reg)
    c = mx.grad(lambda r: rescaled_regularizer(nll, r))(reg)
    return nll + beta * reg_rescaled, nll, reg, reg_rescaled, c


#: How the W_pos gradient crosses the ranks: the dense ``|V| × D`` gradient, or its factors.
EXCHANGES = ("auto", "gradient", "factors")


def exchange_for(vocab: int, hidden: int, n_batch: int, ranks: int, exchange: str = "auto") -> str:
    """``"factors"`` when gathering ``(∂/∂z_pos, h)`` of the batch moves fewer floats than the dense gradient."""
    if exchange != "auto":
        return exchange
    width = -(-n_batch // ranks)
    return "factors" if ranks * width * (vocab + hidden) < vocab * hidden else "gradient"


def make_dp_train_step(heads, optimizer, dp: DataParallel, compile: bool = True, exchange: str = "auto") -> Callable:
    """``step(h, t, q, d, beta, n_global) -> (total, L, R, R')`` for this rank's slice of a global batch.

    The returned losses are the global mini-batch's (identical on every rank).  A rank whose slice
    is empty (a last mini-batch with fewer tokens than ranks) still takes part in the collectives.
    ``exchange`` (:data:`EXCHANGES`): ``"gradient"`` ``all_sum``-s the dense ``|V| × D`` W_pos
    gradient; ``"factors"`` all-gathers the batch's ``∂objective/∂z_pos`` ``[B, |V|]`` and states
    ``h`` ``[B, D]`` (each rank's slice zero-padded to ``⌈B/N⌉`` rows) and every rank forms
    ``∇W_pos = Σ_n ∂z_n^T h_n`` itself — ``B(|V| + D)`` floats instead of ``|V| D`` (for Phi-3.5 and
    B = 50: 1.8M instead of 98.5M); ``"auto"`` picks the smaller per step.
    """
    if exchange not in EXCHANGES:
        raise InputError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")

    logit_objective = _logit_objective(dp)

    def local_objective(hd, h, t, q, d, *, beta, n_global):
        return logit_objective(hd.pos_logits(h), hd.ref_logits(h), t, q, d, mx.ones(t.shape), beta=beta,
                               n_global=n_global)

    loss_and_grad = nn.value_and_grad(heads, local_objective)
    logit_grad = mx.value_and_grad(logit_objective)  # ∂objective/∂z_pos

    def step(h, t, q, d, beta, n_global):
        (_, parts), grads = loss_and_grad(heads, h, t, q, d, beta=beta, n_global=n_global)
        optimizer.update(heads, dp.sum_gradients(grads))
        return parts

    def factor_step(h, t, q, d, valid, *, beta, n_global):
        (_, parts), dz = logit_grad(heads.pos_logits(h), heads.ref_logits(h), t, q, d, valid, beta=beta,
                                    n_global=n_global)
        dz_all = mx.distributed.all_gather(dz, group=dp.group)
        h_all = mx.distributed.all_gather(h, group=dp.group)
        optimizer.update(heads, {"pos": {"weight": dz_all.T @ h_all}})
        return parts

    empty_step = _empty_step(heads, optimizer, dp)
    if compile:
        state = [heads.state, optimizer.state]
        step = partial(mx.compile, inputs=state, outputs=state)(step)
        factor_step = partial(mx.compile, inputs=state, outputs=state)(factor_step)

    def dispatch(h, t, q, d, beta, n_global):
        n_batch = int(n_global.item())
        if exchange_for(heads.vocab_size, heads.hidden_size, n_batch, dp.size, exchange) == "factors":
            out = factor_step(*_padded(h, t, q, d, -(-n_batch // dp.size), heads.vocab_size), beta=beta,
                              n_global=n_global)
        elif int(h.shape[0]) == 0:
            out = empty_step(beta, n_global)
        else:
            out = step(h, t, q, d, beta, n_global)
        dp.wait(out, heads.state, optimizer.state, what="a training step")  # the step's collectives
        return out

    return dispatch


def _logit_objective(dp: DataParallel) -> Callable:
    """``objective(z_pos, z_ref, t, q, d, valid, *, beta, n_global) -> (objective, global losses)`` of one slice.

    The slice's (masked by ``valid``) sums of the loss terms are ``all_sum``-ed over the ranks for the
    global mini-batch's losses; the objective's gradient is this rank's share of the global one.
    """

    def logit_objective(z_pos, z_ref, t, q, d, valid, *, beta, n_global):
        nll_rows, reg_rows = network_loss_terms(z_ref, z_ref, z_pos, t, q, d)
        local = mx.stack([(valid * nll_rows).sum(), (valid * reg_rows).sum()])
        sums = mx.stop_gradient(mx.distributed.all_sum(local, group=dp.group))
        total, nll, reg, reg_rescaled, c = global_losses(sums, n_global, beta)
        objective = (local[0] + beta * mx.stop_gradient(c) * local[1]) / n_global
        return objective, (total, nll, reg, reg_rescaled)

    return logit_objective


def _empty_step(heads, optimizer, dp: DataParallel) -> Callable:
    """``step(beta, n_global)`` of a rank with an empty slice: zero sums and gradients, same collectives."""

    def empty_step(beta, n_global):
        sums = mx.distributed.all_sum(mx.zeros(2), group=dp.group)
        total, nll, reg, reg_rescaled, _ = global_losses(sums, n_global, beta)
        grads = tree_map(mx.zeros_like, heads.trainable_parameters())
        optimizer.update(heads, dp.sum_gradients(grads))
        return total, nll, reg, reg_rescaled

    return empty_step


def _padded(h, t, q, d, width: int, vocab_size: int):
    """The slice padded to ``width`` rows (h = 0, a valid target, q = 0, d = 1) and its 0/1 row mask."""
    m, pad = int(h.shape[0]), width - int(h.shape[0])
    if pad == 0:
        return h, t, q, d, mx.ones((m,))
    cat = lambda a, fill: mx.concatenate([a, fill])  # noqa: E731
    return (cat(h, mx.zeros((pad, h.shape[1]), dtype=h.dtype)),
            cat(t, mx.full((pad,), vocab_size, dtype=t.dtype)),
            cat(q, mx.zeros((pad,), dtype=q.dtype)), cat(d, mx.ones((pad,), dtype=d.dtype)),
            mx.concatenate([mx.ones((m,)), mx.zeros((pad,))]))
