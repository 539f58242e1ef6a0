"""One choice of a request: token ids in, text deltas and logprob entries out.

The decode worker streams each of a request's ``n`` choices as its own run of
``RequestDelta``s under the request's id, told apart by ``delta.index``; each
choice finishes on its own. The router keeps one ``ChoiceOutput`` per choice,
with its own ``IncrementalDetokenizer``, so stop strings apply per choice.

Logprob alignment: an entry goes out with the text of its token, never before
nor without it. Tokens are fed to the detokenizer one at a time, so each token
knows where its text starts in the choice's text (``start``) and ends
(``end``). An entry is released once its token's text has been emitted in full
(``end <= emitted``), which keeps entries in step with text held back for a
possible stop string or an unfinished multi-byte character.

    text:    | h e l l o | _ w o | r l d | _ S T | O P |
    token:   |     0     |   1   |   2   |   3   |  4  |   stop string "STOP"
                                                ^ cut
    entries out: tokens 0..3 (those starting before the cut); token 4 dropped

When a stop string cuts the text, the tokens that start before the cut keep
their entries (the last may straddle it) and the rest are dropped. On any
other finish every entry goes out, the EOS token's too (its text is empty).
"""

from __future__ import annotations

import dataclasses

from pdserve.common.protocol import RequestDelta
from pdserve.tokenizer.detokenizer import IncrementalDetokenizer
from pdserve.router.logprobs import TokenEntry


class MissingLogprobs(Exception):
    """Logprobs were requested but a delta does not carry one per new token."""


@dataclasses.dataclass
class ChoiceDelta:
    """What one choice adds to the response: text, and the entries of its tokens."""

    index: int
    text: str
    finish_reason: str | None = None  # "stop" / "length" once the choice is done
    tokens: list[TokenEntry] = dataclasses.field(default_factory=list)  # empty without logprobs


class ChoiceOutput:
    """Detokenizes one choice and keeps its logprob entries aligned with its text.

    Args:
        index: the choice's index (0..n-1).
        detokenizer: this choice's own detokenizer (stop strings, min_tokens).
        logprobs: whether the worker sends logprobs (then every delta must
            carry one ``TokenLogprob`` per new token).
    """

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer, logprobs: bool):
        self.index = index
        self.detokenizer = detokenizer
        self.logprobs = logprobs
        self.finish_reason: str | None = None
        self.entries: list[TokenEntry] = []  # every entry released so far, in order
        self.token_ids: list[int] = []  # every output token the choice's text took, in order (none past a stop)
        self._no_text: list[TokenEntry] = []  # tokens whose text has not appeared yet
        self._unreleased: list[TokenEntry] = []  # tokens whose text is not fully emitted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def num_tokens(self) -> int:
        return self.detokenizer.num_output_tokens

    def add(self, delta: RequestDelta) -> ChoiceDelta | None:
        """Take one delta of this choice; return what to send now (None: nothing yet).

        Raises:
            MissingLogprobs: logprobs were requested and the delta lacks them.
        """
        detok, ids = self.detokenizer, delta.new_token_ids
        logprobs = delta.logprobs
        if self.logprobs and ids and (logprobs is None or len(logprobs) != len(ids)):
            raise MissingLogprobs(f"{len(ids)} new tokens but "
                                  f"{0 if logprobs is None else len(logprobs)} logprobs")
        text = ""
        for i, token_id in enumerate(ids):
            start = len(detok.text)
            text += detok.add_tokens([token_id])
            self.token_ids.append(token_id)
            if self.logprobs:
                self._no_text.append(TokenEntry(token_id, logprobs[i], start))
                if len(detok.text) > start:  # this token completed some text
                    for entry in self._no_text:
                        entry.end = len(detok.text)
                    self._unreleased += self._no_text
                    self._no_text = []
            if detok.stopped:
                break
        if detok.stopped:
            cut = len(detok.text)
            return self._finish("stop", text, [e for e in self._pending() if e.start < cut])
        if delta.finish_reason is not None:
            text += detok.flush()
            return self._finish(delta.finish_reason.to_openai(), text, self._pending())
        released = 0
        while (released < len(self._unreleased)
               and self._unreleased[released].end <= detok.num_emitted_chars):
            released += 1
        tokens, self._unreleased = self._unreleased[:released], self._unreleased[released:]
        if not text and not tokens:
            return None
        self.entries += tokens
        return ChoiceDelta(self.index, text, None, tokens)

    def _pending(self) -> list[TokenEntry]:
        return self._unreleased + self._no_text

    def _finish(self, reason: str, text: str, tokens: list[TokenEntry]) -> ChoiceDelta:
        self.finish_reason = reason
        self._unreleased, self._no_text = [], []
        self.entries += tokens
        return ChoiceDelta(self.index, text, reason, tokens)
