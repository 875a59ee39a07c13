"""Verified generation: greedy decoding, SDM verification of each answer, abstain / re-ask / return.

Paper §"SDM Network Test-time Generation": generate greedily (over the joint
neg+pos distribution when a positive head is attached — token = argmax index
mod |V| — plain greedy otherwise) up to the verification unit (the closing
``}`` of the JSON answer, EOS, or max tokens), verify the answer with the
verification layer's index-conditional estimate p̂_lower, then branch.

    from sdm_mlx.verified import VerifiedGenerator
    gen = VerifiedGenerator("path/to/model", "path/to/verifier", head_path=None,
                            on_reject="reask", max_attempts=3,
                            system="You are a helpful AI assistant.",
                            prompt_template='... Respond using the JSON: {"sentiment": str}. REVIEW: {document}')
    result = gen.generate("A warm and funny film.")      # -> VerificationResult
    result.verified, result.text, result.p_lower, result.reason, result.to_dict()

Modules (the decoding loop itself is :mod:`sdm_mlx.decoding`): :mod:`.prompts` (``PromptBuilder``: prompts and re-ask prompts, shared with
``serve``), :mod:`.runner` (``BatchRunner``: many prompts' attempts at once), :mod:`.verification`
(``AnswerVerifier``, ``Verdict``), :mod:`.generator` (``VerifiedGenerator``),
:mod:`.outcome` (``VerificationResult``, ``Attempt``).

May import: layers 0-6 (up to :mod:`sdm_mlx.network`: the optional positive head and the answer parsing) and
mlx-lm.  Nothing is imported until used (PEP 562), so ``GenerationConfig`` is read at ``sdm-mlx --help``
without MLX.

JSON output schema (``VerificationResult.to_dict()``; one line per prompt of ``sdm-mlx generate``)
---------------------------------------------------------------------------------------------------
::

    id              any      the input row's id (null for a single --prompt)
    prompt          str      the user message / document (before templating)
    text            str      what to show: the verified answer; with status "unverified" the
                             unverified answer; with "abstained" the not-verified message
    answer          str      the generated answer of the final attempt (always the model's text)
    parsed          obj|null first JSON object of `answer` (null: none / not parseable)
    verified        bool     verification layer: admitted (p_lower, not ⊥) AND ŷ = 1 AND parsed
    status          str      "verified" | "unverified" (on_reject=return) | "abstained"
    p_lower         num|null p̂_lower of the verifier's predicted class for the final answer
    reason          str|null null when verified; else "parse_failure", an estimator rejection
                             ("ood_distance", "ood_similarity", "argmax_flip",
                             "below_model_min_qbin", "below_robust_min_qbin", "below_threshold_psi",
                             "no_valid_threshold", "no_robust_threshold") or "predicted_unverified"
    exemplars       list     nearest training exemplars of the final answer:
                             {id, label, predicted_label, squared_distance}
    on_reject       str      "abstain" | "reask" | "return"
    stopped         str      "verified" | "rejected" (one attempt) | "max_attempts" | "repeated_prompt"
    decoding        str      "plain" (mlx-lm greedy) | "joint" (neg+pos head)
    n_attempts      int
    tokens          int      generated tokens over all attempts
    seconds         num      wall time for this prompt
    attempts        list     one object per attempt, in order:
        attempt            int       1-based
        text, parsed, verified, p_lower, reason, exemplars   as above, for this attempt
        tokens             int       generated tokens (EOS not counted)
        prompt_tokens      int       tokens of the generation prompt of this attempt
        stop_reason        str       "delimiter" | "eos" | "max_tokens" | "stop" (a stop string; serve)
        first_token_seconds num      time to the first generated token (prefill included)
        cached_prompt_tokens int     prompt tokens taken from the prompt cache (not recomputed)
        logprobs           list      only with sampling.logprobs: {token, id, logprob[, top_logprobs]} per token
        seconds            num       generation + verification
        generation_seconds, verification_seconds, tokens_per_second
        verifier           obj       prediction, admitted, rejection_reason, p_lower, p_centroid,
                                     p_upper, q, d0 (squared L2), d, q_tilde_lower, hard_bin_lower,
                                     n_kept, delimiter_index, missing_delimiter, truncated
        reask_message      str|null  the re-ask user message (null for attempt 1)
        token_ids          list      the generated token ids (verify() these, not re-encoded text)
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "GenerationConfig": "config", "ON_REJECT": "config",
    "ABSTAIN_TEXT": "generator", "REASK_TEMPLATE": "generator", "VerifiedGenerator": "generator",
    "Attempt": "outcome", "VerificationResult": "outcome",
    "PromptBuilder": "prompts", "BatchRunner": "runner", "Cancelled": "runner",
    "PARSE_FAILURE": "verification", "PREDICTED_UNVERIFIED": "verification", "AnswerVerifier": "verification",
    "Verdict": "verification", "VerifyItem": "verification",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
