"""PromptCounter runs its calls on one thread of its own (sdm_mlx.serve.limits): what the tokenizers library
keeps of the words it encoded grows with the threads that encode, so counting on the event loop's pool of
workers grew the server's heap."""

import asyncio
import threading
import time
import types

from sdm_mlx.serve.limits import PromptCounter


def _counter() -> PromptCounter:
    return PromptCounter(types.SimpleNamespace(gen=types.SimpleNamespace(tokenizer=None)))


def test_concurrent_calls_run_on_one_thread_off_the_event_loop():
    counter = _counter()

    def where() -> int:
        time.sleep(0.005)  # overlapping calls: a pool would spread them over its workers
        return threading.get_ident()

    async def main():
        loop_thread = threading.get_ident()
        idents = await asyncio.gather(*(counter.off_loop(where) for _ in range(24)))
        return loop_thread, set(idents)

    loop_thread, idents = asyncio.run(main())
    assert len(idents) == 1 and loop_thread not in idents


def test_off_loop_returns_the_result_and_raises_the_error_of_the_call():
    counter = _counter()

    def fail():
        raise ValueError("bad template")

    async def main():
        ok = await counter.off_loop(lambda a, b: a + b, 2, 3)
        try:
            await counter.off_loop(fail)
        except ValueError as e:
            return ok, str(e)

    assert asyncio.run(main()) == (5, "bad template")
