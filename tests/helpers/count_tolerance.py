"""Comparing the calibration counts and the selected epoch of two ``network-train`` runs that round differently.

Two ranks decode their share of the prompts in batches of other sizes than one process does, and OpenBLAS rounds
a row differently with another number of rows (~1e-6 in the features); the host step and MLX's compute W_pos up to
float rounding.  The calibration count thresholds p̂_lower
and greedy decoding takes an argmax, so a count can move by the rows that sit on a boundary: measured up to 1
(counts 23, 27 against 23, 26 on an AVX2-only EPYC; tests/network/test_data_parallel.py).  :data:`COUNT_TOLERANCE`
allows 2.  A wrong gradient exchange or a lost head moves W_pos, the losses and the counts by far more.

The selected epoch is the first epoch whose count is strictly the best (DESIGN #20), so it is compared only where
the reference's choice cannot be changed by counts that move within the tolerance: its kept count beats the
initial count and every other epoch's by more than twice the tolerance.  Each run's own choice is always checked
against the rule on its own counts.
"""

from __future__ import annotations

COUNT_TOLERANCE = 2


def counts_of(metrics: dict) -> list:
    """The base head's count, then one count per epoch."""
    return [metrics["initial"]["count"]] + [e["count"] for e in metrics["epochs"]]


def selected_by_rule(counts: list) -> int:
    """DESIGN #20: the epoch whose count first beat every earlier one strictly and was never beaten (0: the base)."""
    best, selected = counts[0], 0
    for epoch, c in enumerate(counts[1:], 1):
        if c > best:
            best, selected = c, epoch
    return selected


def assert_same_counts_and_selection(metrics: dict, reference: dict, tolerance: int = COUNT_TOLERANCE) -> None:
    """``metrics`` (a run that rounds differently) against ``reference``: the same number of epochs, every count
    within ``tolerance``, each selection by the rule on its own counts, and the same selection where the reference's
    is clear by more than ``2 * tolerance``."""
    got, ref = counts_of(metrics), counts_of(reference)
    assert len(got) == len(ref) and all(abs(a - b) <= tolerance for a, b in zip(got, ref)), (got, ref)
    assert metrics["selected_epoch"] == selected_by_rule(got), (metrics["selected_epoch"], got)
    assert reference["selected_epoch"] == selected_by_rule(ref), (reference["selected_epoch"], ref)
    kept = reference["selected_epoch"]
    others = [c for e, c in enumerate(ref) if e != kept]
    if all(ref[kept] - c > 2 * tolerance for c in others):
        assert metrics["selected_epoch"] == kept, (got, ref)
