"""One epoch of W_pos (step (d) of Alg. 4, ``alg:sdm-network-training``): the compiled training step.

Adam (bias-corrected), token-level shuffling, mini-batches with β rising linearly from β_min to
β_max, the loss of ``eq:sdm-network-next-token-training-loss`` (:mod:`.loss`) and one ``mx.eval``
per step.  With an active :class:`~sdm_mlx.network.data_parallel.DataParallel` each rank runs
its slice of every global mini-batch (``make_dp_train_step``).
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any, Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from .data_parallel import DataParallel
from .heads import SDMHeads
from ..errors import InputError
from .loss import beta_schedule, network_loss


class EpochTokens(NamedTuple):
    """The tokens of one epoch of W_pos: the token cache's hidden states [N, D] and targets [N] (``token + |V|``,
    on the device), and each token's q and d (its document's, step (c), before the epoch)."""

    hidden: mx.array
    targets: mx.array
    q: Any
    d: Any


class MiniBatches(NamedTuple):
    """An epoch's mini-batches: ``batch_size`` tokens each, β rising linearly from ``beta_min`` to ``beta_max`` over
    them (reset every epoch; :func:`~sdm_mlx.network.loss.beta_schedule`)."""

    batch_size: int
    beta_min: float
    beta_max: float


class EpochOrder(NamedTuple):
    """Which of an epoch's mini-batches run, in which order, and when the trainer saves between them.

    The token shuffle is drawn from ``rng`` (so its state before the draw fixes the epoch's order); ``done``
    mini-batches were already run, with loss sums ``sums`` in ``seconds`` (an epoch resumed from a checkpoint).
    ``checkpoint(done, sums, seconds)`` is called after a mini-batch once ``every_seconds`` have passed since the
    epoch's start or the last checkpoint (never after the last mini-batch; with W_pos and Adam in the heads and
    the optimizer); None: never."""

    rng: np.random.Generator
    done: int = 0
    sums: tuple = (0.0, 0.0, 0.0, 0.0)
    seconds: float = 0.0
    checkpoint: Callable | None = None
    every_seconds: float = 600.0


class EpochInputs(NamedTuple):
    """What every epoch of an Alg. 4 run uses, fixed for the run: the verification layer ``est``, the y = 1 training
    rows and the calibration rows, the token cache with its device arrays, the W_pos step and its optimizer."""

    est: Any
    pos_rows: list
    cal_rows: list
    cache: Any
    hidden: mx.array
    targets: mx.array
    step: Callable
    optimizer: Any


def make_train_step(heads: SDMHeads, optimizer: optim.Optimizer, compile: bool = True) -> Callable:
    """``step(h, targets, q, d, beta) -> (total, L, R, R')``: one Adam update of W_pos (compiled by default).

    All arguments are ``mx.array`` (β too, so changing it does not retrace).  The
    caller evaluates the outputs together with ``heads.state`` and
    ``optimizer.state`` (one ``mx.eval`` per step).
    """

    def loss_fn(hd, h, t, q, d, beta):
        z_ref = hd.ref_logits(h)
        z_pos = hd.pos_logits(h)
        total, parts = network_loss(z_ref, z_ref, z_pos, t, q, d, beta=beta)
        return total, parts

    loss_and_grad = nn.value_and_grad(heads, loss_fn)

    def step(h, t, q, d, beta):
        (total, (nll, reg, reg_r)), grads = loss_and_grad(heads, h, t, q, d, beta)
        optimizer.update(heads, grads)
        return total, nll, reg, reg_r

    if not compile:
        return step
    state = [heads.state, optimizer.state]
    return partial(mx.compile, inputs=state, outputs=state)(step)


def make_step(heads: SDMHeads, optimizer: optim.Optimizer, *, kind: str = "auto", compile: bool = True) -> Callable:
    """The W_pos step of one process: ``kind`` "host" (:class:`~.host_step.HostTrainStep`), "mlx"
    (:func:`make_train_step`) or "auto" (host when MLX's default device is the CPU and the reference head is a
    dense float32 matrix: there MLX's single-threaded element-wise work bounds the step)."""
    from .host_step import HostTrainStep, host_step_supported

    if kind not in ("auto", "host", "mlx"):
        raise InputError(f"train_step must be 'auto', 'host' or 'mlx', got {kind!r}")
    if kind == "auto":
        kind = "host" if mx.default_device() == mx.cpu and host_step_supported(heads) else "mlx"
    return HostTrainStep(heads, optimizer) if kind == "host" else make_train_step(heads, optimizer, compile=compile)


def make_optimizer(learning_rate: float) -> optim.Optimizer:
    """Adam with PyTorch semantics (betas 0.9/0.999, eps 1e-8, bias correction)."""
    return optim.Adam(learning_rate=learning_rate, betas=[0.9, 0.999], eps=1e-8, bias_correction=True)


def train_epoch(step: Callable, heads: SDMHeads, optimizer, tokens: EpochTokens, batches: MiniBatches, *,
                order: EpochOrder, progress: Callable | None = None, dp: DataParallel | None = None) -> dict:
    """One epoch over the token cache (token-level shuffle, ``order``); returns loss / β / timing metrics.

    With an active ``dp`` (:mod:`.data_parallel`) the global mini-batches are the same; this rank
    runs its slice of each, with ``step(h, t, q, d, beta, n_global)`` from ``make_dp_train_step``, and the ranks
    checkpoint after the same mini-batch (rank 0's clock decides).  An ``order`` with ``done`` mini-batches runs
    the rest of the same shuffle.
    """
    hidden, targets, q_tok, d_tok = tokens
    batch_size, beta_min, beta_max = batches
    n = int(targets.shape[0])
    if n == 0:
        return {"tokens": 0, "batches": 0, "loss": float("nan"), "nll": float("nan"), "reg": float("nan"),
                "reg_rescaled": float("nan"), "beta_first": beta_min, "beta_last": beta_min, "seconds": 0.0,
                "tokens_per_s": 0.0, "step_ms": float("nan")}
    perm = order.rng.permutation(n)
    nb = math.ceil(n / batch_size)
    betas = beta_schedule(nb, beta_min, beta_max)
    host = getattr(step, "host", False)  # the host step (:mod:`.host_step`) takes NumPy and returns floats
    if host:
        step.begin()
        h_np, t_np = np.asarray(hidden), np.asarray(targets)
        q_np, d_np = np.asarray(q_tok, dtype=np.float32), np.asarray(d_tok, dtype=np.float32)
    else:
        on_device = EpochTokens(hidden, targets, mx.array(np.asarray(q_tok, dtype=np.float32)),
                                mx.array(np.asarray(d_tok, dtype=np.float32)))
    sums = np.array(order.sums, dtype=np.float64)
    t0 = last = time.perf_counter()
    split = dp is not None and dp.active
    if progress is not None and order.done:
        progress(min(order.done * batch_size, n))  # the tokens of the mini-batches run before the checkpoint
    try:
        for b in range(order.done, nb):
            sel = perm[b * batch_size : (b + 1) * batch_size]
            n_b = len(sel)
            if host:
                vals = list(step(h_np[sel], t_np[sel], q_np[sel], d_np[sel], float(betas[b])))
            else:
                vals = _mlx_step(step, heads, optimizer, sel, on_device, beta_b=betas[b], dp=dp if split else None)
            if not all(math.isfinite(v) for v in vals):
                raise FloatingPointError(f"non-finite SDM-network loss at mini-batch {b + 1}/{nb}: {vals}")
            sums += np.array(vals) * n_b
            if progress is not None:
                progress(n_b, loss=f"{vals[0]:.4f}")
            if order.checkpoint is not None and b + 1 < nb and _due(time.perf_counter() - last, order, dp):
                if host:
                    step.sync()  # W_pos and Adam into the heads and the optimizer, the host copies kept
                order.checkpoint(b + 1, tuple(float(x) for x in sums), order.seconds + time.perf_counter() - t0)
                last = time.perf_counter()
    finally:
        if host:  # W_pos and Adam back into MLX, also after Ctrl-C (as MLX's step would have left them)
            step.end()
    secs = order.seconds + time.perf_counter() - t0
    mean = sums / n
    return {
        "tokens": n, "batches": nb, "loss": float(mean[0]), "nll": float(mean[1]), "reg": float(mean[2]),
        "reg_rescaled": float(mean[3]), "beta_first": float(betas[0]), "beta_last": float(betas[-1]),
        "seconds": secs, "tokens_per_s": n / secs if secs > 0 else float("inf"), "step_ms": 1000 * secs / nb,
    }


def _due(elapsed: float, order: EpochOrder, dp: DataParallel | None) -> bool:
    """Whether a checkpoint is due: ``order.every_seconds`` have passed (on rank 0, under ``dp``: every rank
    checkpoints after the same mini-batch)."""
    due = elapsed >= order.every_seconds
    if dp is not None and dp.active:
        due = bool(dp.all_max(np.array([float(due) if dp.writer else 0.0], dtype=np.float32))[0] > 0)
    return due


def _mlx_step(step, heads, optimizer, sel, tokens: EpochTokens, *, beta_b, dp) -> list:
    """One MLX step on the mini-batch ``sel`` of ``tokens`` (q and d on the device too; this rank's slice of it under
    ``dp``), evaluated; its floats."""
    hidden, targets, q_all, d_all = tokens
    n_b = len(sel)
    beta = mx.array(beta_b, dtype=mx.float32)
    if dp is not None:
        lo, hi = dp.minibatch_slice(n_b)
        idx = mx.array(sel[lo:hi].astype(np.int32))
        out = step(hidden[idx], targets[idx], q_all[idx], d_all[idx], beta, mx.array(float(n_b)))
    else:
        idx = mx.array(sel.astype(np.int32))
        out = step(hidden[idx], targets[idx], q_all[idx], d_all[idx], beta)
    mx.eval(out, heads.state, optimizer.state)
    return [float(v.item()) for v in out]
