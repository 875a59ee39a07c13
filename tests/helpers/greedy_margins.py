"""Comparing greedy answers of two computations that may round differently (tests/decoding, tests/network, ...).

A greedy token is an argmax.  Two computations of the same logits that order their float sums differently (a batch of
one against a batch of 16, mlx-lm's decoding against ours, another BLAS kernel or thread count) agree to ~1e-6 of a
logit, so they pick the same token wherever the two best tokens are further apart than that; where they are closer
(a near tie) either pick is right, and the answers may go different ways from there on.

:func:`assert_same_greedy` therefore compares two answers token by token up to the first difference and accepts a
difference only at a near tie of the reference row: the two best tokens' logits within :data:`NEAR_TIE` of each
other, as computed again here (one teacher-forced pass of the prompt and the reference answer).  After it, nothing
more of that row is compared.  A wrong result (a row that reads another row's cache, a wrong position, a lost head)
changes logits by far more than rounding, so it differs where the reference had a clear winner and fails.  The
rows that diverged are returned; callers bound how many may (a near tie is rare: none in these tests' data when
they were written).
"""

from __future__ import annotations

import numpy as np

#: logits of the two best tokens closer than this are a near tie: float32 rounding of another computation order
#: moves a logit of these tiny models by ~1e-5 at most; a real error moves it by O(0.1-1)
NEAR_TIE = 1e-3


def step_margins(model, prompt_ids, token_ids, heads=None) -> np.ndarray:
    """For each generated token, and for the token after the last one (an end of sequence that is not kept): (logit of
    the best token) - (logit of the second best), from one teacher-forced pass of ``prompt_ids + token_ids``; joint
    decoding (``heads``): a token's logit is the larger of its negative and positive entries."""
    import mlx.core as mx

    from sdm_mlx.llm import embed as E

    ids = list(prompt_ids) + list(token_ids)
    h = E.hidden_states(model, [ids])[0, len(prompt_ids) - 1:]  # the states that predict each token, and the next
    if heads is None:
        z = E.logits_from_hidden(model, h).astype(mx.float32)
    else:
        z = mx.maximum(heads.neg_logits(h), heads.pos_logits(h))
    top2 = np.sort(np.array(z, dtype=np.float64), axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def first_difference(a, b) -> int | None:
    """Index of the first token where the answers ``a`` and ``b`` differ (one ending earlier counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_greedy(model, prompt_ids, ref_ids, got_ids, heads=None, near_tie: float = NEAR_TIE) -> bool:
    """``got_ids`` equals ``ref_ids``, or first differs from it at a near tie of the reference (see the module
    docstring); returns True if they differ (the caller stops comparing that row there)."""
    i = first_difference(ref_ids, got_ids)
    if i is None:
        return False
    margins = step_margins(model, prompt_ids, ref_ids, heads)  # i <= len(ref_ids) < len(margins)
    assert margins[i] <= near_tie, (
        f"the answers differ at token {i} where the reference's best token led by {margins[i]:.3g} (> {near_tie}): "
        f"not rounding. reference {list(ref_ids)}, other {list(got_ids)}")
    return True
