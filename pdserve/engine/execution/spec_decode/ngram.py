"""Prompt lookup decoding (Saxena, 2023; vLLM's ``ngram`` method): drafts copied from the context.

The last ``n`` tokens of a sequence (``prompt_lookup_max >= n >= prompt_lookup_min``,
longest first) are searched for earlier in the same sequence (prompt and output);
at the most recent earlier match, the tokens that followed it are the drafts. No
model runs, so a miss costs nothing but the search (vectorized with numpy).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes drafts by n-gram lookup in the request's own tokens.

    Args:
        num_speculative_tokens: most drafts per request and step (k).
        lookup_min, lookup_max: shortest and longest suffix n-gram tried, in tokens.
    """

    drafts_at_execute = False  # drafts are known when the scheduler asks (num_lookahead)

    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def num_lookahead(self, request, max_k: int) -> int:
        """The scheduler's hook: look the drafts up now, store them in ``request.spec_token_ids``,
        return how many (0..min(k, max_k))."""
        request.spec_token_ids = self.lookup(request.all_token_ids, min(self.num_speculative_tokens, max_k))
        return len(request.spec_token_ids)

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (possibly none).

        Args:
            token_ids: the whole sequence so far (prompt + output).
            k: most drafts wanted (>= 1).

        Returns:
            The tokens that followed the most recent earlier occurrence of the longest
            matching suffix n-gram, at most ``k`` of them; [] when nothing matches.
        """
        length = len(token_ids)
        if k < 1 or length < self.lookup_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            suffix = tokens[-n:]
            # Windows starting at 0 .. length-n-1: every earlier n-gram (not the suffix itself).
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # what followed the most recent match
                return tokens[start:start + k].tolist()
        return []
