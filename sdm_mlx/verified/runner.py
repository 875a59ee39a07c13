"""Many verified generations at once over the one :class:`~.batching.DecodeEngine`.

A *task* is a generator function's generator that yields what it needs and is
sent the answer:

* a :class:`~.batching.DecodeRequest` → its :class:`~.batching.Decoded` (the
  request joins the running batch; a re-ask is just the next request, so a
  rejected answer's re-ask rejoins the batch instead of blocking the queue);
* a :class:`~.verification.VerifyItem` → its :class:`~.verification.Verdict`
  (the items waiting are verified together: one batched feature pass for the
  items without pooled features, one batched estimate; see below for when);

and whose ``return`` value is the task's result.  :class:`BatchRunner` drives
any number of tasks: ``start(task, on_done, on_error)`` then ``step()`` until
``busy`` is False, or :meth:`BatchRunner.run` for a list of tasks.

Verdicts are batched while decoding goes on.  One estimate costs much less per
answer in a batch (its cost is mostly per call: on the tiny test model 1.7 ms
for one answer, 3.2 ms for eight, as much as one or two decoding steps of 16
rows).  So while other rows are
decoding, a finished answer waits for others, until :attr:`BatchRunner.verify_batch`
answers wait or until one more decoding step would make its wait longer than
:attr:`BatchRunner.verify_patience` times the measured cost of one verification
call.  When a decoding step costs more than that (a real LLM: a step of
hundreds of ms against a verification of ~10 ms), nothing waits; when no row
is decoding, the waiting answers are verified at once.  The verdicts are those
of verifying each answer alone (the estimate is per row).

The defaults (16 answers, 16 calls' cost) were chosen over HTTP on the tiny
model (``tools/bench/bench_serve.py`` clients; six alternating runs each): at 16
clients 102.9 req/s against 73.5 with 8 answers and 4 calls' cost (mlx_lm.server
75.4), p50 151 against 217 ms; at 4 clients 57.7 against 56.9 req/s.  Answers
released together come back together: their prompts are prefilled in one pass
and verified in one call.  At one client nothing waits.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

from ..decoding.batching import DecodeEngine, DecodeRequest
from ..errors import InputError
from .verification import AnswerVerifier, VerifyItem


class Cancelled(Exception):
    """The request was cancelled (the client went away, or the server is shutting down)."""


@dataclass
class _Task:
    gen: Generator
    on_done: Callable[[object], None]
    on_error: Callable[[BaseException], None]


#: answers waiting for a verdict that are verified at once (:class:`BatchRunner`)
VERIFY_BATCH = 16
#: longest wait for a verdict batch, in verification calls' measured cost (:class:`BatchRunner`)
VERIFY_PATIENCE = 16.0
#: weight of the newest measurement in the running averages of step and verification costs
_COST_WEIGHT = 0.2


class BatchRunner:
    """Drives tasks (see the module docstring) over ``engine`` with ``verifier`` (an :class:`AnswerVerifier`).

    Attributes
    ----------
    verify_batch : int
        While rows are decoding, waiting answers are verified once this many wait (1: each at once).
    verify_patience : float
        ... or once one more decoding step would make the oldest wait longer than this many times the
        running average cost of one verification call (0: never wait).
    """

    def __init__(self, engine: DecodeEngine, verifier: AnswerVerifier | None, *, verify_batch: int = VERIFY_BATCH,
                 verify_patience: float = VERIFY_PATIENCE):
        if verify_batch < 1 or not verify_patience >= 0:
            raise InputError("verify_batch must be >= 1 and verify_patience >= 0")
        self.engine, self.verifier = engine, verifier
        self.verify_batch, self.verify_patience = int(verify_batch), float(verify_patience)
        self._decoding: dict = {}
        self._verifying: deque = deque()
        self._waiting_since = 0.0  # when the oldest waiting answer was queued
        self._step_cost = self._verify_cost = None  # running averages, seconds

    @property
    def busy(self) -> bool:
        return bool(self._decoding or self._verifying or self.engine.busy)

    def start(self, gen: Generator, on_done: Callable[[object], None],
              on_error: Callable[[BaseException], None]) -> None:
        """Run ``gen`` to its first request."""
        self._advance(_Task(gen, on_done, on_error), None)

    def _advance(self, task: _Task, value, error: BaseException | None = None) -> None:
        try:
            item = task.gen.throw(error) if error is not None else task.gen.send(value)
        except StopIteration as stop:
            task.on_done(stop.value)
            return
        except BaseException as e:  # the task failed: handed to its owner
            task.on_error(e)
            return
        if isinstance(item, DecodeRequest):
            try:
                self.engine.submit(item)
            except Exception as e:
                self._advance(task, None, e)
                return
            self._decoding[id(item)] = task
        elif isinstance(item, VerifyItem):
            if not self._verifying:
                self._waiting_since = time.perf_counter()
            self._verifying.append((task, item))
        else:
            self._advance(task, None, TypeError(f"a task yielded {type(item).__name__}"))

    def step(self) -> None:
        """Verify what waits, run one decoding step, hand finished decodings (and then verdicts) to their tasks."""
        self._verify_waiting()
        decoding, t0 = self.engine.busy, time.perf_counter()
        finished = self.engine.step()
        if decoding:  # an idle engine's step costs nothing and says nothing about the next one
            self._step_cost = _average(self._step_cost, time.perf_counter() - t0)
        for req, dec in finished:
            self._advance(self._decoding.pop(id(req)), dec)
        self._verify_waiting()

    def fail_all(self, error: BaseException) -> None:
        """Hand ``error`` to every unfinished task and empty the engine (after a failed step)."""
        tasks = list(self._decoding.values()) + [t for t, _ in self._verifying]
        self._decoding.clear()
        self._verifying.clear()
        self.engine.reset()
        for task in tasks:
            task.gen.close()
            task.on_error(error)

    def _batch_waits(self) -> bool:
        """Whether the waiting answers wait for more (see the module docstring)."""
        if (not self.engine.rows or len(self._verifying) >= self.verify_batch or self._verify_cost is None
                or self._step_cost is None):
            return False
        waited = time.perf_counter() - self._waiting_since
        return waited + self._step_cost <= self.verify_patience * self._verify_cost

    def _verify_waiting(self) -> None:
        if not self._verifying or self._batch_waits():
            return
        waiting = list(self._verifying)
        self._verifying.clear()
        t0 = time.perf_counter()
        try:
            verdicts = self.verifier.verify_many([item for _, item in waiting])
        except Exception as e:
            for task, _ in waiting:
                self._advance(task, None, e)
            return
        self._verify_cost = _average(self._verify_cost, time.perf_counter() - t0)
        for (task, _), verdict in zip(waiting, verdicts):
            self._advance(task, verdict)

    def run(self, tasks: Sequence[Generator], on_result: Callable[[int, object], None] | None = None) -> list:
        """Run ``tasks`` to the end; their results in order (``on_result(i, result)`` as each finishes).

        The first task error is raised after the others have finished.
        """
        results: list = [None] * len(tasks)
        errors: list = []

        def done(i):
            def store(result):
                results[i] = result
                if on_result is not None:
                    on_result(i, result)
            return store

        for i, t in enumerate(tasks):
            self.start(t, done(i), errors.append)
        while self.busy:
            self.step()
        if errors:
            raise errors[0]
        return results


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else mean + _COST_WEIGHT * (value - mean)
