"""CLI pieces shared by several verbs (no heavy imports: ``--help`` stays instant)."""

from __future__ import annotations


def add_model_arguments(p) -> None:
    """The model, verifier, positive head and prompt/verification options of ``generate``, ``chat``, ``serve``
    and ``mcp`` (mlx-lm's spellings next to ours)."""
    p.add_argument("-m", "--model",
                   help="mlx-lm model directory or hub id (default with --head: the head's base model)")
    p.add_argument("--verifier", help="verification layer: a saved SDMEstimator directory trained on features of "
                                      "force-decoded prompt + completion (default with --head: HEAD/verifier)")
    p.add_argument("--head", "--adapter-path", dest="head", default=None,
                   help="SDM-network directory with the positive head W_pos (joint neg+pos decoding; its stored "
                        "settings become the defaults); --adapter-path is mlx-lm's name: like an adapter it holds "
                        "trained weights applied on top of the frozen --model")
    p.add_argument("--system", "--system-prompt", dest="system", default=None,
                   help="system message, added to chats that have none (default: the head's, else none)")
    p.add_argument("--prompt-template", default=None,
                   help="user message (in a chat: the last one) with a {document} slot (default: the head's, else "
                        "the prompt itself; '{document}' sends it unchanged)")
    p.add_argument("--no-chat-template", "--ignore-chat-template", dest="no_chat_template", action="store_true",
                   help="raw text prompts, chat messages joined as raw text (base models)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max generated tokens per attempt (default: the head's max_new_tokens, else 256)")
    p.add_argument("--delimiter", default=None, help="closing delimiter of the verification unit (default '}')")
    p.add_argument("--max-length", type=int, default=None, help="kept positions of the verifier features (500)")
    p.add_argument("--n-exemplars", type=int, default=5, help="nearest training exemplars reported per answer")
    p.add_argument("--allow-non-json", action="store_true",
                   help="do not require a parseable JSON object (only the closing delimiter) for verification")


def add_policy_arguments(p, per_request: bool = False) -> None:
    """What happens to a rejected answer (``per_request``: the server's default, which a request overrides)."""
    note = " (the default; a request overrides it with sdm.on_reject / sdm.max_attempts)" if per_request else ""
    p.add_argument("--on-reject", choices=["abstain", "reask", "return"], default="abstain",
                   help="rejected answer: abstain with a not-verified text, re-ask for a re-check, or return it "
                        "flagged unverified" + note)
    p.add_argument("--max-attempts", type=int, default=3, help="attempts in total with --on-reject reask")
    p.add_argument("--reask-fallback", choices=["abstain", "return"], default="abstain",
                   help="result when no re-asked attempt is verified")
    p.add_argument("--reask-template", default=None,
                   help="re-ask user message with {previous} (and optional {reason}, {attempt}) slots "
                        "(default: sdm_mlx.verified.REASK_TEMPLATE)")
