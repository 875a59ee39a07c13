"""Generation prompts and re-ask prompts, built one way for ``generate``/``chat`` and for ``serve``/``mcp``.

* A **document** (``generate``, ``chat``): the user message is the prompt
  template with its ``{document}`` slot filled; the system message and the
  tokenizer's chat template are applied (:func:`sdm_mlx.llm.tokens.chat_text`) —
  the templating the verifier's training data were built with.
* **Chat messages** (``serve``): the system message is prepended when the
  request has none, the last user message is placed in the template's
  ``{document}`` slot, then the chat template adds the generation prompt
  (without a chat template: the contents joined by newlines).  For a
  one-user-message chat this is exactly the document's prompt.
* **Raw text** (``/v1/completions``): used as is.

A **re-ask** continues the conversation: ``[system], user: <original user
message>, assistant: <previous answer>, user: <re-ask message>`` plus the
generation prompt (without a chat template: the prompt text, the previous
answer and the re-ask message joined by newlines).
"""

from __future__ import annotations

from ..llm import embed as _embed
from ..llm.tokens import check_template_kwargs, render_chat

#: Re-ask user message (slots: ``{previous}`` the previous answer, ``{reason}`` why it was rejected,
#: ``{attempt}`` the number of the attempt being asked for); plain substring replacement.
REASK_TEMPLATE = (
    "Your previous answer was: {previous}\n"
    "It could not be verified. Re-check the request and your answer carefully. If the answer is wrong, "
    "correct it. Reply with only the answer, in the requested JSON format."
)


def fill(template: str, **slots) -> str:
    """``template`` with each ``{name}`` slot replaced by ``str(value)`` (plain substring replacement)."""
    for k, v in slots.items():
        template = template.replace("{" + k + "}", str(v))
    return template


class PromptBuilder:
    """The templating settings of one generator and the prompts built from them (see the module docstring)."""

    def __init__(self, tokenizer, *, system: str | None, prompt_template: str | None, use_chat_template: bool,
                 reask_template: str | None = None, template_kwargs: dict | None = None):
        self.tokenizer, self.system, self.prompt_template = tokenizer, system, prompt_template
        self.use_chat_template = bool(use_chat_template)
        self.reask_template = REASK_TEMPLATE if reask_template is None else reask_template
        #: chat-template variables of every prompt (``--chat-template-args``); a request's own override them
        self.template_kwargs = check_template_kwargs(template_kwargs, "chat_template_args") or {}

    def user_message(self, document: str) -> str:
        return self.prompt_template.replace("{document}", document) if self.prompt_template else document

    def messages(self, document: str) -> list:
        """The one-user-message chat of a document."""
        return [{"role": "user", "content": document}]

    def chat_messages(self, messages: list) -> list:
        """``messages`` with the system message and the prompt template applied (copies)."""
        out = [dict(m) for m in messages]
        if self.prompt_template:
            last = max(i for i, m in enumerate(out) if m["role"] == "user")
            out[last]["content"] = self.user_message(out[last]["content"])
        if self.system and not any(m["role"] == "system" for m in out):
            out.insert(0, {"role": "system", "content": self.system})
        return out

    def render(self, messages: list, template_kwargs: dict | None = None, tokenizer=None) -> str:
        """Already templated messages as the generation prompt text; ``template_kwargs`` go to the tokenizer's
        chat template (e.g. ``{"enable_thinking": False}``, as ``chat_template_kwargs`` in mlx_lm.server).
        A chat template that fails on them raises :class:`~sdm_mlx.errors.InputError`.  ``tokenizer``: a copy
        of this builder's tokenizer to render with (another thread's)."""
        if not self.use_chat_template:
            return "\n".join(m["content"] for m in messages)
        return render_chat(tokenizer or self.tokenizer, messages, {**self.template_kwargs, **(template_kwargs or {})})

    def document_text(self, document: str) -> str:
        """The generation prompt of a document (as ``sdm-mlx embed`` templates it, with this builder's
        template variables)."""
        return _embed.chat_text(self.tokenizer, document, system=self.system, prompt_template=self.prompt_template,
                                use_chat_template=self.use_chat_template, template_kwargs=self.template_kwargs)

    def prompt_text(self, messages: list | None = None, prompt: str | None = None,
                    template_kwargs: dict | None = None, tokenizer=None) -> str:
        """The generation prompt of a chat (``messages``) or of raw text (``prompt``)."""
        return prompt if messages is None else self.render(self.chat_messages(messages), template_kwargs, tokenizer)

    def encode(self, text: str) -> list:
        return _embed.encode(self.tokenizer, text)

    def reask(self, previous: str, reason: str | None, attempt: int, *, messages: list | None = None,
              prompt: str | None = None, template_kwargs: dict | None = None) -> tuple[list, str]:
        """``(prompt token ids, re-ask message)`` asking to re-check ``previous`` for a chat or a raw prompt."""
        message = fill(self.reask_template, previous=previous, reason=reason or "", attempt=attempt)
        if messages is None or not self.use_chat_template:
            base = prompt if messages is None else self.render(self.chat_messages(messages))
            return self.encode(f"{base}{previous}\n{message}\n"), message
        turns = self.chat_messages(messages) + [{"role": "assistant", "content": previous},
                                                {"role": "user", "content": message}]
        return self.encode(self.render(turns, template_kwargs)), message

    def reasker(self, *, messages: list | None = None, prompt: str | None = None,
                template_kwargs: dict | None = None):
        """``build(previous, reason, attempt) -> (ids, message)`` for one request."""
        return lambda previous, reason, attempt: self.reask(previous, reason, attempt, messages=messages,
                                                            prompt=prompt, template_kwargs=template_kwargs)
