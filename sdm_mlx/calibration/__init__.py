"""SDM calibration: from SDM activation outputs to the index-conditional estimator p̂_lower.

One module per step, one named function per equation (docs/paper-map.md):

* :mod:`.bins`        output eCDFs, v, the soft and hard q bins, OOD (``equation:softqbin``)
* :mod:`.bounds`      sample-size arrays, n̂ and the DKW band (``equation:effective-sample-size``, ``equation:dkw``)
* :mod:`.threshold`   Alg. 3, min valid q~ and ψ (``alg:estimate-soft-q-bin``)
* :mod:`.cauchy`      per-bin medians and the Cauchy robust estimates over J rounds
* :mod:`.conditional` the index-conditional estimator at test time and its rejection reasons
* :mod:`.ladder`      one model's levels (W'', ψ, minima, offsets, eCDF tables) validated and stacked once
* :mod:`.nested`      every level of an α grid from the same rounds, α regions, decisions (DESIGN #25)
* :mod:`.rounds`      one round (:class:`RoundCalibration`), aggregation, :class:`Calibration`
* :mod:`._checks`     input checks shared by the above
* :mod:`.rescaler`    Alg. 2, the rescaler W'' (``rescaler_*`` settings);  :mod:`.diagnosis` why rows are not admitted
* :mod:`.reasons`     the rejection reasons below in words, with what would change the verdict (the one source of
                      their text: verdict pages, reports, the demo, the MCP tool)

May import: layers 0-2 (:mod:`sdm_mlx.errors`, :mod:`sdm_mlx.results`, :mod:`sdm_mlx.storage`,
:mod:`sdm_mlx.core`).  Nothing is imported until used (PEP 562): ``sdm_mlx.calibration.estimate`` and the other
names below resolve on first use, and :mod:`.defaults` (Alg. 2's defaults) is read at ``--help`` without MLX.

Paper §"From SDM Activation Functions to SDM Calibration"; conventions fixed by
``docs/design.md`` DESIGN #7, #10-16, #23, #24 (they win over the paper and over the author's
research code where they differ).  Everything here is host-side, vectorised NumPy on
sorted arrays (the rescaler W'' itself is trained in :mod:`sdm_mlx.calibration.rescaler`).

Pipeline for one round (``calibrate_round``), calibration rows of the best epoch:

1. output eCDFs: per true class c, the sorted sdm(z')_c of calibration rows whose
   TRUE label is c (``equation:sdm-output-cdfs``);
2. v_c = eCDF_c(s_c): strict-left count / n, s_c ≥ max ⇒ 1, empty ⇒ 0 (DESIGN #11);
3. q~ = v_ŷ · ln(2+q) (``equation:softqbin``); a row whose SDM output has no
   unique argmax equal to ŷ gets q~ := 0 (DESIGN #7);
4. W'' by Alg. 2 on (v, q~, y);  o = softmax(W''v · ln(2+q~));
5. OOD iff floor(q~) ≤ 0 or o has no unique argmax equal to ŷ; OOD rows get
   q~ := 0 and hard bin 0 (DESIGN #7, #16; o itself is not recomputed);
6. sample-size arrays: per true class, the sorted processed q~ of ALL calibration
   rows (OOD rows included, with q~ = 0);
7. Alg. 3: min valid q~ and ψ (α-dependent);
8. per (ŷ, hard bin) median of o_ŷ (α-independent).

Across the J rounds (``aggregate_rounds``): the Cauchy robust min valid q~
(``eq:cauchyMinValidQBin``) and the per-(ŷ, bin) offsets (``eq:cauchyIteratedLower``).

At test time (``estimate``): q~ for centroid, n̂ and DKW ε from the centroid,
lower/upper v and q~, the rescaled outputs, offsets, and admission
(``eq:index-conditional-sdm-estimator``, all of the research code's conditions, DESIGN #14).

What depends on α: Alg. 3 (ψ, min valid q~), the Cauchy factor tan(π(α−½)) and
DKW ε.  What does not: output eCDFs, v, q~, W'', o, OOD flags, sample-size
arrays, the per-bin medians.  So a new α needs no retraining:
``RoundCalibration.with_alpha`` re-runs Alg. 3 on the stored arrays and
``aggregate_rounds`` recomputes the Cauchy quantities.

Rejection reasons of ``estimate`` (first failing condition wins; "" = admitted; the order's one source is
``conditional.REJECTION_CONDITIONS``):

1. ``"no_valid_threshold"``    the model's own min valid q~ is +inf (Alg. 3 found none)
2. ``"no_robust_threshold"``   the Cauchy robust min valid q~ is +inf (non-finite MAD, DESIGN #15)
3. ``"ood_distance"``          d = 0: farther from the training support than every calibration row of
                               some class, so the SDM output is uniform (DESIGN #7, #24)
4. ``"argmax_flip"``           the SDM output has no unique argmax equal to ŷ (ties), or
                               the centroid's rescaled output o does not (with floor(q~) > 0); that
                               zeroes q~, hence n̂ = 0, ε = 1 and the lower variant is OOD too
5. ``"ood_similarity"``        floor(q~_lower) ≤ 0 (e.g. q = 0: q~ ≤ ln 2)
6. ``"argmax_flip"``           the rescaled lower output o_lower has no unique argmax equal to ŷ
7. ``"below_model_min_qbin"``  q~_lower < the model's own min valid q~
8. ``"below_robust_min_qbin"`` q~_lower < the robust (Cauchy) min valid q~
9. ``"below_threshold_psi"``   {c : o_lower,c ≥ ψ_c} ≠ {ŷ} after the offset at ŷ
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "rescaled_output": "rescaler", "check_alpha": "_checks", "apply_ood": "bins", "hard_qbin": "bins",
    "ood_mask": "bins", "output_ecdfs": "bins", "soft_qbin": "bins", "unique_argmax_is": "bins", "v_vector": "bins",
    "dkw_bounds": "bounds", "dkw_epsilon": "bounds", "effective_sample_size": "bounds",
    "sample_size_arrays": "bounds", "cauchy_factor": "cauchy", "cauchy_offsets": "cauchy",
    "cauchy_robust_min": "cauchy", "lookup_offsets": "cauchy", "mad": "cauchy", "magnitude_medians": "cauchy",
    "REJECTION_REASONS": "conditional", "REASONS": "reasons", "reason_text": "reasons", "estimate": "conditional", "Calibration": "rounds",
    "RoundCalibration": "rounds", "aggregate_rounds": "rounds", "calibrate_round": "rounds",
    "exact_one_minus": "threshold", "min_valid_qbin": "threshold", "train_rescaler": "rescaler",
    "RescalerSettings": "rescaler",
    "DEFAULT_ALPHA_GRID": "nested", "DecisionPolicy": "nested", "NestedCalibration": "nested", "alpha_grid": "nested",
    "anchored_region": "nested", "estimate_nested": "nested", "nested_admissions": "nested",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "DEFAULT_ALPHA_GRID",
    "DecisionPolicy",
    "NestedCalibration",
    "alpha_grid",
    "anchored_region",
    "estimate_nested",
    "nested_admissions",
    "REJECTION_REASONS",
    "REASONS",
    "reason_text",
    "Calibration",
    "RescalerSettings",
    "RoundCalibration",
    "aggregate_rounds",
    "apply_ood",
    "calibrate_round",
    "cauchy_factor",
    "cauchy_offsets",
    "cauchy_robust_min",
    "check_alpha",
    "dkw_bounds",
    "dkw_epsilon",
    "effective_sample_size",
    "estimate",
    "exact_one_minus",
    "hard_qbin",
    "lookup_offsets",
    "mad",
    "magnitude_medians",
    "min_valid_qbin",
    "ood_mask",
    "output_ecdfs",
    "rescaled_output",
    "train_rescaler",
    "sample_size_arrays",
    "soft_qbin",
    "unique_argmax_is",
    "v_vector",
]
