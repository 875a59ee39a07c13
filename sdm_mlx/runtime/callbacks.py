"""One callback protocol for progress and logging during training and evaluation: callbacks observe.

A :class:`Callback` receives events; every hook is a no-op by default, so a subclass overrides only
what it needs.  The library is silent unless given a callback (``SDMEstimator(verbose=True)`` or
``fit(..., callback=...)``); the CLI passes :class:`TqdmProgress`, which draws progress bars with
elapsed time and ETA (tqdm) and writes log lines, both on stderr.

Events (``j``: round index 0..J−1 of Alg. 1; ``epoch``: 1-based)::

    on_epoch_end(j, epoch, metrics)    after an epoch of a round (metrics: loss, balanced_median_q, ...)
    on_round_end(j, result)            after round j and its calibration (a
                                       :class:`sdm_mlx.estimator.training.RoundResult`)
    on_rounds_state(state)             after the bookkeeping and the checkpoint of a round (a resumable
                                       :class:`sdm_mlx.estimator.rounds.RoundsProgress`)
    message(text)                      one log line
    progress(total, desc, unit)        a bar: ``with cb.progress(n, "embed", "doc") as bar: bar.update(k)``

Code that still carries a ``verbose`` switch (the SDM-network trainer, :class:`NetworkConfig`'s
``verbose``) uses the function forms :func:`log` and :func:`progress_bar`, which draw the same tqdm
output.
"""

from __future__ import annotations

import sys


class _NullBar:
    """A progress bar that draws nothing."""

    def update(self, n: int = 1, **postfix) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class Callback:
    """The protocol; this base class ignores every event (the library's default: silent)."""

    def on_epoch_end(self, j: int, epoch: int, metrics: dict) -> None:
        pass

    def on_round_end(self, j: int, result) -> None:
        pass

    def on_rounds_state(self, state) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def progress(self, total: int | None, desc: str = "", unit: str = "it"):
        return _NullBar()


#: The silent callback (the library default).
SILENT = Callback()


class CallbackList(Callback):
    """Several callbacks as one: each event goes to each callback in order; the first bar that draws wins."""

    def __init__(self, callbacks):
        self.callbacks = [c for c in callbacks if c is not None]

    def on_epoch_end(self, j, epoch, metrics):
        for c in self.callbacks:
            c.on_epoch_end(j, epoch, metrics)

    def on_round_end(self, j, result):
        for c in self.callbacks:
            c.on_round_end(j, result)

    def on_rounds_state(self, state):
        for c in self.callbacks:
            c.on_rounds_state(state)

    def message(self, text):
        for c in self.callbacks:
            c.message(text)

    def progress(self, total, desc="", unit="it"):
        for c in self.callbacks:
            bar = c.progress(total, desc, unit)
            if not isinstance(bar, _NullBar):
                return bar
        return _NullBar()


class _TqdmBar:
    """A tqdm bar whose ``update`` also takes a postfix (``bar.update(50, loss="0.12")``)."""

    def __init__(self, total, desc, unit, stream):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, leave=True,
                        mininterval=0.2)

    def update(self, n: int = 1, **postfix) -> None:
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


class TqdmProgress(Callback):
    """Progress for people: tqdm bars (elapsed, rate, ETA) and one log line per epoch and round, on stderr."""

    def __init__(self, stream=None, epochs: bool = True):
        self.stream, self.epochs, self._rounds = stream, epochs, "?"

    @property
    def _out(self):
        return self.stream or sys.stderr

    def message(self, text: str) -> None:
        from tqdm import tqdm

        tqdm.write(text, file=self._out)
        self._out.flush()

    def progress(self, total, desc="", unit="it"):
        return _TqdmBar(total, desc, unit, self._out)

    def on_epoch_end(self, j, epoch, metrics):
        self._rounds = metrics.get("rounds", self._rounds)
        if self.epochs:
            self.message(f"round {j + 1}/{self._rounds} epoch {epoch}/{metrics.get('epochs', '?')} loss {metrics['loss']:.4f} "
                         f"balanced median q {metrics['balanced_median_q']:.2f} cal acc {metrics['cal_accuracy']:.3f} "
                         f"W_g moved {metrics['projection_movement']:.1%}")

    def on_round_end(self, j, result):
        self.message(f"round {j + 1}/{self._rounds}: best epoch {result.best_epoch}/{result.epochs_run}, balanced median q "
                     f"{result.metric:.2f}, W_g moved {result.movement['projection']:.1%}")


def as_callback(callback: Callback | None = None, verbose: bool = False) -> Callback:
    """``callback`` if given, else :class:`TqdmProgress` when ``verbose``, else :data:`SILENT`."""
    if callback is not None:
        return callback
    return TqdmProgress() if verbose else SILENT


def cli_callback(quiet: bool = False) -> Callback:
    """The CLI's callback: :class:`TqdmProgress` on stderr, or :data:`SILENT` with ``--quiet``."""
    return SILENT if quiet else TqdmProgress()


def note(text: str) -> None:
    """A line on stderr that is always shown (notes and warnings of the CLI; safe next to a tqdm bar)."""
    TqdmProgress().message(text)


def log(message: str, enabled: bool = True) -> None:
    """A line on stderr when ``enabled`` (the function form of :meth:`TqdmProgress.message`)."""
    if enabled:
        note(message)


def progress_bar(total: int | None, desc: str = "", unit: str = "it", enabled: bool = True):
    """A tqdm bar on stderr when ``enabled``, else one that draws nothing (the function form of
    :meth:`TqdmProgress.progress`): ``with progress_bar(n, "embed", "doc") as bar: bar.update(k)``."""
    return TqdmProgress().progress(total, desc, unit) if enabled else _NullBar()
