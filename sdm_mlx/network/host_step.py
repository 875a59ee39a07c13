"""The W_pos step of Alg. 4 (step (d) of ``alg:sdm-network-training``) on the host CPU: BLAS products, the
loss of ``eq:sdm-network-next-token-training-loss`` with its gradient in closed form, and Adam in row blocks.

Why a second implementation of the step (:func:`.step.make_train_step` is the MLX one): on a CPU the step of a
real model's head (|V| = 151,936 rows of D = 1,536) is bound by element-wise work, which MLX's CPU backend runs
on one thread far below the memory bandwidth (``docs/performance.md``, "The W_pos step against this box's
roofline").  Here

* z_ref = h W_refᵀ and z_pos = h W_posᵀ are two BLAS products (multi-threaded);
* the loss and its gradient with respect to z_pos are written out (below), a handful of passes over the
  ``[N, |V|]`` logits instead of MLX's autodiff graph over the ``[N, 2|V|]`` joint vector;
* dW = Gᵀ h is computed one block of vocabulary rows at a time, and Adam updates that block of W_pos, m and v
  at once while it is in cache: dW is never written whole, and W_pos, m and v are streamed once per step.

The loss (per token n, with u = ln(2+q), a = d·u, f = (a z − LSE(a z)) / u the log-SDM, :mod:`.loss`):
f_ref − f_gen equals c_n = (LSE_gen − LSE_ref) / u on every negative entry and c_n + d (z_ref − z_pos) on every
positive one.  With p = softmax(a · joint) on the positive half, S_n = Σ_i i_n,i (f_ref − f_gen)_i and
g_R = β ∂R'/∂R (R' of ``eq:regularization-rescale``, s without gradient):

    ∂L/∂z_pos[n, j] = −d (1[t_n = |V| + j] − p_j) / N
    ∂R/∂z_pos[n, j] = −d (i_n,|V|+j (f_ref − f_gen)_|V|+j − p_j S_n) / (N R_n)        (0 where R_n = 0)

Adam is MLX's (``mlx.optimizers.Adam`` with bias correction, float32), so both steps follow one trajectory up
to float rounding: the losses agree to 1e-5 relative, and W_pos to a few thousandths of how far it moved (Adam
divides by √v, so rounding in near-zero gradients moves single weights by up to the learning rate).

Subnormal floats are flushed to zero in the softmax p and the gradient (:func:`_flush_subnormal`): most of the
|V| probabilities of a confident model underflow below 1.2e-38, and x86 CPUs compute on subnormal operands
through slow microcode assists: with 30 % of the gradient's entries subnormal, the dW products took 40x as long
(measured), and a real Alg. 4 epoch ran at 3.9 s per step instead of about 1 s.  Metal flushes them as well, and
an entry that small moves W_pos by less than 1e-30 of a unit through Adam.

The dW + Adam pass is split between :data:`THREADS` threads, each its own contiguous vocabulary rows and its own
scratch block, and each block product runs on its worker's thread (:func:`~sdm_mlx.runtime.blas.one_blas_thread`;
NumPy releases the GIL inside each pass).  Left to OpenBLAS's two threads, the 1,187 small products per step each
ended in a barrier: a real Alg. 4 epoch on a shared virtual machine (30-40 % steal time) ran at 4-6 tokens/s with
three-quarters of its samples in OpenBLAS's thread handling, against 20 when the steal was low; the pass alone took
9-14 s beside other work and 1.5 s on a quiet box, split between two threads 2.1 and 1.0-1.3 s (measured,
``docs/performance.md``).

The host arrays are the step's own during an epoch;
:meth:`HostTrainStep.begin` copies W_pos and the Adam state out of the heads and the optimizer, and
:meth:`HostTrainStep.end` puts them back, so everything between epochs (decoding, the resumable state, the
saved network) sees the MLX arrays as before.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from ..core.activation import Q_SOFTMAX
from ..errors import InputError
from ..runtime.blas import PASS_THREADS, block_ranges, one_blas_thread
from .heads import SDMHeads

#: vocabulary rows of W_pos per dW + Adam block (128 x 1,536 float32 = 0.75 MB per array): on the quiet 2-core
#: box the qwen15-size update took 0.65 s with 128 rows against 0.73 s with 256, 0.74 s with 32 and 1.0-3.3 s
#: (under load) with 512; two threads over the blocks were slower (the passes are bound by the memory
#: bandwidth, and BLAS competes for the same two cores)
BLOCK_ROWS = 128
#: threads of the dW + Adam pass, each its own vocabulary rows (measured on 2 cores)
THREADS = PASS_THREADS


def host_step_supported(heads: SDMHeads) -> bool:
    """True when z_ref comes from a dense float32 matrix the host can multiply with (a float32 model's head, or
    ``reference_head="float32"``); a quantised head used as the reference needs MLX's quantised matmul."""
    return reference_weight(heads) is not None


def reference_weight(heads: SDMHeads) -> mx.array | None:
    """The dense ``[|V|, D]`` float32 W_ref of ``heads``, or None (quantised head)."""
    if heads._ref_w is not None:
        return heads._ref_w
    model = heads.model
    layer = getattr(model, "lm_head", None)
    if layer is None:
        from ..llm import embed as _embed

        layer = _embed.trunk(model).embed_tokens
    w = getattr(layer, "weight", None)
    if w is None or hasattr(layer, "scales") or w.dtype != mx.float32 or getattr(layer, "bias", None) is not None:
        return None
    return w


#: the smallest normal float32; magnitudes below it are subnormal
TINY = np.float32(np.finfo(np.float32).tiny)


def _flush_subnormal(x: np.ndarray) -> np.ndarray:
    """Set the subnormal entries of float32 ``x`` to zero, in place (see the module docstring); returns ``x``."""
    np.copyto(x, np.float32(0.0), where=np.abs(x) < TINY)
    return x


def _lse(x: np.ndarray) -> np.ndarray:
    """Row-wise log-sum-exp of a 2-D float32 array (float64 accumulation of the sum)."""
    m = x.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True, dtype=np.float64))).astype(np.float32)


class HostTrainStep:
    """``step(h, t, q, d, beta) -> (total, L, R, R')`` as floats: one Adam update of W_pos on the host.

    Parameters
    ----------
    heads : SDMHeads
        The heads whose ``pos.weight`` is trained; z_ref from :func:`reference_weight` (see
        :func:`host_step_supported`).
    optimizer : mlx.optimizers.Adam
        Its hyper-parameters, step count and state (``m``, ``v`` of ``pos.weight``) are used and kept up to
        date at :meth:`end`.
    block_rows : int
        Vocabulary rows per dW + Adam block.
    threads : int
        Threads of the dW + Adam pass (1: the calling thread only).

    Attributes
    ----------
    w_pos, m : numpy.ndarray
        The host copies of W_pos and Adam's first moment during an epoch (between :meth:`begin` and
        :meth:`end`), else None.
    v_scaled : numpy.ndarray
        Adam's second moment during an epoch, held as ``v (1 - β₁)² / (1 - β₂)`` so that one update is ten
        element-wise passes instead of twelve (see :meth:`_adam`); :meth:`end` hands back ``v``.
    """

    host = True

    def __init__(self, heads: SDMHeads, optimizer, *, block_rows: int = BLOCK_ROWS, threads: int = THREADS):
        if not host_step_supported(heads):
            raise InputError("the host W_pos step needs a float32 reference head: pass reference_head='float32' "
                             "(--reference-head float32) for a quantised model, or use the MLX step")
        if block_rows < 1:
            raise InputError(f"block_rows must be >= 1, got {block_rows}")
        if threads < 1:
            raise InputError(f"threads must be >= 1, got {threads}")
        self.heads, self.optimizer, self.block_rows, self.threads = heads, optimizer, int(block_rows), int(threads)
        self.w_pos = self.m = self.v_scaled = None
        self._pool = self._ranges = self._scratch = None
        self.steps = 0

    # -- between epochs: the MLX arrays own the state ---------------------------------------------
    def begin(self) -> None:
        """Copy W_pos and the Adam state (zeros before the first update) to the host."""
        self.w_ref = np.asarray(reference_weight(self.heads))  # a read-only view of the frozen head
        self.w_pos = np.array(self.heads.pos.weight, dtype=np.float32)
        state = self.optimizer.state.get("pos", {}).get("weight", {})
        self.m = np.array(state["m"], dtype=np.float32) if "m" in state else np.zeros_like(self.w_pos)
        self.v_scaled = np.array(state["v"], dtype=np.float32) if "v" in state else np.zeros_like(self.w_pos)
        self.v_scaled *= self._v_scale()
        self.steps = int(np.asarray(self.optimizer.state.get("step", mx.array(0, mx.uint64))).item())
        vocab, dim = self.w_pos.shape
        self._ranges = block_ranges(vocab, self.block_rows, self.threads)  # whole blocks per worker
        workers = len(self._ranges)
        self._scratch = [np.empty((self.block_rows, dim), dtype=np.float32) for _ in range(workers)]
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sdm-host-adam") if workers > 1 else None

    def sync(self) -> None:
        """Copy W_pos and the Adam state into the heads and the optimizer (what MLX's step would leave), keeping
        the host copies for the next steps (a checkpoint in the middle of an epoch)."""
        self.heads.pos.weight = mx.array(self.w_pos)
        state = dict(self.optimizer.state)
        state["step"] = mx.array(self.steps, dtype=mx.uint64)
        state["pos"] = {"weight": {"m": mx.array(self.m), "v": mx.array(self.v_scaled / self._v_scale())}}
        self.optimizer.state = state
        mx.eval(self.heads.pos.weight, self.optimizer.state)

    def end(self) -> None:
        """Put W_pos and the Adam state back into the heads and the optimizer (:meth:`sync`) and free the host
        copies."""
        self.sync()
        self.w_ref = self.w_pos = self.m = self.v_scaled = None
        if self._pool is not None:
            self._pool.shutdown()
        self._pool = self._ranges = self._scratch = None

    def _v_scale(self) -> np.float32:
        """(1 - β₁)² / (1 - β₂): the factor of the host's ``v_scaled`` over Adam's ``v``."""
        b1, b2 = (float(b) for b in self.optimizer.betas)
        return np.float32((1.0 - b1) ** 2 / (1.0 - b2))

    # -- one mini-batch ---------------------------------------------------------------------------
    def __call__(self, h: np.ndarray, targets: np.ndarray, q: np.ndarray, d: np.ndarray, beta: float):
        if self.w_pos is None:
            raise RuntimeError("HostTrainStep: call begin() before the first step of an epoch")
        h = np.ascontiguousarray(h, dtype=np.float32)
        n, vocab = h.shape[0], self.w_pos.shape[0]
        t = np.asarray(targets, dtype=np.int64).reshape(n)
        d = np.asarray(d, dtype=np.float32).reshape(n, 1)
        u = (1.0 + np.log1p((np.asarray(q, dtype=np.float32).reshape(n, 1) - Q_SOFTMAX) / math.e)).astype(np.float32)
        a = d * u
        z_ref = h @ self.w_ref.T  # [N, V]
        z_pos = h @ self.w_pos.T
        s_ref, s_pos = a * z_ref, a * z_pos
        lse_ref1 = _lse(s_ref)
        # both LSEs by one function, so that W_pos = W_ref gives f_ref = f_gen exactly (R = 0, as MLX's)
        lse_gen = np.logaddexp(lse_ref1, _lse(s_pos))
        lse_ref = np.logaddexp(lse_ref1, lse_ref1)
        c = (lse_gen - lse_ref) / u  # f_ref - f_gen on every negative entry, [N, 1]
        diff_pos = c + d * (z_ref - z_pos)  # ... and on the positive ones, [N, V]
        rows = np.arange(n)
        # eq:regularization-mask: zero at argmax z_ref (both halves), argmax z_neg (= z_ref), argmax z_pos + |V|, t
        a_ref, a_pos = z_ref.argmax(axis=1), z_pos.argmax(axis=1)
        mask_pos = np.ones((n, vocab), dtype=np.float32)
        mask_pos[rows, a_ref] = 0.0
        mask_pos[rows, a_pos] = 0.0
        in_pos = t >= vocab
        mask_pos[rows[in_pos], t[in_pos] - vocab] = 0.0
        neg_zeros = 1 + (~in_pos & (t != a_ref)).astype(np.float32)  # a_ref (= a_neg), and t if in the neg half
        neg_ones = (vocab - neg_zeros).reshape(n, 1)
        md = mask_pos * diff_pos
        sq = (neg_ones * c * c).reshape(n) + np.einsum("ij,ij->i", md, diff_pos, dtype=np.float64).astype(np.float32)
        r_rows = np.sqrt(np.maximum(sq, 0.0))
        s_t = np.where(in_pos, s_pos[rows, np.where(in_pos, t - vocab, 0)], s_ref[rows, np.where(in_pos, 0, t)])
        nll_rows = -(s_t - lse_gen.reshape(n)) / u.reshape(n)
        nll, reg = float(nll_rows.mean(dtype=np.float64)), float(r_rows.mean(dtype=np.float64))
        with np.errstate(divide="ignore", invalid="ignore"):  # s = ln L / ln R as rescale_exponent takes it
            s = float(np.log(np.float64(nll)) / np.log(np.float64(reg)))
        s = 0.0 if math.isnan(s) else min(max(s, 0.0), 1.0)
        reg_rescaled = math.sqrt(max(reg, 1.0) ** s)
        total = nll + beta * reg_rescaled
        g_reg = beta * 0.5 * s * reg ** (0.5 * s - 1.0) if reg > 1.0 else 0.0
        # dtotal/dz_pos = (-d (onehot - p) + g_reg * (-d / R_n) (i * diff - p S_n)) / N
        p = _flush_subnormal(np.exp(s_pos - lse_gen))  # softmax of the joint, positive half
        grad = p * d
        if in_pos.any():
            grad[rows[in_pos], t[in_pos] - vocab] -= d.reshape(n)[in_pos]
        if g_reg != 0.0:
            s_rows = (neg_ones * c).reshape(n) + md.sum(axis=1, dtype=np.float64).astype(np.float32)
            coef = np.where(r_rows > 0, -g_reg * d.reshape(n) / np.where(r_rows > 0, r_rows, 1.0), 0.0)
            grad += coef.astype(np.float32)[:, None] * (md - p * s_rows[:, None])
        grad /= np.float32(n)
        self._adam(_flush_subnormal(grad), h)
        return total, nll, reg, reg_rescaled

    def _adam(self, grad: np.ndarray, h: np.ndarray) -> None:
        """dW = gradᵀ h and MLX's bias-corrected Adam, one block of vocabulary rows at a time.

        The block's g = (1 - β₁) dW comes straight from the product (``grad`` is scaled once, [N, |V|]), and
        with ``v_scaled = v (1 - β₁)² / (1 - β₂)`` the moments are ``m ← β₁ m + g`` and ``v_scaled ← β₂ v_scaled
        + g²``; the update ``c₁ m / (c₂ √v + ε)`` is then ``(c₁ / (c₂ κ)) m / (√v_scaled + ε / (c₂ κ))`` with
        κ = √(1 - β₂) / (1 - β₁): ten passes over the block, which stays in cache, and W_pos, m and v are read
        and written once per step."""
        grad, consts = self._adam_constants(grad)
        with one_blas_thread():  # each worker's products on its own thread (module docstring)
            if self._pool is None:
                self._rows(0, *self._ranges[0], grad, h, consts)
            else:
                parts = [self._pool.submit(self._rows, i, j0, j1, grad, h, consts)
                         for i, (j0, j1) in enumerate(self._ranges)]
                for part in parts:
                    part.result()

    def _adam_constants(self, grad: np.ndarray) -> tuple[np.ndarray, tuple]:
        """Count this update and return ``((1 - β₁) grad, (β₁, β₂, ε', step size))`` for :meth:`_rows` (see
        :meth:`_adam`)."""
        opt = self.optimizer
        self.steps += 1
        b1, b2 = (float(b) for b in opt.betas)
        lr = float(np.asarray(opt.learning_rate).item())
        c1 = lr / (1.0 - b1 ** self.steps)
        c2 = 1.0 / math.sqrt(1.0 - b2 ** self.steps)
        kappa = math.sqrt(1.0 - b2) / (1.0 - b1)  # √v = κ √v_scaled
        consts = (np.float32(b1), np.float32(b2), np.float32(float(opt.eps) / (c2 * kappa)),
                  np.float32(c1 / (c2 * kappa)))
        return grad * np.float32(1.0 - b1), consts

    def _rows(self, worker: int, start: int, stop: int, grad: np.ndarray, h: np.ndarray, consts) -> None:
        """The blocks of vocabulary rows [start, stop) of :meth:`_adam`, with ``worker``'s scratch block."""
        b1, b2, eps_c, step_c = consts
        w, m, v, tmp = self.w_pos, self.m, self.v_scaled, self._scratch[worker]
        for j0 in range(start, stop, self.block_rows):
            j1 = min(j0 + self.block_rows, stop)
            g = grad[:, j0:j1].T @ h  # this block of (1 - β₁) dW, [B, D]: never written whole
            t = tmp[: j1 - j0]
            mb, vb, wb = m[j0:j1], v[j0:j1], w[j0:j1]
            np.square(g, out=t)
            vb *= b2
            vb += t  # v_scaled = b2 v_scaled + g^2
            mb *= b1
            mb += g  # m = b1 m + (1 - b1) dW
            np.sqrt(vb, out=t)
            t += eps_c
            np.divide(mb, t, out=t)
            t *= step_c
            wb -= t
