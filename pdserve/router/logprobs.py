"""Log-probabilities: each token's own text and bytes, and OpenAI's two response shapes.

The decode worker sends one ``TokenLogprob`` per output token: the sampled
token's logprob and the top alternatives, from the model's raw distribution.
``outputs.ChoiceOutput`` decides which tokens' entries go out with which text;
this module only renders entries.

A token's text is the token decoded on its own (``tokenizer.decode([id])``,
special tokens kept), so a token that holds part of a multi-byte character
shows U+FFFD. Its ``bytes`` are the token's real bytes where the tokenizer
makes them known (byte-level BPE; SentencePiece byte fallback ``<0xHH>``),
else the UTF-8 bytes of its text. A logprob that is not finite (``-inf`` for a
token the model rules out) is reported as -9999.0, since JSON has no infinity.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

from pdserve.common.protocol import TokenLogprob
from pdserve.router.openai_protocol import (ChatLogprobs, ChatLogprobToken, ChatTopLogprob,
                                            CompletionLogprobs, PromptLogprob)

_MIN_LOGPROB = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclasses.dataclass
class TokenEntry:
    """One output token of a choice, with where its text lies in the choice's text.

    ``end`` is None until the token's text has appeared (a token ending inside
    a multi-byte character has none of its own; it ends where the token that
    completes the character ends).
    """

    token_id: int
    logprob: TokenLogprob
    start: int
    end: int | None = None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2 style): the character that stands for each byte.

    Printable Latin-1 bytes stand for themselves; the k-th remaining byte
    (in increasing order) stands as ``chr(256 + k)``, e.g. the space as ``Ġ``.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in printable}
    others = sorted(set(range(256)) - set(printable))
    chars.update({chr(256 + k): b for k, b in enumerate(others)})
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


class TokenTexts:
    """Each token id's own text and bytes, computed once per id."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._added_ids = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            hit = self._cache[token_id] = (text, self._bytes(token_id, text))
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if token_id not in self._added_ids:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self._byte_level and piece and all(c in _BYTE_LEVEL for c in piece):
                    return [_BYTE_LEVEL[c] for c in piece]
                match = _BYTE_FALLBACK.fullmatch(piece)
                if match:
                    return [int(match.group(1), 16)]
        return list(text.encode("utf-8"))


def _top(entry: TokenEntry, num_top: int) -> list[tuple[int, float]]:
    lp = entry.logprob
    return list(zip(lp.top_token_ids, lp.top_logprobs))[:num_top]


def completion_logprobs(entries: Sequence[TokenEntry], num_top: int,
                        texts: TokenTexts) -> CompletionLogprobs:
    """The legacy shape: parallel lists; each ``top_logprobs`` dict holds the top
    ``num_top`` alternatives and the sampled token (so up to ``num_top + 1`` keys;
    tokens whose texts coincide keep the higher logprob)."""
    out = CompletionLogprobs()
    for entry in entries:
        text = texts.text(entry.token_id)
        logprob = _finite(entry.logprob.logprob)
        top: dict[str, float] = {}
        for token_id, value in _top(entry, num_top):
            top.setdefault(texts.text(token_id), _finite(value))
        top.setdefault(text, logprob)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(entry.start)
    return out


def _chat_top(texts: TokenTexts, token_id: int, logprob: float) -> ChatTopLogprob:
    text, raw = texts.get(token_id)
    return ChatTopLogprob(token=text, logprob=_finite(logprob), bytes=raw)


def chat_logprobs(entries: Sequence[TokenEntry], num_top: int, texts: TokenTexts) -> ChatLogprobs:
    """The chat shape: one entry per token with exactly ``num_top`` alternatives
    (fewer only if the worker sent fewer)."""
    content = []
    for entry in entries:
        sampled = _chat_top(texts, entry.token_id, entry.logprob.logprob)
        top = [_chat_top(texts, t, v) for t, v in _top(entry, num_top)]
        content.append(ChatLogprobToken(token=sampled.token, logprob=sampled.logprob,
                                        bytes=sampled.bytes, top_logprobs=top))
    return ChatLogprobs(content=content)


def prompt_logprobs_json(entries: Sequence[TokenLogprob], texts: TokenTexts) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then one dict per prompt token,
    ``{token_id: {logprob, rank, decoded_token}}``, the prompt token first, then the top alternatives
    (ranks 1..k; an alternative that is the prompt token itself appears once).

    Args:
        entries: the worker's entries of prompt tokens 1..N-1 (``TokenLogprob.rank`` set).
    """
    out: list[dict | None] = [None]
    for entry in entries:
        step = {entry.token_id: PromptLogprob(logprob=_finite(entry.logprob), rank=entry.rank,
                                              decoded_token=texts.text(entry.token_id))}
        for rank, (token_id, value) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
            if token_id not in step:
                step[token_id] = PromptLogprob(logprob=_finite(value), rank=rank, decoded_token=texts.text(token_id))
        out.append(step)
    return out


def echo_completion_logprobs(prompt_ids: Sequence[int], entries: Sequence[TokenLogprob], num_top: int,
                             texts: TokenTexts, output: CompletionLogprobs | None,
                             output_offset: int) -> CompletionLogprobs:
    """The legacy shape with ``echo``: the prompt's tokens, then the output's (as vLLM gives them).

    The first prompt token has null ``token_logprobs`` and ``top_logprobs``; each other prompt token
    has its logprob and a ``{text: logprob}`` dict of the top ``num_top`` and itself. Prompt
    ``text_offset``s add up the tokens' own texts from 0; the output's are shifted by ``output_offset``.

    Args:
        prompt_ids: [num_prompt_tokens].
        entries: entries of prompt tokens 1..N-1 (may be empty when the worker sent none).
    """
    out = CompletionLogprobs()
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        text = texts.text(token_id)
        entry = entries[i - 1] if 0 < i <= len(entries) else None
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        top: dict[str, float] = {}
        for top_id, value in list(zip(entry.top_token_ids, entry.top_logprobs))[:num_top]:
            top.setdefault(texts.text(top_id), _finite(value))
        top.setdefault(text, _finite(entry.logprob))
        out.token_logprobs.append(_finite(entry.logprob))
        out.top_logprobs.append(top)
    if output is not None:
        out.tokens += output.tokens
        out.token_logprobs += output.token_logprobs
        out.top_logprobs += output.top_logprobs
        out.text_offset += [output_offset + o for o in output.text_offset]
    return out
