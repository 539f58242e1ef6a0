"""Bad words (vLLM's ``bad_words``) as token ids, tokenized as vLLM does.

A word is banned at the start of the text and after a space: each word is
encoded without special tokens as written (its leading spaces stripped), and
again with one leading space. The spaced form is kept only when it is a
different word token of the same length (with tokenizers that mark a word
start, e.g. byte-level BPE's ``Ġ``); otherwise it adds nothing new.
"""

from __future__ import annotations

from collections.abc import Sequence


def bad_words_token_ids(tokenizer, bad_words: Sequence[str]) -> list[list[int]]:
    """Token-id sequences for ``SamplingParams.bad_words_token_ids``.

    Args:
        tokenizer: a Hugging Face tokenizer.
        bad_words: the words (or phrases) never to generate.

    Returns:
        one or two sequences per word (see the module docstring); empty encodings are dropped.
    """
    out: list[list[int]] = []
    for word in bad_words:
        word = word.lstrip()
        plain = tokenizer.encode(word, add_special_tokens=False)
        if not plain:
            continue
        out.append(plain)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
