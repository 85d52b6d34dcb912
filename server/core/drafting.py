"""Drafts for speculative decoding: tokens a sequence will likely produce next. Pure logic.

Prompt lookup: when the last few tokens of a sequence appeared before (in its
prompt or in what it generated), guess that what followed them then follows
again. Agents resending and editing files, summaries and retrieval answers
copy long runs from their prompt, so guesses there are often right; a wrong
guess costs only the positions that verify it. No model is involved.

A draft model (``cluster/draft_model.py``'s ``ModelDrafter``) drafts where the text has nothing
to copy. Every drafter answers at once: what it has ready, possibly nothing
(a model drafts in the background and wakes the engine when it has more).
``Either`` asks prompt lookup first and the model only when lookup has no guess.
"""

from __future__ import annotations

from typing import Dict, List, Protocol, Sequence, Tuple

SOURCES = ("auto", "prompt_lookup", "draft_model", "none")  # what a request may ask to draft from
DEFAULT_SPECULATION = "auto"  # what it drafts from when it does not say: lookup, then the draft model if any


class Drafter(Protocol):
    """Drafts for one sequence."""

    def prepare(self, tokens: Sequence[int]) -> None:
        """The sequence was admitted with these tokens: get ready to draft after them."""

    def propose(self, tokens: Sequence[int], k: int, confirmed: int) -> List[int]:
        """Up to ``k`` tokens that may follow ``tokens`` (the first ``confirmed`` of them
        only ever extended between calls, the rest drafts not yet judged), at once."""

    def close(self) -> None:
        """The sequence ended, or its drafter is replaced (a replay)."""


class PromptLookup:
    """Drafts for one sequence from n-gram matches in its own tokens.

    The index maps every n-gram (``min_ngram`` <= n <= ``max_ngram``) to the
    position just after its latest occurrence; it grows with the sequence, so
    a draft costs O(max_ngram + k) however long the sequence is. The longest
    match wins: where the text repeats a pattern (the lines of a list), a short
    n-gram's latest occurrence is often another line's, a long one's the line
    being copied (on ``bench served``'s copy task the next token's draft is
    right 77% of the time at ``max_ngram`` 8, 65% at 3). A match of one token
    drafts nothing: in a chat answer such a draft (a common word seen before) was
    right 14% of the time, against 43-67% for two or three tokens and 94% for
    four or more (200 greedy tokens of ``bench stream``'s prompt); in the
    answer's first 64 tokens, 4 of 29 drafts were right at ``min_ngram`` 1 and
    2 of 5 at 2, and the failing trial windows made the stream 4% slower than
    without speculation. On the copy task 4 of the 43 right drafts in the first
    64 tokens came from single tokens.
    """

    def __init__(self, max_ngram: int = 8, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._after: Dict[Tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions < this are in the index

    def _index(self, tokens: Sequence[int], upto: int) -> None:
        for end in range(max(self._indexed, 1), upto + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._after[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, upto + 1)

    def prepare(self, tokens: Sequence[int]) -> None:
        pass  # the index grows as drafts are asked for

    def close(self) -> None:
        pass

    def propose(self, tokens: Sequence[int], k: int, confirmed: int) -> List[int]:
        """Up to ``k`` tokens that may follow ``tokens``: the sequence's first
        ``confirmed`` tokens (only ever extended between calls) and drafts not yet
        judged after them. Only confirmed tokens enter the index."""
        end = len(tokens)
        if k < 1 or end < 2:
            return []
        self._index(tokens, min(confirmed, end - 1))  # every n-gram but the suffix itself
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            at = self._after.get(tuple(tokens[end - n :]))
            if at is not None:
                return list(tokens[at : at + k])
        return []


class Either:
    """Prompt lookup where the text repeats itself, a draft model elsewhere."""

    def __init__(self, lookup: Drafter, model: Drafter):
        self.lookup, self.model = lookup, model

    def prepare(self, tokens: Sequence[int]) -> None:
        # The model starts when lookup first has nothing (text that copies never needs it).
        self.lookup.prepare(tokens)

    def propose(self, tokens: Sequence[int], k: int, confirmed: int) -> List[int]:
        return self.lookup.propose(tokens, k, confirmed) or self.model.propose(tokens, k, confirmed)

    def close(self) -> None:
        self.lookup.close()
        self.model.close()
