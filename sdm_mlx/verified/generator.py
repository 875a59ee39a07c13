"""``VerifiedGenerator``: greedy generation, verification of each answer, and the branching policy.

The policy on a rejected answer (``on_reject``):

* ``"abstain"`` — one attempt; the result's ``text`` is :data:`ABSTAIN_TEXT`
  (a clear "not verified" answer; the generated answer stays in ``answer``
  and ``attempts``);
* ``"return"``  — one attempt; ``text`` is the answer, flagged ``verified =
  false`` / ``status = "unverified"``;
* ``"reask"``   — re-prompt with the previous answer and ask for a re-check
  (:data:`REASK_TEMPLATE`), up to ``max_attempts`` attempts in total, stopping
  at the first verified answer; if none is verified the result falls back to
  ``reask_fallback`` (``"abstain"``, default, or ``"return"`` the last answer).
  Decoding is greedy, so a re-ask prompt identical to one already used would
  repeat its answer: the loop then stops early (``stopped =
  "repeated_prompt"``).

The re-ask prompt is a multi-turn chat: ``[system], user: <the original user
message>, assistant: <previous answer>, user: <REASK_TEMPLATE with {previous},
{reason}, {attempt} substituted>`` with the generation prompt (without a chat
template: the texts joined by newlines).  Every attempt's answer is verified
against the **original** prompt — features of original prompt + answer — since
that is the distribution the verification layer was trained on.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

from ..llm import embed as _embed
from .config import ON_REJECT, GenerationConfig
from .decoding import GreedyDecoder
from .verification import AnswerVerifier, Verdict
from ..errors import InputError

STATUSES = ("verified", "unverified", "abstained")
STOPPED = ("verified", "rejected", "max_attempts", "repeated_prompt")

#: Re-ask user message (slots: ``{previous}`` the previous answer, ``{reason}`` why it was rejected,
#: ``{attempt}`` the number of the attempt being asked for); plain substring replacement.
REASK_TEMPLATE = (
    "Your previous answer was: {previous}\n"
    "It could not be verified. Re-check the request and your answer carefully. If the answer is wrong, "
    "correct it. Reply with only the answer, in the requested JSON format."
)
#: The ``text`` of an abstention (slot ``{reason}``).
ABSTAIN_TEXT = "NOT VERIFIED: the answer was withheld because the verification layer could not verify it ({reason})."


def _fill(template: str, **slots) -> str:
    for k, v in slots.items():
        template = template.replace("{" + k + "}", str(v))
    return template


@dataclass
class Attempt:
    """One generate-then-verify attempt."""

    attempt: int
    text: str
    parsed: dict | None
    verified: bool
    p_lower: float | None
    reason: str | None
    exemplars: list
    tokens: int
    prompt_tokens: int
    stop_reason: str
    seconds: float
    generation_seconds: float
    verification_seconds: float
    verifier: dict = field(default_factory=dict)
    reask_message: str | None = None
    token_ids: list = field(default_factory=list)
    row: dict = field(default_factory=dict, repr=False)  # the verifier's full per-row output (not in to_dict)

    def to_dict(self) -> dict:
        return {
            "attempt": self.attempt, "text": self.text, "parsed": self.parsed, "verified": self.verified,
            "p_lower": self.p_lower, "reason": self.reason, "exemplars": self.exemplars, "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens, "stop_reason": self.stop_reason,
            "seconds": round(self.seconds, 6), "generation_seconds": round(self.generation_seconds, 6),
            "verification_seconds": round(self.verification_seconds, 6),
            "tokens_per_second": (round(self.tokens / self.generation_seconds, 3)
                                  if self.generation_seconds > 0 else None),
            "verifier": self.verifier, "reask_message": self.reask_message, "token_ids": self.token_ids,
        }


@dataclass
class VerificationResult:
    """The outcome for one prompt (JSON schema: :mod:`sdm_mlx.verified`)."""

    id: object
    prompt: str
    text: str
    answer: str
    parsed: dict | None
    verified: bool
    status: str
    p_lower: float | None
    reason: str | None
    exemplars: list
    attempts: list
    on_reject: str
    stopped: str
    decoding: str
    tokens: int
    seconds: float

    def to_dict(self) -> dict:
        return {
            "id": self.id, "prompt": self.prompt, "text": self.text, "answer": self.answer, "parsed": self.parsed,
            "verified": self.verified, "status": self.status, "p_lower": self.p_lower, "reason": self.reason,
            "exemplars": self.exemplars, "on_reject": self.on_reject, "stopped": self.stopped,
            "decoding": self.decoding, "n_attempts": len(self.attempts), "tokens": self.tokens,
            "seconds": round(self.seconds, 6), "attempts": [a.to_dict() for a in self.attempts],
        }


def _load_model(config: GenerationConfig, head_config: dict | None, model, tokenizer):
    """``(model, tokenizer)``: the ones given, else loaded from ``config.model`` or the head's base model."""
    if model is not None:
        if tokenizer is None:
            raise InputError("pass the tokenizer together with the model")
        return model, tokenizer
    path = config.model if config.model is not None else (head_config or {}).get("base_model")
    if path is None:
        raise InputError("give model_path (or a head whose config names its base model)")
    return _embed.load_model(path)


def _load_heads(config: GenerationConfig, head_config: dict, model, tokenizer):
    """The head directory's :class:`~sdm_mlx.network.heads.SDMHeads` on ``model`` (warns on another base model)."""
    from ..network.artifact import load_network

    if config.model is not None and os.path.exists(os.path.expanduser(str(config.model))):
        base = head_config["base_model"]
        if os.path.abspath(os.path.expanduser(str(config.model))) != base:
            warnings.warn(f"the head {config.head} was trained on {base}; using the model {config.model}",
                          stacklevel=3)
    return load_network(config.head, model=model, tokenizer=tokenizer, load_verifier=False).heads


def _load_verifier(config: GenerationConfig, head_config: dict | None):
    """The saved ``SDMEstimator`` of ``config.verifier``, else of the head directory's ``verifier`` entry."""
    path = config.verifier
    if path is None and head_config is not None:
        path = os.path.join(os.path.abspath(os.fspath(config.head)), head_config["verifier"])
    if path is None:
        raise InputError("give verifier_path (a saved SDMEstimator) or a head directory holding one")
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
    **settings
        Fields of ``GenerationConfig``: ``system``, ``prompt_template`` (``{document}`` slot),
        ``use_chat_template`` (how a prompt is templated: use the settings the verifier's data were built
        with), ``max_tokens`` per attempt, ``delimiter`` (closing delimiter of the verification unit),
        ``max_length`` (kept positions of the features, DESIGN #21), ``n_exemplars``, ``require_json``,
        ``on_reject``, ``max_attempts``, ``reask_template``, ``reask_fallback``, ``abstain_text``.

    Attributes
    ----------
    config : GenerationConfig
        The settings in force.
    model, tokenizer, heads, estimator :
        The loaded language model and tokenizer, the SDM heads (None: plain decoding) and the verification
        layer's ``SDMEstimator``.
    decoder : GreedyDecoder
        Greedy decoding up to the verification unit; ``decoding`` is its mode, "plain" or "joint".
    verifier : AnswerVerifier
        Features of an answer -> the estimator's verdict.
    system, prompt_template, use_chat_template, max_tokens, delimiter, max_length :
        The templating and decoding settings resolved against the head's stored settings.
    on_reject, max_attempts, reask_template, reask_fallback, abstain_text :
        What happens to an answer that is not verified.
    """

    def __init__(self, model_path=None, verifier_path=None, head_path=None, *, config: GenerationConfig | None = None,
                 model=None, tokenizer=None, verifier=None, heads=None, **settings):
        paths = {k: v for k, v in (("model", model_path), ("verifier", verifier_path), ("head", head_path))
                 if v is not None}
        self.config = config = dataclasses.replace(config or GenerationConfig(), **paths, **settings)
        config.validate()
        head_config = None
        if config.head is not None:
            from ..network.artifact import read_network_config

            head_config = read_network_config(config.head)
        model, tokenizer = _load_model(config, head_config, model, tokenizer)
        if config.head is not None and heads is None:
            heads = _load_heads(config, head_config, model, tokenizer)
        if verifier is None:
            verifier = _load_verifier(config, head_config)
        self._settle(config, (head_config or {}).get("settings"), model, tokenizer, heads, verifier)

    @classmethod
    def from_config(cls, config: GenerationConfig, **loaded) -> "VerifiedGenerator":
        """A generator built from ``config`` (``loaded``: already loaded model/tokenizer/verifier/heads)."""
        return cls(config=config, **loaded)

    def _settle(self, config: GenerationConfig, head_settings: dict | None, model, tokenizer, heads, verifier):
        """Resolve the head-dependent settings and build the decoder and the verifier."""
        t = config.templating(head_settings)
        self.system, self.prompt_template, self.use_chat_template = (t["system"], t["prompt_template"],
                                                                     t["use_chat_template"])
        self.max_tokens, self.delimiter, self.max_length = t["max_tokens"], t["delimiter"], t["max_length"]
        if self.max_tokens < 1 or self.max_length < 1:
            raise InputError("max_tokens and max_length must be >= 1")
        self.on_reject, self.max_attempts = config.on_reject, int(config.max_attempts)
        self.reask_fallback = config.reask_fallback
        self.reask_template = REASK_TEMPLATE if config.reask_template is None else config.reask_template
        self.abstain_text = ABSTAIN_TEXT if config.abstain_text is None else config.abstain_text
        self.model, self.tokenizer, self.heads, self.estimator = model, tokenizer, heads, verifier
        self.decoder = GreedyDecoder(model, tokenizer, heads=heads, delimiter=self.delimiter, features=True,
                                     max_length=self.max_length)
        self.decoding = self.decoder.mode  # "plain" | "joint"
        self.verifier = AnswerVerifier(model, tokenizer, verifier, delimiter=self.delimiter,
                                       max_length=self.max_length, n_exemplars=config.n_exemplars,
                                       require_json=config.require_json)

    # -- prompts ----------------------------------------------------------------------------------
    def user_message(self, prompt: str) -> str:
        return self.prompt_template.replace("{document}", prompt) if self.prompt_template else prompt

    def prompt_text(self, prompt: str) -> str:
        """The templated generation prompt for a user message / document (as ``sdm-mlx embed`` templates it)."""
        return _embed.chat_text(self.tokenizer, prompt, system=self.system, prompt_template=self.prompt_template,
                                use_chat_template=self.use_chat_template)

    def reask_text(self, prompt: str, previous: str, reason: str | None, attempt: int) -> tuple[str, str]:
        """``(generation prompt, re-ask message)`` asking to re-check ``previous`` (see the module docstring)."""
        message = _fill(self.reask_template, previous=previous, reason=reason or "", attempt=attempt)
        user = self.user_message(prompt)
        if not self.use_chat_template:
            head = self.system + "\n" if self.system else ""
            return f"{head}{user}{previous}\n{message}\n", message
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": previous},
                     {"role": "user", "content": message}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, message

    # -- one prompt -------------------------------------------------------------------------------
    def verify(self, prompt: str, answer_ids, text: str | None = None, id=None) -> Verdict:
        """Verify token ids ``answer_ids`` as the answer to ``prompt`` (user message / document).

        Pass the ids as generated (``Attempt.token_ids``): re-encoding the answer text can split it into
        different tokens (e.g. ``"}`` vs ``"`` + ``}``), which changes the features and hence the verdict.
        """
        ids = _embed.encode(self.tokenizer, self.prompt_text(prompt))
        return self.verifier(ids, answer_ids, self.tokenizer.decode(list(answer_ids)) if text is None else text, id)

    def generate(self, prompt: str, id=None, *, on_text: Callable[[str], None] | None = None,
                 on_attempt_start: Callable[[int], None] | None = None,
                 on_attempt: Callable[[Attempt], None] | None = None, **options) -> VerificationResult:
        """Generate, verify and branch for one prompt (the user message / document of the template).

        Callbacks: ``on_text(segment)`` streams the answer text of every attempt,
        ``on_attempt_start(k)`` before attempt ``k`` (1-based), ``on_attempt(attempt)`` after its verdict.
        ``options``: per-call overrides of :meth:`generate_ids`.
        """
        if not isinstance(prompt, str) or not prompt:
            raise InputError("prompt must be a non-empty string")
        base_ids = _embed.encode(self.tokenizer, self.prompt_text(prompt))

        def reask(previous: str, reason: str | None, attempt: int) -> tuple[list, str]:
            text, message = self.reask_text(prompt, previous, reason, attempt)
            return _embed.encode(self.tokenizer, text), message

        return self.generate_ids(base_ids, reask, prompt=prompt, id=id, on_text=on_text,
                                 on_attempt_start=on_attempt_start, on_attempt=on_attempt, **options)

    def generate_ids(self, base_ids, reask: Callable[[str, str | None, int], tuple[list, str]] | None, *,
                     prompt: str = "", id=None, on_text: Callable[[str], None] | None = None,
                     on_attempt_start: Callable[[int], None] | None = None,
                     on_attempt: Callable[[Attempt], None] | None = None, on_reject: str | None = None,
                     max_attempts: int | None = None, max_tokens: int | None = None, stop=(),
                     temperature: float = 0.0) -> VerificationResult:
        """The generate-verify-branch loop on an already templated prompt (token ids ``base_ids``).

        ``reask(previous, reason, attempt) -> (prompt ids, re-ask message)`` builds the prompt of a re-ask
        attempt (required with ``on_reject="reask"``); every attempt is verified against ``base_ids``.
        ``on_reject``, ``max_attempts``, ``max_tokens`` override the generator's settings for this call;
        ``stop`` (strings) and ``temperature`` go to :class:`~.decoding.GreedyDecoder`.  ``prompt`` is only
        recorded in the result.
        """
        on_reject = self.on_reject if on_reject is None else on_reject
        max_attempts = self.max_attempts if max_attempts is None else int(max_attempts)
        max_tokens = self.max_tokens if max_tokens is None else int(max_tokens)
        if on_reject not in ON_REJECT:
            raise InputError(f"on_reject must be one of {ON_REJECT}, got {on_reject!r}")
        if max_attempts < 1 or max_tokens < 1:
            raise InputError("max_attempts and max_tokens must be >= 1")
        if on_reject == "reask" and reask is None:
            raise InputError("on_reject='reask' needs a reask prompt builder")
        base_ids = [int(t) for t in base_ids]
        decode_options = {k: v for k, v in (("stop", list(stop or ())), ("temperature", temperature)) if v}
        t_start = time.perf_counter()
        gen_ids, reask_message = base_ids, None
        used = {tuple(base_ids)}
        limit = max_attempts if on_reject == "reask" else 1
        attempts: list[Attempt] = []
        stopped = "rejected"
        for k in range(1, limit + 1):
            if on_attempt_start is not None:
                on_attempt_start(k)
            att = self._attempt(k, gen_ids, base_ids, max_tokens, on_text, decode_options, id=id,
                                reask_message=reask_message)
            attempts.append(att)
            if on_attempt is not None:
                on_attempt(att)
            if att.verified:
                stopped = "verified"
                break
            if k == limit:
                stopped = "max_attempts" if on_reject == "reask" else "rejected"
                break
            gen_ids, reask_message = reask(att.text, att.reason, k + 1)
            if tuple(gen_ids) in used:
                stopped = "repeated_prompt"
                break
            used.add(tuple(gen_ids))
        return self._result(attempts, on_reject, stopped, prompt, id, time.perf_counter() - t_start)

    def _attempt(self, k: int, gen_ids, base_ids, max_tokens: int, on_text, decode_options: dict, *, id,
                 reask_message) -> Attempt:
        """Attempt ``k``: decode from ``gen_ids`` and verify the output against the original ``base_ids``."""
        t0 = time.perf_counter()
        dec = self.decoder(gen_ids, max_tokens, on_text, **decode_options)
        # the first attempt's decoding already computed the verifier input; a re-asked attempt is verified
        # against the original prompt, which its decoding never saw: one feature pass
        own = (dec.features, dec.feature_info) if gen_ids is base_ids else None
        verdict = self.verifier(base_ids, dec.token_ids, dec.text, id, **({"features": own} if own else {}))
        return Attempt(
            attempt=k, text=dec.text, parsed=verdict.parsed, verified=verdict.verified, p_lower=verdict.p_lower,
            reason=verdict.reason, exemplars=verdict.exemplars, tokens=len(dec.token_ids),
            prompt_tokens=len(gen_ids), stop_reason=dec.stop_reason, seconds=time.perf_counter() - t0,
            generation_seconds=dec.seconds, verification_seconds=verdict.seconds, verifier=verdict.verifier,
            reask_message=reask_message, token_ids=list(dec.token_ids), row=getattr(verdict, "row", {}),
        )

    def _result(self, attempts: list, on_reject: str, stopped: str, prompt: str, id, seconds: float):
        """The :class:`VerificationResult` of a finished attempt loop (applies the policy to the last attempt)."""
        last = attempts[-1]
        policy = on_reject if on_reject != "reask" else self.reask_fallback
        if last.verified:
            status, shown = "verified", last.text
        elif policy == "return":
            status, shown = "unverified", last.text
        else:
            status, shown = "abstained", _fill(self.abstain_text, reason=last.reason)
        return VerificationResult(
            id=id, prompt=prompt, text=shown, answer=last.text, parsed=last.parsed, verified=last.verified,
            status=status, p_lower=last.p_lower, reason=last.reason, exemplars=last.exemplars, attempts=attempts,
            on_reject=on_reject, stopped=stopped, decoding=self.decoding,
            tokens=sum(a.tokens for a in attempts), seconds=seconds,
        )
