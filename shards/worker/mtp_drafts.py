"""The last stage drafting with the model's MTP head (``shards/models/mtp.py``): each sequence's
MTP cache, kept in step with its main caches, and the drafts it proposes after a sample.

The MTP layer's cache holds one entry per position i of the sequence, made from the
main model's hidden state at i and the token at i + 1; so entry i can be made once the
token at i + 1 is known: an input of a later position, or the token just sampled
after i. ``SeqDrafts`` keeps, per sequence:

- ``done``: entries made, for positions ``[base, done)``. ``base`` is where the stage
  first computed the sequence: after a prefix-cache hit (or on a replay that starts
  after cached blocks) the main model's hidden states of the cached prefix were never
  computed here, so the MTP cache starts after it (RoPE is relative: the entries
  attend to each other as they would at their own positions);
- the hidden states and input tokens of the last positions (``rows``, ``tokens``),
  from the first not yet made (or from ``KEEP`` back, so that a trim can be made good);
- ``used``: the token entry ``done - 1`` was made with when it was a sample no input
  had followed yet; an input that then differs (a rejected draft) unmakes it.

A trim of the main caches (rejected drafts) takes back the entries that used a
position it took back; they are made again from the rows kept. Prefill chunks make
their entries as they come; a decode step only records its row, and makes entries
when the head asks for drafts (``SeqEntry.mtp``) or ``CATCH_UP`` rows wait. A draft is
the argmax of the head after the last accepted sample; further drafts reuse the
layer on its own output (their entries are taken back at once). Drafts never change
a token: the head verifies them like any other, so a wrong one costs only positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx

from mlxpipe.shards.cache import kinds
from mlxpipe.shards.models.mtp import MtpHead, load_mtp
from mlxpipe.shards.models.quantize import quantize_mtp

logger = logging.getLogger(__name__)

KEEP = 64       # rows kept before the first entry not yet made, for trims to make good
CATCH_UP = 64   # rows a sequence decoding without drafts lets wait before its entries are made


class SeqDrafts:
    """One sequence's MTP cache and the rows it is made from."""

    def __init__(self, head: MtpHead, start: int):
        self.head = head
        self.cache = head.make_cache()
        self.base = self.done = self.first = start  # rows and tokens cover positions [first, length)
        self.rows: Optional[mx.array] = None       # [n, D]
        self.tokens: List[int] = []
        self.used: Optional[int] = None

    @property
    def length(self) -> int:
        return self.first + len(self.tokens)

    def add(self, rows: mx.array, tokens: Sequence[int]) -> None:
        """The main model's hidden states [n, D] for ``tokens``, the inputs at the next positions."""
        if self.used is not None and self.done == self.length and tokens[0] != self.used:
            self._unmake(1)  # the draft it was made with was rejected: this input is what followed
        self.rows = rows if self.rows is None else mx.concatenate([self.rows, rows])
        self.tokens += list(tokens)

    def make(self, upto: Optional[int] = None) -> None:
        """Make the entries of positions ``[done, upto)`` (default: all whose next token is an input)."""
        upto = self.length - 1 if upto is None else upto
        if self.done > upto:
            self._unmake(self.done - upto)
        if upto > self.done:
            at = self.done - self.first
            self.head(self.rows[at : upto - self.first], self.tokens[at + 1 : upto - self.first + 1], self.done,
                      self.cache)
            self.done, self.used = upto, None
            mx.async_eval(kinds.arrays(self.cache))
        self._forget()

    def prefilled(self, rows: mx.array, tokens: Sequence[int], sampled: bool) -> None:
        """A prefill chunk: its entries are made now, but the last's (its next token is the
        next chunk's first, or the sample a draft is made with)."""
        self.add(rows, tokens)
        if not sampled:
            self.make()

    def waiting(self) -> int:
        return self.length - 1 - self.done

    def draft(self, position: int, sample: int, k: int) -> List[int]:
        """Up to ``k`` guesses of the tokens after ``sample``, sampled at ``position`` (whose row and
        earlier ones are this sequence's true ones)."""
        self.make(position)
        z = self.head(self.rows[position - self.first : position - self.first + 1], [sample], position, self.cache)
        self.done, self.used = position + 1, sample
        drafts = []
        for j in range(k):
            token = mx.argmax(self.head.logits(z[:, -1]), axis=-1)
            drafts.append(int(token.item()))
            if j + 1 < k:  # the layer again, on its own output: an entry taken back below
                z = self.head(z[0, -1:], drafts[-1:], position + j + 1, self.cache)
        if k > 1:
            self.cache.trim(k - 1)
        self._forget()
        return drafts

    def trim(self, n: int) -> None:
        """The main caches dropped their last ``n`` positions."""
        keep = self.length - n
        if keep <= self.first:  # deeper than the rows kept: the cache starts afresh there
            self.cache, self.rows, self.tokens = self.head.make_cache(), None, []
            self.base = self.done = self.first = keep
            self.used = None
            return
        self.tokens = self.tokens[: keep - self.first]
        self.rows = self.rows[: keep - self.first] if self.rows is not None else None
        if self.done > keep or (self.done == keep and self.used is None):  # made with a token taken back
            self._unmake(self.done - max(self.base, keep - 1))

    def _unmake(self, n: int) -> None:
        target = self.done - n
        if target < self.first:  # rows to make them again are gone: start the cache afresh
            self.cache = self.head.make_cache()
            self.base = self.done = self.first = self.length
            self.rows, self.tokens = None, []
        else:
            self.cache.trim(n)
            self.done = target
        self.used = None

    def _forget(self) -> None:
        """Drop rows no entry will be made from again (but ``KEEP`` for trims)."""
        drop = min(self.done, self.length - KEEP) - self.first
        if drop > 0:
            self.rows, self.tokens, self.first = self.rows[drop:], self.tokens[drop:], self.first + drop


def accepted(inputs: Sequence[int], samples: Sequence[int]) -> int:
    """How many of a verify frame's samples the head takes: each while every input after the
    first matched the sample before it (the head's rule, ``Speculator.judge``)."""
    n = 1
    while n < len(samples) and inputs[n] == samples[n - 1]:
        n += 1
    return n


class Drafting:
    """The last stage's MTP head; hands each sequence its ``SeqDrafts``."""

    def __init__(self, head: MtpHead):
        self.head = head

    def start(self, offset: int) -> SeqDrafts:
        return SeqDrafts(self.head, offset)

    def begin(self) -> None:
        """A frame's forward is about to run: its hidden states are the next taken."""
        self.head.record.clear()

    def rows(self, order: Optional[Sequence[int]] = None) -> mx.array:
        """The hidden states of the forward(s) since ``begin`` [rows, positions, D], the frame's rows
        in ``order`` (a decode group run in parts: each part's rows, one part after the other)."""
        calls = self.head.record.hidden()
        out = calls[0] if len(calls) == 1 else mx.concatenate(calls, axis=0)
        if order is not None and list(order) != list(range(len(order))):
            back = sorted(range(len(order)), key=list(order).__getitem__)
            out = out[mx.array(back)]
        return out


def decode_rows(entries: Sequence, drafts: Sequence[Optional[SeqDrafts]], tokens: Sequence[int],
                rows: mx.array) -> None:
    """A decode step's hidden states [rows, 1, D] to each drafting sequence's MTP cache (entries
    made now only for those that draft after it, or with ``CATCH_UP`` rows waiting)."""
    for i, (e, seq) in enumerate(zip(entries, drafts)):
        if seq is not None:
            seq.add(rows[i], [tokens[i]])
            if not e.mtp and seq.waiting() > CATCH_UP:
                seq.make()


@dataclass
class MtpLoad:
    """What loading the MTP head gave: for the Load reply, and the KV bytes its cache adds."""

    layers: int = 0        # 1 where it drafts
    note: str = ""         # asked for, but none: why
    nbytes: int = 0        # its weights
    kv_bytes: int = 0      # its cache, per token of context (kept at full precision)

    def reply(self, kv_reply: dict) -> dict:
        """The Load reply's fields: the KV ones (``kv_reply``) with its cache's bytes per token
        added (at full precision, before and after a KV switch alike), and its own."""
        kv = {k: v + self.kv_bytes if k in ("kv_bytes_per_token", "kv_full_bytes_per_token") else v
              for k, v in kv_reply.items()}
        return {**kv, "mtp_layers": self.layers, "mtp_note": self.note, "mtp_bytes": self.nbytes}


def load_drafting(wanted: bool, stage, path, config: dict, quant=None):
    """The last stage's MTP head (``wanted``: the head asked for it), read, quantized with the
    range's ``quant`` and materialized: (``Drafting`` or None, ``MtpLoad``)."""
    if not (wanted and stage.last):
        return None, MtpLoad()
    head, note = load_mtp(path, stage.model, config)
    if head is None:
        logger.info("no MTP drafts: %s", note)
        return None, MtpLoad(note=note)
    if quant is not None:
        quantize_mtp(head, stage.model, config, quant)
    mx.eval(head.parameters(), head.embed.parameters())
    cache = head.make_cache()
    hidden = mx.zeros((2, head.layer.enorm.weight.shape[0]))
    mx.eval(head(hidden, [0, 0], 0, cache), kinds.arrays(cache))
    kv = kinds.footprint([cache]).kv_bytes_per_token
    logger.info("drafting with the model's MTP head: %.1f MB, %d of its %d layers", head.nbytes / 1e6, 1,
                head.layers_found)
    return Drafting(head), MtpLoad(1, "", head.nbytes, kv)
