"""Drafts for speculative decoding: tokens a sequence will likely produce next. Pure logic.

Prompt lookup: when the last few tokens of a sequence appeared before (in its
prompt or in what it generated), guess that what followed them then follows
again. Agents resending and editing files, summaries and retrieval answers
copy long runs from their prompt, so guesses there are often right; a wrong
guess costs only the positions that verify it. No model is involved.

The model's own multi-token-prediction head drafts on the last stage
(``shards/worker/mtp_drafts.py``): after every token it guesses the next, and the
guess comes back with the token (``StageDrafts``). A draft model
(``cluster/draft_model.py``'s ``ModelDrafter``) drafts where the text has nothing
to copy. Every drafter answers at once: what it has ready, possibly nothing
(a model drafts in the background and wakes the engine when it has more).
``Either`` asks each of its drafters in turn (prompt lookup first, then the MTP
head, then a draft model) and takes the first that has a guess.
"""

from __future__ import annotations

from typing import Dict, List, Protocol, Sequence, Tuple

SOURCES = ("auto", "prompt_lookup", "mtp", "draft_model", "none")  # what a request may ask to draft from
DEFAULT_SPECULATION = "auto"  # the server's choice (``--speculation``; by default lookup, the MTP head, the draft model)


class Drafter(Protocol):
    """Drafts for one sequence (``source``: what it drafts from, one of ``SOURCES``)."""

    source: str

    def prepare(self, tokens: Sequence[int]) -> None:
        """The sequence was admitted with these tokens: get ready to draft after them."""

    def propose(self, tokens: Sequence[int], k: int, confirmed: int) -> List[int]:
        """Up to ``k`` tokens that may follow ``tokens`` (the first ``confirmed`` of them
        only ever extended between calls, the rest drafts not yet judged), at once."""

    def offered(self, anchor: int, drafts: Sequence[int]) -> None:
        """The last stage guessed ``drafts`` after the sequence's first ``anchor`` tokens."""

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

    source = "prompt_lookup"

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

    def offered(self, anchor: int, drafts: Sequence[int]) -> None:
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


class StageDrafts:
    """The guesses of the model's own MTP head, made on the last stage after each token and
    sent back with it (``TokenResult.drafts``): they follow the tokens the sequence had then."""

    source = "mtp"
    mtp = True  # it needs the last stage's MTP head to draft (``SeqEntry.mtp``)

    def __init__(self):
        self.anchor, self.drafts = -1, []  # drafts of the tokens after the sequence's first ``anchor``

    def prepare(self, tokens: Sequence[int]) -> None:
        pass

    def offered(self, anchor: int, drafts: Sequence[int]) -> None:
        self.anchor, self.drafts = anchor, list(drafts)

    def propose(self, tokens: Sequence[int], k: int, confirmed: int) -> List[int]:
        n, a = len(tokens), self.anchor
        if a < 0 or not a <= n < a + len(self.drafts) or list(tokens[a:n]) != self.drafts[: n - a]:
            return []
        return self.drafts[n - a : n - a + k]

    def close(self) -> None:
        pass


class Either:
    """Each of ``drafters`` in turn (prompt lookup where the text repeats itself, the model's MTP
    head, a draft model elsewhere): the first with a guess. ``source``: whose the last guesses were."""

    def __init__(self, *drafters: Drafter):
        self.drafters = drafters
        self.source = drafters[0].source
        self.mtp = any(getattr(d, "mtp", False) for d in drafters)

    def prepare(self, tokens: Sequence[int]) -> None:
        # A draft model starts when lookup first has nothing (text that copies never needs it).
        self.drafters[0].prepare(tokens)

    def offered(self, anchor: int, drafts: Sequence[int]) -> None:
        for d in self.drafters:
            d.offered(anchor, drafts)

    def propose(self, tokens: Sequence[int], k: int, confirmed: int) -> List[int]:
        for d in self.drafters:
            guesses = d.propose(tokens, k, confirmed)
            if guesses:
                self.source = d.source
                return guesses
        return []

    def close(self) -> None:
        for d in self.drafters:
            d.close()
