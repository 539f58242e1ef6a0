"""Chat prompts: messages -> templated text -> token ids, one way for the router and ``LLM``."""

from __future__ import annotations

from collections.abc import Sequence

import jinja2


def render_chat_prompt(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True
                       ) -> tuple[str, list[int]]:
    """Apply the tokenizer's chat template and tokenize the result.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: ``{"role", "content"[, "name"]}`` dicts, content already flattened to text.
        add_generation_prompt: end with the assistant turn's opening.

    Returns:
        (templated text, its token ids). The template writes any BOS or special
        tokens as text, so the tokenizer adds none of its own.

    Raises:
        ValueError: the template cannot be applied (no template, a template error)
            or the result is empty.
    """
    try:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except (ValueError, jinja2.TemplateError) as e:
        raise ValueError(f"cannot apply the chat template: {e}") from e
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError("the chat prompt is empty")
    return text, ids
