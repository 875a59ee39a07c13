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
   classes of the per-class median) is kept (≥: later epochs win ties);
5. convergence-aware stopping (optional, not in the paper): with
   ``TrainConfig.patience = P`` a round stops once the balanced median q has not
   strictly improved for P consecutive epochs (``epochs`` is then a cap).

Every epoch records the loss, the balanced median q, the calibration accuracy and how
far the adaptor has moved from its initialisation (‖W − W₀‖_F / ‖W₀‖_F for W_g and W').

:func:`sdm_mlx.estimator.rounds.train_rounds` runs J such rounds over stratified re-splits of the pooled
train+calibration data with fresh initialisation and keeps the best round by the same metric (≥, later wins).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..calibration.bins import unique_argmax_is
from ..core.activation import Q_SOFTMAX, sdm_nll_loss, sdm_numpy
from ..runtime.callbacks import SILENT, Callback
from ..core.adaptor import ExemplarAdaptor, InvariantForward, exemplar_basis, fit_normalization, normalize_mode
from .adaptor_step import HostAdaptorStep, normalized, set_params
from .config import EstimatorConfig
from ..core.distance import distance_ecdfs, distance_quantile
from ..index import default_k, good_neighbours_by_class, make_index
from ..errors import InputError


_D = EstimatorConfig()  #: the package defaults (declared once, in EstimatorConfig)


@dataclass
class TrainConfig:
    """Alg. 1 settings: the training subset of :class:`~sdm_mlx.estimator.config.EstimatorConfig`, with its
    defaults (the paper's are :data:`~sdm_mlx.estimator.config.PAPER_SETTINGS`; see ``docs/defaults.md``)."""

    epochs: int = _D.epochs  #: per round (a cap when ``patience`` is set)
    batch_size: int = _D.batch_size
    learning_rate: float = _D.learning_rate
    exemplar_dim: int = _D.exemplar_dim
    k: int | None = _D.k  #: neighbours scanned for q; None = largest class count of the training split
    normalize: str = _D.normalize  #: DESIGN #2: scalar | per-dimension | none (True/False: scalar/none)
    iterations: int = _D.iterations  #: J
    stratified: bool = _D.stratified
    seed: int = _D.seed
    index_backend: str = _D.index_backend
    patience: int | None = _D.patience  #: stop a round after this many epochs without a better balanced median q
    shard_index: bool = _D.shard_index  #: under mlx.launch, split the exact index over the ranks (index.sharded)
    shard_timeout: float = _D.shard_timeout  #: seconds a sharded-index collective waits for the other ranks

    @classmethod
    def of(cls, params: dict) -> "TrainConfig":
        """The training settings among an estimator's parameters (``SDMEstimator.get_params()``)."""
        return cls(**{f.name: params[f.name] for f in fields(cls)})

    def validate(self) -> None:
        normalize_mode(self.normalize)
        for name in ("epochs", "batch_size", "exemplar_dim", "iterations"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise InputError(f"{name} must be a positive integer, got {v!r}")
        if not self.learning_rate > 0:
            raise InputError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.patience is not None and (not isinstance(self.patience, (int, np.integer)) or self.patience < 1):
            raise InputError(f"patience must be a positive integer or None, got {self.patience!r}")
        if self.k is not None and self.k < 1:
            raise InputError(f"k must be ≥ 1 or None, got {self.k}")
        if isinstance(self.shard_timeout, bool) or not (isinstance(self.shard_timeout, (int, float))
                                                          and self.shard_timeout > 0):
            raise InputError(f"shard_timeout must be a number of seconds > 0, got {self.shard_timeout!r}")
        if self.index_backend not in ("exact", "hnsw"):
            raise InputError(f"index_backend must be 'exact' or 'hnsw', got {self.index_backend!r}")


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


@dataclass(frozen=True)
class KeptEpoch:
    """The best epoch of a round so far (≥: later epochs win ties), as :func:`train_round` keeps it."""

    metric: float  #: the balanced median calibration q
    epoch: int
    params: dict  #: the adaptor's parameters after this epoch (flattened)
    train: SplitState
    calibration: SplitState
    train_distance_ecdfs: list
    calibration_distance_ecdfs: list
    movement: dict  #: relative Frobenius movement of W_g and W' from their initialisation
    basis: np.ndarray | None  #: the exemplar basis the coordinates were computed in


@dataclass(frozen=True)
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
    movement: dict = field(default_factory=dict)  #: relative Frobenius movement of the kept epoch
    epochs_run: int = 0
    stopped_early: bool = False


def balanced_median(values: np.ndarray, labels: np.ndarray, num_classes: int) -> float:
    """Mean over true classes of the per-class median (empty class ⇒ 0): Alg. 1's selection metric."""
    meds = [float(np.median(values[labels == c])) if np.any(labels == c) else 0.0 for c in range(num_classes)]
    return float(np.mean(meds))


def flip_rule(s: np.ndarray, y_hat: np.ndarray) -> np.ndarray:
    """True where the SDM output has no unique argmax equal to ŷ (DESIGN #7: then q := 0)."""
    return ~unique_argmax_is(s, y_hat)


def split_state(z, h, labels, support_index, good, k, *, num_classes, exclude=None):
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


def _weights(model: ExemplarAdaptor) -> dict[str, np.ndarray]:
    """W_g (projection) and W' (classifier) as float64 NumPy arrays."""
    return {
        "projection": np.array(model.projection.weight, dtype=np.float64),
        "classifier": np.array(model.classifier.weight, dtype=np.float64),
    }


def adaptor_movement(model: ExemplarAdaptor, initial: dict[str, np.ndarray]) -> dict[str, float]:
    """‖W − W₀‖_F / ‖W₀‖_F for W_g ("projection") and W' ("classifier") against their initialisation."""
    now = _weights(model)
    return {name: float(np.linalg.norm(now[name] - w0) / np.linalg.norm(w0)) for name, w0 in initial.items()}


def _movement(arrays, initial: dict[str, np.ndarray]) -> dict[str, float]:
    """:func:`adaptor_movement` of the parameters ``arrays`` (W_g, b_g, W', b')."""
    now = {"projection": arrays[0], "classifier": arrays[2]}
    return {name: float(np.linalg.norm(now[name].astype(np.float64) - w0) / np.linalg.norm(w0))
            for name, w0 in initial.items()}


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


class _MlxTrainer:
    """Alg. 1's epochs with the compiled MLX step (:func:`_make_step`): off the CPU (Metal), or when asked."""

    def __init__(self, model: ExemplarAdaptor, X_tr: np.ndarray, y_tr: np.ndarray, config: TrainConfig):
        self.model = model
        self.optimizer = optim.Adam(learning_rate=config.learning_rate, betas=[0.9, 0.999], eps=1e-8,
                                    bias_correction=True)
        self.step = _make_step(model, self.optimizer)
        self.X, self.y = mx.array(X_tr), mx.array(y_tr.astype(np.int32))
        self.x_norm = None

    def run_epoch(self, q_tr, d_tr, order, batch_size) -> float:
        """One pass of Adam over the training split in ``order`` (the compiled MLX step); returns the mean batch
        loss."""
        q_mx, d_mx = mx.array(q_tr), mx.array(d_tr)
        total, batches = 0.0, 0
        for start in range(0, order.size, batch_size):
            b = mx.array(order[start : start + batch_size])
            loss = self.step(self.X[b], self.y[b], q_mx[b], d_mx[b])
            mx.eval(loss, self.model.parameters(), self.optimizer.state)
            total += loss.item()
            batches += 1
        return total / max(batches, 1)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(W_g, b_g, W', b') as float32 NumPy arrays."""
        m = self.model
        return tuple(np.array(a, dtype=np.float32) for a in (m.projection.weight, m.projection.bias,
                                                               m.classifier.weight, m.classifier.bias))

    def params(self) -> dict:
        return dict(tree_flatten(self.model.parameters()))

    def to_model(self, params: dict) -> None:
        self.model.load_weights(list(params.items()))

    def sync(self) -> None:
        """The model holds the current parameters (it always does here)."""

    def close(self) -> None:
        """Nothing to release."""


class _HostTrainer:
    """Alg. 1's epochs with the host step (:class:`~sdm_mlx.estimator.adaptor_step.HostAdaptorStep`), the
    default on the CPU: no MLX dispatch and no host round trip inside an epoch."""

    def __init__(self, model: ExemplarAdaptor, X_tr: np.ndarray, y_tr: np.ndarray, config: TrainConfig):
        self.model = model
        self.step = HostAdaptorStep(model, learning_rate=config.learning_rate)
        self.x_norm = normalized(model, X_tr)
        self.y = np.asarray(y_tr, dtype=np.int64)

    def run_epoch(self, q_tr, d_tr, order, batch_size) -> float:
        total, batches = 0.0, 0
        for start in range(0, order.size, batch_size):
            b = order[start : start + batch_size]
            total += self.step(self.x_norm[b], self.y[b], q_tr[b], d_tr[b])
            batches += 1
        return total / max(batches, 1)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        s = self.step
        return s.w_g, s.b_g, s.w_c, s.b_c

    def params(self) -> dict:
        return self.step.params()

    def to_model(self, params: dict) -> None:
        set_params(self.model, params)

    def sync(self) -> None:
        """Write the current parameters into the model."""
        self.step.to_model(self.model)

    def close(self) -> None:
        self.step.close()


#: Alg. 1's step: "host" (NumPy, :mod:`.adaptor_step`) or "mlx" (compiled); None: host when MLX runs on the CPU.
TRAIN_STEP: str | None = None


def _trainer(model, X_tr, y_tr, config):
    kind = TRAIN_STEP or ("host" if mx.default_device() == mx.cpu else "mlx")
    return (_HostTrainer if kind == "host" else _MlxTrainer)(model, X_tr, y_tr, config)


def _float32_maps(arrays):
    """The float32 maps of :func:`_float32_forward` for one epoch's parameters (W_g, b_g, W', b'): for D ≥ M,
    W_g as an MLX array (h' = x̄ W_gᵀ + b_g); for D < M, the folded logits map (W' W_g, W' b_g + b') and the
    basis Rᵀ with W_gᵀ W_g = Rᵀ R (distance-equivalent coordinates x̄ Rᵀ, as
    :func:`~sdm_mlx.core.adaptor.exemplar_basis`), made once and used for both splits."""
    w_g, b_g, w_c, b_c = arrays
    m, dim = w_g.shape
    if dim >= m:
        return {"w_g": mx.array(w_g), "b_g": b_g, "w_c": w_c, "b_c": b_c}
    w64 = w_g.astype(np.float64)
    try:
        lower = np.linalg.cholesky(w64.T @ w64)
    except np.linalg.LinAlgError:  # W_g rank-deficient
        lower = np.linalg.qr(w64)[1].T
    return {"fold_w": (w_c @ w_g).T.copy(), "fold_b": w_c @ b_g + b_c, "basis": lower.astype(np.float32)}


def _float32_forward(maps: dict, x_norm: np.ndarray, x_mx: mx.array | None = None):
    """(z' [N, C], exemplar coordinates) of normalised rows by float32 BLAS products (:func:`_float32_maps`)."""
    if "w_g" in maps:
        x_mx = mx.array(x_norm) if x_mx is None else x_mx
        h = np.array(mx.matmul(x_mx, maps["w_g"].T, stream=mx.cpu))
        h += maps["b_g"]
        return h @ maps["w_c"].T + maps["b_c"], h
    return x_norm @ maps["fold_w"] + maps["fold_b"], x_norm @ maps["basis"]


def _epoch_refresh(arrays, x_tr, y_tr, x_ca, y_ca, num_classes, *, k, x_mx=(None, None)):
    """Alg. 1's refresh after an epoch in float32 (the dense index, :mod:`sdm_mlx.index.dense`): both splits'
    z', q, d0, d; it weights the next epoch's loss and chooses the epoch, and is never stored (the kept epoch is
    recomputed exactly by :func:`_refresh`)."""
    maps = _float32_maps(arrays)
    z_tr, h_tr = _float32_forward(maps, x_tr, x_mx[0])
    z_ca, h_ca = _float32_forward(maps, x_ca, x_mx[1])
    good = good_neighbours_by_class(y_tr, z_tr.argmax(axis=1), num_classes)
    index = make_index(h_tr, "dense")
    tr = split_state(z_tr, h_tr, y_tr, index, good, k, num_classes=num_classes, exclude=np.arange(x_tr.shape[0]))
    ca = split_state(z_ca, h_ca, y_ca, index, good, k, num_classes=num_classes)
    return tr, ca


def _refresh(model, X_tr, y_tr, X_ca, y_ca, num_classes, *, k, config):
    """Forward both splits by the batch-invariant forward that predict uses, rebuild the support index,
    refresh q, d0, d (training: self-excluded); also returns the exemplar basis the coordinates are in."""
    basis = exemplar_basis(model)
    forward = InvariantForward(model, basis)
    z_tr, h_tr = forward(X_tr)
    z_ca, h_ca = forward(X_ca)
    good = good_neighbours_by_class(y_tr, z_tr.argmax(axis=1), num_classes)
    index = make_index(h_tr, config.index_backend, shard=config.shard_index, shard_timeout=config.shard_timeout)
    tr = split_state(z_tr, h_tr, y_tr, index, good, k, num_classes=num_classes, exclude=np.arange(X_tr.shape[0]))
    ca = split_state(z_ca, h_ca, y_ca, index, good, k, num_classes=num_classes)
    return tr, ca, basis


def _new_adaptor(X_tr: np.ndarray, num_classes: int, config: TrainConfig, seed: int) -> ExemplarAdaptor:
    """A freshly initialised exemplar adaptor for a round, with the input normalisation (DESIGN #2) fitted on
    this round's training split."""
    model = ExemplarAdaptor(X_tr.shape[1], config.exemplar_dim, num_classes, seed=seed)
    stats = fit_normalization(X_tr, config.normalize)
    if stats is not None:
        model.set_normalization(*stats)
    return model


def _epoch_record(epoch: int, loss: float, metric: float, cal_accuracy: float, moved: dict) -> dict:
    """One entry of a round's per-epoch history."""
    return {"epoch": epoch, "loss": loss, "balanced_median_q": metric, "cal_accuracy": cal_accuracy,
            "projection_movement": moved["projection"], "classifier_movement": moved["classifier"]}


class RoundSplit(NamedTuple):
    """One round's split (DESIGN #9): the training half (``X_tr``, ``y_tr``: the adaptor's rows and the support set)
    and the calibration half (``X_ca``, ``y_ca``), and where their rows sit in the pooled data (None: 0..n-1)."""

    X_tr: np.ndarray
    y_tr: np.ndarray
    X_ca: np.ndarray
    y_ca: np.ndarray
    train_idx: np.ndarray | None = None
    cal_idx: np.ndarray | None = None

    @classmethod
    def of(cls, X: np.ndarray, y: np.ndarray, train_idx: np.ndarray, cal_idx: np.ndarray) -> "RoundSplit":
        """The split of the pooled rows ``X``, ``y`` at ``train_idx`` / ``cal_idx``."""
        return cls(X[train_idx], y[train_idx], X[cal_idx], y[cal_idx], train_idx, cal_idx)


def train_round(split: RoundSplit, num_classes: int, config: TrainConfig, *, seed: int, callback: Callback = SILENT,
                round_index: int = 0) -> RoundResult:
    """One round of Alg. 1 (``alg:sdm-estimator-training``) on a fixed split; returns its best epoch.

    With ``config.patience`` set, the round stops after that many epochs without a strictly
    better balanced median calibration q (convergence-aware stopping; the paper runs all epochs).
    ``callback.on_epoch_end(round_index, epoch, metrics)`` follows every epoch.
    """
    X_tr, y_tr, X_ca, y_ca, train_idx, cal_idx = split
    n_tr = X_tr.shape[0]
    model = _new_adaptor(X_tr, num_classes, config, seed)
    initial = _weights(model)
    trainer = _trainer(model, X_tr, y_tr, config)
    k = int(config.k) if config.k is not None else default_k(y_tr, num_classes)
    rng = np.random.default_rng(seed)
    q_tr = np.full(n_tr, Q_SOFTMAX, dtype=np.float32)
    d_tr = np.ones(n_tr, dtype=np.float32)
    dense = config.index_backend == "exact"  # the epochs' float32 refresh; hnsw keeps its own index every epoch
    if dense:
        x_tr = trainer.x_norm if trainer.x_norm is not None else normalized(model, X_tr)
        x_ca = normalized(model, X_ca)
        x_mx = (mx.array(x_tr), mx.array(x_ca)) if X_tr.shape[1] >= config.exemplar_dim else (None, None)
    best, history, stale = None, [], 0
    for epoch in range(1, config.epochs + 1):
        loss = trainer.run_epoch(q_tr, d_tr, rng.permutation(n_tr), config.batch_size)
        if dense:
            (tr_state, tr_ecdfs), (ca_state, ca_ecdfs) = _epoch_refresh(trainer.arrays(), x_tr, y_tr, x_ca, y_ca,
                                                                      num_classes, k=k, x_mx=x_mx)
            basis = None
        else:
            trainer.sync()
            (tr_state, tr_ecdfs), (ca_state, ca_ecdfs), basis = _refresh(model, X_tr, y_tr, X_ca, y_ca, num_classes,
                                                                         k=k, config=config)
        q_tr, d_tr = tr_state.q.astype(np.float32), tr_state.d.astype(np.float32)
        metric = balanced_median(ca_state.q, y_ca, num_classes)
        moved = _movement(trainer.arrays(), initial)
        history.append(_epoch_record(epoch, loss, metric, float((ca_state.y_hat == y_ca).mean()), moved))
        callback.on_epoch_end(round_index, epoch, {**history[-1], "epochs": config.epochs, "rounds": config.iterations})
        stale = 0 if best is None or metric > best.metric else stale + 1
        if best is None or metric >= best.metric:
            best = KeptEpoch(metric=metric, epoch=epoch, params=trainer.params(),
                             train=tr_state, calibration=ca_state, train_distance_ecdfs=tr_ecdfs,
                             calibration_distance_ecdfs=ca_ecdfs, movement=moved, basis=basis)
        if config.patience is not None and stale >= config.patience:
            break
    trainer.close()
    trainer.to_model(best.params)
    if dense:  # the kept epoch's state, exactly (batch-invariant forward, exact index): what is calibrated and stored
        (tr_state, tr_ecdfs), (ca_state, ca_ecdfs), basis = _refresh(model, X_tr, y_tr, X_ca, y_ca, num_classes, k=k,
                                                                     config=config)
        best = replace(best, metric=balanced_median(ca_state.q, y_ca, num_classes), train=tr_state,
                       calibration=ca_state, train_distance_ecdfs=tr_ecdfs, calibration_distance_ecdfs=ca_ecdfs,
                       basis=basis)
        history[best.epoch - 1].update(balanced_median_q=best.metric,
                                       cal_accuracy=float((ca_state.y_hat == y_ca).mean()))
    return RoundResult(
        model=model, metric=best.metric, best_epoch=best.epoch, k=k,
        train_idx=np.arange(n_tr) if train_idx is None else train_idx,
        cal_idx=np.arange(X_ca.shape[0]) if cal_idx is None else cal_idx,
        train=best.train, calibration=best.calibration, train_distance_ecdfs=best.train_distance_ecdfs,
        calibration_distance_ecdfs=best.calibration_distance_ecdfs, history=history, movement=best.movement,
        epochs_run=len(history), stopped_early=len(history) < config.epochs, basis=best.basis,
    )
