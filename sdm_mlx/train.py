"""Alg. 1 (``alg:sdm-estimator-training``): training the exemplar adaptor under the SDM loss.

One *round* (one of the J iterations):

1. epoch 1 uses q = e−2, d = 1 (plain softmax cross-entropy);
2. after every epoch the whole training and calibration splits are forwarded,
   the support index is rebuilt over the training exemplars h', and per-row
   q, d0, d are refreshed from the current model (training rows: self-excluded
   search, training distance eCDFs; calibration rows: calibration eCDFs);
3. the "flip" rule (DESIGN #7): a row whose SDM output has no unique argmax equal
   to ŷ gets q := 0;
4. the epoch with the highest balanced median calibration q (mean over true
   classes of the per-class median) is kept (≥: later epochs win ties).

:func:`train_rounds` runs J rounds over stratified re-splits of the pooled
train+calibration data with fresh initialisation and keeps the best round by
the same metric (≥, later wins).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from .activation import Q_SOFTMAX, sdm, sdm_nll_loss
from .adaptor import ExemplarAdaptor, InvariantForward, exemplar_basis, scalar_normalization
from .distance import distance_ecdfs, distance_quantile
from .index import default_k, good_neighbours_by_class, make_index
from .progress import log


@dataclass
class TrainConfig:
    """Alg. 1 settings (paper defaults)."""

    epochs: int = 50
    batch_size: int = 50
    learning_rate: float = 1e-5
    exemplar_dim: int = 1000
    k: int | None = None  #: neighbours scanned for q; None = largest class count of the training split
    normalize: bool = True
    iterations: int = 10  #: J
    stratified: bool = True
    seed: int = 0
    index_backend: str = "exact"
    eval_batch_size: int = 1024

    def validate(self) -> None:
        for name in ("epochs", "batch_size", "exemplar_dim", "iterations", "eval_batch_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"k must be ≥ 1 or None, got {self.k}")
        if self.index_backend not in ("exact", "hnsw"):
            raise ValueError(f"index_backend must be 'exact' or 'hnsw', got {self.index_backend!r}")


@dataclass
class SplitState:
    """Per-row Similarity/Distance state of one split under one model."""

    z: np.ndarray  #: logits z' [N, C]
    h: np.ndarray  #: exemplar coordinates (h' itself, or its distance-equivalent D-dim coordinates)
    y_hat: np.ndarray  #: argmax z'
    q: np.ndarray  #: Similarity after the flip rule
    d0: np.ndarray  #: squared L2 to the nearest training exemplar
    d: np.ndarray  #: Distance quantile
    sdm: np.ndarray  #: SDM activation output [N, C]


@dataclass
class RoundResult:
    """The best epoch of one round: the model, its support set and calibration state."""

    model: ExemplarAdaptor
    metric: float
    best_epoch: int
    k: int
    train_idx: np.ndarray
    cal_idx: np.ndarray
    train: SplitState
    calibration: SplitState
    train_distance_ecdfs: list
    calibration_distance_ecdfs: list
    history: list = field(default_factory=list)
    basis: np.ndarray | None = None  #: the exemplar basis Rᵀ the coordinates were computed in (None: h' itself)


def balanced_median(values: np.ndarray, labels: np.ndarray, num_classes: int) -> float:
    """Mean over true classes of the per-class median (empty class ⇒ 0): Alg. 1's selection metric."""
    meds = [float(np.median(values[labels == c])) if np.any(labels == c) else 0.0 for c in range(num_classes)]
    return float(np.mean(meds))


def flip_rule(s: np.ndarray, y_hat: np.ndarray) -> np.ndarray:
    """True where the SDM output has no unique argmax equal to ŷ (DESIGN #7: then q := 0)."""
    top = s.max(axis=1, keepdims=True)
    unique = (s == top).sum(axis=1) == 1
    return ~(unique & (s.argmax(axis=1) == y_hat))


def sdm_numpy(z: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The SDM activation evaluated eagerly to NumPy."""
    out = sdm(mx.array(z), mx.array(q.astype(np.float32)), mx.array(d.astype(np.float32)))
    return np.array(out)


def split_state(z, h, labels, support_index, good, k, num_classes, exclude=None):
    """One split's q, d0, its own distance eCDFs (``equation:d``), d and the flip rule.

    Training rows pass ``exclude`` (their own support index) and get training eCDFs;
    calibration rows get calibration eCDFs.  Returns (SplitState, eCDFs).
    """
    y_hat = z.argmax(axis=1)
    q, d0 = support_index.similarity(h, y_hat, good, k, exclude=exclude)
    ecdfs = distance_ecdfs(d0, labels, q, num_classes)
    d = distance_quantile(d0, ecdfs)
    s = sdm_numpy(z, q, d)
    flipped = flip_rule(s, y_hat)
    if flipped.any():
        q = np.where(flipped, 0, q)
        s = sdm_numpy(z, q, d)
    return SplitState(z=z, h=h, y_hat=y_hat, q=q, d0=d0, d=d, sdm=s), ecdfs


def _make_step(model: ExemplarAdaptor, optimizer: optim.Optimizer) -> Callable:
    def loss_fn(m, x, y, q, d):
        z, _ = m(x)
        return sdm_nll_loss(z, y, q, d)

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y, q, d):
        loss, grads = loss_and_grad(model, x, y, q, d)
        optimizer.update(model, grads)
        return loss

    return step


def train_round(
    X_tr: np.ndarray,
    y_tr: np.ndarray,
    X_ca: np.ndarray,
    y_ca: np.ndarray,
    num_classes: int,
    config: TrainConfig,
    seed: int,
    train_idx: np.ndarray | None = None,
    cal_idx: np.ndarray | None = None,
    verbose: bool = True,
    round_label: str = "",
) -> RoundResult:
    """One round of Alg. 1 (``alg:sdm-estimator-training``) on a fixed split; returns its best epoch."""
    n_tr, dim = X_tr.shape
    model = ExemplarAdaptor(dim, config.exemplar_dim, num_classes, seed=seed)
    if config.normalize:
        model.set_normalization(*scalar_normalization(X_tr))
    optimizer = optim.Adam(learning_rate=config.learning_rate, betas=[0.9, 0.999], eps=1e-8, bias_correction=True)
    step = _make_step(model, optimizer)
    k = int(config.k) if config.k is not None else default_k(y_tr, num_classes)
    rng = np.random.default_rng(seed)
    q_tr = np.full(n_tr, Q_SOFTMAX, dtype=np.float32)
    d_tr = np.ones(n_tr, dtype=np.float32)
    y_tr_mx = mx.array(y_tr.astype(np.int32))
    X_tr_mx = mx.array(X_tr)
    best = None
    history = []
    for epoch in range(1, config.epochs + 1):
        order = rng.permutation(n_tr)
        q_mx, d_mx = mx.array(q_tr), mx.array(d_tr)
        total, batches = 0.0, 0
        for start in range(0, n_tr, config.batch_size):
            b = mx.array(order[start : start + config.batch_size])
            loss = step(X_tr_mx[b], y_tr_mx[b], q_mx[b], d_mx[b])
            mx.eval(loss, model.parameters(), optimizer.state)
            total += loss.item()
            batches += 1
        # refresh q, d from the current model, by the batch-invariant forward that predict uses
        basis = exemplar_basis(model)
        forward = InvariantForward(model, basis)
        z_tr, h_tr = forward(X_tr)
        z_ca, h_ca = forward(X_ca)
        yhat_tr = z_tr.argmax(axis=1)
        good = good_neighbours_by_class(y_tr, yhat_tr, num_classes)
        index = make_index(h_tr, config.index_backend)
        tr_state, tr_ecdfs = split_state(z_tr, h_tr, y_tr, index, good, k, num_classes, exclude=np.arange(n_tr))
        ca_state, ca_ecdfs = split_state(z_ca, h_ca, y_ca, index, good, k, num_classes)
        q_tr, d_tr = tr_state.q.astype(np.float32), tr_state.d.astype(np.float32)
        metric = balanced_median(ca_state.q, y_ca, num_classes)
        accuracy = float((ca_state.y_hat == y_ca).mean())
        history.append(
            {"epoch": epoch, "loss": total / max(batches, 1), "balanced_median_q": metric, "cal_accuracy": accuracy}
        )
        if verbose:
            log(
                f"{round_label}epoch {epoch}/{config.epochs} loss {total / max(batches, 1):.4f} "
                f"balanced median q {metric:.2f} cal acc {accuracy:.3f}"
            )
        if best is None or metric >= best[0]:
            params = dict(tree_flatten(model.parameters()))
            best = (metric, epoch, params, tr_state, ca_state, tr_ecdfs, ca_ecdfs, basis)
    metric, epoch, params, tr_state, ca_state, tr_ecdfs, ca_ecdfs, basis = best
    model.load_weights(list(params.items()))
    return RoundResult(
        model=model,
        metric=metric,
        best_epoch=epoch,
        k=k,
        train_idx=np.arange(n_tr) if train_idx is None else train_idx,
        cal_idx=np.arange(X_ca.shape[0]) if cal_idx is None else cal_idx,
        train=tr_state,
        calibration=ca_state,
        train_distance_ecdfs=tr_ecdfs,
        calibration_distance_ecdfs=ca_ecdfs,
        history=history,
        basis=basis,
    )


def split_pool(y: np.ndarray, num_classes: int, rng: np.random.Generator, stratified: bool = True):
    """Shuffle the pooled rows and split them in half (per class when ``stratified``; DESIGN #9).

    Raises ValueError if either half lacks a class.
    """
    n = y.shape[0]
    if stratified:
        tr, ca = [], []
        for c in range(num_classes):
            idx = rng.permutation(np.flatnonzero(y == c))
            half = idx.size // 2
            tr.append(idx[:half])
            ca.append(idx[half:])
        train_idx, cal_idx = rng.permutation(np.concatenate(tr)), rng.permutation(np.concatenate(ca))
    else:
        perm = rng.permutation(n)
        train_idx, cal_idx = perm[: n // 2], perm[n // 2 :]
    for name, idx in (("training", train_idx), ("calibration", cal_idx)):
        counts = np.bincount(y[idx], minlength=num_classes)
        if (counts == 0).any():
            missing = np.flatnonzero(counts == 0).tolist()
            raise ValueError(
                f"the {name} split has no rows of class(es) {missing}: each class needs at least 2 rows in the "
                "pooled data (one per split)"
            )
    return train_idx, cal_idx


def train_rounds(
    X: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    config: TrainConfig,
    on_round: Callable[[int, RoundResult], None] | None = None,
    verbose: bool = True,
) -> tuple[RoundResult, int, list]:
    """J rounds of Alg. 1 (``alg:sdm-estimator-training``) over stratified re-splits of the pooled data.

    ``on_round(j, result)`` is called after every round (calibration statistics are gathered
    there).  Returns (best round, its index j, per-round summaries).  Only the best round's
    arrays are kept in memory.
    """
    config.validate()
    rng = np.random.default_rng(config.seed)
    best, best_j, summaries = None, -1, []
    for j in range(config.iterations):
        train_idx, cal_idx = split_pool(y, num_classes, rng, config.stratified)
        result = train_round(
            X[train_idx], y[train_idx], X[cal_idx], y[cal_idx], num_classes, config,
            seed=config.seed * 1000 + j, train_idx=train_idx, cal_idx=cal_idx, verbose=verbose,
            round_label=f"round {j + 1}/{config.iterations} ",
        )
        if on_round is not None:
            on_round(j, result)
        summaries.append({"round": j, "metric": result.metric, "best_epoch": result.best_epoch, "k": result.k})
        if verbose:
            log(f"round {j + 1}/{config.iterations}: best epoch {result.best_epoch}, balanced median q {result.metric:.2f}")
        if best is None or result.metric >= best.metric:
            best, best_j = result, j
    return best, best_j, summaries
