"""Settings of verified generation (:class:`sdm_mlx.verified.VerifiedGenerator`) in one dataclass.

Each field carries its default and help text (:func:`sdm_mlx.settings.option`); the options and
YAML keys of ``sdm-mlx generate``, ``chat``, ``serve`` and ``mcp`` are generated from it and the
generator is built from it (:meth:`VerifiedGenerator.from_config`).  ``None`` in a templating field
means "the positive head's stored setting, else the built-in default" (:data:`BUILTIN`).  No MLX
import here, so ``--help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..llm import embed as _embed
from ..settings import option
from ..errors import InputError

#: What happens to a rejected answer (see :mod:`sdm_mlx.verified.generator`).
ON_REJECT = ("abstain", "reask", "return")
#: The result when no re-asked attempt is verified.
REASK_FALLBACK = ("abstain", "return")

#: Defaults of the head-dependent fields when neither the caller nor a head sets them
#: (keys: the head's stored setting names).
BUILTIN = {"system": None, "prompt_template": None, "use_chat_template": True, "max_new_tokens": 256,
           "delimiter": _embed.DEFAULT_DELIMITER, "max_length": _embed.DEFAULT_MAX_LENGTH}

_HEAD = "the head's, else "


@dataclass(frozen=True)
class GenerationConfig:
    """How answers are generated, verified and what happens to a rejected one."""

    # model, verifier and positive head
    model: str | None = option(None, "mlx-lm model directory or hub id", short="-m", none_means="with --head: "
                               "the head's base model")
    verifier: str | None = option(None, "verification layer: a saved SDMEstimator directory trained on features "
                                  "of force-decoded prompt + completion", none_means="with --head: HEAD/verifier")
    head: str | None = option(None, "SDM-network directory with the positive head W_pos (joint neg+pos decoding; "
                              "its stored settings become the defaults); --adapter-path is mlx-lm's name: like an "
                              "adapter it holds trained weights applied on top of the frozen --model",
                              aliases=("--adapter-path",))
    # prompts
    system: str | None = option(None, "system message, added to chats that have none", aliases=("--system-prompt",),
                                none_means=_HEAD + "none")
    prompt_template: str | None = option(
        None, "user message (in a chat: the last one) with a {document} slot; '{document}' sends the prompt "
              "unchanged", none_means=_HEAD + "the prompt itself")
    use_chat_template: bool | None = option(
        None, "wrap prompts in the tokenizer's chat template (--no-chat-template / --ignore-chat-template: raw "
              "text prompts, chat messages joined as raw text, for base models)", flag="--chat-template",
        none_means=_HEAD + "on")
    # decoding and verification
    max_tokens: int | None = option(None, "max generated tokens per attempt",
                                    none_means=f"the head's max_new_tokens, else {BUILTIN['max_new_tokens']}")
    delimiter: str | None = option(None, "closing delimiter of the verification unit",
                                   none_means=f"{_HEAD}'{BUILTIN['delimiter']}'")
    max_length: int | None = option(None, "kept positions of the verifier features",
                                    none_means=_HEAD + str(BUILTIN["max_length"]))
    chat_template_args: str | None = option(
        None, "JSON object of chat-template variables for every prompt, e.g. '{\"enable_thinking\": false}' "
              "(mlx-lm's --chat-template-args / --chat-template-config; a server request's chat_template_kwargs "
              "override them)", aliases=("--chat-template-config",), none_means="none")
    n_exemplars: int = option(5, "nearest training exemplars reported per answer")
    prompt_cache_bytes: int = option(256 << 20, "bytes of the prompt-prefix cache shared across prompts (the "
                                                "system/instruction/template prefix is prefilled once; 0: off)")
    require_json: bool = option(True, "require a parseable JSON object for verification (--allow-non-json: only "
                                      "the closing delimiter)")
    # policy on a rejected answer
    on_reject: str = option("abstain", "rejected answer: abstain with a not-verified text, re-ask for a re-check, "
                                       "or return it flagged unverified", choices=ON_REJECT)
    max_attempts: int = option(3, "attempts in total with --on-reject reask")
    reask_fallback: str = option("abstain", "result when no re-asked attempt is verified", choices=REASK_FALLBACK)
    reask_template: str | None = option(
        None, "re-ask user message with {previous} (and optional {reason}, {attempt}) slots",
        none_means="sdm_mlx.verified.REASK_TEMPLATE")
    abstain_text: str | None = option(None, "text of an abstention ({reason} slot)", cli=False,
                                      none_means="sdm_mlx.verified.ABSTAIN_TEXT")

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent setting."""
        if self.on_reject not in ON_REJECT:
            raise InputError(f"on_reject must be one of {ON_REJECT}, got {self.on_reject!r}")
        if self.reask_fallback not in REASK_FALLBACK:
            raise InputError(f"reask_fallback must be one of {REASK_FALLBACK}, got {self.reask_fallback!r}")
        if self.prompt_template is not None and "{document}" not in self.prompt_template:
            raise InputError("prompt_template must contain a {document} slot")
        if int(self.max_attempts) < 1:
            raise InputError("max_attempts must be >= 1")
        if self.n_exemplars < 0:
            raise InputError("n_exemplars must be >= 0")
        if int(self.prompt_cache_bytes) < 0:
            raise InputError("prompt_cache_bytes must be >= 0 (0: no prompt cache)")
        for name in ("max_tokens", "max_length"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise InputError(f"{name} must be >= 1, got {value!r}")
        self.template_kwargs()

    def template_kwargs(self) -> dict | None:
        """:attr:`chat_template_args` parsed (``ValueError`` naming it when it is not a JSON object of
        template variables)."""
        import json

        from ..llm.tokens import check_template_kwargs

        if self.chat_template_args is None:
            return None
        try:
            value = json.loads(self.chat_template_args)
        except ValueError as e:
            raise InputError(f"chat_template_args is not JSON: {e}") from None
        return check_template_kwargs(value, "chat_template_args")

    def templating(self, head_settings: dict | None = None) -> dict:
        """The head-dependent settings, resolved: given here > the head's stored ``settings`` > :data:`BUILTIN`
        (keys: ``system``, ``prompt_template``, ``use_chat_template``, ``max_tokens``, ``delimiter``,
        ``max_length``)."""
        stored = head_settings or {}
        given = {"system": self.system, "prompt_template": self.prompt_template,
                 "use_chat_template": self.use_chat_template, "max_new_tokens": self.max_tokens,
                 "delimiter": self.delimiter, "max_length": self.max_length}
        out = {k: v if v is not None else stored.get(k, BUILTIN[k]) for k, v in given.items()}
        out["max_tokens"] = int(out.pop("max_new_tokens"))
        out["use_chat_template"] = bool(out["use_chat_template"])
        out["max_length"] = int(out["max_length"])
        return out


def add_sampling_arguments(p, *, per_request: bool = False) -> None:
    """mlx-lm's sampling flags (``--temp``, ``--top-p``, ``--top-k``, ``--min-p``, ``--xtc-probability``,
    ``--xtc-threshold``, ``--seed``) and the repetition penalty for ``generate``/``chat`` (``per_request``: the
    server's settings, for the fields a request leaves out)."""
    title = "sampling (default: greedy; with --head drawn from the joint neg+pos SDM output)"
    if per_request:
        title += "; the server's settings: a request's own fields override them"
    g = p.add_argument_group(title)
    g.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.0,
                   help="sampling temperature (0: greedy argmax)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this mass")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * max p (0: off)")
    g.add_argument("--seed", type=int, default=None, help="random seed of the draws (same seed, same text)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="penalise the recent tokens' logits by this factor (> 1 discourages repeats)")
    g.add_argument("--repetition-context-size", type=int, default=20,
                   help="tokens the repetition penalty looks back over (0: all)")
    g.add_argument("--xtc-probability", type=float, default=0.0,
                   help="XTC: probability of removing the likely tokens but the least likely of them (draws only)")
    g.add_argument("--xtc-threshold", type=float, default=0.1, help="XTC: probability threshold, in [0, 0.5]")


def sampling_params(args):
    """The :class:`~sdm_mlx.decoding.sampling.SamplingParams` of parsed sampling flags (validated)."""
    from ..decoding.sampling import SamplingParams

    return SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, repetition_penalty=args.repetition_penalty,
                          repetition_context_size=args.repetition_context_size,
                          xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold).validate()
