"""Chat prompts: messages -> templated text -> token ids, one way for the router and ``LLM``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2


# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "tools", "documents",
                                      "return_dict", "return_tensors", "padding", "truncation", "max_length",
                                      "tokenizer_kwargs", "return_assistant_tokens_mask"})


def render_chat_prompt(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True,
                       continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
                       ) -> tuple[str, list[int]]:
    """Apply the tokenizer's chat template and tokenize the result.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: ``{"role", "content"[, "name"]}`` dicts, content already flattened to text.
        add_generation_prompt: end with the assistant turn's opening.
        continue_final_message: leave the last (assistant) message open, so the reply continues
            it (vLLM's and transformers' flag); not together with ``add_generation_prompt``.
        chat_template_kwargs: more variables for the template, as the checkpoint's template reads
            them (e.g. Qwen3's ``enable_thinking``); vLLM's request field of that name.

    Returns:
        (templated text, its token ids). The template writes any BOS or special
        tokens as text, so the tokenizer adds none of its own.

    Raises:
        ValueError: the template cannot be applied (no template, a template error), the result
            is empty, both flags are set, or ``chat_template_kwargs`` names one of
            ``apply_chat_template``'s own arguments (``RESERVED_TEMPLATE_KWARGS``).
    """
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: they are the request's own "
                         "fields or the server's")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                         "add_generation_prompt to false to continue the final message")
    try:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False,
                                             **extra)
    except (ValueError, jinja2.TemplateError) as e:
        raise ValueError(f"cannot apply the chat template: {e}") from e
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError("the chat prompt is empty")
    return text, ids
