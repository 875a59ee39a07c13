"""The rescaling transform W'' and its training (``alg:train-rescaler``, ``eq:rescaler-loss``).

W'' is a C×C linear map without bias, stored like ``mlx.nn.Linear.weight``
(``[out, in]``), so v' = W'' v, i.e. ``v' = v @ W.T`` for row vectors.  The
normalised output (``equation:rescaled-prediction-conditional-estimate``) is the
SDM normalisation with base 2 + q~ and no distance term:

    o_i = (2+q~)^{v'_i} / Σ_c (2+q~)^{v'_c} = softmax(v' · ln(2+q~))_i

and the per-row loss is −log_{2+q~} o_y = (logsumexp(l) − l_y) / ln(2+q~) with
l = v' · ln(2+q~), computed exactly (stable log-softmax, no eps floor; DESIGN #6).

Training (DESIGN #10, following the research code): initial weights
U(±1/sqrt(C)) from ``mx.random.key(seed)``; Adam (lr 1e-4, betas 0.9/0.999,
eps 1e-8, PyTorch-style bias correction, the state persists across epochs);
batch size 1, i.e. one optimizer step per calibration row, rows reshuffled every
epoch by ``np.random.default_rng(seed)``.  The epoch loss is the mean of the
per-row losses evaluated *before* each row's update (the running loss, as the
research code does); the weights kept for an epoch are those at its end.  The best (lowest)
epoch loss wins; an epoch whose loss is strictly greater than the best so far
increments a counter, any other epoch resets it, and training stops when the
counter exceeds ``patience`` (the 11th consecutive worse epoch for patience 10).

Engines.  Batch size 1 over C×C parameters is pure latency: every step is a
handful of operations on ~C² numbers.  MLX dispatches each primitive for ~10 µs
on the CPU backend, and even an ``mx.compile``d step (or an unrolled,
compiled chunk of 8-128 sequential steps) measured 120-370 µs per row (N = 3000,
C = 2: 0.37-1.1 s per epoch), while the same float32 arithmetic in NumPy takes
~20 µs per row (50-80 ms per epoch).  So:

* ``engine="numpy"`` (default): the sequential single-row Adam loop on the
  host, the update of ``mlx.optimizers.Adam(bias_correction=True)`` with the
  analytic gradient ∂loss/∂W = (o − e_y) vᵀ (the ln(2+q~) factors cancel).
  For C ≤ :data:`SCALAR_MAX_CLASSES` it is a Python loop generated per C over
  float64 scalars (:class:`_ScalarEngine`, ~2 µs a row for C = 2, ~5 µs for
  C = 4), above it the float32 NumPy array loop (:class:`_NumpyEngine`).
* ``engine="mlx"``: ``mx.value_and_grad`` + ``mlx.optimizers.Adam(...,
  bias_correction=True)`` in one ``mx.compile``d step per row (optimizer state
  captured), one ``mx.eval`` per step.  Same semantics, slower; kept as the
  reference the NumPy engine is tested against.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from ..errors import InputError

from .defaults import (  # noqa: F401  (Alg. 2 defaults, DESIGN #10; re-exported)
    DEFAULT_BETAS, DEFAULT_ENGINE, DEFAULT_EPS, DEFAULT_LEARNING_RATE, DEFAULT_MAX_EPOCHS, DEFAULT_PATIENCE,
)

_F32 = np.float32


def init_rescaler_weights(num_classes: int, seed: int) -> np.ndarray:
    """Initial W'' for ``alg:train-rescaler``: U(±1/sqrt(C)) from ``mx.random.key(seed)``, float32 [C, C]."""
    if num_classes < 1:
        raise InputError(f"num_classes must be ≥ 1, got {num_classes}")
    bound = 1.0 / math.sqrt(num_classes)
    w = mx.random.uniform(-bound, bound, (num_classes, num_classes), dtype=mx.float32, key=mx.random.key(int(seed)))
    return np.array(w, dtype=_F32)


def rescaler_logits(W: np.ndarray, v: np.ndarray, q_tilde: np.ndarray) -> np.ndarray:
    """l = (W'' v) · ln(2+q~), the exponent of ``equation:rescaled-prediction-conditional-estimate`` (float64)."""
    W = np.asarray(W, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    log_base = np.log(2.0 + np.asarray(q_tilde, dtype=np.float64).reshape(-1))
    # a per-row fixed-order reduction, not a BLAS GEMM: a row's value must not depend on the batch
    return (v[:, None, :] * W[None, :, :]).sum(axis=-1) * log_base[:, None]


def rescaled_output(W: np.ndarray, v: np.ndarray, q_tilde: np.ndarray) -> np.ndarray:
    """o = softmax((W'' v)·ln(2+q~)) row-wise, ``equation:rescaled-prediction-conditional-estimate`` (float64 [N, C])."""
    logits = rescaler_logits(W, v, q_tilde)
    logits -= np.maximum.reduce(logits, axis=1, keepdims=True)  # (ndarray.max / .sum without their wrappers)
    e = np.exp(logits)
    return e / np.add.reduce(e, axis=1, keepdims=True)


def rescaler_loss(W: np.ndarray, v: np.ndarray, q_tilde: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-row −log_{2+q~} o_y, the summand of ``eq:rescaler-loss`` (exact log-softmax / ln(2+q~), float64 [N])."""
    logits = rescaler_logits(W, v, q_tilde)
    top = logits.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    y = np.asarray(y).astype(np.int64).reshape(-1)
    log_base = np.log(2.0 + np.asarray(q_tilde, dtype=np.float64).reshape(-1))
    return (lse - logits[np.arange(len(y)), y]) / log_base


@dataclass(frozen=True)
class RescalerSettings:
    """How ``alg:train-rescaler`` trains W'' (DESIGN #10; the defaults: :mod:`sdm_mlx.calibration.defaults`):
    the seed of the initial weights and of the row shuffles, the epochs and the early stop, Adam's settings and
    the engine.  Checked by :func:`train_rescaler`."""

    seed: int = 0
    max_epochs: int = DEFAULT_MAX_EPOCHS
    patience: int = DEFAULT_PATIENCE
    learning_rate: float = DEFAULT_LEARNING_RATE
    betas: tuple[float, float] = DEFAULT_BETAS
    eps: float = DEFAULT_EPS
    engine: str = DEFAULT_ENGINE


@dataclass
class RescalerFit:
    """Result of ``alg:train-rescaler``: the kept weights and the loss history."""

    W: np.ndarray  #: best-epoch W'' (float32 [C, C], ``[out, in]``)
    epoch_losses: np.ndarray  #: mean per-row running loss of every epoch run (float64)
    best_epoch: int  #: 0-based index of the kept epoch
    best_loss: float
    epochs_run: int
    stopped_early: bool  #: True when the patience rule fired before max_epochs
    seconds: float  #: wall-clock training time
    W_init: np.ndarray = field(repr=False, default=None)  #: the initial weights

    @property
    def seconds_per_epoch(self) -> float:
        """Mean wall-clock seconds per epoch."""
        return self.seconds / max(self.epochs_run, 1)


# --------------------------------------------------------------------------------------------
# Engines: one epoch of sequential batch-1 Adam steps.  State: W, m, s (float32 [C, C]) and t.


class _NumpyEngine:
    """Host float32 engine: the exact ``mlx.optimizers.Adam(bias_correction=True)`` update per row."""

    def __init__(self, W0, lr, betas, eps):
        self.W = np.array(W0, dtype=_F32)
        self.m = np.zeros_like(self.W)
        self.s = np.zeros_like(self.W)
        self.t = 0
        self.lr = float(lr)
        self.b1, self.b2 = (float(b) for b in betas)
        self.eps = _F32(eps)

    def run_epoch(self, V: np.ndarray, log_base: np.ndarray, Y: np.ndarray) -> np.ndarray:
        """Sequential single-row Adam steps over the rows in the given order; returns the pre-step losses."""
        n, C = V.shape
        W = self.W
        steps = np.arange(self.t + 1, self.t + n + 1, dtype=np.float64).astype(_F32)
        # bias corrections exactly as mlx.optimizers.Adam computes them (float32):
        # c1 = lr / (1 − b1^t), c2 = rsqrt(1 − b2^t); update = c1·m / (sqrt(s)·c2 + eps)
        c1 = (_F32(self.lr) / (_F32(1.0) - np.power(_F32(self.b1), steps))).astype(_F32)
        c2 = (_F32(1.0) / np.sqrt(_F32(1.0) - np.power(_F32(self.b2), steps))).astype(_F32)
        # first and second moments updated together: MS = [m; s], G2 = [g; g²]
        MS = np.stack([self.m, self.s])
        G2 = np.empty_like(MS)
        m, s, g, g2 = MS[0], MS[1], G2[0], G2[1]
        decay = np.array([self.b1, self.b2], dtype=_F32).reshape(2, 1, 1)
        gain = np.array([1.0 - self.b1, 1.0 - self.b2], dtype=_F32).reshape(2, 1, 1)
        VB = V * log_base[:, None]  # v·ln(2+q~): logits = W (v·ln(2+q~))
        L = np.empty((n, C), dtype=_F32)  # pre-step logits, for the epoch's running loss
        e = np.empty(C, dtype=_F32)
        tmp = np.empty((C, C), dtype=_F32)
        eps = self.eps
        dot, subtract, exp, sqrt, divide, outer, square = (
            np.dot, np.subtract, np.exp, np.sqrt, np.divide, np.multiply.outer, np.square)
        amax, asum = np.maximum.reduce, np.add.reduce
        for j in range(n):
            logits = L[j]
            dot(W, VB[j], out=logits)
            subtract(logits, amax(logits), out=e)
            exp(e, out=e)
            e /= asum(e)  # o
            e[Y[j]] -= 1.0  # o − e_y
            outer(e, V[j], out=g)  # ∂loss/∂W = (o − e_y) vᵀ (the ln(2+q~) factors cancel)
            square(g, out=g2)
            G2 *= gain
            MS *= decay
            MS += G2
            sqrt(s, out=tmp)
            tmp *= c2[j]
            tmp += eps
            divide(m, tmp, out=tmp)
            tmp *= c1[j]
            W -= tmp
        self.m[...] = m
        self.s[...] = s
        self.t += n
        top = L.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(L - top).sum(axis=1))
        return ((lse - L[np.arange(n), Y]) / log_base).astype(_F32)

    def weights(self) -> np.ndarray:
        return self.W.copy()


#: Classes up to which the host engine runs :class:`_ScalarEngine` (one generated Python loop per C); above it
#: :class:`_NumpyEngine`'s array loop (its per-call overhead is then shared by C² weights).
SCALAR_MAX_CLASSES = 8

_SCALAR_LOOPS: dict = {}


def _scalar_loop(C: int):
    """The generated epoch loop of :class:`_ScalarEngine` for C classes: every weight, moment and logit is a local
    float, so a step is ~11 float operations per weight and no call into NumPy (whose ~1 µs per call made up most
    of the array loop's ~20 µs per row)."""
    if C in _SCALAR_LOOPS:
        return _SCALAR_LOOPS[C]
    cls, wts = range(C), [(i, k) for i in range(C) for k in range(C)]
    names = lambda p: ", ".join(f"{p}{i}{k}" for i, k in wts)  # noqa: E731
    vs = ", ".join(f"v{k}" for k in cls)
    body = [
        "def loop(rows, state, b1, b2):",
        f"    ({names('w')},) = state[0]",
        f"    ({names('m')},) = state[1]",
        f"    ({names('s')},) = state[2]",
        "    losses = []",
        "    append = losses.append",
        f"    for ({vs}), lb, y, step, ep, keep in rows:",
        *[f"        l{i} = ({' + '.join(f'w{i}{k} * v{k}' for k in cls)}) * lb" for i in cls],
        "        top = l0",
        *[f"        if l{i} > top: top = l{i}" for i in cls if i > 0],
        *[f"        e{i} = exp(l{i} - top)" for i in cls],
        f"        total = {' + '.join(f'e{i}' for i in cls)}",
        f"        append((top + log(total) - ({', '.join(f'l{i}' for i in cls)},)[y]) / lb)",
        "        scale = keep / total",
        *[f"        o{i} = e{i} * scale - (keep if y == {i} else 0.0)" for i in cls],
    ]
    for i, k in wts:
        body += [f"        g = o{i} * v{k}",
                 f"        m{i}{k} = b1 * m{i}{k} + g",
                 f"        s{i}{k} = b2 * s{i}{k} + g * g",
                 f"        w{i}{k} -= step * m{i}{k} / (sqrt(s{i}{k}) + ep)"]
    body += [f"    state[0] = ({names('w')},)", f"    state[1] = ({names('m')},)", f"    state[2] = ({names('s')},)",
             "    return losses"]
    scope = {"exp": math.exp, "log": math.log, "sqrt": math.sqrt}
    exec(compile("\n".join(body), f"<rescaler loop C={C}>", "exec"), scope)  # noqa: S102 (generated above)
    _SCALAR_LOOPS[C] = scope["loop"]
    return scope["loop"]


class _ScalarEngine:
    """Host engine for small C: MLX's ``Adam(bias_correction=True)`` update per row in float64 Python scalars.

    The same update as :class:`_NumpyEngine` (m ← β₁ m + (1 − β₁) g, v ← β₂ v + (1 − β₂) g², W ← W − c₁ m /
    (c₂ √v + ε), g = (o − e_y) vᵀ), with v held scaled by (1 − β₁)² / (1 − β₂) as
    :mod:`sdm_mlx.network.host_step` does, in float64 rather than float32 (the weights handed out are rounded to
    float32): about 2 µs per row for C = 2 on the 2-core test box against 20 µs for the array loop
    (``docs/performance.md``).
    """

    def __init__(self, W0, lr, betas, eps):
        W0 = np.asarray(W0, dtype=np.float64)
        self.C = W0.shape[0]
        self.state = [tuple(W0.ravel().tolist()), (0.0,) * W0.size, (0.0,) * W0.size]
        self.t = 0
        self.lr, self.eps = float(lr), float(eps)
        self.b1, self.b2 = (float(b) for b in betas)
        self.loop = _scalar_loop(self.C)

    def run_epoch(self, V: np.ndarray, log_base: np.ndarray, Y: np.ndarray) -> np.ndarray:
        n = V.shape[0]
        t = np.arange(self.t + 1, self.t + n + 1, dtype=np.float64)
        c1 = self.lr / (1.0 - self.b1 ** t)
        c2 = 1.0 / np.sqrt(1.0 - self.b2 ** t)
        kappa = math.sqrt(1.0 - self.b2) / (1.0 - self.b1)  # √v = κ √v_scaled
        step, ep = (c1 / (c2 * kappa)).tolist(), (self.eps / (c2 * kappa)).tolist()
        keep = [1.0 - self.b1] * n
        rows = zip(V.astype(np.float64).tolist(), log_base.astype(np.float64).tolist(), Y.tolist(), step, ep, keep)
        losses = self.loop(rows, self.state, self.b1, self.b2)
        self.t += n
        return np.asarray(losses, dtype=np.float64)

    def weights(self) -> np.ndarray:
        return np.asarray(self.state[0], dtype=np.float64).reshape(self.C, self.C).astype(_F32)


def _host_engine(W0, lr, betas, eps):
    """``engine="numpy"``: the scalar loop for C ≤ :data:`SCALAR_MAX_CLASSES`, else the NumPy array loop."""
    if np.asarray(W0).shape[0] <= SCALAR_MAX_CLASSES:
        return _ScalarEngine(W0, lr, betas, eps)
    return _NumpyEngine(W0, lr, betas, eps)


def _row_loss_mlx(params, v, log_base, y):
    logits = (params["W"] @ v) * log_base
    return (mx.logsumexp(logits) - logits[y]) / log_base


class _MlxEngine:
    """MLX engine: value_and_grad + ``mlx.optimizers.Adam(bias_correction=True)``, one compiled step per row."""

    def __init__(self, W0, lr, betas, eps, compiled: bool = True):
        self.params = {"W": mx.array(np.asarray(W0, dtype=_F32))}
        self.opt = optim.Adam(learning_rate=lr, betas=list(betas), eps=eps, bias_correction=True)
        self.opt.init(self.params)
        grad_fn = mx.value_and_grad(_row_loss_mlx)
        state = [self.params, self.opt.state]

        def step(v, log_base, y):
            loss, grads = grad_fn(self.params, v, log_base, y)
            self.params["W"] = self.opt.apply_gradients(grads, self.params)["W"]
            return loss

        self.step = partial(mx.compile, inputs=state, outputs=state)(step) if compiled else step

    def run_epoch(self, V: np.ndarray, log_base: np.ndarray, Y: np.ndarray) -> np.ndarray:
        Vm, Bm, Ym = mx.array(V), mx.array(log_base), mx.array(Y.astype(np.int32))
        losses = []
        for j in range(V.shape[0]):
            loss = self.step(Vm[j], Bm[j], Ym[j])
            mx.eval(loss, self.params, self.opt.state)
            losses.append(loss)
        return np.array(mx.stack(losses), dtype=_F32) if losses else np.empty(0, _F32)

    def weights(self) -> np.ndarray:
        return np.array(self.params["W"], dtype=_F32)


_ENGINES = {"numpy": _host_engine, "mlx": _MlxEngine}


def _check_training_inputs(v, q_tilde, y):
    v = np.asarray(v)
    q_tilde = np.asarray(q_tilde).reshape(-1)
    y = np.asarray(y).reshape(-1)
    if v.ndim != 2:
        raise InputError(f"v must be [N, C], got shape {v.shape}")
    n, C = v.shape
    if n == 0:
        raise InputError("the rescaler needs at least one calibration row")
    if q_tilde.shape[0] != n or y.shape[0] != n:
        raise InputError(f"v, q_tilde and y must have the same number of rows, got {n}, {q_tilde.shape[0]}, {y.shape[0]}")
    for name, arr in (("v", v), ("q_tilde", q_tilde)):
        if not np.all(np.isfinite(arr)):
            raise InputError(f"{name} contains NaN or Inf")
    if np.any(q_tilde < 0):
        raise InputError("q_tilde must be ≥ 0")
    if not np.issubdtype(y.dtype, np.integer):
        if not np.all(np.isfinite(y)) or np.any(y != np.round(y)):
            raise InputError("y must hold integer class labels")
    y = y.astype(np.int64)
    if np.any((y < 0) | (y >= C)):
        raise InputError(f"labels must lie in [0, {C})")
    return v, q_tilde, y


def _check_training_settings(settings: RescalerSettings) -> None:
    """ValueError naming the first invalid setting of :func:`train_rescaler`."""
    max_epochs, patience, learning_rate, engine = (settings.max_epochs, settings.patience, settings.learning_rate,
                                                   settings.engine)
    if not isinstance(max_epochs, (int, np.integer)) or max_epochs < 1:
        raise InputError(f"max_epochs must be a positive integer, got {max_epochs!r}")
    if not isinstance(patience, (int, np.integer)) or patience < 0:
        raise InputError(f"patience must be a non-negative integer, got {patience!r}")
    if not learning_rate > 0:
        raise InputError(f"learning_rate must be > 0, got {learning_rate}")
    if engine not in _ENGINES:
        raise InputError(f"engine must be one of {sorted(_ENGINES)}, got {engine!r}")


def train_rescaler(
    v: np.ndarray,
    q_tilde: np.ndarray,
    y: np.ndarray,
    settings: RescalerSettings = RescalerSettings(),
    *,
    W_init: np.ndarray | None = None,
    on_epoch: Callable[[int, float], None] | None = None,
) -> RescalerFit:
    """Train W'' by ``alg:train-rescaler`` on cached calibration (v, q~, y): batch 1 Adam, best-epoch weights.

    ``settings``: seed, epochs, patience, Adam and engine (:class:`RescalerSettings`); ``W_init``: the initial
    weights (default: :func:`init_rescaler_weights` of the seed); ``on_epoch(epoch, loss)`` after every epoch."""
    v, q_tilde, y = _check_training_inputs(v, q_tilde, y)
    n, C = v.shape
    _check_training_settings(settings)
    seed, max_epochs, patience = settings.seed, settings.max_epochs, settings.patience
    W0 = init_rescaler_weights(C, seed) if W_init is None else np.array(W_init, dtype=_F32)
    if W0.shape != (C, C):
        raise InputError(f"W_init must be [{C}, {C}], got {W0.shape}")
    rng = np.random.default_rng(seed)
    V32 = np.ascontiguousarray(v, dtype=_F32)
    B32 = np.log(2.0 + q_tilde.astype(np.float64)).astype(_F32)
    eng = _ENGINES[settings.engine](W0, settings.learning_rate, settings.betas, settings.eps)

    t_start = time.perf_counter()
    history: list[float] = []
    best_loss, best_epoch, best_W = math.inf, -1, None
    counter, stopped = 0, False
    for epoch in range(int(max_epochs)):
        perm = rng.permutation(n)
        losses = eng.run_epoch(V32[perm], B32[perm], y[perm])
        loss = float(np.mean(losses, dtype=np.float64))
        history.append(loss)
        if on_epoch is not None:
            on_epoch(epoch, loss)
        if loss < best_loss:
            best_loss, best_epoch, best_W = loss, epoch, eng.weights()
        if not loss <= best_loss:  # strictly worse (a non-finite loss counts as worse)
            counter += 1
            if counter > patience:
                stopped = True
                break
        else:
            counter = 0
    seconds = time.perf_counter() - t_start
    if best_W is None:
        warnings.warn("rescaler training never produced a finite epoch loss; keeping the initial weights",
                      RuntimeWarning, stacklevel=2)
        best_W = W0.copy()
    return RescalerFit(W=best_W, epoch_losses=np.asarray(history, dtype=np.float64), best_epoch=best_epoch,
                       best_loss=best_loss, epochs_run=len(history), stopped_early=stopped, seconds=seconds,
                       W_init=W0)
