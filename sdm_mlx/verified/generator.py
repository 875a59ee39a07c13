"""``VerifiedGenerator``: decoding, verification of each answer, and the branching policy.

The policy on a rejected answer (``on_reject``):

* ``"abstain"`` — one attempt; the result's ``text`` is :data:`ABSTAIN_TEXT`
  (a clear "not verified" answer; the generated answer stays in ``answer``
  and ``attempts``);
* ``"return"``  — one attempt; ``text`` is the answer, flagged ``verified =
  false`` / ``status = "unverified"``;
* ``"reask"``   — re-prompt with the previous answer and ask for a re-check
  (:data:`~.prompts.REASK_TEMPLATE`), up to ``max_attempts`` attempts in total, stopping
  at the first verified answer; if none is verified the result falls back to
  ``reask_fallback`` (``"abstain"``, default, or ``"return"`` the last answer).
  Greedy decoding would repeat its answer to a re-ask prompt identical to one
  already used: the loop then stops early (``stopped = "repeated_prompt"``).

Prompts and re-ask prompts: :mod:`.prompts`.  Every attempt's answer is
verified against the **original** prompt — features of original prompt +
answer — since that is the distribution the verification layer was trained on;
the first attempt's features are pooled from its own decoding states.

One prompt's attempts are a task of :class:`~.runner.BatchRunner` (:meth:`VerifiedGenerator.attempts`):
``generate`` runs one, ``generate_many`` (``sdm-mlx generate --input``) and
``sdm-mlx serve`` run many at once in one continuous batch.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Callable, Sequence

from ..llm import embed as _embed
from .config import ON_REJECT, GenerationConfig
from ..errors import InputError
from ..decoding.batching import DecodeEngine, DecodeRequest
from .outcome import ABSTAIN_TEXT, STATUSES, STOPPED, Attempt, VerificationResult
from ..decoding.prompt_cache import PrefixCache
from .prompts import REASK_TEMPLATE, PromptBuilder, fill
from .runner import BatchRunner, Cancelled
from .sources import ModelSources
from ..decoding.sampling import GREEDY, SamplingParams
from .verification import AnswerVerifier, Verdict, VerifyItem

__all__ = ["ABSTAIN_TEXT", "REASK_TEMPLATE", "STATUSES", "STOPPED", "Attempt", "AttemptPolicy", "Streams",
           "VerificationResult", "VerifiedGenerator", "split_options"]
#: Rows decoded at once by default (``max_batch`` of the engine).
DEFAULT_MAX_BATCH = 16


@dataclasses.dataclass(frozen=True)
class AttemptPolicy:
    """How one prompt's attempts run: ``on_reject``, ``max_attempts``, ``max_tokens`` (None: the generator's
    settings), ``stop`` strings and ``sampling`` (:class:`~sdm_mlx.decoding.sampling.SamplingParams`; attempt
    ``k`` draws with seed + k − 1)."""

    on_reject: str | None = None
    max_attempts: int | None = None
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    sampling: SamplingParams = GREEDY


@dataclasses.dataclass(frozen=True)
class Streams:
    """What one prompt's attempts report as they run, and how they are stopped: ``on_text(segment)`` /
    ``on_tokens(text, records)`` stream the answer (:class:`~sdm_mlx.decoding.batching.DecodeRequest`),
    ``on_attempt_start(k)`` before attempt ``k`` (1-based), ``on_attempt(attempt)`` after its verdict,
    ``cancel()`` is polled at every token (True: :class:`~.runner.Cancelled`)."""

    on_text: Callable[[str], None] | None = None
    on_tokens: Callable[[str, list], None] | None = None
    on_attempt_start: Callable[[int], None] | None = None
    on_attempt: Callable[["Attempt"], None] | None = None
    cancel: Callable[[], bool] | None = None


_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(AttemptPolicy))
_STREAM_FIELDS = frozenset(f.name for f in dataclasses.fields(Streams))


def split_options(options: dict) -> tuple[AttemptPolicy, Streams]:
    """``(AttemptPolicy, Streams)`` of flat per-call keywords (``generate(prompt, on_reject=..., on_text=...)``)."""
    unknown = set(options) - _POLICY_FIELDS - _STREAM_FIELDS
    if unknown:
        raise TypeError(f"unexpected options: {sorted(unknown)}")
    return (AttemptPolicy(**{k: v for k, v in options.items() if k in _POLICY_FIELDS}),
            Streams(**{k: v for k, v in options.items() if k in _STREAM_FIELDS}))


def _load_model(sources: ModelSources, model, tokenizer):
    """``(model, tokenizer)``: the ones given, else loaded from the sources' model reference."""
    if model is not None:
        if tokenizer is None:
            raise InputError("pass the tokenizer together with the model")
        return model, tokenizer
    return _embed.load_model(sources.require_model())


def _load_heads(sources: ModelSources, model, tokenizer):
    """The head directory's :class:`~sdm_mlx.network.heads.SDMHeads` on ``model`` (warns on another base model)."""
    from ..network.artifact import load_network

    config = sources.config
    if config.model is not None and os.path.exists(os.path.expanduser(str(config.model))):
        base = sources.head_config["base_model"]
        if os.path.abspath(os.path.expanduser(str(config.model))) != base:
            warnings.warn(f"the head {config.head} was trained on {base}; using the model {config.model}",
                          stacklevel=3)
    return load_network(config.head, model=model, tokenizer=tokenizer, load_verifier=False).heads


def _load_verifier(sources: ModelSources):
    """The saved ``SDMEstimator`` of the sources' verifier directory."""
    path = sources.require_verifier()
    from ..estimator import SDMEstimator

    verifier = SDMEstimator.load(path)
    verifier.verbose = False
    return verifier


class VerifiedGenerator:
    """Generate an answer, verify it with the SDM verification layer, branch on the verdict.

    ``VerifiedGenerator(model_path, verifier_path, head_path=None, on_reject="abstain", max_attempts=3, ...)``
    or ``VerifiedGenerator.from_config(GenerationConfig(...))``; every keyword setting is a field of
    :class:`~sdm_mlx.verified.config.GenerationConfig` (defaults and help text live there).

    Parameters
    ----------
    model_path : str, optional
        mlx-lm model directory or hub id (default with a head: its base model).
    verifier_path : str, optional
        A saved ``SDMEstimator`` trained on features of force-decoded prompt + completion (label 1 = correct
        completion) of this model (default with a head: the network's ``verifier/``).
    head_path : str, optional
        An SDM-network directory (``network_config.json`` + ``positive_head.safetensors``); its W_pos switches
        decoding to the joint neg+pos argmax and its stored settings (system, prompt template, delimiter,
        max_length, max_new_tokens) become the defaults (DESIGN #19).
    config : GenerationConfig, optional
        All settings at once; keywords in ``settings`` override its fields.
    model, tokenizer, verifier, heads : optional
        Already loaded objects instead of paths (an mlx-lm model + tokenizer, an ``SDMEstimator``, ``SDMHeads``).
    max_batch : int, optional
        Requests decoded at once (the engine's running batch).
    **settings
        Fields of ``GenerationConfig``: ``system``, ``prompt_template`` (``{document}`` slot),
        ``use_chat_template`` (how a prompt is templated: use the settings the verifier's data were built
        with), ``max_tokens`` per attempt, ``delimiter`` (closing delimiter of the verification unit),
        ``max_length`` (kept positions of the features, DESIGN #21), ``n_exemplars``, ``require_json``,
        ``on_reject``, ``max_attempts``, ``reask_template``, ``reask_fallback``, ``abstain_text``.

    Attributes
    ----------
    sources : ModelSources
        The model reference, the head's parsed config and the verifier directory, resolved once.
    config : GenerationConfig
        The settings as given (``sources.config``).
    settings : GenerationConfig
        The settings in force: ``config`` with its head-dependent fields (``system``, ``prompt_template``,
        ``use_chat_template``, ``max_tokens``, ``delimiter``, ``max_length``) resolved against the head's stored
        settings (:meth:`GenerationConfig.templating`).
    prompts : PromptBuilder
        The templating (system message, prompt and re-ask templates) of every prompt.
    model, tokenizer, heads, estimator :
        The loaded language model and tokenizer, the SDM heads (None: plain decoding) and the verification
        layer's ``SDMEstimator``.
    engine : DecodeEngine
        The batched decoding loop (continuous batching); ``decoding`` is its mode, "plain" or "joint".
    verifier : AnswerVerifier
        Features of an answer -> the estimator's verdict.
    """

    def __init__(self, model_path=None, verifier_path=None, head_path=None, *,
                 config: GenerationConfig | ModelSources | None = None, model=None, tokenizer=None, verifier=None,
                 heads=None, max_batch: int = DEFAULT_MAX_BATCH, **settings):
        """Nine parameters: three paths (the positional API of mlx-lm-style callers), the settings (``config``),
        four already loaded objects that replace what the paths would load, and the batch size; grouping the
        loaded objects would break the keyword API that tests and notebooks use."""
        paths = {k: v for k, v in (("model", model_path), ("verifier", verifier_path), ("head", head_path))
                 if v is not None}
        if isinstance(config, ModelSources) and not paths and not settings:
            sources = config  # resolved once by the caller
        else:
            base = config.config if isinstance(config, ModelSources) else (config or GenerationConfig())
            sources = ModelSources.resolve(dataclasses.replace(base, **paths, **settings))
        self.sources, self.config = sources, sources.config
        self.max_batch = int(max_batch)
        model, tokenizer = _load_model(sources, model, tokenizer)
        if sources.config.head is not None and heads is None:
            heads = _load_heads(sources, model, tokenizer)
        if verifier is None:
            verifier = _load_verifier(sources)
        self._settle(sources.config, sources.head_settings, model, tokenizer, heads, verifier)

    @classmethod
    def from_config(cls, config: GenerationConfig | ModelSources, **loaded) -> "VerifiedGenerator":
        """A generator built from ``config`` (a :class:`~.sources.ModelSources`: resolved once by the caller;
        ``loaded``: already loaded model/tokenizer/verifier/heads)."""
        return cls(config=config, **loaded)

    def _settle(self, config: GenerationConfig, head_settings: dict | None, model, tokenizer, heads, verifier):
        """Resolve the head-dependent settings (:attr:`settings`) and build the prompts, the engine and the
        verifier."""
        t = config.templating(head_settings)
        if t["max_tokens"] < 1 or t["max_length"] < 1:
            raise InputError("max_tokens and max_length must be >= 1")
        self.settings = dataclasses.replace(config, **t)
        self.prompts = PromptBuilder(tokenizer, system=t["system"], prompt_template=t["prompt_template"],
                                     use_chat_template=t["use_chat_template"], reask_template=config.reask_template,
                                     template_kwargs=config.template_kwargs())
        self.model, self.tokenizer, self.heads, self.estimator = model, tokenizer, heads, verifier
        cache = PrefixCache(int(config.prompt_cache_bytes)) if config.prompt_cache_bytes else False
        self.engine = DecodeEngine(model, tokenizer, heads=heads, delimiter=t["delimiter"],
                                   max_batch=self.max_batch, max_length=t["max_length"], prefix_cache=cache)
        self.decoding = self.engine.mode  # "plain" | "joint"
        self.verifier = AnswerVerifier(model, tokenizer, verifier, delimiter=t["delimiter"],
                                       max_length=t["max_length"], n_exemplars=config.n_exemplars,
                                       require_json=config.require_json)
        self.runner = BatchRunner(self.engine, self.verifier)

    # -- prompts ----------------------------------------------------------------------------------
    def user_message(self, prompt: str) -> str:
        return self.prompts.user_message(prompt)

    def prompt_text(self, prompt: str) -> str:
        """The templated generation prompt for a user message / document (as ``sdm-mlx embed`` templates it)."""
        return self.prompts.document_text(prompt)

    def reask_text(self, prompt: str, previous: str, reason: str | None, attempt: int) -> tuple[str, str]:
        """``(generation prompt text, re-ask message)`` asking to re-check ``previous`` (see :mod:`.prompts`)."""
        ids, message = self.prompts.reask(previous, reason, attempt, messages=self.prompts.messages(prompt))
        return self.tokenizer.decode(ids), message

    # -- one prompt -------------------------------------------------------------------------------
    def verify(self, prompt: str, answer_ids, text: str | None = None, id=None) -> Verdict:
        """Verify token ids ``answer_ids`` as the answer to ``prompt`` (user message / document).

        Pass the ids as generated (``Attempt.token_ids``): re-encoding the answer text can split it into
        different tokens (e.g. ``"}`` vs ``"`` + ``}``), which changes the features and hence the verdict.
        """
        ids = _embed.encode(self.tokenizer, self.prompt_text(prompt))
        return self.verifier(ids, answer_ids, self.tokenizer.decode(list(answer_ids)) if text is None else text, id)

    def document_task(self, prompt: str, id=None, **options):
        """The :meth:`attempts` task of one prompt (the user message / document of the template); ``options``:
        the fields of :class:`AttemptPolicy` and :class:`Streams` as flat keywords."""
        if not isinstance(prompt, str) or not prompt:
            raise InputError("prompt must be a non-empty string")
        base_ids = _embed.encode(self.tokenizer, self.prompt_text(prompt))
        policy, streams = split_options(options)
        return self.attempts(base_ids, self.prompts.reasker(messages=self.prompts.messages(prompt)), prompt=prompt,
                             id=id, policy=policy, streams=streams)

    def generate(self, prompt: str, id=None, *, on_text: Callable[[str], None] | None = None,
                 on_attempt_start: Callable[[int], None] | None = None,
                 on_attempt: Callable[[Attempt], None] | None = None, **options) -> VerificationResult:
        """Generate, verify and branch for one prompt (the user message / document of the template).

        Callbacks: ``on_text(segment)`` streams the answer text of every attempt,
        ``on_attempt_start(k)`` before attempt ``k`` (1-based), ``on_attempt(attempt)`` after its verdict.
        ``options``: the fields of :class:`AttemptPolicy` and :class:`Streams` as flat keywords.
        """
        task = self.document_task(prompt, id, on_text=on_text, on_attempt_start=on_attempt_start,
                                  on_attempt=on_attempt, **options)
        return self.runner.run([task])[0]

    def generate_ids(self, base_ids, reask, **options) -> VerificationResult:
        """:meth:`attempts` on an already templated prompt (token ids ``base_ids``), run to its result."""
        policy, streams = split_options(options)
        return self.runner.run([self.attempts(base_ids, reask, policy=policy, streams=streams)])[0]

    def generate_many(self, prompts: Sequence[str], ids: Sequence | None = None,
                      on_result: Callable[[int, VerificationResult], None] | None = None, **options) -> list:
        """Every prompt's :class:`VerificationResult`, decoded together in one continuous batch.

        ``on_result(i, result)`` is called as each finishes (not in input order); ``options`` as :meth:`attempts`.
        """
        ids = list(ids) if ids is not None else [None] * len(prompts)
        tasks = [self.document_task(p, i, **options) for p, i in zip(prompts, ids)]
        return self.runner.run(tasks, on_result)

    def attempts(self, base_ids, reask: Callable[[str, str | None, int], tuple[list, str]] | None, *,
                 prompt: str = "", id=None, policy: AttemptPolicy = AttemptPolicy(), streams: Streams = Streams()):
        """The generate-verify-branch loop of one prompt as a :class:`~.runner.BatchRunner` task.

        ``reask(previous, reason, attempt) -> (prompt ids, re-ask message)`` builds the prompt of a re-ask
        attempt (required with ``on_reject="reask"``); every attempt is verified against ``base_ids``.
        ``policy`` (:class:`AttemptPolicy`) overrides the generator's settings for this call and carries the
        decoding's ``stop`` and ``sampling``; ``streams`` (:class:`Streams`) are the callbacks and the cancel
        poll (raises :class:`~.runner.Cancelled`).  ``prompt`` is only recorded in the result.
        """
        on_reject, max_attempts, max_tokens = self._options(policy, reask)
        sampling = policy.sampling
        base_ids = [int(t) for t in base_ids]
        t_start = time.perf_counter()
        gen_ids, reask_message, used = base_ids, None, {tuple(base_ids)}
        limit = max_attempts if on_reject == "reask" else 1
        attempts: list[Attempt] = []
        stopped = "rejected"
        for k in range(1, limit + 1):
            if streams.on_attempt_start is not None:
                streams.on_attempt_start(k)
            seed = None if sampling.seed is None else sampling.seed + k - 1
            req = DecodeRequest(gen_ids, max_tokens, dataclasses.replace(sampling, seed=seed),
                                tuple(policy.stop or ()), features=gen_ids is base_ids,
                                feature_parts=self.verifier.feature_parts, on_text=streams.on_text,
                                cancel=streams.cancel, on_tokens=streams.on_tokens)
            t0 = time.perf_counter()
            dec = yield req
            if dec.stop_reason == "cancelled":
                raise dec.error if dec.error is not None else Cancelled("the request was cancelled")
            # the first attempt's decoding computed the verifier input; a re-asked attempt is verified
            # against the original prompt, which its decoding never saw: one feature pass
            verdict = yield VerifyItem(base_ids, dec.token_ids, dec.text, id,
                                       (dec.features, dec.feature_info) if dec.features is not None else None)
            att = _attempt_record(k, dec, verdict, reask_message, time.perf_counter() - t0)
            attempts.append(att)
            if streams.on_attempt is not None:
                streams.on_attempt(att)
            if verdict.verified:
                stopped = "verified"
                break
            if k == limit:
                stopped = "max_attempts" if on_reject == "reask" else "rejected"
                break
            gen_ids, reask_message = reask(att.text, verdict.reason, k + 1)
            gen_ids = [int(t) for t in gen_ids]
            if sampling.greedy and tuple(gen_ids) in used:
                stopped = "repeated_prompt"
                break
            used.add(tuple(gen_ids))
        return self._result(attempts, on_reject, stopped, prompt, id, time.perf_counter() - t_start)

    def _options(self, policy: AttemptPolicy, reask) -> tuple:
        """``(on_reject, max_attempts, max_tokens)`` of one call, the generator's settings filling ``None``."""
        settings = self.settings
        on_reject = settings.on_reject if policy.on_reject is None else policy.on_reject
        max_attempts = int(settings.max_attempts) if policy.max_attempts is None else int(policy.max_attempts)
        max_tokens = settings.max_tokens if policy.max_tokens is None else int(policy.max_tokens)
        if on_reject not in ON_REJECT:
            raise InputError(f"on_reject must be one of {ON_REJECT}, got {on_reject!r}")
        if max_attempts < 1 or max_tokens < 1:
            raise InputError("max_attempts and max_tokens must be >= 1")
        if on_reject == "reask" and reask is None:
            raise InputError("on_reject='reask' needs a reask prompt builder")
        policy.sampling.validate()
        return on_reject, max_attempts, max_tokens

    def _result(self, attempts: list, on_reject: str, stopped: str, prompt: str, id, seconds: float):
        """The :class:`VerificationResult` of a finished attempt loop (applies the policy to the last attempt)."""
        last, v = attempts[-1], attempts[-1].verdict
        policy = on_reject if on_reject != "reask" else self.settings.reask_fallback
        if v.verified:
            status, shown = "verified", last.text
        elif policy == "return":
            status, shown = "unverified", last.text
        else:
            abstain = ABSTAIN_TEXT if self.settings.abstain_text is None else self.settings.abstain_text
            status, shown = "abstained", fill(abstain, reason=v.reason)
        return VerificationResult(
            id=id, prompt=prompt, text=shown, answer=last.text, parsed=v.parsed, verified=v.verified,
            status=status, p_lower=v.p_lower, reason=v.reason, exemplars=v.exemplars, attempts=attempts,
            on_reject=on_reject, stopped=stopped, decoding=self.decoding,
            tokens=sum(a.tokens for a in attempts), seconds=seconds,
        )


def _attempt_record(k: int, dec, verdict: Verdict, reask_message, seconds: float) -> Attempt:
    """Attempt ``k`` from its decoding and its verdict."""
    return Attempt(
        attempt=k, text=dec.text, verdict=verdict, tokens=len(dec.token_ids), prompt_tokens=len(dec.prompt_ids),
        stop_reason=dec.stop_reason, seconds=seconds, generation_seconds=dec.seconds, reask_message=reask_message,
        token_ids=list(dec.token_ids), first_token_seconds=dec.first_token_seconds,
        cached_prompt_tokens=dec.cached_prompt_tokens, logprobs=dec.logprobs,
    )
