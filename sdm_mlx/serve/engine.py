"""The model side of ``sdm-mlx serve`` / ``sdm-mlx mcp``: one verified generator, one worker thread, verdicts by id.

All model work (loading included) runs on a single dedicated thread
(``Engine.submit``, :class:`ModelThread`); MLX state stays on the thread that
created it.  A submitted call that returns a generator — a completion
(:meth:`Engine.complete`) or a verification (:meth:`Engine.verify`) — is a
task of the generator's :class:`~sdm_mlx.verified.runner.BatchRunner`:
completions are decoded together in one continuous batch (requests join and
leave at token boundaries, a re-ask rejoins the batch), and the answers that
wait for a verdict are verified together (batched while rows decode: see
:mod:`sdm_mlx.verified.runner`).  Between two decoding
steps the thread starts newly submitted calls, so a request never waits for
another to finish.  That thread is a daemon that lives until the process
exits: a thread that used mlx-lm's thread-local generation stream and then
ends makes the process abort at exit ("terminate called without an active
exception") about half the time (measured: 6 of 16 runs joined, 0 of 16 kept
alive), so ``close()`` waits for the running job but never ends the thread, and the
process entry point ends such a process without MLX's native teardown
(:func:`sdm_mlx.cli.run`).

Prompts (:mod:`sdm_mlx.verified.prompts`, shared with ``generate``)
-------------------------------------------------------------------
* chat ``messages``: the server's system message (``--system`` / the head's) is
  prepended when the request has none, the last user message is placed in the
  ``{document}`` slot of the prompt template, then the tokenizer's chat
  template adds the generation prompt — for a one-user-message chat this is
  exactly :meth:`VerifiedGenerator.prompt_text`, the templating the verifier was trained on;
* completions ``prompt``: raw text, encoded as mlx-lm encodes a string prompt.

A re-ask continues the conversation (``assistant: <previous>``, ``user: <re-ask
message>``); every attempt is verified against the original prompt.

Verdicts
--------
Every verification (a completion's final attempt, ``/v1/verify``, MCP
``verify``) is kept in a bounded in-memory :class:`VerdictStore` under a
``verdict_id`` together with the prompt and answer token ids it was computed
from, so an explanation (and, later, a feedback label) can refer to it.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

from ..llm import embed as _embed
from ..runtime.allocator import HeapTrimmer
from ..verified.generator import AttemptPolicy, Streams
from ..verified.runner import Cancelled
from ..verified.verification import Verdict, VerifyItem
from ..errors import InputError
from .schema import GenerationRequest, VerifyRequest
from .verdicts import DEFAULT_MAX_BYTES, VerdictStore, verdict_record

#: Exemplar fields shown in a completion's ``verification`` (the full records are in the explanation).
EXEMPLAR_FIELDS = ("id", "label", "predicted_label", "squared_distance")


class UnknownVerdict(LookupError):
    """A verdict id that was never issued, or was evicted from the store."""


class ModelThread:
    """A single daemon worker thread running submitted calls (see the module docstring).

    ``runner`` (set once the generator is loaded) drives the calls that return a generator.  ``trimmer``
    gives the heap's free pages back between two decoding steps or once the thread idles, at most every
    ``trimmer.every_s`` seconds (:class:`~sdm_mlx.runtime.allocator.HeapTrimmer`).

    Attributes
    ----------
    started : bool
        Class-wide: whether this process started a model thread (the process entry point then ends it without
        MLX's native teardown, :func:`sdm_mlx.cli.run`).
    """

    started = False

    def __init__(self, name: str = "sdm-model", *, trimmer: HeapTrimmer | None = None):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending, self._closed = 0, False
        self.runner = None
        self.trimmer = trimmer if trimmer is not None else HeapTrimmer()
        threading.Thread(target=self._run, name=name, daemon=True).start()
        ModelThread.started = True

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the model thread is closed")
            self._pending += 1
            self._jobs.put((fut, fn, args, kwargs))
        return fut

    def _finished(self) -> None:
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def _start(self, job) -> None:
        fut, fn, args, kwargs = job
        if not fut.set_running_or_notify_cancel():
            self._finished()
            return
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:  # handed to the waiting caller
            fut.set_exception(e)
            self._finished()
            return
        if not inspect.isgenerator(out):
            fut.set_result(out)
            self._finished()
            return

        def done(result):
            fut.set_result(result)
            self._finished()

        def failed(error):
            fut.set_exception(error)
            self._finished()

        self.runner.start(out, done, failed)

    def _next_job(self):
        """The next submitted call, once there is one; an idle thread releases the heap's free pages when due."""
        while True:
            try:
                return self._jobs.get(timeout=self.trimmer.due_in())
            except queue.Empty:
                self.trimmer.maybe_release()

    def _run(self) -> None:
        while True:
            runner = self.runner
            if runner is None or not runner.busy:
                self._start(self._next_job())
                self.trimmer.worked()
                continue
            while True:  # calls submitted since the last step join now
                try:
                    self._start(self._jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                runner.step()
            except Exception as e:  # our own bug: every running request gets it, the thread lives on
                runner.fail_all(e)
            self.trimmer.worked()
            self.trimmer.maybe_release()

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new calls, cancel queued ones, wait for the running ones; True if idle (the thread stays)."""
        with self._cond:
            self._closed = True
        while True:
            try:
                fut = self._jobs.get_nowait()[0]
            except queue.Empty:
                break
            fut.cancel()
            self._finished()
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)


class Engine:
    """A loaded :class:`~sdm_mlx.verified.VerifiedGenerator` behind one worker thread.

    ``load()`` builds the generator (run on the worker thread); ``model_id`` is the id served by
    ``/v1/models``; ``aliases`` are other accepted ``model`` values (e.g. the model path).
    """

    def __init__(self, load: Callable, model_id: str, *, aliases=(), max_verdicts: int = 1000,
                 persist_feedback: str | None = None, max_verdict_bytes: int = DEFAULT_MAX_BYTES):
        self.persist_feedback = persist_feedback  # verifier directory rewritten (atomically) after each feedback
        self._thread = ModelThread()
        self.closing = threading.Event()
        self.verdicts = VerdictStore(max_verdicts, max_verdict_bytes)
        self.model_id, self.aliases = model_id, {model_id, *aliases}
        self.created = int(time.time())
        self.gen = self._thread.submit(load).result()
        self._thread.runner = self.gen.runner

    # -- the server's seam: what serve/ and mcp read of the loaded generator ----------------------------------
    # (one read-only property each, alike in shape on purpose: a view per need, no reach-through into gen)
    @property
    def vocab_size(self) -> int:
        """Rows of the LM head: the token ids a request may name (``logit_bias``)."""
        return self.gen.engine.vocab

    @property
    def tokenizer(self):
        """The served model's tokenizer (a request's prompt is encoded with it)."""
        return self.gen.tokenizer

    @property
    def prompts(self):
        """The :class:`~sdm_mlx.verified.prompts.PromptBuilder` of every request's prompt."""
        return self.gen.prompts

    @property
    def estimator(self):
        """The verification layer's ``SDMEstimator`` (replaced when feedback is persisted)."""
        return self.gen.estimator

    @property
    def settings(self):
        """The generation settings in force (:attr:`VerifiedGenerator.settings`): a request's defaults."""
        return self.gen.settings

    @property
    def decoding(self) -> str:
        """"plain" or "joint" (neg+pos SDM heads) decoding."""
        return self.gen.decoding

    @property
    def context_length(self) -> int:
        """The served model's context length (:func:`sdm_mlx.serve.limits.context_length`)."""
        from .limits import context_length

        return context_length(self.gen.model)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Queue ``fn(*args, **kwargs)`` on the model thread."""
        return self._thread.submit(fn, *args, **kwargs)

    def close(self, timeout: float | None = 60.0) -> None:
        """Abort running generations at their next token, drop queued ones, wait for the model thread to idle."""
        self.closing.set()
        self._thread.close(timeout)

    # -- prompts (sdm_mlx.verified.prompts) ------------------------------------------------------------------
    def chat_messages(self, messages: list) -> list:
        """The request's messages with the server's system message and prompt template applied."""
        return self.prompts.chat_messages(messages)

    def prompt_text(self, messages: list | None = None, prompt: str | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The generation prompt of a chat (``messages``, with the request's ``chat_template_kwargs``) or raw
        text (``prompt``) request."""
        return self.prompts.prompt_text(messages, prompt, template_kwargs)

    def prompt_ids(self, messages: list | None = None, prompt: str | None = None,
                   template_kwargs: dict | None = None) -> list:
        """Token ids of :meth:`prompt_text`, encoded as mlx-lm encodes a string prompt."""
        return _embed.encode(self.tokenizer, self.prompt_text(messages, prompt, template_kwargs))

    # -- model work (call through submit; the generators are BatchRunner tasks) ---------------------------
    def complete(self, req: GenerationRequest, on_stream: Callable[[str, list | None], None] | None = None,
                 cancel: threading.Event | None = None):
        """Generate, verify and apply the policy (a task): ``(VerificationResult, verification dict, prompt
        token count)``.  ``on_stream(text, logprobs)`` gets the text as it is generated: when the request asks
        for logprobs, released at token boundaries with the records of exactly the tokens it completes
        (``on_tokens``); otherwise mlx-lm's detokenized segments, with ``None`` (``on_text``: no per-token
        decoding cost).  ``cancel`` (and the server closing) stops the generation at its next token."""
        cancel = cancel or threading.Event()

        def gone() -> bool:
            return cancel.is_set() or self.closing.is_set()

        if gone():  # a request that waited in the queue may already be gone
            raise Cancelled("the request was cancelled")
        base_ids = (list(req.prompt_ids) if req.prompt_ids is not None
                    else self.prompt_ids(req.messages, req.prompt, req.chat_template_kwargs))
        on_tokens = on_stream if (on_stream is not None and req.sampling.logprobs) else None
        on_text = (lambda seg: on_stream(seg, None)) if (on_stream is not None and on_tokens is None) else None
        policy = AttemptPolicy(on_reject=req.on_reject, max_attempts=req.max_attempts, max_tokens=req.max_tokens,
                               stop=req.stop, sampling=req.sampling)
        result = yield from self.gen.attempts(
            base_ids, self.prompts.reasker(messages=req.messages, prompt=req.prompt,
                                               template_kwargs=req.chat_template_kwargs),
            prompt=req.prompt or req.messages[-1]["content"], policy=policy,
            streams=Streams(on_text=on_text, on_tokens=on_tokens, cancel=gone),
        )
        last = result.attempts[-1]
        vid = self._store(req.kind, base_ids, last.token_ids, last.text, last.verdict)
        return result, completion_verification(result, vid), len(base_ids)

    def verify(self, req: VerifyRequest):
        """Force-decode ``req.completion`` after the request's prompt (a task): ``(verification dict, usage)``."""
        return self.verify_text(self.prompt_text(req.messages, req.prompt), req.completion, "verify")

    def verify_question(self, question: str, answer: str):
        """Verify ``answer`` to a user message ``question`` (templated as a one-message chat; a task)."""
        return self.verify_text(self.prompt_text([{"role": "user", "content": question}]), answer, "mcp")

    def verify_text(self, prompt: str, completion: str, source: str):
        """Verify ``completion`` force-decoded after ``prompt`` (``sdm-mlx embed``'s construction; a task).

        As :func:`sdm_mlx.llm.embed.prompt_completion_features`, prompt + completion are encoded as one string;
        the completion's tokens are those after the prompt's own encoding (its common prefix, should the
        two tokenisations differ at the boundary).  Verifications waiting together share one batched pass.
        """
        tok = self.tokenizer
        prompt_ids, full = _embed.encode(tok, prompt), _embed.encode(tok, prompt + completion)
        k = 0
        while k < min(len(prompt_ids), len(full)) and prompt_ids[k] == full[k]:
            k += 1
        prompt_ids, answer_ids = full[:k], full[k:]
        if not answer_ids:
            raise InputError("the completion encodes to no tokens")
        v = yield VerifyItem(prompt_ids, answer_ids, completion)
        vid = self._store(source, prompt_ids, answer_ids, completion, v)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(answer_ids),
                 "total_tokens": len(prompt_ids) + len(answer_ids)}
        return verdict_verification(v, vid), usage

    def _store(self, source: str, prompt_ids: list, answer_ids: list, text: str, v: Verdict) -> str:
        """Keep one verdict with the ids it was computed from (bounded store)."""
        return self.verdicts.put(verdict_record(self.tokenizer, source, prompt_ids, answer_ids, text=text,
                                                  verdict=v))

    def add_feedback(self, verdict_id: str, label, source: str) -> dict:
        """Add a verdict's feature row, labelled by the user, to the verifier's support set (model thread);
        with ``persist_feedback`` through the writer protocol (see :func:`sdm_mlx.estimator.updates.apply_verdict_feedback`)."""
        from ..estimator.updates import apply_verdict_feedback

        rec = self.verdicts.get(verdict_id)
        if rec is None:
            raise UnknownVerdict(f"no verdict {verdict_id!r} (unknown, or evicted from the last "
                                 f"{self.verdicts.capacity} verdicts)")
        return apply_verdict_feedback(self.gen, rec["prompt_ids"].tolist(), rec["answer_ids"].tolist(), verdict_id,
                                      label, source=source, persist_path=self.persist_feedback)

    def explain(self, verdict_id: str) -> dict | None:
        """The full per-row quantities of a stored verdict (None: unknown or evicted id); no model work."""
        rec = self.verdicts.get(verdict_id)
        if rec is None:
            return None
        out = {k: v for k, v in rec.items() if k not in ("prompt_ids", "answer_ids")}
        out["prompt_tokens"], out["completion_tokens"] = len(rec["prompt_ids"]), len(rec["answer_ids"])
        out["answer_token_ids"] = rec["answer_ids"].tolist()
        return out


def _exemplars(exemplars: list) -> list:
    return [{k: e.get(k) for k in EXEMPLAR_FIELDS} for e in exemplars]


def verdict_verification(v: Verdict, verdict_id: str) -> dict:
    """The ``verification`` object of one verdict."""
    return {
        "verdict_id": verdict_id, "verified": v.verified, "admitted": bool(v.verifier.get("admitted")),
        "p_lower": v.p_lower, "prediction": v.verifier.get("prediction"), "rejection_reason": v.reason,
        "exemplars": _exemplars(v.exemplars),
    }


def completion_verification(result, verdict_id: str) -> dict:
    """The ``choices[0].verification`` object of a completion (the final attempt's verdict + the policy outcome)."""
    out = verdict_verification(result.attempts[-1].verdict, verdict_id)
    out.update(status=result.status, on_reject=result.on_reject, stopped=result.stopped,
               n_attempts=len(result.attempts))
    out["attempts"] = [{"attempt": a.attempt, "text": a.text, "verified": a.verdict.verified,
                        "admitted": bool(a.verdict.verifier.get("admitted")), "p_lower": a.verdict.p_lower,
                        "rejection_reason": a.verdict.reason, "tokens": a.tokens, "stop_reason": a.stop_reason,
                        "generation_seconds": round(a.generation_seconds, 6),
                        "verification_seconds": round(a.verdict.seconds, 6)}
                       for a in result.attempts]
    return out
