"""One round of calibration (:func:`calibrate_round`, :class:`RoundCalibration`), aggregation over the J
rounds (:func:`aggregate_rounds`) and the stored model (:class:`Calibration`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Sequence

import numpy as np

from ..storage.files import get_float, put_float
from .rescaler import RescalerFit, RescalerSettings, rescaled_output, train_rescaler
from ._checks import _labels, _matrix, _vector, check_alpha
from .bins import apply_ood, ood_mask, output_ecdfs, soft_qbin, unique_argmax_is, v_vector
from .bounds import sample_size_arrays
from .threshold import _min_valid_qbin
from .cauchy import cauchy_offsets, cauchy_robust_min, magnitude_medians
from .ladder import Ladder, LevelArrays, check_level
from ..errors import InputError


@dataclass
class RoundCalibration:
    """Everything one round (of J) contributes: what prediction needs and what aggregation over J needs."""

    num_classes: int
    alpha: float  #: α' the α-dependent fields (min_valid, psi) were computed at
    output_ecdfs: list  #: per class c, sorted calibration sdm_c of true class c (``equation:sdm-output-cdfs``)
    W: np.ndarray  #: rescaler W'' float32 [C, C] (``[out, in]``: v' = W v)
    y: np.ndarray  #: calibration true labels [N]
    y_hat: np.ndarray  #: calibration predictions argmax z' [N]
    sdm_flip: np.ndarray  #: SDM output without a unique argmax equal to ŷ [N]
    v: np.ndarray  #: [N, C]
    q_tilde_pre: np.ndarray  #: q~ before the rescaler (sdm flips → 0): W'' was trained on it [N]
    o: np.ndarray  #: rescaled output [N, C] (from q~_pre)
    non_ood: np.ndarray  #: bool [N]
    q_tilde: np.ndarray  #: processed q~ (OOD → 0) [N]
    hard_bin: np.ndarray  #: int [N] (OOD → 0)
    o_true: np.ndarray  #: o at the TRUE label [N] (Alg. 3 input)
    o_hat: np.ndarray  #: o at ŷ [N] (median input)
    sample_size_arrays: list  #: per class, sorted processed q~ of all rows of that true class
    min_valid: float  #: Alg. 3 min valid q~ (+inf if none) at ``alpha``
    psi: np.ndarray  #: Alg. 3 thresholds [C] at ``alpha``
    medians: np.ndarray  #: median o_ŷ per (ŷ, bin) [C, B], NaN where empty
    rescaler: RescalerFit | None = field(default=None, repr=False)

    def with_alpha(self, alpha: float) -> "RoundCalibration":
        """This round re-thresholded at a new α' by Alg. 3 (``alg:estimate-soft-q-bin``), no retraining.

        ``alpha``: a validated α' (:func:`sdm_mlx.validation.alpha`); the round's arrays are the package's own."""
        mv, psi = _min_valid_qbin(self.o_true, self.q_tilde, self.y, self.non_ood, self.num_classes, alpha)
        return replace(self, alpha=float(alpha), min_valid=mv, psi=psi)

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, meta) for a safetensors + JSON artifact; ragged per-class lists are concatenated + counts."""
        arrays = {
            name: np.asarray(getattr(self, name))
            for name in ("W", "y", "y_hat", "sdm_flip", "v", "q_tilde_pre", "o", "non_ood", "q_tilde",
                         "hard_bin", "o_true", "o_hat", "psi", "medians")
        }
        for name in ("sdm_flip", "non_ood"):
            arrays[name] = arrays[name].astype(np.uint8)
        for name in ("output_ecdfs", "sample_size_arrays"):
            lists = getattr(self, name)
            arrays[name + "_values"] = np.concatenate([np.asarray(a) for a in lists]) if lists else np.zeros(0)
            arrays[name + "_counts"] = np.array([len(a) for a in lists], dtype=np.int64)
        meta = {"num_classes": int(self.num_classes), "alpha": float(self.alpha)}
        put_float(meta, "min_valid", self.min_valid, "no valid threshold: Alg. 3 found no q~ where psi_c >= alpha "
                                                     "for every class, so this round rejects every prediction")
        if self.rescaler is not None:
            meta["rescaler"] = {
                "epoch_losses": self.rescaler.epoch_losses.tolist(),
                "best_epoch": int(self.rescaler.best_epoch),
                "best_loss": float(self.rescaler.best_loss),
                "epochs_run": int(self.rescaler.epochs_run),
                "stopped_early": bool(self.rescaler.stopped_early),
                "seconds": float(self.rescaler.seconds),
            }
        return arrays, meta

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], meta: dict) -> "RoundCalibration":
        """Inverse of :meth:`to_arrays` (the rescaler history is not restored)."""
        def split(name):
            vals, counts = np.asarray(arrays[name + "_values"]), np.asarray(arrays[name + "_counts"])
            return [a.copy() for a in np.split(vals, np.cumsum(counts)[:-1])]

        a = {k: np.asarray(v) for k, v in arrays.items()}
        return cls(
            num_classes=int(meta["num_classes"]), alpha=float(meta["alpha"]),
            output_ecdfs=split("output_ecdfs"), W=a["W"].astype(np.float32), y=a["y"].astype(np.int64),
            y_hat=a["y_hat"].astype(np.int64), sdm_flip=a["sdm_flip"].astype(bool), v=a["v"],
            q_tilde_pre=a["q_tilde_pre"], o=a["o"], non_ood=a["non_ood"].astype(bool), q_tilde=a["q_tilde"],
            hard_bin=a["hard_bin"].astype(np.int64), o_true=a["o_true"], o_hat=a["o_hat"],
            sample_size_arrays=split("sample_size_arrays"), min_valid=_stored_min_valid(meta),
            psi=a["psi"], medians=a["medians"],
        )


def _stored_min_valid(meta: dict) -> float:
    value = get_float(meta, "min_valid")
    if value is None:
        raise InputError("round metadata has min_valid null without a min_valid_reason")
    return value


def calibrate_round(
    sdm_cal: np.ndarray,
    q_cal: np.ndarray,
    y_cal: np.ndarray,
    y_hat_cal: np.ndarray,
    *,
    alpha: float = 0.95,
    rescaler: RescalerSettings = RescalerSettings(),
    W: np.ndarray | None = None,
    on_epoch=None,
) -> RoundCalibration:
    """One round after Alg. 1's best epoch: eCDFs → v → q~ → W'' (``alg:train-rescaler``) → o → OOD → ``alg:estimate-soft-q-bin`` → medians.

    ``sdm_cal``/``q_cal`` are the calibration SDM outputs [N, C] (C classes) and (flip-reset) q of the
    best epoch, ``y_hat_cal`` = argmax z'.  Pass ``W`` to skip training (e.g. a stored W''); otherwise W''
    is trained with ``rescaler`` (:class:`~sdm_mlx.calibration.rescaler.RescalerSettings`: seed, epochs,
    Adam, engine); ``on_epoch(epoch, loss)`` is called after every rescaler epoch.
    """
    sdm_cal = _matrix("sdm_cal", sdm_cal)
    C = sdm_cal.shape[1]
    alpha = check_alpha(alpha, C)
    n = sdm_cal.shape[0]
    if n == 0:
        raise InputError("calibration split is empty")
    q_cal = _vector("q_cal", q_cal, n)
    y = _labels("y_cal", y_cal, C, n)
    y_hat = _labels("y_hat_cal", y_hat_cal, C, n)

    ecdfs = output_ecdfs(sdm_cal, y, C)
    v = v_vector(sdm_cal, ecdfs)
    sdm_flip = ~unique_argmax_is(sdm_cal, y_hat)
    q_pre = np.where(sdm_flip, 0.0, soft_qbin(v, q_cal, y_hat))
    fit = None
    if W is None:
        fit = train_rescaler(v, q_pre, y, rescaler, on_epoch=on_epoch)
        W = fit.W
    W = np.asarray(W, dtype=np.float32)
    if W.shape != (C, C):
        raise InputError(f"W must be [{C}, {C}], got {W.shape}")
    o = rescaled_output(W, v, q_pre)
    ood = sdm_flip | ood_mask(o, q_pre, y_hat)
    q_proc, bins = apply_ood(q_pre, ood)
    rows = np.arange(n)
    o_true, o_hat = o[rows, y], o[rows, y_hat]
    min_valid, psi = _min_valid_qbin(o_true, q_proc, y, ~ood, C, alpha)  # arrays made above: not re-checked
    return RoundCalibration(
        num_classes=C, alpha=alpha, output_ecdfs=ecdfs, W=W, y=y, y_hat=y_hat, sdm_flip=sdm_flip, v=v,
        q_tilde_pre=q_pre, o=o, non_ood=~ood, q_tilde=q_proc, hard_bin=bins, o_true=o_true, o_hat=o_hat,
        sample_size_arrays=sample_size_arrays(q_proc, y, C), min_valid=min_valid, psi=psi,
        medians=magnitude_medians(o_hat, y_hat, bins, C), rescaler=fit,
    )


def rethreshold(rounds: Sequence[RoundCalibration], alpha: float) -> list[RoundCalibration]:
    """The rounds at ``alpha``: Alg. 3 re-run once on each round calibrated at another α' (no retraining).

    ``alpha``: a validated α' (:func:`sdm_mlx.validation.alpha`)."""
    return [r if r.alpha == alpha else r.with_alpha(alpha) for r in rounds]


def _cauchy(rounds_at: Sequence[RoundCalibration], best_index: int, alpha: float) -> tuple[float, np.ndarray]:
    """(robust min valid q~, offsets [C, B]) of rounds already at ``alpha`` (:func:`rethreshold`)."""
    robust = cauchy_robust_min([r.min_valid for r in rounds_at], best_index, alpha)
    return robust, cauchy_offsets([r.medians for r in rounds_at], alpha)


def aggregate_rounds(rounds: Sequence[RoundCalibration], best_index: int, alpha: float) -> tuple[float, np.ndarray]:
    """(robust min valid q~, offsets [C, B]) over the J rounds (``eq:cauchyMinValidQBin``, ``eq:cauchyIteratedLower``).

    Rounds calibrated at another α are re-thresholded (Alg. 3) at ``alpha`` first.  Checks ``alpha`` and the
    rounds (the public entry); :meth:`Calibration.from_rounds` is the package's own path.
    """
    if len(rounds) == 0:
        raise InputError("need at least one round")
    C = rounds[0].num_classes
    alpha = check_alpha(alpha, C)
    if any(r.num_classes != C for r in rounds):
        raise InputError("all rounds must have the same number of classes")
    return _cauchy(rethreshold(rounds, alpha), best_index, alpha)


@dataclass(frozen=True)
class Calibration:
    """The test-time model of ``eq:index-conditional-sdm-estimator`` at one α'.

    The best round's output eCDFs, W'', ψ, min valid q~ and sample-size arrays (Alg. 3 at ``alpha``),
    plus the Cauchy robust min valid q~ (``eq:cauchyMinValidQBin``) and offsets (``eq:cauchyIteratedLower``)
    over all J rounds at the same α'.
    """

    alpha: float
    W: np.ndarray  #: rescaler W'' [C, C]
    psi: np.ndarray  #: Alg. 3 thresholds ψ [C]
    min_valid: float  #: the model's own min valid q~ (+inf: none)
    robust_min_valid: float  #: Cauchy robust min valid q~ (+inf: none)
    offsets: np.ndarray | None  #: [C, B] (None: no offsets)
    output_ecdfs: list  #: per class, sorted calibration sdm_c of true class c (for v)
    sample_size_arrays: list  #: per class, sorted processed calibration q~ (for n̂)

    @cached_property
    def checked(self) -> LevelArrays:
        """This level's arrays validated, once: the estimator's inputs (a level can be built by hand)."""
        return check_level(self)

    @cached_property
    def ladder(self) -> Ladder:
        """This level alone as a :class:`~sdm_mlx.calibration.ladder.Ladder` (what ``estimate`` scores with),
        built once."""
        return Ladder((self,))

    @classmethod
    def from_round(cls, best: RoundCalibration, robust_min_valid: float, offsets) -> "Calibration":
        """The best round (at its α') with given robust min valid q~ and offsets."""
        return cls(alpha=best.alpha, W=best.W, psi=best.psi, min_valid=best.min_valid,
                   robust_min_valid=float(robust_min_valid), offsets=offsets, output_ecdfs=best.output_ecdfs,
                   sample_size_arrays=best.sample_size_arrays)

    @classmethod
    def from_rounds(cls, rounds: Sequence[RoundCalibration], best_index: int, alpha: float) -> "Calibration":
        """Alg. 3 re-run at ``alpha`` once on each round, then the Cauchy aggregation over all rounds (no
        retraining).  ``alpha``: a validated α' (:func:`sdm_mlx.validation.alpha`), ``rounds`` one fit's."""
        at = rethreshold(rounds, alpha)
        robust, offsets = _cauchy(at, best_index, alpha)
        return cls.from_round(at[best_index], robust, offsets)
