"""What one verified generation produced: its attempts and its result (JSON schema: :mod:`sdm_mlx.verified`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .verification import Verdict

STATUSES = ("verified", "unverified", "abstained")
STOPPED = ("verified", "rejected", "max_attempts", "repeated_prompt")
#: The ``text`` of an abstention (slot ``{reason}``).
ABSTAIN_TEXT = "NOT VERIFIED: the answer was withheld because the verification layer could not verify it ({reason})."


@dataclass
class Attempt:
    """One generate-then-verify attempt: what decoding produced, and the attempt's :class:`Verdict` (held, not
    copied: read ``attempt.verdict.verified``, ``.p_lower``, ``.reason``, ...; code that needs a verdict takes
    the verdict)."""

    attempt: int
    text: str
    verdict: "Verdict"
    tokens: int
    prompt_tokens: int
    stop_reason: str
    seconds: float
    generation_seconds: float
    reask_message: str | None = None
    token_ids: list = field(default_factory=list)
    first_token_seconds: float | None = None
    cached_prompt_tokens: int = 0
    logprobs: list | None = None  # with sampling.logprobs: one record per generated token

    def to_dict(self) -> dict:
        v = self.verdict  # its ``row`` (the verifier's full per-row output) is not in the dict
        return {
            "attempt": self.attempt, "text": self.text, "parsed": v.parsed, "verified": v.verified,
            "p_lower": v.p_lower, "reason": v.reason, "exemplars": v.exemplars, "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens, "stop_reason": self.stop_reason,
            "seconds": round(self.seconds, 6), "generation_seconds": round(self.generation_seconds, 6),
            "verification_seconds": round(v.seconds, 6),
            "tokens_per_second": (round(self.tokens / self.generation_seconds, 3)
                                  if self.generation_seconds > 0 else None),
            "verifier": v.verifier, "reask_message": self.reask_message, "token_ids": self.token_ids,
            "first_token_seconds": (None if self.first_token_seconds is None
                                    else round(self.first_token_seconds, 6)),
            "cached_prompt_tokens": self.cached_prompt_tokens,
            **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
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
