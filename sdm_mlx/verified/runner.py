"""Many verified generations at once over the one :class:`~.batching.DecodeEngine`.

A *task* is a generator function's generator that yields what it needs and is
sent the answer:

* a :class:`~.batching.DecodeRequest` → its :class:`~.batching.Decoded` (the
  request joins the running batch; a re-ask is just the next request, so a
  rejected answer's re-ask rejoins the batch instead of blocking the queue);
* a :class:`~.verification.VerifyItem` → its :class:`~.verification.Verdict`
  (every item waiting at a step is verified together: one batched feature pass
  for the items without pooled features, one batched estimate);

and whose ``return`` value is the task's result.  :class:`BatchRunner` drives
any number of tasks: ``start(task, on_done, on_error)`` then ``step()`` until
``busy`` is False, or :meth:`BatchRunner.run` for a list of tasks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

from ..decoding.batching import DecodeEngine, DecodeRequest
from .verification import AnswerVerifier, VerifyItem


class Cancelled(Exception):
    """The request was cancelled (the client went away, or the server is shutting down)."""


@dataclass
class _Task:
    gen: Generator
    on_done: Callable[[object], None]
    on_error: Callable[[BaseException], None]


class BatchRunner:
    """Drives tasks (see the module docstring) over ``engine`` with ``verifier`` (an :class:`AnswerVerifier`)."""

    def __init__(self, engine: DecodeEngine, verifier: AnswerVerifier | None):
        self.engine, self.verifier = engine, verifier
        self._decoding: dict = {}
        self._verifying: deque = deque()

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
            self._verifying.append((task, item))
        else:
            self._advance(task, None, TypeError(f"a task yielded {type(item).__name__}"))

    def step(self) -> None:
        """Verify what waits, run one decoding step, hand finished decodings (and then verdicts) to their tasks."""
        self._verify_waiting()
        for req, dec in self.engine.step():
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

    def _verify_waiting(self) -> None:
        if not self._verifying:
            return
        waiting = list(self._verifying)
        self._verifying.clear()
        try:
            verdicts = self.verifier.verify_many([item for _, item in waiting])
        except Exception as e:
            for task, _ in waiting:
                self._advance(task, None, e)
            return
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
