"""Token ids -> text deltas, incrementally, with stop-string matching.

Decoding the whole output after every step costs O(n^2) over a request. Instead
``IncrementalDetokenizer`` keeps two offsets into its token list:

    tokens:  [ ... context ... | ... already read ... | new ... ]
                               ^prefix_offset          ^read_offset

and decodes only ``tokens[prefix_offset:]``; the new text is what that decode
adds beyond ``decode(tokens[prefix_offset:read_offset])``. The few context
tokens let tokenizers that treat a word start specially (SentencePiece's
leading space) decode the new tokens as they appear in the full text. When the
new text ends in U+FFFD, the last token ends inside a multi-byte character, so
nothing is emitted and the offsets stay put until the next token completes it.

Stop strings: the output text is cut just before the earliest occurrence of
any stop string, and that text never appears in a delta. While streaming, the
longest text tail that is still the start of some stop string (at most
``max(len(stop)) - 1`` chars) is held back until it either completes a stop
string or stops being one's prefix. Stop strings are not searched until
``min_tokens`` tokens exist, and never across text already emitted.
"""

from __future__ import annotations

from typing import Sequence

_REPLACEMENT = "\ufffd"
_NUM_CONTEXT_TOKENS = 5  # prompt tokens kept as decode context for the first output tokens


class IncrementalDetokenizer:
    """Turn a growing list of output token ids into text deltas.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=)``).
        prompt_token_ids: the prompt; its last few tokens are decode context only.
        stop: stop strings (empty strings are ignored).
        skip_special_tokens: passed to ``tokenizer.decode``.
        min_tokens: stop strings only count once this many output tokens exist.

    Call ``add_tokens(ids)`` with each step's new ids; it returns the text that
    may be shown now. After the last step call ``flush()`` for any held-back
    text. Once ``stopped`` is True (a stop string matched), ``text`` is final
    and further tokens are ignored.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = [s for s in stop if s]
        self._min_tokens = min_tokens
        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        # Context that itself ends mid-character would garble the first delta.
        if context and _REPLACEMENT in self._decode(context):
            context = []
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.num_output_tokens = 0
        self.text = ""  # decoded output so far (cut at a stop string once one matched)
        self._num_emitted = 0  # len of text already returned as deltas
        self.stopped = False  # a stop string matched
        self.stop_str: str | None = None

    @property
    def num_emitted_chars(self) -> int:
        """How much of ``text`` has been returned as deltas so far."""
        return self._num_emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append one step's tokens; return the text delta that may be emitted now."""
        if self.stopped or not new_token_ids:
            return ""
        self._tokens.extend(new_token_ids)
        self.num_output_tokens += len(new_token_ids)
        new_text = self._read_new_text(final=False)
        return self._append(new_text, final=False)

    def flush(self) -> str:
        """The request finished: return all remaining text, incomplete characters included."""
        if self.stopped:
            return ""
        new_text = self._read_new_text(final=True)
        return self._append(new_text, final=True)

    def _read_new_text(self, final: bool) -> str:
        if self._read_offset >= len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset:])
        if not final and full_text.endswith(_REPLACEMENT):
            return ""  # the last token ends mid-character: wait for the rest of it
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text):]

    def _append(self, new_text: str, final: bool) -> str:
        """Add ``new_text`` to ``text``, match stop strings, return what may be emitted."""
        old_len = len(self.text)
        self.text += new_text
        if self._stops and self.num_output_tokens >= self._min_tokens:
            cut = self._find_stop(old_len)
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                return self._emit(len(self.text))
        if final or not self._stops:
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back_len())

    def _find_stop(self, old_len: int) -> int | None:
        """Start of the earliest stop string that ends in the newly added text."""
        longest = max(len(s) for s in self._stops)
        start = max(self._num_emitted, old_len - longest + 1)
        found = [i for s in self._stops if (i := self.text.find(s, start)) != -1]
        if not found:
            return None
        cut = min(found)
        self.stop_str = next(s for s in self._stops if self.text.startswith(s, cut))
        return cut

    def _held_back_len(self) -> int:
        """Length of the longest unemitted tail that could still grow into a stop string."""
        pending = len(self.text) - self._num_emitted
        longest = max(len(s) for s in self._stops)
        for k in range(min(longest - 1, pending), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def _emit(self, end: int) -> str:
        if end <= self._num_emitted:
            return ""
        delta = self.text[self._num_emitted:end]
        self._num_emitted = end
        return delta
