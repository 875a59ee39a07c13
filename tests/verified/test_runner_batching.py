"""BatchRunner batches verdicts while decoding goes on (sdm_mlx.verified.runner), on a scripted engine and clock.

The engine finishes each request after as many steps as its ``max_tokens``; a step and a verification call each
advance a fake clock by a set cost, so the waiting rule is checked without timing noise.
"""

from __future__ import annotations

import pytest

from sdm_mlx.decoding.decode_types import DecodeRequest
from sdm_mlx.errors import InputError
from sdm_mlx.verified import runner as runner_module
from sdm_mlx.verified.runner import BatchRunner
from sdm_mlx.verified.verification import VerifyItem


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class ScriptedEngine:
    """Rows finish after ``max_tokens`` steps; each step costs ``step_cost`` seconds of the clock."""

    def __init__(self, clock: Clock, step_cost: float):
        self.clock, self.step_cost = clock, step_cost
        self.rows: list = []
        self.left: dict = {}

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    def submit(self, req):
        self.rows.append(req)
        self.left[id(req)] = req.max_tokens
        return req

    def step(self) -> list:
        self.clock.now += self.step_cost
        done = []
        for req in list(self.rows):
            self.left[id(req)] -= 1
            if self.left[id(req)] == 0:
                self.rows.remove(req)
                done.append((req, f"decoded {req.max_tokens}"))
        return done

    def reset(self):
        self.rows.clear()


class ScriptedVerifier:
    """Each call costs ``cost`` seconds; a verdict depends only on its own item."""

    def __init__(self, clock: Clock, cost: float):
        self.clock, self.cost = clock, cost
        self.calls: list = []

    def verify_many(self, items):
        self.clock.now += self.cost
        self.calls.append([it.text for it in items])
        return [f"verdict of {it.text}" for it in items]


def task(steps: int, finished_at: dict, clock: Clock):
    decoded = yield DecodeRequest([1, 2, 3], steps)
    decoded_at = clock.now
    verdict = yield VerifyItem([1, 2, 3], [4], decoded)
    finished_at[steps] = clock.now - decoded_at
    return verdict


def run(step_cost: float, verify_cost: float, lengths, monkeypatch, **kwargs):
    clock = Clock()
    monkeypatch.setattr(runner_module, "time", clock)
    verifier = ScriptedVerifier(clock, verify_cost)
    runner = BatchRunner(ScriptedEngine(clock, step_cost), verifier, **kwargs)
    waited: dict = {}
    results = runner.run([task(n, waited, clock) for n in lengths])
    return results, verifier.calls, waited


def test_verdicts_wait_for_each_other_while_rows_decode(monkeypatch):
    # a step costs 1 ms, a verification 4 ms: answers finishing on consecutive steps share calls
    lengths = [2, 3, 4, 5, 6, 7, 8, 30]
    results, calls, waited = run(0.001, 0.004, lengths, monkeypatch)
    assert results == [f"verdict of decoded {n}" for n in lengths]  # as if each were verified alone
    assert calls[0] == ["decoded 2"]  # the first call measures the cost: nothing waits before it
    assert len(calls) < len(lengths) - 2 and max(len(c) for c in calls) >= 3
    # no answer waits longer than the patience (in verification calls) plus one step and the calls made meanwhile
    assert max(waited.values()) <= runner_module.VERIFY_PATIENCE * 0.004 + 0.001 + 0.004 + 1e-9


def test_nothing_waits_when_a_step_costs_more_than_the_patience(monkeypatch):
    # a real LLM: a step of 300 ms against a verification of 10 ms
    lengths = [2, 3, 4, 5, 30]
    results, calls, _ = run(0.3, 0.01, lengths, monkeypatch)
    assert calls == [[f"decoded {n}"] for n in lengths]
    assert results == [f"verdict of decoded {n}" for n in lengths]


def test_answers_are_verified_at_once_when_no_row_decodes(monkeypatch):
    # every row finishes in the same step: the engine is idle, so they are verified then, together
    results, calls, waited = run(0.001, 0.004, [3, 3, 3], monkeypatch)
    assert calls == [["decoded 3"] * 3] and set(waited.values()) == {0.004}


def test_a_full_batch_is_verified_without_waiting(monkeypatch):
    lengths = [1, 2, 2, 2, 2, 40]
    _, calls, _ = run(0.001, 0.004, lengths, monkeypatch, verify_batch=4, verify_patience=100.0)
    assert calls[0] == ["decoded 1"] and calls[1] == ["decoded 2"] * 4


def test_patience_zero_verifies_each_step(monkeypatch):
    lengths = [2, 3, 4, 30]
    _, calls, _ = run(0.001, 0.004, lengths, monkeypatch, verify_patience=0.0)
    assert calls == [[f"decoded {n}"] for n in lengths]


def test_bad_settings_are_refused():
    with pytest.raises(InputError, match="verify_batch"):
        BatchRunner(None, None, verify_batch=0)
    with pytest.raises(InputError, match="verify_patience"):
        BatchRunner(None, None, verify_patience=float("nan"))


def test_an_idle_step_does_not_lower_the_step_cost(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(runner_module, "time", clock)
    engine = ScriptedEngine(clock, 0.002)
    runner = BatchRunner(engine, ScriptedVerifier(clock, 0.004))
    runner.step()  # nothing to decode
    assert runner._step_cost is None
    runner.run([task(3, {}, clock)])
    assert runner._step_cost == pytest.approx(0.002)
