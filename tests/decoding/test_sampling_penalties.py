"""sdm_mlx.decoding.sampling: the logit bias, the presence / frequency penalties and XTC do what mlx-lm's do.

mlx-lm's own processors (``make_logits_processors``) and ``apply_xtc`` are the reference on a plain |V| row; on
a joint 2|V| row (a positive head) each token's neg and pos entries move together.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_xtc, make_logits_processors

from sdm_mlx.decoding.sampling import RowSampler, SamplingParams
from sdm_mlx.errors import InputError

V = 50


def _row(seed: int = 0, width: int = V):
    return mx.array(np.random.default_rng(seed).normal(0, 3, (1, width)).astype(np.float32))


CONTEXT = [3, 7, 7, 11, 3, 3, 40, 2] * 4  # 32 tokens: the default windows (20) leave some out


@pytest.mark.parametrize("kw", [
    dict(presence_penalty=0.7),
    dict(frequency_penalty=0.4),
    dict(frequency_penalty=-0.3, frequency_context_size=5),
    dict(presence_penalty=1.5, presence_context_size=0),  # 0: the whole context, as mlx-lm's tokens[-0:]
    dict(repetition_penalty=1.3, repetition_context_size=4),
    dict(logit_bias=((4, 100.0), (9, -2.5))),
    dict(logit_bias=((1, 3.0),), repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25),
])
def test_bias_and_penalties_equal_mlx_lm_processors(kw):
    params = SamplingParams(**kw).validate()
    ours = RowSampler(params, V)._penalise(_row(), list(CONTEXT))
    ref = _row()
    for process in make_logits_processors(
            logit_bias=dict(params.logit_bias) or None, repetition_penalty=params.repetition_penalty,
            repetition_context_size=params.repetition_context_size, presence_penalty=params.presence_penalty,
            presence_context_size=params.presence_context_size, frequency_penalty=params.frequency_penalty,
            frequency_context_size=params.frequency_context_size):
        ref = process(mx.array(CONTEXT), ref)
    np.testing.assert_allclose(np.array(ours), np.array(ref), rtol=1e-6, atol=1e-6)
    assert not params.plain_argmax


def test_on_a_joint_row_both_halves_of_a_token_move_together():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 2.0),)).validate()
    joint = _row(1, 2 * V)
    ours = np.array(RowSampler(params, V)._penalise(joint, list(CONTEXT)))
    neg = np.array(RowSampler(params, V)._penalise(joint[:, :V], list(CONTEXT)))
    pos = np.array(RowSampler(params, V)._penalise(joint[:, V:], list(CONTEXT)))
    np.testing.assert_allclose(ours, np.concatenate([neg, pos], axis=1), rtol=1e-6, atol=1e-6)


def test_xtc_removes_what_mlx_lm_removes_and_keeps_the_special_tokens():
    logits = _row(2)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    special = (int(mx.argmax(logits)),)  # the most likely token would go; as a special token it stays
    params = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.02).validate()
    ours = np.array(RowSampler(params, V, xtc_special=special)._xtc(logprobs, mx.random.key(0)))
    ref = np.array(apply_xtc(logprobs, 1.0, 0.02, list(special)))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    assert np.isinf(ours).sum() >= 1 and np.isfinite(ours[0, special[0]])


def test_seeded_xtc_draws_repeat_and_xtc_leaves_greedy_alone():
    params = SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05, seed=3).validate()

    def draws():
        sampler = RowSampler(params, V)
        return [int(sampler.choose(_row(k), [])[0].item()) for k in range(30)]

    assert draws() == draws()
    greedy = RowSampler(SamplingParams(xtc_probability=1.0, xtc_threshold=0.0).validate(), V)
    assert int(greedy.choose(_row(4), [])[0].item()) == int(mx.argmax(_row(4)).item())


@pytest.mark.parametrize("kw, name", [
    (dict(xtc_threshold=0.6), "xtc_threshold"), (dict(xtc_probability=1.5), "xtc_probability"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(frequency_context_size=-1), "frequency_context_size"),
    (dict(logit_bias=((3, 101.0),)), "logit_bias"), (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
])
def test_out_of_range_fields_are_named(kw, name):
    with pytest.raises(InputError, match=name):
        SamplingParams(**kw).validate()


def test_a_logit_bias_dict_is_taken_as_sorted_pairs():
    assert SamplingParams(logit_bias={9: -2.5, 4: 100.0}).validate().logit_bias == ((4, 100.0), (9, -2.5))
