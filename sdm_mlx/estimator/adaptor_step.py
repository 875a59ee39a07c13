"""Alg. 1's mini-batch step on the host CPU: the SDM loss gradient of the linear adaptor in closed form, with
rank-C products, and Adam in row blocks of W_g.

The adaptor is linear (DESIGN #3): z' = W' (W_g x̄ + b_g) + b', x̄ = (x − μ)/σ.  With A = W' W_g [C, D] and
c = W' b_g + b', z' = x̄ Aᵀ + c, so a mini-batch needs z' alone, never h' [B, M].  The SDM loss of
``eq:sdm-loss`` (the batch mean of −log_{2+q} sdm(z')_y) has ∂L/∂z'_n = d_n (p_n − e_{y_n}) / B with
p_n = softmax(z'_n d_n ln(2+q_n)) (the ln(2+q) of the change of base cancels), and with G = ∂L/∂z' [B, C]:

    ∂L/∂W_g = W'ᵀ (Gᵀ x̄)             [M, C] @ [C, D]: rank C
    ∂L/∂b_g = W'ᵀ (Gᵀ 1)
    ∂L/∂W'  = (Gᵀ x̄) W_gᵀ + (Gᵀ 1) b_gᵀ
    ∂L/∂b'  = Gᵀ 1

So a step costs about 3·C·M·D multiply-adds (A, ∂L/∂W', ∂L/∂W_g) where autodiff through h' costs 3·B·M·D
(B = 50, C = 2: 25× fewer).  What remains is Adam over the M·D weights of W_g: the element-wise update, which
MLX's CPU backend runs on one thread well below the memory bandwidth (``docs/performance.md``, "Training the
estimator at the widths of LLM features").  Here it runs in NumPy one block of W_g's rows at a time: the block's
gradient is made in cache by the rank-C product, the block's m, v and W_g are updated while they are in cache,
and A = W' W_g of the next step is accumulated from the updated block, so W_g, m and v are streamed once per
step.

Adam is MLX's (``mlx.optimizers.Adam``, bias correction, float32, the betas and ε of Alg. 1) with v held as
``v (1 − β₁)² / (1 − β₂)`` for fewer passes (as :mod:`sdm_mlx.network.host_step` does), so the trajectory is
the MLX step's up to float rounding (tested to agree: ``tests/estimator/test_training.py``).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from ..core.activation import Q_SOFTMAX
from ..core.adaptor import ExemplarAdaptor
from ..runtime.blas import PASS_THREADS, block_ranges

#: Bytes of one array's row block in the Adam pass (g, m, v, W_g and a scratch block stay in the 2 MB L2 cache
#: of the 2-core test box: 256 KB measured faster than 64 KB and 1 MB, docs/performance.md).
BLOCK_BYTES = 256 * 1024

#: Threads of the Adam pass (each its own rows of W_g); at most the CPU count.
THREADS = PASS_THREADS

_NAMES = ("projection.weight", "projection.bias", "classifier.weight", "classifier.bias")


def log_base(q: np.ndarray) -> np.ndarray:
    """ln(2+q) in float32, as :func:`sdm_mlx.core.activation._log_base` computes it (exactly 1 at q = e−2)."""
    q = np.asarray(q, dtype=np.float32)
    return (np.float32(1.0) + np.log1p((q - np.float32(Q_SOFTMAX)) / np.float32(math.e))).astype(np.float32)


def normalized(model: ExemplarAdaptor, x: np.ndarray) -> np.ndarray:
    """x̄ = (x − μ)/σ in float32, as the model's forward computes it."""
    mean = np.asarray(model.input_mean, dtype=np.float32)
    std = np.asarray(model.input_std, dtype=np.float32)
    return np.ascontiguousarray((np.asarray(x, dtype=np.float32) - mean) / std, dtype=np.float32)


def set_params(model: ExemplarAdaptor, params: dict) -> None:
    """Set the adaptor's four trained parameters from ``params`` (the model's names → arrays) and evaluate them."""
    missing = set(_NAMES) - set(params)
    if missing:
        raise KeyError(f"missing adaptor parameters {sorted(missing)}")
    model.projection.weight = mx.array(params["projection.weight"])
    model.projection.bias = mx.array(params["projection.bias"])
    model.classifier.weight = mx.array(params["classifier.weight"])
    model.classifier.bias = mx.array(params["classifier.bias"])
    mx.eval(model.parameters())


class HostAdaptorStep:
    """``step(x̄ [B, D], y [B], q [B], d [B]) -> loss``: one Adam update of the adaptor on the host.

    Holds the adaptor's parameters and Adam's state as float32 NumPy arrays; :meth:`params` gives them in the
    model's names, :meth:`to_model` writes them into an :class:`~sdm_mlx.core.adaptor.ExemplarAdaptor`.
    W' and b_g are held together as ``P = [W'ᵀ | b_g]`` [M, C + 1], so that one row block of W_g and the same
    rows of P are all a block's update touches: every gradient entry of the block comes from the block's own
    parameters before the update (∂L/∂P[r] = [W_g[r] (Gᵀ x̄)ᵀ + b_g[r] (Gᵀ 1)ᵀ | W'ᵀ[r] Gᵀ 1]), and the block's
    share of the next A = W' W_g from its updated rows, so one pass over W_g, m and v makes a whole step.
    """

    def __init__(self, model: ExemplarAdaptor, *, learning_rate: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 block_bytes: int = BLOCK_BYTES, threads: int = THREADS):
        self.w_g = np.array(model.projection.weight, dtype=np.float32)  # [M, D]
        m, dim = self.w_g.shape
        w_c = np.array(model.classifier.weight, dtype=np.float32)  # [C, M]
        self.classes = w_c.shape[0]
        self.p = np.empty((m, self.classes + 1), dtype=np.float32)  # [W'ᵀ | b_g]
        self.p[:, : self.classes] = w_c.T
        self.p[:, self.classes] = np.array(model.projection.bias, dtype=np.float32)
        self.b_c = np.array(model.classifier.bias, dtype=np.float32)
        self.lr, self.eps = float(learning_rate), float(eps)
        self.b1, self.b2 = (float(b) for b in betas)
        self._state = [(np.zeros_like(a), np.zeros_like(a)) for a in (self.w_g, self.p, self.b_c)]  # (m, v_scaled)
        self.steps = 0
        self.block_rows = max(1, min(m, int(block_bytes) // (4 * dim)))
        blocks = -(-m // self.block_rows)
        self.threads = max(1, min(int(threads), blocks // 4))  # a thread needs a few blocks to be worth it
        self._scratch = [(np.empty((self.block_rows, dim), dtype=np.float32),
                          np.empty((self.block_rows, self.classes + 1), dtype=np.float32),
                          np.empty((self.block_rows, dim), dtype=np.float32),
                          np.empty((self.block_rows, self.classes + 1), dtype=np.float32))
                         for _ in range(self.threads)]
        self._halves = block_ranges(m, self.block_rows, self.threads)
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self.fold_w = self.p[:, : self.classes].T @ self.w_g  # A = W' W_g [C, D]
        self._fold_bias()

    @property
    def w_c(self) -> np.ndarray:
        return self.p[:, : self.classes].T

    @property
    def b_g(self) -> np.ndarray:
        return self.p[:, self.classes]

    def params(self) -> dict[str, np.ndarray]:
        """Copies of the parameters, by the model's parameter names."""
        arrays = (self.w_g, self.b_g, self.w_c, self.b_c)
        return {name: np.ascontiguousarray(p, dtype=np.float32).copy() for name, p in zip(_NAMES, arrays)}

    def to_model(self, model: ExemplarAdaptor) -> None:
        """Write the parameters into ``model`` (evaluated MLX arrays)."""
        set_params(model, self.params())

    def close(self) -> None:
        """Stop the Adam pass's threads (the step can still run, on the calling thread)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
            self._halves = [(0, self.w_g.shape[0])]

    def _fold_bias(self) -> None:
        self.fold_b = self.w_c @ self.b_g + self.b_c  # c = W' b_g + b'

    def logits(self, x_norm: np.ndarray) -> np.ndarray:
        """z' = x̄ Aᵀ + c of the current parameters (float32)."""
        return x_norm @ self.fold_w.T + self.fold_b

    def __call__(self, x_norm: np.ndarray, y: np.ndarray, q: np.ndarray, d: np.ndarray) -> float:
        n = x_norm.shape[0]
        u = log_base(q)
        d = np.asarray(d, dtype=np.float32)
        s = self.logits(x_norm) * (d * u)[:, None]
        top = s.max(axis=1, keepdims=True)
        e = np.exp(s - top)
        total = e.sum(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(total[:, 0])
        rows = np.arange(n)
        loss = float(np.mean((lse - s[rows, y]) / u, dtype=np.float64))
        grad = e / total  # p
        grad[rows, y] -= np.float32(1.0)
        grad *= (d / np.float32(n))[:, None]  # G = ∂L/∂z' [B, C]
        self._update(grad.T @ x_norm, grad.sum(axis=0))
        return loss

    # -- Adam ---------------------------------------------------------------------------------------
    def _constants(self) -> tuple[np.float32, np.float32]:
        """(step size, ε') of the update m / (√v_scaled + ε') · step for this step (see :meth:`_adam`)."""
        self.steps += 1
        c1 = self.lr / (1.0 - self.b1 ** self.steps)
        c2 = 1.0 / math.sqrt(1.0 - self.b2 ** self.steps)
        kappa = math.sqrt(1.0 - self.b2) / (1.0 - self.b1)  # √v = κ √v_scaled
        return np.float32(c1 / (c2 * kappa)), np.float32(self.eps / (c2 * kappa))

    def _adam(self, g, m, v, w, tmp, *, step, eps) -> None:
        """MLX's Adam on one block, in place, from g = (1 − β₁)·gradient: m ← β₁ m + g, v_scaled ← β₂ v_scaled
        + g², w ← w − step · m / (√v_scaled + ε'), which is c₁ m / (c₂ √v + ε) with v = v_scaled (1 − β₂) /
        (1 − β₁)²."""
        np.square(g, out=tmp)
        v *= np.float32(self.b2)
        v += tmp
        m *= np.float32(self.b1)
        m += g
        np.sqrt(v, out=tmp)
        tmp += eps
        np.divide(m, tmp, out=tmp)
        tmp *= step
        w -= tmp

    def _update(self, grad_a: np.ndarray, grad_sum: np.ndarray) -> None:
        """Adam on every parameter from Gᵀ x̄ [C, D] and Gᵀ 1 [C], in one pass over the row blocks of W_g (split
        between :attr:`threads` threads, each its own rows: NumPy releases the GIL inside each pass)."""
        step, eps = self._constants()
        keep = np.float32(1.0 - self.b1)
        grad_a = grad_a * keep  # (1 − β₁) Gᵀ x̄
        grad_sum = grad_sum * keep
        grad_a_t = np.ascontiguousarray(grad_a.T)  # [D, C]
        args = (grad_a, grad_a_t, grad_sum, step, eps)  # one record: _rows(worker, start, stop, args)
        if self._pool is None:
            fold = self._rows(0, 0, self.w_g.shape[0], args)
        else:
            parts = [self._pool.submit(self._rows, i, r0, r1, args) for i, (r0, r1) in enumerate(self._halves)]
            fold = parts[0].result()
            for part in parts[1:]:
                fold += part.result()  # in a fixed order: the same sums every run
        m_c, v_c = self._state[2]
        self._adam(grad_sum, m_c, v_c, self.b_c, np.empty_like(self.b_c), step=step, eps=eps)
        self.fold_w = fold
        self._fold_bias()

    def _rows(self, worker, start, stop, args) -> np.ndarray:
        """The block loop over rows [start, stop) of W_g and P with ``worker``'s scratch blocks; returns these
        rows' share of the next A = W' W_g.  ``args``: ``(grad_a, grad_a_t, grad_sum, step, eps)`` of :meth:`_update`."""
        grad_a, grad_a_t, grad_sum, step, eps = args
        C = self.classes
        (m_w, v_w), (m_p, v_p) = self._state[0], self._state[1]
        w, p = self.w_g, self.p
        g_all, gp_all, tmp_all, tmp_p_all = self._scratch[worker]
        fold = np.zeros_like(self.fold_w)
        for r0 in range(start, stop, self.block_rows):
            r1 = min(r0 + self.block_rows, stop)
            n = r1 - r0
            wb, pb, g, gp = w[r0:r1], p[r0:r1], g_all[:n], gp_all[:n]
            # gradients from the block's parameters before the update
            np.matmul(pb[:, :C], grad_a, out=g)  # ∂L/∂W_g[r] = W'ᵀ[r] (Gᵀ x̄)
            np.matmul(wb, grad_a_t, out=gp[:, :C])  # ∂L/∂W'ᵀ[r] = W_g[r] (Gᵀ x̄)ᵀ + b_g[r] (Gᵀ 1)ᵀ
            gp[:, :C] += pb[:, C:] * grad_sum
            np.matmul(pb[:, :C], grad_sum, out=gp[:, C])  # ∂L/∂b_g[r] = W'ᵀ[r] Gᵀ 1
            self._adam(g, m_w[r0:r1], v_w[r0:r1], wb, tmp_all[:n], step=step, eps=eps)
            self._adam(gp, m_p[r0:r1], v_p[r0:r1], pb, tmp_p_all[:n], step=step, eps=eps)
            fold += pb[:, :C].T @ wb  # this block's share of the next A = W' W_g
        return fold
